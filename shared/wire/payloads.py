"""The tensor values a message carries: plain arrays, ``Sparse`` rows, ``Keyed`` rows of a
dynamic table, ``FlatSparse`` elements, ``BFloat16`` tensors and ``SparseBF16`` /
``KeyedBF16`` rows, the dtypes the wire allows, and helpers on them.
``downpour.wire`` re-exports all of it; import it from there.

Every payload type is a ``Payload``: it says what it is (``row_sparse``, ``keyed``,
``bf16``) and does what its callers need of it (its dense view, its bytes, its rows, its
shard pieces, sums and scaling for the worker's ``--n-push`` accumulator, bfloat16 rounding
and widening), so no caller tests its class. A dense tensor travels as a plain ndarray,
which shares ``dtype`` and ``nbytes`` with the payloads; the functions at the end of this
module (``densify``, ``is_rows``, ``rows_of``, ...) take either.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

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
_BF16_BYTES = 2  # a bfloat16 value on the wire


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
    """A row gradient as a push sends it (``Sparse.pushed``: each row once, its repeats
    summed; a dynamic table's rows with their lookups as ``counts``)."""
    return s.pushed()


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


def _index_nbytes(indices: np.ndarray) -> int:
    """Bytes of an indices frame: int32 and int64 as they are, other integers as int64."""
    idx = np.asarray(indices)
    return idx.size * (idx.dtype.itemsize if idx.dtype.name in INDEX_DTYPES else 8)


def _counts_nbytes(counts: np.ndarray | None) -> int:
    """Bytes of a keyed row list's counts frame (int32 each; none without counts)."""
    return 0 if counts is None else 4 * int(np.size(counts))


def _halves(dtype: np.dtype) -> bool:
    """Whether bfloat16 halves (or better) values of ``dtype``: float32 and float64."""
    return dtype.name in BF16_DTYPES and dtype != np.float16


def _check_out(out: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """``out`` if it is a writeable C-contiguous array of ``shape``; ValueError otherwise."""
    if out.shape != shape or not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError(f"out must be a writeable C-contiguous array of shape {shape}")
    return out


def _zeros(shape: tuple[int, ...], dtype: np.dtype, out: np.ndarray | None) -> np.ndarray:
    """Zeros of ``shape``: ``out`` cleared when given (``_check_out``), else a fresh array
    of ``dtype``."""
    if out is None:
        return np.zeros(shape, dtype=dtype)
    _check_out(out, shape).fill(0)
    return out


class Payload:
    """What every tensor payload type answers, so callers ask it rather than test its class.

    ``row_sparse``: rows of a rank >= 1 tensor (``Sparse``, ``SparseBF16`` and their keyed
    kinds), which carry ``indices`` and ``values``; ``keyed``: a dynamic table's rows,
    addressed by id with ``counts`` and ``lookups``; ``bf16``: values held as bfloat16,
    standing for ``dtype``. Every payload has a ``dense_shape`` and a logical ``dtype``
    (the dense tensor's) and ``nbytes`` (its frames' bytes), as an ndarray has a shape, a
    dtype and nbytes. What a kind cannot do raises TypeError."""

    row_sparse: ClassVar[bool] = False
    keyed: ClassVar[bool] = False
    bf16: ClassVar[bool] = False

    # fields or properties of each payload type
    values: np.ndarray
    dense_shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def nbytes(self) -> int:
        """Bytes its frames take on the wire (indices, values, a keyed row's counts; the
        header not included)."""
        raise NotImplementedError

    @property
    def logical_nbytes(self) -> int:
        """Bytes it takes with its values at the logical dtype's width: what a bfloat16
        payload stood for before rounding; ``nbytes`` for the others."""
        return self.nbytes

    def to_dense(self, out: np.ndarray | None = None) -> np.ndarray:
        """The dense tensor (``out``, writeable C-contiguous of the dense shape and dtype:
        filled and returned instead of a fresh array)."""
        raise NotImplementedError

    def rows(self) -> tuple[np.ndarray, np.ndarray]:
        """(row indices, their values), as held: the rows of a row-sparse payload."""
        raise TypeError(f"{type(self).__name__} has no rows")

    def unique_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """Each row once (int64, ascending) with its repeats summed (``dedupe_rows``): what
        the server's compiled apply takes."""
        ids, values = self.rows()
        return dedupe_rows(np.asarray(ids), np.asarray(values))

    def row_range(self, start: int, stop: int) -> Payload:
        """Rows ``start:stop`` of the tensor as a tensor of ``stop - start`` rows: a shard's
        piece of a variable split by row ranges (``downpour.model.partition``)."""
        raise TypeError(f"{type(self).__name__} cannot be split by rows")

    def pushed(self) -> Payload:
        """As a push sends it: as it is, unless a kind merges its rows."""
        return self

    def as_bf16(self) -> Payload:
        """To send in bfloat16 (``as_bf16``), where a kind can be rounded."""
        raise TypeError(f"{type(self).__name__} cannot be rounded to bfloat16")

    def plus(self, other: np.ndarray | Sparse) -> Payload:
        """This tensor plus ``other`` (the worker's ``--n-push`` accumulator)."""
        raise TypeError(f"{type(self).__name__} gradients cannot be accumulated")

    def scaled(self, s: float) -> Payload:
        """This tensor times ``s``, in its dtype."""
        raise TypeError(f"{type(self).__name__} gradients cannot be scaled")


class _Indexed(Payload):
    """A payload of ``indices`` and their ``values`` (the sparse kinds' shared part, not a
    dataclass: its subclasses declare the fields): its dtype is the values', its bytes the two
    frames'."""

    indices: np.ndarray
    values: np.ndarray

    @property
    def dtype(self) -> np.dtype:
        """The dense tensor's dtype (that of the values)."""
        return self.values.dtype

    @property
    def nbytes(self) -> int:
        return _index_nbytes(self.indices) + np.asarray(self.values).nbytes


@dataclass(frozen=True)
class Sparse(_Indexed):
    """Row-sparse tensor (``tf.IndexedSlices``): ``dense[indices[i]] += values[i]``."""

    row_sparse: ClassVar[bool] = True

    indices: np.ndarray
    values: np.ndarray
    dense_shape: tuple[int, ...]

    @classmethod
    def every_row(cls, a: np.ndarray) -> Sparse:
        """A dense array (rank >= 1) as rows: each of its rows once, in order (no copy)."""
        return Sparse(np.arange(a.shape[0], dtype=np.int64), a, tuple(a.shape))

    def to_dense(self, out: np.ndarray | None = None) -> np.ndarray:
        """Materialise as a dense array; repeated indices are summed, as TF does."""
        dense = _zeros(tuple(self.dense_shape), self.values.dtype, out)
        np.add.at(dense, self.indices, self.values)
        return dense

    def rows(self) -> tuple[np.ndarray, np.ndarray]:
        return self.indices, self.values

    def select(self, keep: np.ndarray) -> Sparse:
        """The rows where the mask ``keep`` is true, of the same kind (a keyed row list
        keeps their counts)."""
        return replace(self, indices=self.indices[keep], values=self.values[keep])

    def row_range(self, start: int, stop: int) -> Sparse:
        """The rows in ``[start, stop)``, renumbered from ``start`` (their index dtype kept)."""
        keep = (self.indices >= start) & (self.indices < stop)
        return Sparse(
            (self.indices[keep] - start).astype(self.indices.dtype, copy=False),
            self.values[keep],
            (stop - start, *self.dense_shape[1:]),
        )

    def pushed(self) -> Sparse:
        """As a push sends it: each row once, its repeats summed (as the server sums them
        before it applies them; a ``bf16`` push then rounds each sum once). Fewer bytes for
        the same update. A fixed table's rows go by int32 row number when the table has
        fewer than 2**31 rows."""
        rows, values = dedupe_rows(np.asarray(self.indices), np.asarray(self.values))
        return Sparse(row_numbers(rows, self.dense_shape[0]), values, tuple(self.dense_shape))

    def plus(self, other: np.ndarray | Sparse) -> Sparse:
        """This tensor plus ``other`` (rows, or a dense array as every row) as one row list:
        this one's rows, then the other's; repeats are summed later (``pushed``)."""
        ids, values = rows_of(other)
        return Sparse(
            np.concatenate([self.indices, ids]),
            np.concatenate([self.values, values]),
            self.dense_shape,
        )

    def scaled(self, s: float) -> Sparse:
        """The values times ``s``, in their dtype (a keyed row list keeps its counts)."""
        return replace(self, values=(self.values * s).astype(self.values.dtype))

    def as_bf16(self) -> Sparse | SparseBF16:
        """To send in bfloat16 (``as_bf16``): float32 and float64 rows as ``SparseBF16``,
        others as they are."""
        return SparseBF16.from_sparse(self) if _halves(self.values.dtype) else self


@dataclass(frozen=True)
class Keyed(Sparse):
    """Rows of a dynamic table (``downpour.layers.DynamicEmbedding``): ``indices`` are ids,
    any int64 value, not row numbers below ``dense_shape[0]`` (the table's declared shape,
    which ids do not index). ``counts``: the lookups each row sums (int32, each >= 1) when
    the sender merged repeated ids (``pushed_rows``); None: each row is one lookup. The
    server counts lookups for admission and per row. What a ``keyed`` tensor (without
    counts) and a ``keyed_counted`` one (with) encode from and decode to."""

    keyed: ClassVar[bool] = True

    counts: np.ndarray | None = None

    def lookups(self) -> np.ndarray:
        """The lookups each row stands for: ``counts``, or one each."""
        if self.counts is None:
            return np.ones(np.shape(self.indices)[0], np.int64)
        return np.asarray(self.counts, np.int64)

    @property
    def nbytes(self) -> int:
        return super().nbytes + _counts_nbytes(self.counts)

    def to_dense(self, out: np.ndarray | None = None) -> np.ndarray:
        raise ValueError("the rows of a dynamic table are keyed by id and have no dense form")

    def select(self, keep: np.ndarray) -> Keyed:
        counts = None if self.counts is None else self.counts[keep]
        return Keyed(self.indices[keep], self.values[keep], self.dense_shape, counts)

    def row_range(self, start: int, stop: int) -> Sparse:
        raise TypeError("a dynamic table's rows are keyed by id, not split by row ranges")

    def pushed(self) -> Keyed:
        """As a push sends it: each id once, by int64 id, with the lookups each sums as
        ``counts`` (``counted_rows``), which the server counts for admission."""
        return counted_rows(self)

    def plus(self, other: np.ndarray | Sparse) -> Sparse:
        """As ``Sparse.plus``; with another dynamic table's rows, a ``Keyed`` carrying the
        lookups of each row."""
        if not is_keyed(other):
            return super().plus(other)
        return Keyed(
            np.concatenate([self.indices, other.indices]),
            np.concatenate([self.values, other.values]),
            self.dense_shape,
            np.concatenate([self.lookups(), other.lookups()]),
        )

    def as_bf16(self) -> Keyed | KeyedBF16:
        """To send in bfloat16: float32 and float64 rows as ``KeyedBF16``, counts kept."""
        return KeyedBF16.from_sparse(self) if _halves(self.values.dtype) else self


@dataclass(frozen=True)
class FlatSparse(_Indexed):
    """Element-sparse tensor (a top-k gradient): ``dense.ravel()[indices[i]] += values[i]``.

    ``indices`` (nnz,) int32/int64 positions in the C-order flattened tensor, ``values``
    (nnz,) of the tensor's dtype. What a ``topk`` tensor encodes from and decodes to.
    """

    indices: np.ndarray
    values: np.ndarray
    dense_shape: tuple[int, ...]

    def to_dense(self, out: np.ndarray | None = None) -> np.ndarray:
        """Scatter into zeros (``out``, C-contiguous, if given: reused, no allocation).

        Repeated positions are summed.
        """
        dense = _zeros(tuple(self.dense_shape), self.values.dtype, out)
        np.add.at(dense.reshape(-1), self.indices, self.values)
        return dense


@dataclass(frozen=True)
class BFloat16(Payload):
    """A float tensor to send as bfloat16 (2 bytes an element); decodes to ``dtype``.

    ``values`` is an ``ml_dtypes.bfloat16`` array; build it with ``from_array`` (round to
    nearest even). Only encode takes it: decode hands back the array converted to ``dtype``.
    """

    bf16: ClassVar[bool] = True

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

    @property
    def nbytes(self) -> int:
        return self.values.size * _BF16_BYTES

    @property
    def logical_nbytes(self) -> int:
        return self.values.size * np.dtype(self.dtype).itemsize

    def to_dense(self, out: np.ndarray | None = None) -> np.ndarray:
        """The values widened to ``dtype`` (exact): a fresh array, or ``out`` filled."""
        if out is None:
            return self.values.astype(self.dtype)
        np.copyto(_check_out(out, self.dense_shape), self.values, casting="unsafe")
        return out

    def row_range(self, start: int, stop: int) -> BFloat16:
        """Rows ``start:stop`` of the rounded values (a view, no copy)."""
        return BFloat16(self.values[start:stop], self.dtype)


@dataclass(frozen=True)
class SparseBF16(Payload):
    """Rows of a row-sparse tensor to send with their values in bfloat16 (a row pull under
    ``--pull-compress bf16``, a row gradient under ``--compress bf16``): ``Sparse`` at 2
    bytes a value. ``values`` is an ``ml_dtypes.bfloat16`` array of shape
    (nnz, *dense_shape[1:]); build it with ``from_sparse``. Only encode takes it: decode
    hands back a ``Sparse`` whose values are widened to ``dtype`` (``widened``)."""

    row_sparse: ClassVar[bool] = True
    bf16: ClassVar[bool] = True

    indices: np.ndarray
    values: np.ndarray
    dense_shape: tuple[int, ...]
    dtype: np.dtype = np.dtype(np.float32)

    @classmethod
    def from_sparse(cls, s: Sparse) -> SparseBF16:
        """``s`` with its values rounded to bfloat16 (nearest even, as ``BFloat16``)."""
        rounded = BFloat16.from_array(s.values)
        return cls(s.indices, rounded.values, tuple(s.dense_shape), rounded.dtype)

    @property
    def nbytes(self) -> int:
        return _index_nbytes(self.indices) + self.values.size * _BF16_BYTES

    @property
    def logical_nbytes(self) -> int:
        itemsize = np.dtype(self.dtype).itemsize
        return self.nbytes + self.values.size * (itemsize - _BF16_BYTES)

    def widened(self) -> Sparse:
        """The rows with their values widened to ``dtype`` (exact), as decoding gives them."""
        return Sparse(self.indices, self.values.astype(self.dtype), self.dense_shape)

    def rows(self) -> tuple[np.ndarray, np.ndarray]:
        """(row indices, their bfloat16 values)."""
        return self.indices, self.values

    def unique_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """Each row once with its repeats summed at ``dtype`` (after widening)."""
        return self.widened().unique_rows()

    def to_dense(self, out: np.ndarray | None = None) -> np.ndarray:
        """Materialise as a dense array of ``dtype``; repeated indices are summed."""
        return self.widened().to_dense(out)


@dataclass(frozen=True)
class KeyedBF16(SparseBF16):
    """``Keyed`` rows with their values in bfloat16 (a dynamic table's rows pulled under
    ``--pull-compress bf16`` or pushed under ``--compress bf16``), ``counts`` as
    ``Keyed``'s; decodes to ``Keyed``."""

    keyed: ClassVar[bool] = True

    counts: np.ndarray | None = None

    @classmethod
    def from_sparse(cls, s: Keyed) -> KeyedBF16:
        """``s`` with its values rounded to bfloat16, its counts kept."""
        rounded = BFloat16.from_array(s.values)
        return cls(s.indices, rounded.values, tuple(s.dense_shape), rounded.dtype, s.counts)

    @property
    def nbytes(self) -> int:
        return super().nbytes + _counts_nbytes(self.counts)

    def widened(self) -> Keyed:
        """The rows with their values widened to ``dtype``, counts kept, as decoding gives."""
        values = self.values.astype(self.dtype)
        return Keyed(self.indices, values, self.dense_shape, self.counts)

    def to_dense(self, out: np.ndarray | None = None) -> np.ndarray:
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


# Any tensor a message carries: a payload answers for itself, an array is a dense tensor.


def as_bf16(t: np.ndarray | Sparse) -> np.ndarray | Sparse | BFloat16 | SparseBF16:
    """``t`` to send in bfloat16 where that halves its values (float32, float64): an array
    as ``BFloat16``, rows as ``SparseBF16`` (``Sparse.as_bf16``); float16 (as many bytes
    and more precise) and non-float values as they are. Gradients (``--compress bf16``),
    weights and table rows (``--pull-compress bf16``) follow this one rule."""
    if isinstance(t, Payload):
        return t.as_bf16()
    return BFloat16.from_array(t) if _halves(t.dtype) else t


def densify(t: WireTensor, out: np.ndarray | None = None) -> np.ndarray:
    """Any tensor a message carries as a dense ndarray (``out``: filled by a payload, see
    ``Payload.to_dense``). An ndarray comes back as it is (a decoded one is a read-only
    view on its frame)."""
    if isinstance(t, Payload):
        return t.to_dense(out)
    return np.asarray(t)


def logical_shape(t: WireTensor) -> tuple[int, ...]:
    """The dense shape of any tensor a message carries."""
    return tuple(t.dense_shape if isinstance(t, Payload) else np.shape(t))


def logical_dtype(t: WireTensor) -> np.dtype:
    """The dense dtype of any tensor a message carries."""
    return np.dtype(t.dtype)


def is_rows(t: WireTensor | None) -> bool:
    """Whether ``t`` is a row-sparse payload (``Payload.row_sparse``); an array is not."""
    return isinstance(t, Payload) and t.row_sparse


def is_keyed(t: WireTensor | None) -> bool:
    """Whether ``t`` is a dynamic table's rows (``Payload.keyed``); an array is not."""
    return isinstance(t, Payload) and t.keyed


def values_of(t: WireTensor) -> np.ndarray:
    """The array holding a tensor's values: a payload's ``values``, an array itself."""
    return t.values if isinstance(t, Payload) else np.asarray(t)


def rows_of(t: np.ndarray | Sparse) -> tuple[np.ndarray, np.ndarray]:
    """(row indices, their values) of rows as held (``Payload.rows``), or of a dense array
    (rank >= 1): every row in order (int64), the array itself as their values (no copy)."""
    if isinstance(t, Payload):
        return t.rows()
    a = np.asarray(t)
    return np.arange(a.shape[0], dtype=np.int64), a


def unique_rows(t: np.ndarray | Sparse) -> tuple[np.ndarray, np.ndarray]:
    """Each row once (int64, ascending) with its values, as the server's compiled apply
    takes a row-sparse variable's gradient: rows' repeats summed (``Sparse.unique_rows``),
    a dense array's every row with the array itself (no copy)."""
    if isinstance(t, Payload):
        return t.unique_rows()
    return rows_of(t)


def row_range(t: np.ndarray | Payload, start: int, stop: int) -> np.ndarray | Payload:
    """Rows ``start:stop`` of any tensor (``Payload.row_range``; an array's: a view)."""
    if isinstance(t, Payload):
        return t.row_range(start, stop)
    return t[start:stop]
