"""Model helpers that need TensorFlow: build and check a spec's model, its fingerprint, its tables.

The fingerprint (a hash of the trainable variables' names, shapes and dtypes) proves at hello
that a worker built the same model as the server. Plugins declare their model with
``downpour.ModelSpec`` (``downpour.spec``), which does not import TensorFlow.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
from collections.abc import Iterable, Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from downpour.layers import DynamicEmbedding
from downpour.model import initial
from downpour.spec import ModelSpec

log = logging.getLogger("downpour")


def describe_variables(variables: Sequence[keras.Variable]) -> list[tuple[str, list[int], str]]:
    """(name, shape, dtype) per variable, the basis of the fingerprint."""
    return [(v.path, [int(d) for d in v.shape], str(v.dtype)) for v in variables]


def fingerprint(variables: Sequence[keras.Variable]) -> str:
    """Hex digest identifying the trainable variables' names, shapes and dtypes."""
    return fingerprint_of(describe_variables(variables))


def fingerprint_of(described: Sequence[tuple[str, list[int], str]]) -> str:
    """The fingerprint of ``describe_variables`` output (also of a TF1 graph's variables)."""
    blob = json.dumps([list(d) for d in described], separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:32]


# Trainable variables travel as gradients and weights on the wire and are applied by the
# server's optimizer: float16, float32 and float64 do all of that (float16 and float64 train
# end to end, tests/test_variable_dtypes.py). bfloat16 is not a wire dtype (NumPy has none of
# its own, DLPack refuses it); integer and bool variables have no gradient.
TRAINABLE_DTYPES = frozenset({"float16", "float32", "float64"})


def check_variables(model: keras.Model, name: str | None = None) -> None:
    """Refuse a model whose trainable variables downpour cannot train, naming the variable.

    Both services build the model through ``build_model``, so a server refuses at start and a
    worker before its hello. Checked: every trainable variable has a dtype of
    ``TRAINABLE_DTYPES``, no two share a path (tensors are named by path on the wire and
    in checkpoints). Non-trainable variables of any dtype are allowed: they stay in each
    process as ``build`` made them (downpour neither sends nor checkpoints them).
    """
    label = f"model {name!r}" if name else "the model"
    seen: set[str] = set()
    for v in model.trainable_variables:
        dtype = str(v.dtype)
        if dtype not in TRAINABLE_DTYPES:
            hint = (
                "keep the variables float32 and compute in bfloat16 with the "
                "'mixed_bfloat16' dtype policy"
                if dtype == "bfloat16"
                else "make it non-trainable (trainable=False) if it is state, not a parameter"
            )
            raise ValueError(
                f"{label}: trainable variable {v.path!r} has dtype {dtype}; downpour trains "
                f"{', '.join(sorted(TRAINABLE_DTYPES))} variables only: {hint}"
            )
        if v.path in seen:
            raise ValueError(
                f"{label}: two trainable variables have the path {v.path!r}; give each "
                "add_weight() of a layer its own name (variables travel and are checkpointed "
                "by path)"
            )
        seen.add(v.path)


def define_model(spec: ModelSpec, seed: int = 0) -> keras.Model:
    """The spec's model with its variables declared but not allocated (names, shapes,
    dtypes, initialisers; ``downpour.model.initial``), ``check_variables``-ed: a shard server
    allocates only its own rows, ``build_model`` all of them. A model whose build needs
    values (it calls itself on data) is built allocated, with Keras's own initial values:
    logged at warning level, as a shard then holds the whole model while it starts."""
    keras.utils.set_random_seed(seed)  # initialisers Keras draws whole (``initial``)
    try:
        model = initial.build_deferred(spec.build)
    except Exception as exc:  # noqa: BLE001 - any failure: the allocated build is the fallback
        reason = " ".join(str(exc).split())[:300] or type(exc).__name__
        log.warning(
            "model %r cannot be built without allocating its variables (%s): built whole, "
            "with Keras's own initial values",
            spec.name,
            reason,
        )
        keras.utils.set_random_seed(seed)
        model = spec.build()
    if not model.built or not model.trainable_variables:
        raise ValueError(f"model {spec.name!r} has no built trainable variables")
    check_variables(model, spec.name)
    return model


def build_model(spec: ModelSpec, seed: int = 0) -> keras.Model:
    """The spec's model with every variable allocated and given its initial value, a
    function of (``seed``, variable, row) only (``downpour.model.initial``), so every process and
    every layout of shards starts from the same weights."""
    model = define_model(spec, seed)
    initial.materialize_model(model, seed)
    return model


def model_inputs(model: keras.Model) -> Any:
    """The model's input structure (KerasTensors: one, a list, a dict or nested, as given to
    ``keras.Model(inputs=...)``; a Sequential's too), or None for a model that declares none
    (subclassed)."""
    for m in (model, getattr(model, "_functional", None)):
        struct = getattr(m, "_inputs_struct", None)  # Keras's own record of Model(inputs=...)
        if struct is not None:
            return struct
    return None


class _RealIds(keras.layers.Layer):
    """The ids a table looks up in every call of it: a ``DynamicEmbedding``'s real ids (a
    bag's values, no pad or masked position, ``DynamicEmbedding.real_ids``), an Embedding's
    input flattened; each call's, joined (a table shared by several features)."""

    def __init__(self, table: keras.layers.Layer, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.table = table

    def call(self, calls: list[Any], masks: list[Any] | None = None) -> tf.Tensor:
        masks = masks or [None] * len(calls)
        if isinstance(self.table, DynamicEmbedding):
            ids = [self.table.real_ids(x, m) for x, m in zip(calls, masks, strict=True)]
        else:
            ids = [tf.reshape(DynamicEmbedding.ids(x), [-1]) for x in calls]
        return ids[0] if len(ids) == 1 else tf.concat(ids, 0)

    def compute_output_shape(self, *_: Any, **__: Any) -> tuple[int | None]:
        return (None,)


def _looked_up(layer: keras.layers.Layer, model: keras.Model) -> Any:
    """The symbolic ids ``layer`` gathers over all its calls in the model (a table several
    features share is called once per feature): each call's first argument, and a
    DynamicEmbedding's ``mask`` argument; a table inside another layer (a
    ``DistributedEmbedding``'s) through that layer's calls."""
    nodes = layer._inbound_nodes  # noqa: SLF001 - Keras's record of the functional calls
    if not nodes:
        owner = next((x for x in model._flatten_layers(include_self=False)  # noqa: SLF001
                      if layer in getattr(x, "tables", {}).values()), None)  # fmt: skip
        if owner is not None and owner._inbound_nodes:  # noqa: SLF001
            inputs = [n.arguments.args[0] for n in owner._inbound_nodes]  # noqa: SLF001
            return _OwnedIds(owner, layer, name=f"{layer.name}_ids")(inputs)
    if not nodes or not all(n.arguments.args for n in nodes):
        raise ValueError(f"layer {layer.name!r} has no call in a graph of layers")
    calls, masks = [], []
    for node in nodes:
        calls.append(node.arguments.args[0])
        masks.append(node.arguments.kwargs.get("mask"))
    if all(m is None for m in masks):
        masks = None
    return _RealIds(layer, name=f"{layer.name}_ids")(calls, masks=masks)


class _OwnedIds(keras.layers.Layer):
    """The ids a table inside ``owner`` (a ``DistributedEmbedding``) looks up in each call
    of the owner, over every feature using it (``owner.real_ids``)."""

    def __init__(self, owner: Any, table: DynamicEmbedding, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.owner, self.table = owner, table

    def call(self, calls: list[Any]) -> tf.Tensor:
        ids = [self.owner.real_ids(self.table, x) for x in calls]
        return ids[0] if len(ids) == 1 else tf.concat(ids, 0)

    def compute_output_shape(self, *_: Any, **__: Any) -> tuple[int | None]:
        return (None,)


def id_extractor(model: keras.Model, layers: Sequence[keras.layers.Layer]) -> keras.Model:
    """A model from ``model``'s inputs, in their own structure (a tensor, a list, a dict,
    nested), to the ids ``layers`` gather (an Embedding's input, a DynamicEmbedding's real
    ids: ragged, sparse and padded inputs as their bags' values): run on a batch's features
    it gives the ids each table gathers, without the rest of the model. ValueError /
    TypeError / AttributeError when the model has no graph of layers (subclassed)."""
    return keras.Model(model_inputs(model), [_looked_up(layer, model) for layer in layers])


def gathered_ids(extractor: keras.Model, features: Any) -> list[tf.Tensor]:
    """Per Embedding the extractor reaches (its outputs are their ids), the unique int64
    ids a batch with ``features`` gathers (strings hashed as a ``DynamicEmbedding`` does)."""
    outs = extractor(features, training=False)
    outs = outs if isinstance(outs, list | tuple) else [outs]
    return [tf.unique(tf.reshape(DynamicEmbedding.ids(o), [-1]))[0] for o in outs]


def zero_inputs(model: keras.Model) -> Any:
    """A batch of one example of zeros (empty strings for string inputs) in the model's own
    input structure (``model_inputs``): unknown dimensions are 1. ValueError for a model
    that declares no inputs."""
    import tensorflow as tf

    struct = model_inputs(model)
    if struct is None:
        raise ValueError(f"model {model.name!r} declares no inputs (keras.Input)")

    def zeros(t: Any) -> Any:
        shape = (1, *(d or 1 for d in t.shape[1:]))
        dtype = tf.as_dtype(t.dtype)
        dense = tf.fill(shape, "") if dtype == tf.string else tf.zeros(shape, dtype)
        if getattr(t, "ragged", False):
            return tf.RaggedTensor.from_tensor(dense)
        if getattr(t, "sparse", False):
            return tf.sparse.from_dense(dense)
        return dense

    return tf.nest.map_structure(zeros, struct)


def embedding_tables(model: keras.Model) -> dict[str, keras.layers.Layer]:
    """The model's Embedding and DynamicEmbedding layers by their table's variable path
    (nested models too)."""
    found: dict[str, keras.layers.Layer] = {}
    for layer in model._flatten_layers(include_self=False):  # Keras's own layer walk
        if isinstance(layer, keras.layers.Embedding | DynamicEmbedding):
            found[layer.embeddings.path] = layer
    return found


def dynamic_tables(model: keras.Model) -> dict[str, DynamicEmbedding]:
    """The model's DynamicEmbedding layers by their table's variable path."""
    return {p: x for p, x in embedding_tables(model).items() if isinstance(x, DynamicEmbedding)}


def evaluate(spec: ModelSpec, model: keras.Model, x: Any, y: np.ndarray | None = None) -> float:
    """The spec's metric, inference mode: on arrays ``(x, y)`` in batches of 500, or with
    ``y`` None on ``x``, an iterable of ``(features, labels)`` batches (a held-out
    ``tf.data.Dataset``)."""
    labels, outputs = predict(model, x, y)
    return spec.metric(labels, outputs)


def predict(model: keras.Model, x: Any, y: np.ndarray | None = None) -> tuple[Any, np.ndarray]:
    """(labels, model outputs) as arrays over every example, inference mode; ``x`` and ``y``
    as for ``evaluate``."""
    if y is not None:
        outs = [model(x[i : i + 500], training=False).numpy() for i in range(0, len(x), 500)]
        return y, np.concatenate(outs) if outs else np.zeros((0,))
    ys, outs = [], []
    for features, labels in x:
        outs.append(np.asarray(model(features, training=False)))
        ys.append(np.asarray(labels))
    if not outs:
        raise ValueError("no held-out batch to evaluate")
    return np.concatenate(ys), np.concatenate(outs)


def batchnorm_layers(model: keras.Model) -> list[keras.layers.BatchNormalization]:
    """The model's BatchNormalization layers, nested models included."""
    return [
        layer
        for layer in model._flatten_layers(include_self=False)  # noqa: SLF001 - Keras's own walk
        if isinstance(layer, keras.layers.BatchNormalization)
    ]


def recalibrate_batchnorm(
    model: keras.Model, x: Any, batch_size: int = 250, max_batches: int = 20
) -> int:
    """Re-estimate every BatchNormalization layer's moving mean and variance for the weights
    the model holds now; returns how many layers there were.

    downpour's policy for non-trainable state: BatchNorm's moving statistics get no gradient,
    so the server does not train or hold them. Statistics a worker gathered belong to the
    (older, different) weights it computed with; averaging them would describe no model the
    server ever had. So whoever evaluates or exports the server's weights first recomputes
    the statistics with those weights, as SWA does (Izmailov et al. 2018, ``bn_update``):
    forward passes in training mode over up to ``max_batches`` training batches, with the
    momentum set so that the result is the exact mean over the batches. ``x`` is an array
    (cut into batches of ``batch_size``) or an iterable of feature batches (the first
    batches of the training ``input_fn``: ``downpour.inputs.pipeline.training_features``).
    """
    layers = batchnorm_layers(model)
    if not layers:
        return 0
    if isinstance(x, np.ndarray):
        stop = min(len(x), batch_size * max_batches)
        feature_batches: Iterable[Any] = (x[i : i + batch_size] for i in range(0, stop, batch_size))
    else:
        feature_batches = itertools.islice(x, max_batches)
    saved = [layer.momentum for layer in layers]
    try:
        for i, features in enumerate(feature_batches):
            for layer in layers:
                layer.momentum = i / (i + 1)  # running mean: batch i weighs 1/(i+1)
            model(features, training=True)
    finally:
        for layer, m in zip(layers, saved, strict=True):
            layer.momentum = m
    return len(layers)
