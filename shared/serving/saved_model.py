"""A model's serving export; a ``DynamicEmbedding`` in it becomes a hash-table lookup.

A ``downpour.layers.DynamicEmbedding`` creates a row on first touch and draws its initial
value in NumPy: neither belongs in a serving graph. ``serving_module`` clones the Keras model
with every such layer replaced by ``TableLookup``: the table's live ids (gathered from every
shard) map through a TensorFlow hash table to a row of a rows variable. An id the table does
not hold reads its **fallback row** in a table with fallback rows (``mix64(id) mod B``, the row
it read and trained during training, computed in the graph with uint64 arithmetic), and the
**default row, zeros**, in one without: an unknown id carries no information; in training it
would read its initial value, a random draw, which a serving model should not invent. A
layer fed strings hashes them with ``downpour.layers.string_ids`` (FarmHash Fingerprint64),
traced into the graph, so the served model needs no downpour import. A model without dynamic
tables is served as it is (not cloned), in the same export layout, so that delta exports
(``downpour.serving.delta``) follow it too.

The hash table is a ``tf.lookup.experimental.MutableHashTable`` that serving only reads: its
contents are saved in the SavedModel's variables (not as constants in the graph, which caps a
graph at 2 GB), and ``delta.apply_delta`` can load an export, change its ids and rows
in place and save it again without the model's Python code.

A full export is a SavedModel directory (``tf.saved_model.load(dir).serve(batch)`` or the
``serving_default`` signature) holding, besides ``serve``:

- ``tables[key]``: the hash table, id -> row index (1-based; index 0 is the default row);
- ``rows[key]``: the rows, ``(n + 1, dim)``, row 0 zeros, row i + 1 the i-th smallest id's;
- ``fallback[key]``: a table's fallback rows ``(B, dim)``, row g the fallback row g (a table
  without fallback rows has none);
- ``dense``: the model's other variables, in the order ``assets.extra`` records their paths
  (a fixed ``keras.layers.Embedding`` table among them, listed in ``fixed_tables``);

and, for a delta export (``downpour.serving.delta``) computed from it later, ``assets.extra/``:
``downpour_export.json`` (``EXPORT_META``: format, model fingerprint, per-shard versions,
per-table key/layer/dim/dtype/fallback_rows, dense paths, ``fixed_tables``) and
``downpour_ids.npz`` (each table's ids, ascending, under its key).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from downpour.checkpoints.tables import SERVED_FIELDS, joined_fallback
from downpour.layers import DistributedEmbedding, DynamicEmbedding, embed
from downpour.layers.bags import pooled_shape
from downpour.layers.dynamic import LAYERS_OWN
from downpour.model.hashing import MIX64_MULTIPLIERS, mix64

FORMAT = "downpour-export"
FORMAT_VERSION = 1
EXTRA = "assets.extra"
EXPORT_META = "downpour_export.json"
EXPORT_IDS = "downpour_ids.npz"


class ServingError(ValueError):
    """A model, a table or an export directory that cannot be served or read as one."""


@dataclass
class Table:
    """One dynamic table's live rows, every shard's together: ``ids`` (int64, unique) with
    their ``rows`` (n, dim) and the version each was last updated at (``versions``); and its
    fallback rows, row g the fallback row g over the table (``(0, dim)`` for none)."""

    ids: np.ndarray
    rows: np.ndarray
    versions: np.ndarray
    fallback: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.fallback is None:
            self.fallback = np.zeros((0, self.rows.shape[1]), self.rows.dtype)

    def sorted(self) -> Table:
        """The same rows in ascending id order (the order of a full export)."""
        order = np.argsort(self.ids, kind="stable")
        return Table(self.ids[order], self.rows[order], self.versions[order], self.fallback)

    def read(self, ids: np.ndarray) -> np.ndarray:
        """What the served table returns for unique ``ids``: their rows, an unknown id its
        fallback row, or zeros in a table without fallback rows."""
        rows = np.zeros((ids.size, self.rows.shape[1]), self.rows.dtype)
        if self.fallback.shape[0]:
            rows[:] = self.fallback[fallback_number(ids, self.fallback.shape[0])]
        order = np.argsort(self.ids)
        pos = np.searchsorted(self.ids, ids, sorter=order).clip(max=max(self.ids.size - 1, 0))
        known = self.ids[order][pos] == ids if self.ids.size else np.zeros(ids.size, bool)
        rows[known] = self.rows[order][pos[known]]
        return rows


def fallback_number(ids: np.ndarray, fallback_rows: int) -> np.ndarray:
    """The fallback row g of each int64 id: ``mix64(id) mod B`` (``downpour.tables.rowmap``)."""
    g = mix64(np.asarray(ids, np.int64).view(np.uint64)) % np.uint64(fallback_rows)
    return g.astype(np.int64)


def mix64_tf(ids: tf.Tensor) -> tf.Tensor:
    """``downpour.model.hashing.mix64`` of int64 ``ids`` in TensorFlow ops (uint64 wrapping
    arithmetic): the serving graph computes an id's fallback row as training did."""
    x = tf.bitcast(ids, tf.uint64)
    m1, m2 = (tf.constant(int(m), tf.uint64) for m in MIX64_MULTIPLIERS)
    for shift, mult in ((30, m1), (27, m2)):
        x = tf.bitwise.bitwise_xor(x, tf.bitwise.right_shift(x, tf.constant(shift, tf.uint64)))
        x = x * mult
    return tf.bitwise.bitwise_xor(x, tf.bitwise.right_shift(x, tf.constant(31, tf.uint64)))


def dynamic_layers(model: keras.Model) -> dict[str, DynamicEmbedding]:
    """The model's DynamicEmbedding layers by their table's variable path (nested too)."""
    found: dict[str, DynamicEmbedding] = {}
    for layer in model._flatten_layers(include_self=False):  # noqa: SLF001 - Keras's own walk
        if isinstance(layer, DynamicEmbedding):
            found[layer.embeddings.path] = layer
    return found


def dense_variables(model: keras.Model) -> list[keras.Variable]:
    """The model's variables that are not a DynamicEmbedding's (trainable or not)."""
    dynamic = {id(v) for layer in dynamic_layers(model).values() for v in layer.variables}
    return [v for v in model.variables if id(v) not in dynamic]


def fixed_tables(model: keras.Model) -> list[str]:
    """The paths of the model's trainable ``keras.layers.Embedding`` tables: dense variables
    that a delta export sends by row (the rows changed), not whole."""
    return [
        layer.embeddings.path
        for layer in model._flatten_layers(include_self=False)  # noqa: SLF001 - Keras's own walk
        if isinstance(layer, keras.layers.Embedding) and layer.embeddings.trainable
    ]


class TableLookup(keras.layers.Layer):
    """A DynamicEmbedding for serving: ids (int or string) -> rows of ``rows`` through
    ``table`` (id -> row index, 0 for an unknown id), an unknown id reading its row of
    ``fallback`` when given (else the zero row)."""

    def __init__(
        self, table: Any, rows: tf.Variable, layer: DynamicEmbedding,
        fallback: tf.Variable | None = None, **kwargs: Any,
    ) -> None:  # fmt: skip
        super().__init__(**kwargs)
        self.table, self.rows, self.fallback = table, rows, fallback
        self.dim, self.combiner, self.pad_id = layer.dim, layer.combiner, layer.pad_id

    def _lookup(self, ids: tf.Tensor) -> tf.Tensor:
        """The served rows of flat int64 ``ids``."""
        slots = self.table.lookup(ids)
        rows = tf.gather(self.rows, slots)
        if self.fallback is not None:
            b = tf.constant(int(self.fallback.shape[0]), tf.uint64)
            g = tf.cast(tf.math.floormod(mix64_tf(ids), b), tf.int64)
            unknown = tf.expand_dims(slots == 0, -1)
            rows = tf.where(unknown, tf.gather(self.fallback, g), rows)
        return tf.cast(rows, self.compute_dtype)

    def call(
        self, inputs: Any, weights: Any = None, mask: Any = None, combiner: Any = LAYERS_OWN
    ) -> Any:
        """The training layer's outputs (``downpour.layers.embed``), read from the tables."""
        combiner = self.combiner if combiner is LAYERS_OWN else combiner
        return embed(inputs, self._lookup, self.dim, combiner, self.pad_id, weights, mask)

    def compute_output_shape(
        self, input_shape: tuple[int | None, ...], *_: Any, **__: Any
    ) -> tuple[int | None, ...]:
        return pooled_shape(input_shape, self.dim, self.combiner)


class ServedDistributed(keras.layers.Layer):
    """A ``DistributedEmbedding`` for serving: each feature through its table's
    ``TableLookup``, pooled as in training (``DistributedEmbedding.call``)."""

    def __init__(self, layer: DistributedEmbedding, lookups: dict[str, TableLookup], **kw: Any):
        super().__init__(name=layer.name, **kw)
        self.layer, self.lookups = layer, lookups

    def call(self, inputs: Any, weights: Any = None) -> Any:
        xs = tf.nest.flatten(inputs)
        ws = [None] * len(xs) if weights is None else tf.nest.flatten(weights)
        out = []
        for f, x, w in zip(self.layer.features, xs, ws, strict=True):
            lookup = self.lookups[f.table.name]
            combiner = lookup.combiner if self.layer._pools(f) else None  # noqa: SLF001
            out.append(lookup(x, weights=w, combiner=combiner))
        return tf.nest.pack_sequence_as(self.layer.feature_configs, out)

    def compute_output_shape(self, input_shape: Any, *_: Any, **__: Any) -> Any:
        return self.layer.compute_output_shape(input_shape)


def new_lookup(key: str, table: Table) -> tuple[Any, tf.Variable]:
    """(hash table, rows variable) holding ``table`` (ascending ids, as ``Table.sorted``)."""
    index = tf.lookup.experimental.MutableHashTable(tf.int64, tf.int64, 0, name=f"{key}_index")
    rows = tf.Variable(
        with_default_row(table.rows),
        shape=tf.TensorShape([None, table.rows.shape[1]]),
        name=f"{key}_rows",
    )
    index.insert(table.ids, np.arange(1, table.ids.size + 1, dtype=np.int64))
    return index, rows


def with_default_row(rows: np.ndarray) -> np.ndarray:
    """``rows`` below the default row (zeros): the rows variable of a lookup."""
    return np.concatenate([np.zeros((1, rows.shape[1]), rows.dtype), rows])


def input_signature(model: keras.Model) -> list[Any]:
    """The serving function's input signature: the model's inputs (one, a list, a dict),
    any batch size; a ragged or sparse input keeps its kind (a signature takes its
    component tensors)."""
    from downpour.model.build import model_inputs

    struct = model_inputs(model)
    if struct is None:
        raise ServingError(f"model {model.name!r} declares no inputs (keras.Input)")

    def spec(t: Any) -> Any:
        if getattr(t, "ragged", False):  # a multi-valued feature's bags
            return tf.RaggedTensorSpec(t.shape, t.dtype, ragged_rank=len(t.shape) - 1)
        if getattr(t, "sparse", False):
            return tf.SparseTensorSpec(t.shape, t.dtype)
        return tf.TensorSpec(t.shape, t.dtype, t.name)

    return [tf.nest.map_structure(spec, struct)]


def serving_module(model: keras.Model, tables: Mapping[str, Table]) -> tuple[tf.Module, dict]:
    """(module to save, table records for the export's meta): ``model`` with each
    DynamicEmbedding replaced by a ``TableLookup`` over ``tables[its path]``."""
    layers = dynamic_layers(model)
    missing = sorted(set(layers) - set(tables))
    if missing:
        raise ServingError(f"no rows given for the dynamic table(s) {missing}")
    module, records, lookups = tf.Module(), {}, {}
    module.tables, module.rows, module.fallback = {}, {}, {}
    for i, (path, layer) in enumerate(sorted(layers.items())):
        key, table = f"t{i}", tables[path].sorted()
        if table.rows.ndim != 2 or table.rows.shape[1] != layer.dim:
            raise ServingError(
                f"table {path}: rows of shape {table.rows.shape} for a layer of dim {layer.dim}"
            )
        module.tables[key], module.rows[key] = new_lookup(key, table)
        fallback = None
        if table.fallback.shape[0]:
            fallback = module.fallback[key] = tf.Variable(table.fallback, name=f"{key}_fallback")
        lookups[id(layer)] = TableLookup(module.tables[key], module.rows[key], layer, fallback,
                                         name=layer.name, dtype=layer.dtype_policy)  # fmt: skip
        records[path] = {"key": key, "layer": layer.name, "dim": layer.dim,
                         "dtype": np.dtype(table.rows.dtype).name,
                         "fallback_rows": int(table.fallback.shape[0])}  # fmt: skip

    def swap(layer: keras.layers.Layer) -> keras.layers.Layer:
        if isinstance(layer, DistributedEmbedding):  # its tables are inside it
            inner = {n: lookups[id(t)] for n, t in layer.tables.items()}
            return ServedDistributed(layer, inner, dtype=layer.dtype_policy)
        return lookups.get(id(layer), layer)

    try:
        served = model if not lookups else keras.models.clone_model(model, clone_function=swap)
    except ValueError as exc:
        raise ServingError(
            f"model {model.name!r} cannot be cloned for serving (a functional or Sequential "
            f"model can): {' '.join(str(exc).split())[:300]}"
        ) from None
    module.dense = [v.value for v in dense_variables(model)]
    module.serve = tf.function(
        lambda x: served(x, training=False), input_signature=input_signature(model)
    )
    return module, records


def write_export(
    model: keras.Model,
    tables: Mapping[str, Table],
    out: str | Path,
    versions: Sequence[int],
    fingerprint: str,
    name: str | None = None,
) -> dict[str, Any]:
    """Write the full export of ``model`` (named ``name``, by default the model's own name)
    serving ``tables`` to directory ``out`` (see the module) at the shards' ``versions``;
    returns its meta."""
    module, records = serving_module(model, tables)
    tf.saved_model.save(module, str(out), signatures={"serving_default": module.serve})
    meta = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "model": name or model.name,
        "fingerprint": fingerprint,
        "versions": [int(v) for v in versions],
        "tables": records,
        "dense": [v.path for v in dense_variables(model)],
        "fixed_tables": fixed_tables(model),
    }
    ids = {records[p]["key"]: tables[p].sorted().ids for p in records}
    write_extra(Path(out), meta, ids)
    return meta


def write_extra(out: Path, meta: dict[str, Any], ids: Mapping[str, np.ndarray]) -> None:
    """The export's ``assets.extra``: its meta and each table's ids (by key)."""
    (out / EXTRA).mkdir(exist_ok=True)
    (out / EXTRA / EXPORT_META).write_text(json.dumps(meta, indent=1) + "\n")
    np.savez(out / EXTRA / EXPORT_IDS, **ids)


def read_export(path: str | Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(meta, ids by table path) of a full export; ServingError if ``path`` is not one."""
    extra = Path(path) / EXTRA
    try:
        meta = json.loads((extra / EXPORT_META).read_text())
        if meta.get("format") != FORMAT or meta.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"format {meta.get('format')!r} {meta.get('format_version')!r}")
        with np.load(extra / EXPORT_IDS) as npz:
            ids = {p: npz[r["key"]] for p, r in meta["tables"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ServingError(
            f"{path} is not a downpour export of a model with dynamic tables "
            f"({FORMAT} {FORMAT_VERSION}: {EXTRA}/{EXPORT_META} and {EXPORT_IDS}): {exc}"
        ) from None
    return meta, ids


def hold_rows(layer: DynamicEmbedding, ids: np.ndarray, rows: np.ndarray) -> None:
    """Make ``layer`` hold exactly ``ids`` (unique int64) with ``rows``: the Keras model then
    computes what the served one does for these ids. ServingError over the rows it holds."""
    try:
        layer.hold(ids, rows)
    except ValueError as exc:
        raise ServingError(str(exc)) from None


def layer_ids(model: keras.Model, batch: Any) -> dict[str, np.ndarray]:
    """The unique int64 ids each DynamicEmbedding of a functional ``model`` reads for
    ``batch`` (strings hashed; every feature of a shared table; no pads), by table path."""
    from downpour.model.build import gathered_ids, id_extractor

    layers = dynamic_layers(model)
    paths = sorted(layers)
    extractor = id_extractor(model, [layers[p] for p in paths])
    found = gathered_ids(extractor, batch)
    return {p: np.asarray(ids) for p, ids in zip(paths, found, strict=True)}


def reference_outputs(model: keras.Model, tables: Mapping[str, Table], batch: Any) -> np.ndarray:
    """What the served model must return for ``batch``: ``model`` with each DynamicEmbedding
    holding what the served table reads for the batch's ids (``Table.read``)."""
    layers = dynamic_layers(model)
    for path, ids in layer_ids(model, batch).items():
        hold_rows(layers[path], ids, tables[path].read(ids))
    return np.asarray(model(batch, training=False))


def remove_export(out: Path) -> None:
    """Remove a partly written export directory."""
    shutil.rmtree(out, ignore_errors=True)


def as_table(state: Mapping[str, np.ndarray]) -> Table:
    """A ``Table`` of a ``DynamicTable.export_state`` of the only shard, or a
    ``tables_from_checkpoints`` dict (``fallback``: the fallback rows in g order)."""
    fallback = state.get("fallback")
    if fallback is None and "fallback_index" in state:
        fallback = joined_fallback("the only shard's table", [state])
    return Table(*(np.asarray(state[f]) for f in SERVED_FIELDS),
                 None if fallback is None else np.asarray(fallback))  # fmt: skip
