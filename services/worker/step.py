"""The worker's compute step: one compiled evaluation returns the loss and the whole gradient list.

Evaluating each gradient tensor on its own re-runs the forward and backward pass once per
variable; one ``tf.function`` returning the list runs them once per batch. Its
``input_signature`` is the input dataset's ``element_spec`` (features a tensor, tuple or dict;
labels of any rank and dtype) with the batch dimension open, so it is traced exactly once, and
a smaller last batch does not trace again.
"""

from __future__ import annotations

from typing import Any

import keras
import ml_dtypes
import numpy as np
import tensorflow as tf

from downpour.memory.tensors import as_array, to_tensor
from downpour.spec import ModelSpec
from downpour.wire import BFloat16, Payload, Sparse, Tensor, WireTensor, pushed_rows
from downpour.worker.rows.cache import RowCache


def batch_signature(element_spec: Any) -> Any:
    """``element_spec`` with every tensor's batch (first) dimension left open (ragged and
    sparse features, a multi-valued feature's bags, keep their kind)."""

    def open_batch(s: Any) -> Any:
        shape = (None, *s.shape[1:])
        if isinstance(s, tf.RaggedTensorSpec):
            return tf.RaggedTensorSpec(shape, s.dtype, s.ragged_rank, s.row_splits_dtype)
        if isinstance(s, tf.SparseTensorSpec):
            return tf.SparseTensorSpec(shape, s.dtype)
        return tf.TensorSpec(shape, s.dtype)

    return tf.nest.map_structure(open_batch, element_spec)


def to_wire(g: tf.Tensor | tf.IndexedSlices) -> Tensor:
    """A gradient as the protocol sends it: an ndarray, or Sparse for IndexedSlices (each
    row once, ``wire.pushed_rows``)."""
    if isinstance(g, tf.IndexedSlices):
        shape = tuple(int(d) for d in g.dense_shape.numpy())
        return pushed_rows(Sparse(as_array(g.indices), as_array(g.values), shape))
    return as_array(g)


def _round_bf16(g: tf.Tensor) -> tf.Tensor:
    """A float32 tensor rounded to bfloat16 (nearest, ties to even), as its uint16 bits."""
    return tf.bitcast(tf.cast(g, tf.bfloat16), tf.uint16)


class GradientStep:
    """``step(x, y) -> (loss, [gradient per trainable variable])`` in one evaluation.

    With ``round_bf16`` the compiled step also rounds every dense float32 gradient to
    bfloat16 (``--compress bf16``), and those come out as ``wire.BFloat16``: TensorFlow's
    cast rounds to nearest even, bit for bit as ``wire.as_bf16``, and it runs vectorised
    inside the step, so the worker neither rounds 4 bytes an element in NumPy nor reads
    them out of TensorFlow. Row-sparse gradients, the row caches' and other dtypes come out
    as without it, for the compressor to treat.
    """

    def __init__(
        self,
        spec: ModelSpec,
        model: keras.Model,
        element_spec: Any,
        caches: dict[str, RowCache] | None = None,
        round_bf16: bool = False,
    ) -> None:
        """``element_spec``: the input dataset's ``(features, labels)`` spec; an array of
        examples stands for a single feature tensor with rank-1 ``spec.label_dtype`` labels.
        ``caches``: row caches by variable path, whose gradients go out with global ids.
        ``round_bf16``: dense float32 gradients come out rounded, as ``BFloat16``."""
        self.model = model
        self.round_bf16 = round_bf16
        self.variables = list(model.trainable_variables)
        caches = caches or {}
        self.caches = {i: caches[v.path] for i, v in enumerate(self.variables) if v.path in caches}
        self.traces = 0
        if isinstance(element_spec, np.ndarray):
            element_spec = (
                tf.TensorSpec(element_spec.shape, tf.as_dtype(element_spec.dtype)),
                tf.TensorSpec((None,), spec.label_dtype),
            )
        signature = list(batch_signature(tuple(element_spec)))

        @tf.function(input_signature=signature)
        def compute(x: Any, y: Any) -> tuple[tf.Tensor, list[tf.Tensor]]:
            self.traces += 1  # runs only while tracing
            with tf.GradientTape() as tape:
                out = model(x, training=True)
                loss = spec.loss(y, out)
            grads = tape.gradient(loss, self.variables)
            if round_bf16:
                grads = [
                    _round_bf16(g)
                    if i not in self.caches
                    and g is not None
                    and not isinstance(g, tf.IndexedSlices)
                    and g.dtype == tf.float32
                    else g
                    for i, g in enumerate(grads)
                ]
            return loss, grads

        self._compute = compute

        @tf.function(input_signature=[tf.TensorSpec(v.shape, v.dtype) for v in self.variables])
        def assign_all(*arrays: tf.Tensor) -> None:
            for v, a in zip(self.variables, arrays, strict=True):
                v.assign(a)

        self._assign_all = assign_all
        self._assign_some: dict[tuple[int, ...], Any] = {}
        self._scatters: dict[int, Any] = {}

    def trace(self) -> None:
        """Trace the step now (the only trace): a batch that cannot fit the model fails
        here, before the worker says hello, instead of at its first step."""
        self._compute.get_concrete_function()

    def __call__(self, x: Any, y: Any) -> tuple[float, list[WireTensor]]:
        """Loss as a float and the gradients as wire tensors, in variable order."""
        loss, grads = self._compute(x, y)
        out: list[WireTensor] = []
        for i, g in enumerate(grads):
            if i in self.caches:
                out.append(self.caches[i].gradient(g))
            elif g.dtype == tf.uint16:  # rounded in the step: only float32 gradients are
                out.append(BFloat16(as_array(g).view(ml_dtypes.bfloat16), np.dtype(np.float32)))
            else:
                out.append(to_wire(g))
        return float(loss), out

    def prepare(self, arrays: list[np.ndarray]) -> list[tf.Tensor]:
        """Pulled arrays as tensors, ready for ``set_weights``; the caller gives the arrays
        up. The fetcher thread calls this, so the copy out of ZeroMQ's buffers overlaps the
        next step's computation instead of delaying it; weights widened from bfloat16 on
        receipt are private memory and become tensors without that copy (``to_tensor``'s
        ``adopt``). The training thread's assign then takes the tensors' memory as it is."""
        return [to_tensor(a, adopt=True) for a in arrays]

    def set_weights(self, arrays: list[np.ndarray] | list[tf.Tensor]) -> None:
        """Load pulled weights into the local model copy (one compiled call for all)."""
        self._assign_all(*(to_tensor(a) if isinstance(a, np.ndarray) else a for a in arrays))

    def set_some(self, which: tuple[int, ...], arrays: list[Any]) -> None:
        """Load the variables ``which`` (model order) only: the others are tables kept by
        row (``scatter_rows``). One compiled call, traced once per set of variables."""
        fn = self._assign_some.get(which)
        if fn is None:
            chosen = [self.variables[i] for i in which]

            @tf.function(input_signature=[tf.TensorSpec(v.shape, v.dtype) for v in chosen])
            def assign_some(*arrays: tf.Tensor) -> None:
                for v, a in zip(chosen, arrays, strict=True):
                    v.assign(a)

            fn = self._assign_some[which] = assign_some
        fn(*arrays)

    def scatter_rows(self, i: int, rows: np.ndarray, values: np.ndarray) -> None:
        """Write rows ``rows`` (int64) of variable ``i`` (a table kept by row): O(rows).

        A sparse write (``ResourceScatterUpdate``) puts the variable into TensorFlow's
        copy-on-read mode, in which every later dense read (``ReadVariableOp``, as Keras's
        ``Embedding`` reads its table in the step) copies the whole table: O(table) a step.
        The same compiled call then turns the mode off again (``DisableCopyOnRead``, what
        ``ResourceVariable.read_value_no_copy`` uses): the next write made while no read
        holds the table still finds its buffer unshared and writes it in place, so a row
        install and the step's read stay O(rows) at any table size."""
        fn = self._scatters.get(i)
        if fn is None:
            v = self.variables[i]

            @tf.function(
                input_signature=[
                    tf.TensorSpec((None,), tf.int64),
                    tf.TensorSpec((None, *v.shape[1:]), v.dtype),
                ]
            )
            def scatter(rows: tf.Tensor, values: tf.Tensor) -> None:
                v.value.scatter_update(tf.IndexedSlices(values, rows))
                tf.raw_ops.DisableCopyOnRead(resource=v.value.handle)

            fn = self._scatters[i] = scatter
        fn(rows, values)


class Accumulator:
    """Sums gradient lists over ``n_push`` steps and returns their mean (DistBelief's n_push)."""

    def __init__(self) -> None:
        self.total: list[Tensor] | None = None
        self.count = 0

    def add(self, grads: list[Tensor]) -> None:
        """Fold one step's gradients in; dense ones are summed, sparse ones concatenated."""
        if self.total is None:
            self.total = list(grads)
        else:
            self.total = [_add(a, b) for a, b in zip(self.total, grads, strict=True)]
        self.count += 1

    def take(self) -> list[Tensor]:
        """The mean gradient list since the last take; resets the accumulator."""
        assert self.total is not None and self.count > 0
        total, n = self.total, self.count
        self.total, self.count = None, 0
        if n == 1:
            return total
        return [_scale(_merged(g), 1.0 / n) for g in total]


def _add(a: Tensor, b: Tensor) -> Tensor:
    """``a + b`` (``Payload.plus``): rows concatenated when either is rows (a dense one as
    every row), a dynamic table's with the lookups of each; a ``BFloat16`` refuses."""
    if isinstance(a, Payload):
        return a.plus(b)
    if isinstance(b, Payload):
        return Sparse.every_row(a).plus(b)
    return a + b  # a fresh array: never mutates one that may still be queued for sending


def _merged(g: Tensor) -> Tensor:
    """Accumulated rows with each id once, their rows summed: a push carries each id of its
    batches once (``Payload.pushed``: a dynamic table's with the lookups each sums)."""
    return g.pushed() if isinstance(g, Payload) else g


def _scale(g: Tensor, s: float) -> Tensor:
    if isinstance(g, Payload):  # a dynamic table's rows keep their counts
        return g.scaled(s)
    return (g * s).astype(g.dtype)
