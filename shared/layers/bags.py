"""Bags of ids: what an embedding returns for a multi-valued feature, and string ids.

A multi-valued feature (a user's recent items, a video's tags, a query's tokens) is a bag of
ids per example, of varying length: a ``tf.RaggedTensor``, a rank-2 ``tf.SparseTensor``, or a
dense tensor padded by a declared pad id or marked by a mask (``bag_of``). A combiner pools
each bag (``combine``: ``sum``, ``mean`` or ``sqrtn``, with optional per-id weights, as
``tf.nn.safe_embedding_lookup_sparse`` pools them; an empty bag gives zeros), or, with none,
the rows stay per position. ``embed`` is the one implementation: the one-process
``DynamicEmbedding``, a worker's cached table and the served export's ``TableLookup`` call it
with their own lookup of flat ids. A pad or masked position is never an id: never looked up,
so never a row, never sent to a server, never counted for admission, given no gradient.

``string_ids``: the little-endian int64 of FarmHash Fingerprint64 of each string, as
``tf.fingerprint`` gives it: stable across processes, machines and TensorFlow versions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import tensorflow as tf


def string_ids(strings: tf.Tensor) -> tf.Tensor:
    """int64 ids of a string tensor of any shape: each string's FarmHash Fingerprint64 (the
    8 bytes ``tf.fingerprint`` gives, read as a little-endian int64), same shape."""
    flat = tf.reshape(strings, [-1])
    ids = tf.bitcast(tf.fingerprint(flat), tf.int64)  # x86 and ARM: little-endian
    return tf.reshape(ids, tf.shape(strings))


COMBINERS = ("sum", "mean", "sqrtn")


def as_ids(values: tf.Tensor) -> tf.Tensor:
    """int64 ids of a dense tensor of ids (strings hashed by ``string_ids``)."""
    if values.dtype == tf.string:
        return string_ids(values)
    return tf.cast(values, tf.int64)


def bag_of(inputs: Any, pad_id: int | None = None, mask: Any = None) -> tf.RaggedTensor | None:
    """The ids of a multi-valued input as a ragged tensor of its real ids, one bag per
    position of all but its last axis: a ``tf.RaggedTensor`` as it is, a
    ``tf.SparseTensor`` by its values, a dense tensor without its ``pad_id`` positions and
    those ``mask`` marks False. None for a dense tensor with neither (every position an id:
    no bag). Strings are hashed (``string_ids``)."""
    if isinstance(inputs, tf.RaggedTensor):
        return inputs.with_flat_values(as_ids(inputs.flat_values))
    if isinstance(inputs, tf.SparseTensor):
        return _sparse_bag(inputs, as_ids)
    ids = as_ids(tf.convert_to_tensor(inputs))
    if pad_id is None and mask is None:
        return None
    keep = tf.ones_like(ids, tf.bool) if mask is None else tf.cast(mask, tf.bool)
    if pad_id is not None:
        keep &= ids != pad_id
    return tf.ragged.boolean_mask(ids, keep)


def _sparse_bag(sp: tf.SparseTensor, convert: Callable[[tf.Tensor], tf.Tensor]) -> Any:
    """A rank-2 ``tf.SparseTensor`` (a bag per row, ids at any columns) as a ragged tensor
    of its values in row-major order, ``convert`` applied to them."""
    if sp.shape.rank is not None and sp.shape.rank != 2:
        raise ValueError(f"a sparse input of ids must be of rank 2 (batch, ids), not {sp.shape}")
    sp = tf.sparse.reorder(sp)
    return tf.RaggedTensor.from_value_rowids(
        convert(sp.values), sp.indices[:, 0], nrows=sp.dense_shape[0]
    )


def bag_weights(bag: tf.RaggedTensor, weights: Any, inputs: Any, pad_id: Any, mask: Any) -> Any:
    """Per-id weights in ``bag``'s layout from ``weights`` of the input's own form (ragged,
    sparse or dense; None: ones)."""
    if weights is None:
        return None
    if isinstance(weights, tf.RaggedTensor):
        return bag.with_flat_values(tf.cast(weights.flat_values, tf.float32))
    if isinstance(weights, tf.SparseTensor):
        return _sparse_bag(weights, lambda v: tf.cast(v, tf.float32))
    ids = as_ids(tf.convert_to_tensor(inputs))
    keep = tf.ones_like(ids, tf.bool) if mask is None else tf.cast(mask, tf.bool)
    if pad_id is not None:
        keep &= ids != pad_id
    return tf.ragged.boolean_mask(tf.cast(weights, tf.float32), keep)


def combine(rows: tf.RaggedTensor, combiner: str, weights: Any = None) -> tf.Tensor:
    """Each bag's rows (``rows``: the bag's layout, a ``dim`` axis last) pooled by
    ``combiner``, as ``tf.nn.safe_embedding_lookup_sparse`` pools them: the weighted sum,
    divided by the sum of the weights (``mean``) or by the root of their squares' sum
    (``sqrtn``). An empty bag gives zeros."""
    if weights is not None:
        rows = rows * tf.expand_dims(weights, -1)
    total = tf.reduce_sum(rows, axis=-2)
    if combiner == "sum":
        return total
    w = weights if weights is not None else tf.ones_like(rows[..., 0])
    denom = tf.reduce_sum(w if combiner == "mean" else tf.square(w), axis=-1)
    if combiner == "sqrtn":
        denom = tf.sqrt(denom)
    return tf.math.divide_no_nan(total, tf.expand_dims(tf.cast(denom, total.dtype), -1))


def pooled_shape(
    input_shape: tuple[int | None, ...], dim: int, combiner: str | None
) -> tuple[int | None, ...]:
    """The output shape of ``embed`` for an input of ``input_shape``: its last axis pooled
    by a combiner (unless the input has one id an example), else a row per position."""
    if combiner is not None and len(input_shape) > 1:
        return (*input_shape[:-1], dim)
    return (*input_shape, dim)


def embed(
    inputs: Any,
    lookup: Callable[[tf.Tensor], tf.Tensor],
    dim: int,
    combiner: str | None = None,
    pad_id: int | None = None,
    weights: Any = None,
    mask: Any = None,
) -> Any:
    """What an embedding layer returns for ``inputs`` given ``lookup`` (flat int64 ids ->
    their rows): for a dense input without pads, its rows in the input's shape (a rank-1
    input, one id an example, is never pooled: a single-valued feature of a table with a
    combiner reads its row); for a bag
    (``bag_of``), each bag pooled by ``combiner``, or with none the rows per position (a
    ragged input's as a ragged tensor, a sparse or padded input's at their positions, zeros
    elsewhere). The one-process layer, the worker's and the served export all call it."""
    bag = bag_of(inputs, pad_id, mask)
    single = bag is None and tf.convert_to_tensor(inputs).shape.rank == 1  # one id an example
    if bag is None and (combiner is None or single):  # every position an id: rows in its shape
        ids = as_ids(tf.convert_to_tensor(inputs))
        rows = lookup(tf.reshape(ids, [-1]))
        return tf.reshape(rows, tf.concat([tf.shape(ids), [dim]], 0))
    if bag is None:  # a dense tensor pooled over its last axis
        bag = tf.RaggedTensor.from_tensor(as_ids(tf.convert_to_tensor(inputs)))
    rows = bag.with_flat_values(tf.ensure_shape(lookup(bag.flat_values), [None, dim]))
    if combiner is not None:
        return combine(rows, combiner, bag_weights(bag, weights, inputs, pad_id, mask))
    if isinstance(inputs, tf.RaggedTensor):
        return rows
    if isinstance(inputs, tf.SparseTensor):
        sp = tf.sparse.reorder(inputs)
        where, shape = sp.indices, sp.dense_shape
    else:
        ids = as_ids(tf.convert_to_tensor(inputs))
        keep = tf.ones_like(ids, tf.bool) if mask is None else tf.cast(mask, tf.bool)
        if pad_id is not None:
            keep &= ids != pad_id
        where, shape = tf.where(keep), tf.shape(ids, out_type=tf.int64)
    return tf.scatter_nd(where, rows.flat_values, tf.concat([shape, [dim]], 0))
