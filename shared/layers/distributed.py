"""``DistributedEmbedding``: tables and features declared as keras-rs declares them, trained
by downpour.

Keras 3's recommendation library, keras-rs, declares tables and the features that look them
up with ``keras_rs.layers.TableConfig(name, vocabulary_size, embedding_dim, initializer,
optimizer, combiner)`` and ``FeatureConfig(name, table, input_shape, output_shape)``; several
features may share a table. Its ``keras_rs.layers.DistributedEmbedding(feature_configs)``
takes a structure of features (a dict) and returns their activations in the same structure;
it is built for TPUs and GPUs with a fixed vocabulary. This layer has the same constructor
and call convention and takes keras-rs's own config objects (or ``TableConfig`` and
``FeatureConfig`` here, the same fields, when keras-rs is not installed), so a model written
for keras-rs trains through downpour by swapping that one layer.

Each table is a ``DynamicEmbedding`` (``downpour.layers.dynamic``): its ``vocabulary_size``
is its row budget (``max_rows``: ids of any value share that many rows, fallback rows and
admission as the table's policy says, ``table_policy`` per table name), its
``embedding_dim`` the width, its initializer the rows' (drawn per id), its ``combiner`` how a
multi-valued feature's bag is pooled. A feature whose ``output_shape`` has one more axis
than its ``input_shape`` keeps a row per position; otherwise its last axis is pooled by the
table's combiner (a single-valued feature reads its row). A table's ``optimizer`` is
downpour's server's (``--optimizer``, updating the rows it touches): one naming another is
said at warning level, once per table. ``placement`` and the partition sizes are TPU
settings and are not used.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import keras
import tensorflow as tf

from downpour.layers.dynamic import DynamicEmbedding

log = logging.getLogger("downpour")

__all__ = ["DistributedEmbedding", "FeatureConfig", "TableConfig"]


@dataclass(frozen=True)
class TableConfig:
    """One table, keras-rs's fields (``keras_rs.layers.TableConfig``)."""

    name: str
    vocabulary_size: int
    embedding_dim: int
    initializer: Any = "uniform"
    optimizer: Any = None
    combiner: str = "mean"
    placement: str = "auto"
    max_ids_per_partition: int = 256
    max_unique_ids_per_partition: int = 256


@dataclass(frozen=True)
class FeatureConfig:
    """One feature, keras-rs's fields (``keras_rs.layers.FeatureConfig``)."""

    name: str
    table: Any
    input_shape: tuple[int | None, ...]
    output_shape: tuple[int | None, ...]


def _same_table(a: Any, b: Any) -> bool:
    keys = ("vocabulary_size", "embedding_dim", "combiner")
    return all(getattr(a, k) == getattr(b, k) for k in keys)


@keras.saving.register_keras_serializable(package="downpour")
class DistributedEmbedding(keras.layers.Layer):
    """keras-rs's ``DistributedEmbedding`` on downpour's tables (see the module).

    ``feature_configs``: a structure (dict, list) of ``FeatureConfig`` (keras-rs's or
    ``downpour.layers.FeatureConfig``). ``table_policy``: per table name, the
    ``DynamicEmbedding`` policy arguments beside the budget (``fallback_rows``, ``evict``,
    ``admission``, ``admit_after``, ``admit_init``) and ``pad_id``. ``seed``: every table's."""

    def __init__(
        self,
        feature_configs: Any,
        *,
        table_policy: dict[str, dict[str, Any]] | None = None,
        seed: int = 0,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.feature_configs = feature_configs
        self.features = tf.nest.flatten(feature_configs)
        extra = table_policy or {}
        declared: dict[str, Any] = {}
        for f in self.features:
            t = f.table
            if t.name in declared and not _same_table(declared[t.name], t):
                raise ValueError(f"table {t.name!r} is declared twice, differently")
            declared.setdefault(t.name, t)
        unknown = sorted(set(extra) - set(declared))
        if unknown:
            raise ValueError(f"table_policy names tables no feature uses: {unknown}")
        self.tables = {
            name: DynamicEmbedding(
                t.embedding_dim,
                t.vocabulary_size,
                _initializer(t.initializer),
                seed,
                combiner=t.combiner,
                name=name,
                **extra.get(name, {}),
            )
            for name, t in declared.items()
        }
        for name, t in declared.items():
            if t.optimizer not in (None, "adam"):  # keras-rs's default is "adam"
                named = t.optimizer if isinstance(t.optimizer, str) else type(t.optimizer).__name__
                log.warning(
                    "table %r declares optimizer %s: downpour's server updates every table "
                    "by its own --optimizer", name, named,
                )  # fmt: skip
        self.table_policy, self.seed = extra, seed

    def build(self, input_shape: Any = None) -> None:
        for f in self.features:  # each table's variables, under this layer's name
            table = self.tables[f.table.name]
            if not table.built:
                table.build(f.input_shape)
        self.built = True

    def _pools(self, feature: Any) -> bool:
        """Whether ``feature``'s bag is pooled (its output has no axis more than its input)."""
        return len(feature.output_shape) != len(feature.input_shape) + 1

    def call(self, inputs: Any, weights: Any = None, training: bool | None = None) -> Any:
        """Each feature's activation, in the structure of ``feature_configs``."""
        xs = tf.nest.flatten(inputs)
        ws = [None] * len(xs) if weights is None else tf.nest.flatten(weights)
        if len(xs) != len(self.features):
            raise ValueError(f"{len(xs)} inputs for {len(self.features)} features")
        out = []
        for f, x, w in zip(self.features, xs, ws, strict=True):
            table = self.tables[f.table.name]
            combiner = table.combiner if self._pools(f) else None
            out.append(table(x, weights=w, combiner=combiner, training=training))
        return tf.nest.pack_sequence_as(self.feature_configs, out)

    def real_ids(self, table: DynamicEmbedding, inputs: Any) -> tf.Tensor:
        """The ids ``table`` looks up for ``inputs`` over every feature using it, flat."""
        xs = tf.nest.flatten(inputs)
        ids = [
            table.real_ids(x)
            for f, x in zip(self.features, xs, strict=True)
            if self.tables[f.table.name] is table
        ]
        return ids[0] if len(ids) == 1 else tf.concat(ids, 0)

    def compute_output_shape(self, input_shape: Any, *_: Any, **__: Any) -> Any:
        return tf.nest.pack_sequence_as(
            self.feature_configs, [tuple(f.output_shape) for f in self.features]
        )

    def get_config(self) -> dict[str, Any]:
        def feature(f: Any) -> dict[str, Any]:
            t = f.table
            table = {
                "name": t.name,
                "vocabulary_size": t.vocabulary_size,
                "embedding_dim": t.embedding_dim,
                "initializer": keras.initializers.serialize(_initializer(t.initializer)),
                "combiner": t.combiner,
            }
            return {"name": f.name, "table": table, "input_shape": list(f.input_shape),
                    "output_shape": list(f.output_shape)}  # fmt: skip

        return super().get_config() | {
            "feature_configs": tf.nest.map_structure(feature, self.feature_configs),
            "table_policy": self.table_policy,
            "seed": self.seed,
        }

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> DistributedEmbedding:
        config = dict(config)

        def feature(d: dict[str, Any]) -> FeatureConfig:
            t = dict(d["table"])
            t["initializer"] = keras.initializers.deserialize(t["initializer"])
            return FeatureConfig(d["name"], TableConfig(**t), tuple(d["input_shape"]),
                                 tuple(d["output_shape"]))  # fmt: skip

        config["feature_configs"] = tf.nest.map_structure(
            feature, config["feature_configs"], check_types=False
        )
        return cls(**config)


def _initializer(init: Any) -> Any:
    """A keras-rs initializer as ``DynamicEmbedding`` takes it (an object or its name)."""
    return keras.initializers.get(init)
