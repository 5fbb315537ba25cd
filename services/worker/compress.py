"""Gradient compression for pushes (``downpour worker --compress none|bf16|bf16:dense|topk:RATIO``).

``COMPRESSIONS`` is the one table of ``--compress`` forms: ``parse_compression``,
``COMPRESSION_FORMS`` (the forms in error messages), ``COMPRESSION_HELP`` (the option's help)
and the table in docs/policies.md (compared with it by ``tests/test_compress.py``) derive
from it.

A compressor turns the gradient list of one push into the tensors of its ``Message``
(``downpour.wire`` encodes them: ``bf16``, ``sparse_bf16``, ``keyed_counted_bf16`` and
``topk`` encodings) and counts the payload bytes before (``raw_bytes``) and after
(``sent_bytes``) compression, cumulatively.

- ``none``: the gradients as they are.
- ``bf16``: each float32/float64 gradient rounded to the nearest bfloat16 (ties to even):
  half the bytes of float32, 8 significant bits (relative error at most 2**-8), dense
  gradients and the values of row-sparse ones alike (rows go as ``sparse_bf16``, a dynamic
  table's as ``keyed_counted_bf16``: the ids as they are, the values in half the bytes).
  The server decodes them back to float32. A worker whose compiled step already rounded its dense
  float32 gradients (``GradientStep(round_bf16=True)``) hands them over as ``BFloat16``,
  which the bf16 compressors pass on as they are and the others refuse.
- ``bf16:dense``: ``bf16`` for dense gradients only; rows go in float32.
- ``topk:RATIO`` (0 < RATIO <= 1), with error feedback: per variable a float32 residual ``r``
  is kept; each push computes ``v = r + g``, sends the ``k = max(1, ceil(RATIO * size))``
  entries of largest ``|v|`` (``np.argpartition``: linear, no full sort) and keeps
  ``r = v`` with those entries zeroed (minus what was sent, when the gradient's dtype is
  narrower than the residual's). Nothing is lost, only delayed: the sum of what was
  sent plus the residual equals the sum of the gradients (up to float32 rounding). Error
  feedback comes from 1-bit SGD (Seide et al., Interspeech 2014) and is what makes top-k
  sparsification converge in Deep Gradient Compression (Lin et al., ICLR 2018).
  When ``k`` indices and values would take at least as many bytes as the dense tensor
  (RATIO >= 0.5 with int32 indices), the whole of ``v`` is sent dense and the residual is
  cleared: more information for no more bytes.

Row-sparse gradients (``wire.Sparse``, from ``tf.IndexedSlices``, e.g. embeddings) are
rounded by ``bf16`` and passed through unchanged by the other compressors: they already carry
only the touched rows, and densifying an embedding gradient to top-k it would cost far more
than it saves. Non-float tensors are passed through by every compressor. A gradient with a
NaN or Inf never enters a top-k residual (it would stay there and every later push would be
refused): it is sent dense as it is, for the server to refuse and count as ``nonfinite``,
and the residual is left as it was.

Residuals are kept by position in the list: give one compressor the same variables in the
same order every push (with sharded servers, one compressor per shard, fed that shard's list
after ``Partition.split``).

Arrays returned by ``compress`` are fresh (never the residual itself), so they may be held by
ZeroMQ (``send copy=False``) while the next step runs.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import numpy as np

from downpour import wire
from downpour.config.forms import Form, Forms, literal, pattern
from downpour.wire import BFloat16, FlatSparse, Payload, Sparse, Tensor, WireTensor


def raw_bytes(t: WireTensor) -> int:
    """Bytes a gradient's payload takes uncompressed: a ``BFloat16`` (rounded in the step)
    or ``SparseBF16`` at its logical dtype's width (``Payload.logical_nbytes``), anything
    else as ``payload_bytes``."""
    if isinstance(t, Payload):
        return int(t.logical_nbytes)
    return payload_bytes(t)


def payload_bytes(t: WireTensor) -> int:
    """Bytes a tensor's frames take on the wire (indices, values and a keyed row's counts;
    header not included): ``Payload.nbytes``, an array's ``nbytes``."""
    return int(t.nbytes if isinstance(t, Payload) else np.asarray(t).nbytes)


class Compressor(ABC):
    """Gradient list -> message tensors, with byte accounting (``raw_bytes``, ``sent_bytes``).

    ``encodings``: the wire encodings it sends beyond ``dense`` and ``sparse``, which the
    server must decode (a server advertises its ``wire.ENCODINGS`` in its hello reply).
    ``keyed_encoding``: the one a dynamic table's rows go in (each id once, with its
    lookups), which the server must decode too when the model has dynamic tables.
    """

    encodings: frozenset[str] = frozenset()
    keyed_encoding: str = wire.KEYED_COUNTED

    def __init__(self) -> None:
        self.raw_bytes = 0
        self.sent_bytes = 0

    @property
    @abstractmethod
    def spec(self) -> str:
        """The canonical text: ``parse_compression(c.spec)`` builds an equal compressor."""

    @abstractmethod
    def _compress(self, i: int, g: np.ndarray) -> WireTensor:
        """Compress variable ``i``'s dense float gradient."""

    def _rows(self, g: Sparse) -> WireTensor:
        """A row-sparse gradient (``Sparse`` or ``Keyed``) to send: as it is, unless the
        compressor rounds rows."""
        return g

    def compress(self, grads: Sequence[Tensor | BFloat16]) -> list[WireTensor]:
        """One push's gradients (variable order) -> tensors for ``Message.tensors``, same order.
        A ``BFloat16`` gradient (rounded in the worker's step) is taken only by ``bf16``."""
        out: list[WireTensor] = []
        for i, g in enumerate(grads):
            if wire.is_rows(g):
                t: WireTensor = self._rows(g)
            elif isinstance(g, Payload):  # values rounded to bfloat16 in the step
                if wire.BF16 not in self.encodings:
                    raise ValueError(f"{self.spec}: gradient {i} is already rounded to bf16")
                t = g  # rounded as bf16 would round it
            else:
                a = np.asarray(g)
                t = self._compress(i, a) if a.dtype.name in wire.BF16_DTYPES else a
            self.raw_bytes += raw_bytes(g)
            self.sent_bytes += payload_bytes(t)
            out.append(t)
        return out

    def reset(self) -> None:
        """Forget any state kept between pushes (top-k residuals)."""
        return None  # stateless by default

    @property
    def compression_ratio(self) -> float:
        """raw_bytes / sent_bytes so far (1.0 before the first push)."""
        return self.raw_bytes / self.sent_bytes if self.sent_bytes else 1.0

    def describe(self) -> dict[str, Any]:
        """For the worker's reported figures."""
        return {
            "compress": self.spec,
            "raw_bytes": self.raw_bytes,
            "sent_bytes": self.sent_bytes,
            "compression_ratio": self.compression_ratio,
        }

    def __str__(self) -> str:
        return self.spec


class NoCompression(Compressor):
    """Sends the gradients as they are."""

    @property
    def spec(self) -> str:
        return "none"

    def _compress(self, i: int, g: np.ndarray) -> WireTensor:
        return g


class BF16Compression(Compressor):
    """Rounds float tensors to bfloat16 (nearest, ties to even): 2 bytes per element.
    ``rows``: row-sparse gradients' values too (``bf16``); without, only dense gradients
    (``bf16:dense``)."""

    def __init__(self, rows: bool = True) -> None:
        super().__init__()
        self.rows = rows
        self.encodings = (
            frozenset({wire.BF16, wire.SPARSE_BF16}) if rows else frozenset({wire.BF16})
        )
        self.keyed_encoding = wire.KEYED_COUNTED_BF16 if rows else wire.KEYED_COUNTED

    @property
    def spec(self) -> str:
        return "bf16" if self.rows else "bf16:dense"

    def _compress(self, i: int, g: np.ndarray) -> WireTensor:
        return wire.as_bf16(g)

    def _rows(self, g: Sparse) -> WireTensor:
        return wire.as_bf16(g) if self.rows else g


class TopKCompression(Compressor):
    """Top-k sparsification with error feedback (see the module docstring)."""

    encodings = frozenset({wire.TOPK})

    def __init__(self, ratio: float) -> None:
        super().__init__()
        if not (isinstance(ratio, float | int) and 0 < ratio <= 1):
            raise ValueError(f"topk:RATIO needs RATIO in (0, 1], got RATIO={ratio!r}")
        self.ratio_kept = float(ratio)
        self._residuals: dict[int, np.ndarray] = {}  # flat float32 (float64 for float64)
        self._scratch: dict[int, np.ndarray] = {}  # |v|, reused

    @property
    def spec(self) -> str:
        return f"topk:{self.ratio_kept:g}"

    def k(self, size: int) -> int:
        """Entries sent for a tensor of ``size`` elements: ``max(1, ceil(RATIO * size))``."""
        return min(size, max(1, math.ceil(self.ratio_kept * size)))

    def residual(self, i: int) -> np.ndarray | None:
        """Variable ``i``'s residual (flat; None before its first push). For tests and stats."""
        return self._residuals.get(i)

    def reset(self) -> None:
        self._residuals.clear()

    def _compress(self, i: int, g: np.ndarray) -> WireTensor:
        size = g.size
        rdtype = np.float64 if g.dtype == np.float64 else np.float32
        r = self._residuals.get(i)
        if r is None:
            r = self._residuals[i] = np.zeros(size, rdtype)
        elif r.size != size:
            raise ValueError(f"topk: gradient {i} has {size} elements, its residual {r.size}")
        if not wire.all_finite(g):  # sent as it is (the server refuses it); residual kept
            return g
        v = r  # v = r + g, in place: r holds v from here on
        np.add(v, g.reshape(-1), out=v, casting="same_kind")
        k = self.k(size)
        index_dtype = np.int32 if size < 2**31 else np.int64
        if size == 0 or k * (np.dtype(index_dtype).itemsize + g.dtype.itemsize) >= g.nbytes:
            dense = v.astype(g.dtype)  # a fresh array: v changes next
            np.subtract(v, dense, out=v)  # 0, or what rounding to a narrower dtype lost
            return dense.reshape(g.shape)
        mag = self._scratch.get(i)
        if mag is None or mag.size != size:
            mag = self._scratch[i] = np.empty(size, rdtype)
        np.abs(v, out=mag)
        idx = np.argpartition(mag, size - k)[size - k :]
        idx.sort()  # ascending positions: a deterministic message, a cache-friendly scatter
        values = v[idx].astype(g.dtype, copy=False)  # fancy indexing copies
        v[idx] -= values  # 0, or what rounding to a narrower dtype lost
        return FlatSparse(idx.astype(index_dtype), values, tuple(g.shape))


COMPRESSIONS: Forms[Compressor] = Forms(
    "compression",
    {
        "none": Form(pattern(r"(?:none)?"), NoCompression, "the gradients as they are"),
        "bf16": Form(
            literal("bf16"),
            BF16Compression,
            "rounded to bfloat16, dense gradients and rows alike: half the bytes",
        ),
        "bf16:dense": Form(
            literal("bf16:dense"),
            lambda: BF16Compression(rows=False),
            "dense gradients rounded to bfloat16, rows sent in float32",
        ),
        "topk:RATIO": Form(
            pattern(r"topk:(?P<ratio>.+)", ratio=float),
            TopKCompression,
            "the largest RATIO of each gradient's entries, the rest carried to the next push: "
            "error feedback",
            "a number RATIO in (0, 1]",
        ),
    },
)
COMPRESSION_FORMS = COMPRESSIONS.summary
COMPRESSION_HELP = COMPRESSIONS.help("gradient compression")


def parse_compression(text: str) -> Compressor:
    """A fresh Compressor from its text, one of ``COMPRESSIONS``'s forms (``none`` or empty,
    ``bf16``, ``bf16:dense``, ``topk:RATIO``; case and surrounding spaces ignored);
    ValueError otherwise."""
    return COMPRESSIONS.parse(text)
