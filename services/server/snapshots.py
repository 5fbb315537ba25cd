"""What pulls read of a shard's variables: one snapshot per version, taken as pulls need it.

A pull of a version reads arrays shared by every pull of that version, read off TensorFlow
(``numpy()``) when a pull first needs each: a row-sparse table is snapshotted only when
someone pulls it whole (a snapshot holds the variable's buffer, so the next apply would copy
the whole table to write it); a row pull gathers its rows instead, with a compiled
``tf.gather``. Whole pulls in bfloat16 are rounded by one compiled call reading the
variables, without a float32 snapshot. A dynamic table has no array: a whole pull carries it
without rows (they go by id, ``ParameterState.gather``).

Snapshots are immutable arrays; TensorFlow copies a variable's buffer before writing it while
a read still holds it, so a snapshot is never torn by a later apply.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import keras
import ml_dtypes
import numpy as np
import tensorflow as tf

from downpour.memory.tensors import as_array
from downpour.wire import BFloat16, Keyed, WireTensor, as_bf16


def _round_bf16_fn(variables: list[tf.Variable]) -> tf.types.experimental.ConcreteFunction:
    """A compiled call returning ``variables`` (float32) rounded to bfloat16, as the bits
    (uint16) NumPy can take without a copy."""

    @tf.function(input_signature=[])
    def round_bf16() -> list[tf.Tensor]:
        return [tf.bitcast(tf.cast(v, tf.bfloat16), tf.uint16) for v in variables]

    return round_bf16.get_concrete_function()


def _gather_fn(variable: keras.Variable) -> tf.types.experimental.ConcreteFunction:
    """A compiled ``tf.gather`` of ``variable``'s rows, traced once for any number of ids."""

    @tf.function(input_signature=[tf.TensorSpec((None,), tf.int64)])
    def gather(ids: tf.Tensor) -> tf.Tensor:
        return tf.gather(variable.value, ids)

    return gather.get_concrete_function()


class Snapshots:
    """The pull side of a ``ParameterState``: ``variables`` are its TF variables by wire
    index (a dynamic table's index has none); ``shapes``, ``dtypes`` and ``sparse`` are every
    index's. Each method is given the state's current ``version``; what it returns is shared
    by every call at that version and not changed afterwards."""

    def __init__(
        self,
        variables: Mapping[int, keras.Variable],
        shapes: Sequence[tuple[int, ...]],
        dtypes: Sequence[np.dtype],
        sparse: Sequence[bool],
    ) -> None:
        self._var = dict(variables)
        self._fixed = list(self._var)  # the indices that are variables, in wire order
        self.shapes, self.dtypes, self.sparse = shapes, dtypes, sparse
        # Per-version snapshots, one array per variable, taken when a pull first needs it.
        self._snap_version = -1
        self._snap: list[np.ndarray | None] = []
        self._snapshot: tuple[int, list[np.ndarray]] | None = None
        # Whole pulls in bfloat16: the float32 variables rounded by one compiled call, once
        # per version, without a float32 snapshot (``weights_bf16``).
        self._bf16: tuple[int, list[WireTensor]] | None = None
        self._rounded = [i for i in self._fixed if dtypes[i] == np.float32]
        self._round_bf16 = _round_bf16_fn([self._var[i] for i in self._rounded])
        self._gathers = {i: _gather_fn(v) for i, v in self._var.items() if sparse[i]}

    def _arrays(self, version: int, which: Sequence[int]) -> list[np.ndarray | None]:
        """``version``'s snapshot list, with the variables ``which`` filled in."""
        if self._snap_version != version:
            self._snap_version = version
            self._snap = [None] * len(self.shapes)
        for i in which:
            if self._snap[i] is None:
                self._snap[i] = self._var[i].numpy()
        return self._snap

    def weights(self, version: int) -> tuple[int, list[np.ndarray]]:
        """(version, arrays) — one snapshot per version, shared by every pull of it. O(model):
        for whole pulls, evaluation and tests; a row pull uses ``dense_weights`` and
        ``gather``."""
        if self._snapshot is None or self._snapshot[0] != version:
            self._arrays(version, self._fixed)
            arrays = [
                self._snap[i] if i in self._var else self.no_rows(i)
                for i in range(len(self.shapes))
            ]
            self._snapshot = (version, [a for a in arrays if a is not None])
        return self._snapshot

    def weights_bf16(self, version: int) -> tuple[int, list[WireTensor]]:
        """(version, tensors) for a whole pull in bfloat16 (``--pull-compress bf16``), one
        list per version shared by every pull of it. The float32 variables are rounded by
        one compiled call reading them (nearest even, bit for bit what ``wire.as_bf16``
        gives a finite value; a NaN stays a NaN) and leave TensorFlow without a copy; no
        float32 snapshot is taken. Other variables go as ``wire.as_bf16`` sends them:
        float64 rounded from a snapshot, float16 and integers as they are, dynamic tables
        without rows."""
        if self._bf16 is None or self._bf16[0] != version:
            rounded = dict(zip(self._rounded, self._round_bf16(), strict=True))
            out: list[WireTensor] = []
            for i in range(len(self.shapes)):
                if i in rounded:
                    bits = as_array(rounded[i])
                    out.append(BFloat16(bits.view(ml_dtypes.bfloat16), self.dtypes[i]))
                else:
                    out.append(as_bf16(self.array(version, i)))
            self._bf16 = (version, out)
        return self._bf16

    def no_rows(self, i: int) -> Keyed:
        """Dynamic table ``i`` in a whole pull: no rows (they go by id, ``gather``)."""
        empty = np.zeros((0, *self.shapes[i][1:]), self.dtypes[i])
        return Keyed(np.zeros(0, np.int64), empty, self.shapes[i])

    def array(self, version: int, i: int) -> np.ndarray | Keyed:
        """Variable ``i`` at ``version`` (a snapshot shared by every pull of it)."""
        if i not in self._var:
            return self.no_rows(i)
        a = self._arrays(version, (i,))[i]
        assert a is not None
        return a

    def dense_weights(self, version: int) -> tuple[int, list[np.ndarray | None]]:
        """(version, arrays) of the variables that are not row-sparse; None for row-sparse
        ones, which are not snapshotted: a row pull gathers their rows (``gather``)."""
        dense = [i for i in self._fixed if not self.sparse[i]]
        arrays = self._arrays(version, dense)
        return version, [None if s else a for a, s in zip(arrays, self.sparse, strict=True)]

    def gather(self, i: int, ids: np.ndarray) -> np.ndarray:
        """Rows ``ids`` (int64, in range: the caller checks) of row-sparse variable ``i`` at
        this version, as a fresh array: O(len(ids)), the table is not copied."""
        return self._gathers[i](tf.constant(ids, tf.int64)).numpy()
