"""Aligned buffers, and the private ones a decoder may hand to TensorFlow without a copy.

TensorFlow's kernels CHECK-fail on a tensor that is not aligned like its own allocator's
buffers (EIGEN_MAX_ALIGN_BYTES, at most 64), so arrays handed to it are at ``ALIGN_BYTES``.

A *private* buffer (``private_empty``) is fresh memory that only the arrays viewing it refer
to: a bf16 tensor widened on receipt is one. ``downpour.memory.tensors.to_tensor`` with ``adopt``
gives such an array's memory to a tensor as it is, where any other array is copied first.
This module imports no TensorFlow: the wire codecs allocate through it.
"""

from __future__ import annotations

import numpy as np

ALIGN_BYTES = 64


class _Private(np.ndarray):
    """The raw bytes under a ``private_empty`` array: the mark ``is_private`` looks for."""


def _aligned(shape: tuple[int, ...], dtype: np.dtype, align: int, kind: type) -> np.ndarray:
    """An uninitialised C-contiguous ``shape`` array on an ``align``-byte boundary, viewing
    raw bytes of class ``kind``."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + align, dtype=np.uint8).view(kind)
    offset = (-raw.ctypes.data) % align
    return raw[offset : offset + nbytes].view(dtype).reshape(shape)


def aligned_empty(shape: tuple[int, ...], dtype: np.dtype, align: int = ALIGN_BYTES) -> np.ndarray:
    """An uninitialised C-contiguous array whose data starts on an ``align``-byte boundary."""
    return _aligned(shape, dtype, align, np.ndarray)


def private_empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """``aligned_empty`` marked private (see the module docstring): a plain ndarray whose
    memory ``is_private`` recognises."""
    return np.asarray(_aligned(shape, dtype, ALIGN_BYTES, _Private))


def is_private(a: np.ndarray) -> bool:
    """True if ``a`` is C-contiguous, aligned, and views memory from ``private_empty``."""
    if not a.flags.c_contiguous or a.ctypes.data % ALIGN_BYTES:
        return False
    b: object = a
    while isinstance(b, np.ndarray):
        if type(b) is _Private:
            return True
        b = b.base
    return False
