"""The tensor values a message carries: plain arrays, ``Sparse`` rows, ``Keyed`` rows of a
dynamic table, ``FlatSparse`` elements, ``BFloat16`` tensors and ``SparseBF16`` /
``KeyedBF16`` rows, the dtypes the wire allows, and helpers on them.
``downpour.wire`` re-exports all of it; import it from there.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

ALLOWED_DTYPES: frozenset[str] = frozenset(
    {
        "float16",
        "float32",
        "float64",
        "bool",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
    }
)
INDEX_DTYPES = frozenset({"int32", "int64"})
# logical dtypes a bf16-encoded tensor may decode to
BF16_DTYPES = frozenset({"float16", "float32", "float64"})


def dedupe_rows(indices: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unique row indices (int64) and each row's summed values. Keras's Adagrad and Adam
    square a sparse gradient's values row by row, so a repeated row must be summed first."""
    rows, inverse = np.unique(indices, return_inverse=True)
    if len(rows) == len(indices):
        order = np.argsort(indices, kind="stable")
        return indices[order].astype(np.int64), np.ascontiguousarray(values[order])
    summed = np.zeros((len(rows), *values.shape[1:]), dtype=values.dtype)
    np.add.at(summed, inverse, values)
    return rows.astype(np.int64), summed


def row_numbers(ids: np.ndarray, rows: int) -> np.ndarray:
    """Row numbers of a table of ``rows`` rows as the wire sends them: int32 when every row
    number fits (``rows`` <= 2**31 - 1), half the bytes of int64; int64 otherwise."""
    return ids.astype(np.int32 if rows <= np.iinfo(np.int32).max else np.int64, copy=False)


def pushed_rows(s: Sparse) -> Sparse:
    """A row gradient as a push sends it: each row once, its repeats summed (as the server
    sums them before it applies them; a ``bf16`` push then rounds each sum once). Fewer
    bytes for the same update. A fixed table's rows go by int32 row number when the table
    has fewer than 2**31 rows; a dynamic table's (``Keyed``) by int64 id, with the lookups
    each sums as ``counts`` (``counted_rows``), which the server counts for admission."""
    if isinstance(s, Keyed):
        return counted_rows(s)
    rows, values = dedupe_rows(np.asarray(s.indices), np.asarray(s.values))
    return Sparse(row_numbers(rows, s.dense_shape[0]), values, tuple(s.dense_shape))


def counted_rows(k: Keyed) -> Keyed:
    """``k`` with each id once, in id order: the rows of an id summed, its lookups added up
    as ``counts`` (int32; a row without counts is one lookup)."""
    ids = np.asarray(k.indices)
    ids, values = ids.astype(np.int64, copy=False), np.asarray(k.values)
    uniq, inverse = np.unique(ids, return_inverse=True)
    if uniq.size == ids.size:
        order = np.argsort(ids, kind="stable")
        summed, counts = np.ascontiguousarray(values[order]), k.lookups()[order]
    else:
        summed = np.zeros((uniq.size, *values.shape[1:]), values.dtype)
        np.add.at(summed, inverse, values)
        counts = np.bincount(inverse, weights=k.lookups(), minlength=uniq.size)
    return Keyed(uniq, summed, tuple(k.dense_shape), np.asarray(counts).astype(np.int32))


@dataclass(frozen=True)
class Sparse:
    """Row-sparse tensor (``tf.IndexedSlices``): ``dense[indices[i]] += values[i]``."""

    indices: np.ndarray
    values: np.ndarray
    dense_shape: tuple[int, ...]

    def to_dense(self) -> np.ndarray:
        """Materialise as a dense array; repeated indices are summed, as TF does."""
        out = np.zeros(self.dense_shape, dtype=self.values.dtype)
        np.add.at(out, self.indices, self.values)
        return out


@dataclass(frozen=True)
class Keyed(Sparse):
    """Rows of a dynamic table (``downpour.layers.DynamicEmbedding``): ``indices`` are ids,
    any int64 value, not row numbers below ``dense_shape[0]`` (the table's declared shape,
    which ids do not index). ``counts``: the lookups each row sums (int32, each >= 1) when
    the sender merged repeated ids (``pushed_rows``); None: each row is one lookup. The
    server counts lookups for admission and per row. What a ``keyed`` tensor (without
    counts) and a ``keyed_counted`` one (with) encode from and decode to."""

    counts: np.ndarray | None = None

    def lookups(self) -> np.ndarray:
        """The lookups each row stands for: ``counts``, or one each."""
        if self.counts is None:
            return np.ones(np.shape(self.indices)[0], np.int64)
        return np.asarray(self.counts, np.int64)

    def to_dense(self) -> np.ndarray:
        raise ValueError("the rows of a dynamic table are keyed by id and have no dense form")


@dataclass(frozen=True)
class FlatSparse:
    """Element-sparse tensor (a top-k gradient): ``dense.ravel()[indices[i]] += values[i]``.

    ``indices`` (nnz,) int32/int64 positions in the C-order flattened tensor, ``values``
    (nnz,) of the tensor's dtype. What a ``topk`` tensor encodes from and decodes to.
    """

    indices: np.ndarray
    values: np.ndarray
    dense_shape: tuple[int, ...]

    @property
    def dtype(self) -> np.dtype:
        """The dense tensor's dtype (that of the values)."""
        return self.values.dtype

    def to_dense(self, out: np.ndarray | None = None) -> np.ndarray:
        """Scatter into zeros (``out``, C-contiguous, if given: reused, no allocation).

        Repeated positions are summed.
        """
        shape = tuple(self.dense_shape)
        if out is None:
            out = np.zeros(shape, dtype=self.values.dtype)
        else:
            if out.shape != shape or not out.flags.c_contiguous or not out.flags.writeable:
                raise ValueError(f"out must be a writeable C-contiguous array of shape {shape}")
            out.fill(0)
        np.add.at(out.reshape(-1), self.indices, self.values)
        return out


@dataclass(frozen=True)
class BFloat16:
    """A float tensor to send as bfloat16 (2 bytes an element); decodes to ``dtype``.

    ``values`` is an ``ml_dtypes.bfloat16`` array; build it with ``from_array`` (round to
    nearest even). Only encode takes it: decode hands back the array converted to ``dtype``.
    """

    values: np.ndarray
    dtype: np.dtype = np.dtype(np.float32)

    @classmethod
    def from_array(cls, a: np.ndarray) -> BFloat16:
        """Round a float array to bfloat16 (nearest even; beyond about 3.39e38 is inf)."""
        a = np.asarray(a)
        if a.dtype.name not in BF16_DTYPES:
            raise ValueError(f"bf16 takes {sorted(BF16_DTYPES)}, not {a.dtype}")
        return cls(a.astype(ml_dtypes.bfloat16), np.dtype(a.dtype.name))

    @property
    def dense_shape(self) -> tuple[int, ...]:
        """The tensor's shape."""
        return tuple(self.values.shape)

    def to_dense(self) -> np.ndarray:
        """The values as a fresh array of ``dtype``."""
        return self.values.astype(self.dtype)


@dataclass(frozen=True)
class SparseBF16:
    """Rows of a row-sparse tensor to send with their values in bfloat16 (a row pull under
    ``--pull-compress bf16``, a row gradient under ``--compress bf16``): ``Sparse`` at 2
    bytes a value. ``values`` is an ``ml_dtypes.bfloat16`` array of shape
    (nnz, *dense_shape[1:]); build it with ``from_sparse``. Only encode takes it: decode
    hands back a ``Sparse`` whose values are widened to ``dtype``."""

    indices: np.ndarray
    values: np.ndarray
    dense_shape: tuple[int, ...]
    dtype: np.dtype = np.dtype(np.float32)

    @classmethod
    def from_sparse(cls, s: Sparse) -> SparseBF16:
        """``s`` with its values rounded to bfloat16 (nearest even, as ``BFloat16``)."""
        rounded = BFloat16.from_array(s.values)
        return cls(s.indices, rounded.values, tuple(s.dense_shape), rounded.dtype)

    def to_dense(self) -> np.ndarray:
        """Materialise as a dense array of ``dtype``; repeated indices are summed."""
        return Sparse(self.indices, self.values.astype(self.dtype), self.dense_shape).to_dense()


@dataclass(frozen=True)
class KeyedBF16(SparseBF16):
    """``Keyed`` rows with their values in bfloat16 (a dynamic table's rows pulled under
    ``--pull-compress bf16`` or pushed under ``--compress bf16``), ``counts`` as
    ``Keyed``'s; decodes to ``Keyed``."""

    counts: np.ndarray | None = None

    @classmethod
    def from_sparse(cls, s: Sparse) -> KeyedBF16:
        """``s`` (``Keyed``) with its values rounded to bfloat16, its counts kept."""
        rounded = BFloat16.from_array(s.values)
        counts = s.counts if isinstance(s, Keyed) else None
        return cls(s.indices, rounded.values, tuple(s.dense_shape), rounded.dtype, counts)

    def to_dense(self) -> np.ndarray:
        raise ValueError("the rows of a dynamic table are keyed by id and have no dense form")


Tensor = np.ndarray | Sparse  # a gradient as the worker computes it
WireTensor = np.ndarray | Sparse | FlatSparse | BFloat16 | SparseBF16  # what a Message may carry
# (Keyed and KeyedBF16 are a Sparse and a SparseBF16)


def all_finite(a: np.ndarray) -> bool:
    """True if no NaN/Inf. One read-only pass catches both: for float32/float64 the dot
    product of the values with themselves (BLAS, about twice as fast as a sum; every term is
    non-negative, so an Inf cannot cancel), else a sum; a finite result proves every value
    finite, and an overflow falls back to a scan. The server checks every gradient with it;
    a top-k worker keeps bad ones out of residuals."""
    if a.dtype.kind not in "fc" or a.size == 0:
        return True
    with np.errstate(all="ignore"):
        if a.dtype in (np.float32, np.float64) and a.flags.c_contiguous:
            flat = a.reshape(-1)
            if np.isfinite(np.dot(flat, flat)):
                return True
        elif np.isfinite(a.sum()):
            return True
    return bool(np.isfinite(a).all())


def as_bf16(t: np.ndarray | Sparse) -> np.ndarray | Sparse | BFloat16 | SparseBF16:
    """``t`` to send in bfloat16 where that halves its values (float32, float64): an array
    as ``BFloat16``, rows as ``SparseBF16``; float16 (as many bytes and more precise) and
    non-float values as they are. Gradients (``--compress bf16``), weights and table rows
    (``--pull-compress bf16``) follow this one rule."""
    values = t.values if isinstance(t, Sparse) else t
    if values.dtype.name not in BF16_DTYPES or values.dtype == np.float16:
        return t
    if isinstance(t, Sparse):
        return (KeyedBF16 if isinstance(t, Keyed) else SparseBF16).from_sparse(t)
    return BFloat16.from_array(t)


def densify(t: WireTensor, out: np.ndarray | None = None) -> np.ndarray:
    """Any tensor a message carries as a dense ndarray (``out``: reused by FlatSparse only).

    An ndarray comes back as it is (a decoded one is a read-only view on its frame).
    """
    if isinstance(t, FlatSparse):
        return t.to_dense(out)
    if isinstance(t, Sparse | BFloat16 | SparseBF16):
        return t.to_dense()
    return np.asarray(t)


def logical_shape(t: WireTensor) -> tuple[int, ...]:
    """The dense shape of any tensor a message carries."""
    return tuple(t.shape if isinstance(t, np.ndarray) else t.dense_shape)


def logical_dtype(t: WireTensor) -> np.dtype:
    """The dense dtype of any tensor a message carries."""
    return t.values.dtype if isinstance(t, Sparse) else np.dtype(t.dtype)
