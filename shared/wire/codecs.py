"""The tensor encodings: one codec per encoding, all in one table, ``CODECS``.

A codec turns one tensor into its descriptor fields and frames (``encode``), validates a
received descriptor before anything is allocated (``check``: what the frames must hold and
what decoding will allocate), and builds the tensor from its frames (``decode``).
``downpour.wire`` encodes and decodes every tensor through ``CODECS``: adding an encoding is
one ``Codec`` subclass and one entry there. The frame layouts are the wire spec's
(``downpour.wire``'s docstring).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, ClassVar

import ml_dtypes
import numpy as np

from downpour.memory.buffers import private_empty
from downpour.wire.payloads import (
    BF16_DTYPES,
    INDEX_DTYPES,
    BFloat16,
    FlatSparse,
    Keyed,
    KeyedBF16,
    Sparse,
    SparseBF16,
)
from downpour.wire.protocol import R_COUNTS, R_DTYPE, R_HEADER, R_SHAPE, R_TRUNCATED, ProtocolError

if TYPE_CHECKING:
    from downpour.wire.payloads import WireTensor

DENSE = "dense"
SPARSE = "sparse"
BF16 = "bf16"
TOPK = "topk"
SPARSE_BF16 = "sparse_bf16"
KEYED = "keyed"
KEYED_BF16 = "keyed_bf16"
KEYED_COUNTED = "keyed_counted"
KEYED_COUNTED_BF16 = "keyed_counted_bf16"
_COUNT_WIRE = np.dtype("<i4")  # a keyed_counted row's lookups

_BF16_WIRE = np.dtype("<u2")  # bfloat16 bits as they travel; viewed as ml_dtypes.bfloat16


@dataclass(frozen=True)
class Slot:
    """One tensor's validated descriptor: what its codec needs to build it from its frames.
    ``nnz`` and ``index_dtype`` belong to the indexed encodings (sparse, topk)."""

    name: str
    codec: Codec
    dtype: np.dtype
    shape: tuple[int, ...]
    nnz: int = -1
    index_dtype: np.dtype | None = None


@dataclass(frozen=True)
class Checked:
    """What ``Codec.check`` found: the slot, the ``nbytes`` the descriptor must state (the
    values frame) and the other bytes decoding allocates (index frames, widened values)."""

    slot: Slot
    nbytes: int
    extra_bytes: int


class Codec(ABC):
    """One tensor encoding. Subclasses set ``name`` (the descriptor's "encoding"),
    ``carries`` (the value type ``encode`` takes) and ``frames`` (frames per tensor)."""

    name: ClassVar[str]
    carries: ClassVar[type]
    frames: ClassVar[int]

    def takes(self, t: Any) -> bool:
        """Whether this codec encodes ``t`` (by default: a ``carries``)."""
        return isinstance(t, self.carries)

    @abstractmethod
    def encode(self, name: str, t: Any) -> tuple[dict[str, Any], list[np.ndarray]]:
        """The tensor's descriptor map and its frames (arrays to send ``copy=False``)."""

    @abstractmethod
    def check(
        self, name: str, desc: dict[str, Any], dtype: np.dtype, shape: tuple[int, ...]
    ) -> Checked:
        """Validate the encoding's own descriptor fields (``dtype`` and ``shape`` are
        checked already); ProtocolError when they are wrong. Allocates nothing."""

    @abstractmethod
    def decode(self, slot: Slot, bufs: list[memoryview]) -> WireTensor:
        """The tensor from its frames; ProtocolError(R_TRUNCATED) on a frame of the wrong
        length, before it is read."""


def descriptor(
    name: str, encoding: str, dtype: np.dtype, shape: Any, nbytes: int, **extra: Any
) -> dict[str, Any]:
    """A descriptor map, its keys in the spec's order."""
    return {
        "name": name,
        "dtype": np.dtype(dtype).name,
        "shape": [int(d) for d in shape],
        "encoding": encoding,
        "nbytes": int(nbytes),
        **extra,
    }


def dense_frame(a: Any) -> np.ndarray:
    """``a`` as a C-order little-endian array (no copy when it is one already)."""
    a = np.asarray(a, order="C")  # unlike ascontiguousarray, keeps 0-d arrays 0-d
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    return a


def _index_frame(indices: np.ndarray) -> np.ndarray:
    indices = dense_frame(indices)
    if indices.dtype.name not in INDEX_DTYPES:
        indices = indices.astype(np.int64)
    return indices


def check_frame(slot: Slot, buf: memoryview, nbytes: int, what: str) -> None:
    """ProtocolError(R_TRUNCATED) unless the frame ``buf`` holds ``nbytes`` bytes (``what``:
    a word for the message, e.g. "index ")."""
    if buf.nbytes != nbytes:
        raise ProtocolError(R_TRUNCATED, f"{slot.name!r}: {what}frame has {buf.nbytes} bytes")


def wire_dtype(name: Any, allowed: frozenset[str]) -> np.dtype:
    """The little-endian dtype ``name`` if ``allowed``; ProtocolError(R_DTYPE) otherwise."""
    if not isinstance(name, str) or name not in allowed:
        raise ProtocolError(R_DTYPE, f"dtype {name!r} is not allowed")
    return np.dtype(name).newbyteorder("<")


def wire_count(desc: dict[str, Any], key: str) -> int:
    """The non-negative int ``key`` of a header or descriptor map; ProtocolError(R_HEADER)
    otherwise."""
    v = desc.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < 0 or v >= 1 << 63:
        raise ProtocolError(R_HEADER, f"header field {key!r} must be a non-negative int")
    return v


def view(buf: memoryview, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    """A read-only array on the received frame (zero-copy)."""
    a = np.frombuffer(buf, dtype=dtype).reshape(shape)
    a.flags.writeable = False  # a view on the received frame: nobody may change it
    return a


def bf16_bits(name: str, dtype: Any, values: np.ndarray) -> np.ndarray:
    """The frame of bfloat16 ``values`` standing for a tensor of ``dtype``: their bits as
    little-endian uint16 (a buffer cannot export the bfloat16 dtype). ValueError when
    ``dtype`` is no bf16 logical dtype or ``values`` are not bfloat16."""
    if np.dtype(dtype).name not in BF16_DTYPES:
        raise ValueError(f"{name!r}: bf16 cannot stand for {np.dtype(dtype)}")
    values = np.asarray(values, order="C")
    if values.dtype != ml_dtypes.bfloat16:
        raise ValueError(f"{name!r}: bf16 values must be ml_dtypes.bfloat16, not {values.dtype}")
    return values.view(np.uint16).astype(_BF16_WIRE, copy=False)


def check_bf16_dtype(name: str, dtype: np.dtype) -> None:
    """ProtocolError(R_DTYPE) unless bf16 values may decode to ``dtype``."""
    if dtype.name not in BF16_DTYPES:
        raise ProtocolError(R_DTYPE, f"{name!r}: bf16 cannot decode to {dtype.name}")


def widen_bf16(buf: memoryview, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    """A frame of bfloat16 bits (length checked) as a fresh read-only array of ``dtype``,
    exact (every bfloat16 is a float32). The array is private memory
    (``downpour.memory.buffers.private_empty``): a worker may hand widened weights to TensorFlow
    without another copy. float32 is widened by two integer passes (each bfloat16 is the
    upper half of its float32), faster than the element-wise cast through ``ml_dtypes`` that
    widens the other dtypes."""
    bits = np.frombuffer(buf, dtype=_BF16_WIRE)
    dtype = dtype.newbyteorder("=")
    out = private_empty(shape, dtype)
    if dtype == np.float32:
        words = out.reshape(-1).view(np.uint32)
        np.copyto(words, bits)
        np.left_shift(words, 16, out=words)
    else:
        values = bits.astype(np.uint16, copy=False).view(ml_dtypes.bfloat16)
        np.copyto(out.reshape(-1), values, casting="unsafe")
    out.flags.writeable = False  # like every decoded tensor
    return out


class DenseCodec(Codec):
    """``dense``: the tensor's bytes as they are, one frame; decodes to a read-only view."""

    name = DENSE
    carries = np.ndarray
    frames = 1

    def encode(self, name: str, t: Any) -> tuple[dict[str, Any], list[np.ndarray]]:
        a = dense_frame(t)
        return descriptor(name, DENSE, a.dtype, a.shape, a.nbytes), [a]

    def check(
        self, name: str, desc: dict[str, Any], dtype: np.dtype, shape: tuple[int, ...]
    ) -> Checked:
        return Checked(Slot(name, self, dtype, shape), math.prod(shape) * dtype.itemsize, 0)

    def decode(self, slot: Slot, bufs: list[memoryview]) -> WireTensor:
        check_frame(slot, bufs[0], math.prod(slot.shape) * slot.dtype.itemsize, "")
        return view(bufs[0], slot.dtype, slot.shape)


class BF16Codec(Codec):
    """``bf16``: bfloat16 bits as little-endian uint16, one frame; decodes to a fresh array
    of the logical dtype (its size counts against the limit too)."""

    name = BF16
    carries = BFloat16
    frames = 1

    def encode(self, name: str, t: BFloat16) -> tuple[dict[str, Any], list[np.ndarray]]:
        bits = bf16_bits(name, t.dtype, t.values)
        return descriptor(name, BF16, t.dtype, bits.shape, bits.nbytes), [bits]

    def check(
        self, name: str, desc: dict[str, Any], dtype: np.dtype, shape: tuple[int, ...]
    ) -> Checked:
        check_bf16_dtype(name, dtype)
        n = math.prod(shape)
        widened = n * (dtype.itemsize - _BF16_WIRE.itemsize)
        return Checked(Slot(name, self, dtype, shape), n * _BF16_WIRE.itemsize, widened)

    def decode(self, slot: Slot, bufs: list[memoryview]) -> WireTensor:
        check_frame(slot, bufs[0], math.prod(slot.shape) * _BF16_WIRE.itemsize, "bf16 ")
        return widen_bf16(bufs[0], slot.dtype, slot.shape)


class IndexedCodec(Codec):
    """An encoding of ``nnz`` entries: an indices frame of ``index_dtype``, then a values
    frame. Subclasses say how big an entry is, what the indices may address and what
    decoding builds (``decodes_to``, from indices, values and the dense shape); the values
    travel in their logical dtype unless a subclass says otherwise (``value_bytes``,
    ``values``)."""

    frames = 2
    decodes_to: ClassVar[type]

    @abstractmethod
    def entry_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of one entry's values."""

    @abstractmethod
    def index_bound(self, shape: tuple[int, ...]) -> int | None:
        """Indices lie in ``[0, index_bound)``; None: any value (ids)."""

    def check_nnz(self, name: str, nnz: int, shape: tuple[int, ...]) -> None:
        """Refuse an entry count the shape cannot hold (ProtocolError); any by default."""

    def value_bytes(self, dtype: np.dtype) -> int:
        """Bytes one value of logical ``dtype`` takes in the values frame."""
        return dtype.itemsize

    def values(self, slot: Slot, buf: memoryview, shape: tuple[int, ...]) -> np.ndarray:
        """The values frame (its length checked) as ``shape`` of ``slot.dtype``: a read-only
        view on it."""
        return view(buf, slot.dtype, shape)

    def indexed(
        self,
        name: str,
        indices: np.ndarray,
        values: np.ndarray,
        shape: Any,
        dtype: Any = None,
    ) -> tuple[dict[str, Any], list[np.ndarray]]:
        """The descriptor and frames of ``indices`` and ``values`` (wire-ready arrays);
        ``dtype``: the logical dtype when the values travel in another (default theirs)."""
        desc = descriptor(
            name,
            self.name,
            values.dtype if dtype is None else dtype,
            shape,
            values.nbytes,
            nnz=int(indices.shape[0]),
            index_dtype=indices.dtype.name,
        )
        return desc, [indices, values]

    def check(
        self, name: str, desc: dict[str, Any], dtype: np.dtype, shape: tuple[int, ...]
    ) -> Checked:
        nnz = wire_count(desc, "nnz")
        self.check_nnz(name, nnz, shape)
        index_dtype = wire_dtype(desc.get("index_dtype"), INDEX_DTYPES)
        slot = Slot(name, self, dtype, shape, nnz, index_dtype)
        n = nnz * math.prod(self.entry_shape(shape))
        values = n * self.value_bytes(dtype)
        widened = n * dtype.itemsize - values  # what decoding allocates beyond the frame
        return Checked(slot, values, nnz * index_dtype.itemsize + widened)

    def decode(self, slot: Slot, bufs: list[memoryview]) -> WireTensor:
        return self.decodes_to(*self.entries(slot, bufs), slot.shape)

    def entries(self, slot: Slot, bufs: list[memoryview]) -> tuple[np.ndarray, np.ndarray]:
        """The indices (bounds checked) and values of the indices and values frames ``bufs``
        (their lengths checked first)."""
        assert slot.index_dtype is not None
        ibuf, vbuf = bufs
        entry = self.entry_shape(slot.shape)
        check_frame(slot, ibuf, slot.nnz * slot.index_dtype.itemsize, "index ")
        n = slot.nnz * math.prod(entry)
        check_frame(slot, vbuf, n * self.value_bytes(slot.dtype), "value ")
        indices = view(ibuf, slot.index_dtype, (slot.nnz,))
        bound = self.index_bound(slot.shape)
        if (
            slot.nnz
            and bound is not None
            and (int(indices.min()) < 0 or int(indices.max()) >= bound)
        ):
            raise ProtocolError(R_SHAPE, f"{slot.name!r}: {self.name} index out of range")
        return indices, self.values(slot, vbuf, (slot.nnz, *entry))


class SparseCodec(IndexedCodec):
    """``sparse``: rows of a rank >= 1 tensor (``tf.IndexedSlices``); decodes to ``Sparse``."""

    name = SPARSE
    carries = Sparse
    decodes_to = Sparse

    def entry_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return shape[1:]

    def index_bound(self, shape: tuple[int, ...]) -> int:
        return shape[0]

    def encode(self, name: str, t: Sparse) -> tuple[dict[str, Any], list[np.ndarray]]:
        return self.indexed(name, _index_frame(t.indices), dense_frame(t.values), t.dense_shape)

    def check(
        self, name: str, desc: dict[str, Any], dtype: np.dtype, shape: tuple[int, ...]
    ) -> Checked:
        if len(shape) < 1:
            raise ProtocolError(R_SHAPE, f"sparse tensor {name!r} needs a rank >= 1 shape")
        return super().check(name, desc, dtype, shape)


class TopKCodec(IndexedCodec):
    """``topk``: elements at positions of the C-order flattened tensor; decodes to
    ``FlatSparse``."""

    name = TOPK
    carries = FlatSparse
    decodes_to = FlatSparse

    def entry_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return ()

    def index_bound(self, shape: tuple[int, ...]) -> int:
        return math.prod(shape)

    def encode(self, name: str, t: FlatSparse) -> tuple[dict[str, Any], list[np.ndarray]]:
        values = dense_frame(t.values).reshape(-1)
        indices = _index_frame(t.indices).reshape(-1)
        if indices.shape != values.shape:
            raise ValueError(f"{name!r}: {indices.size} indices for {values.size} values")
        return self.indexed(name, indices, values, t.dense_shape)

    def check_nnz(self, name: str, nnz: int, shape: tuple[int, ...]) -> None:
        if nnz > math.prod(shape):
            raise ProtocolError(
                R_SHAPE, f"topk tensor {name!r}: nnz {nnz} > {math.prod(shape)} elements"
            )


class SparseBF16Codec(SparseCodec):
    """``sparse_bf16``: ``sparse`` rows whose values frame holds bfloat16 bits (as ``bf16``:
    little-endian uint16, 2 bytes a value); takes ``SparseBF16``, decodes to ``Sparse``
    whose values are a fresh array of the logical dtype (counted against the limit too)."""

    name = SPARSE_BF16
    carries = SparseBF16

    def encode(self, name: str, t: SparseBF16) -> tuple[dict[str, Any], list[np.ndarray]]:
        bits = bf16_bits(name, t.dtype, t.values)
        return self.indexed(name, _index_frame(t.indices), bits, t.dense_shape, t.dtype)

    def check(
        self, name: str, desc: dict[str, Any], dtype: np.dtype, shape: tuple[int, ...]
    ) -> Checked:
        check_bf16_dtype(name, dtype)
        return super().check(name, desc, dtype, shape)

    def value_bytes(self, dtype: np.dtype) -> int:
        return _BF16_WIRE.itemsize

    def values(self, slot: Slot, buf: memoryview, shape: tuple[int, ...]) -> np.ndarray:
        return widen_bf16(buf, slot.dtype, shape)


class KeyedCodec(SparseCodec):
    """``keyed``: rows of a dynamic table, addressed by ids of any value, without counts;
    decodes to ``Keyed``."""

    name = KEYED
    carries = Keyed
    decodes_to = Keyed

    def takes(self, t: Any) -> bool:
        return isinstance(t, self.carries) and t.counts is None

    def index_bound(self, shape: tuple[int, ...]) -> int | None:
        return None


class KeyedBF16Codec(SparseBF16Codec):
    """``keyed_bf16``: ``keyed`` rows with bfloat16 values; decodes to ``Keyed``."""

    name = KEYED_BF16
    carries = KeyedBF16
    decodes_to = Keyed

    def takes(self, t: Any) -> bool:
        return isinstance(t, self.carries) and t.counts is None

    def index_bound(self, shape: tuple[int, ...]) -> int | None:
        return None


class _Counted(IndexedCodec):
    """Keyed rows with their lookups: the ids and values frames of the base encoding, then
    a counts frame of nnz little-endian int32, each >= 1 (R_COUNTS otherwise)."""

    frames = 3

    def takes(self, t: Any) -> bool:
        return isinstance(t, self.carries) and t.counts is not None

    def encode(self, name: str, t: Any) -> tuple[dict[str, Any], list[np.ndarray]]:
        desc, frames = super().encode(name, t)
        counts = np.asarray(t.counts)
        if counts.shape != (desc["nnz"],) or counts.dtype.kind not in "iu":
            raise ValueError(f"{name!r}: counts must be {desc['nnz']} integers, got {counts.shape}")
        return desc, [*frames, counts.astype(_COUNT_WIRE, copy=False)]

    def check(
        self, name: str, desc: dict[str, Any], dtype: np.dtype, shape: tuple[int, ...]
    ) -> Checked:
        checked = super().check(name, desc, dtype, shape)
        return replace(checked, extra_bytes=checked.extra_bytes + checked.slot.nnz * 4)

    def decode(self, slot: Slot, bufs: list[memoryview]) -> WireTensor:
        indices, values = self.entries(slot, bufs[:2])
        check_frame(slot, bufs[2], slot.nnz * _COUNT_WIRE.itemsize, "count ")
        counts = view(bufs[2], _COUNT_WIRE, (slot.nnz,))
        if slot.nnz and int(counts.min()) < 1:
            raise ProtocolError(R_COUNTS, f"{slot.name!r}: a row counted {int(counts.min())} times")
        return self.decodes_to(indices, values, slot.shape, counts)


class KeyedCountedCodec(_Counted, KeyedCodec):
    """``keyed_counted``: ``keyed`` rows, each id once, with the lookups each sums (the rows
    a worker pushes); decodes to ``Keyed`` with ``counts``."""

    name = KEYED_COUNTED


class KeyedCountedBF16Codec(_Counted, KeyedBF16Codec):
    """``keyed_counted_bf16``: ``keyed_counted`` with bfloat16 values (pushed under
    ``--compress bf16``); decodes to ``Keyed`` with ``counts``."""

    name = KEYED_COUNTED_BF16


# The encodings, by descriptor name: encode and decode go through this table only. A codec
# for a subclass comes before its base's, as ``codec_for`` takes the first that carries it.
CODECS: dict[str, Codec] = {
    c.name: c
    for c in (
        DenseCodec(),
        KeyedCountedCodec(),
        KeyedCodec(),
        SparseCodec(),
        BF16Codec(),
        TopKCodec(),
        KeyedCountedBF16Codec(),
        KeyedBF16Codec(),
        SparseBF16Codec(),
    )
}
ENCODINGS = frozenset(CODECS)
# The encodings every peer of protocol version 1 decodes: the protocol's first published
# form (docs/wire.md's changelog). A client that states nothing in its hello is sent these.
BASELINE_ENCODINGS = frozenset({DENSE, SPARSE, BF16, TOPK})
# What a weights reply may carry (the others travel in pushes only): whole variables,
# a fixed table's rows, a dynamic table's rows, each as it is or rounded to bfloat16.
REPLY_ENCODINGS = frozenset({DENSE, BF16, SPARSE, SPARSE_BF16, KEYED, KEYED_BF16})


def codec_for(t: Any) -> Codec:
    """The codec of a tensor to send: the one whose ``carries`` it is; anything else is an
    array-like, sent dense."""
    for codec in CODECS.values():
        if codec.takes(t):
            return codec
    return CODECS[DENSE]
