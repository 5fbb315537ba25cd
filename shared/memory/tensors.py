"""Moving tensors between TensorFlow and NumPy at memcpy speed, or without a copy.

``Tensor.numpy()`` and ``tf.convert_to_tensor`` copy at about a third of memcpy speed (and
``convert_to_tensor`` slower still from a read-only array, which is what a decoded message
holds). On a 13 MB model those copies cost milliseconds per step on the core the step runs
on. DLPack hands a buffer across without a copy; these helpers use it where that is safe:

- ``as_array``: a CPU tensor as a read-only ndarray on the tensor's own memory. TensorFlow's
  buffers are reference counted: an update to a variable whose buffer is still referenced
  copies it first, so the array never changes under its reader.
- ``to_tensor``: an ndarray copied once into fresh aligned memory that a tensor then uses as
  it is; nothing else refers to that memory, so a variable assigned from the tensor may keep
  it. A private array its holder gives up (``adopt``: weights widened from bfloat16 on
  receipt) is taken as it is, without the copy.

Small tensors, dtypes NumPy cannot exchange through DLPack (bfloat16, bool, strings) and
tensors on another device take the plain conversions.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

from downpour.memory.buffers import aligned_empty, is_private

SHARED_DTYPES = frozenset(
    np.dtype(t) for t in ("float16", "float32", "float64", "int32", "int64", "uint16")
)  # uint16: bfloat16 bits
SHARE_MIN_BYTES = 64 * 1024  # below this the plain conversions cost no more


class _Capsule:
    """A DLPack capsule from TensorFlow in the form ``np.from_dlpack`` takes."""

    __slots__ = ("capsule",)

    def __init__(self, capsule: Any) -> None:
        self.capsule = capsule

    def __dlpack__(self, stream: Any = None, **_: Any) -> Any:
        return self.capsule

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)  # kDLCPU


def _shareable(t: tf.Tensor) -> bool:
    """True if ``t`` is worth handing to NumPy through DLPack, and can be."""
    return (
        np.dtype(t.dtype.as_numpy_dtype) in SHARED_DTYPES
        and (t.shape.num_elements() or 0) * t.dtype.size >= SHARE_MIN_BYTES
        and "CPU" in t.device
    )


def _view(t: tf.Tensor) -> np.ndarray:
    return np.from_dlpack(_Capsule(tf.experimental.dlpack.to_dlpack(t)))


def as_array(t: tf.Tensor) -> np.ndarray:
    """``t`` as a read-only ndarray on the tensor's own memory, without a copy (see the
    module docstring); other tensors through ``numpy()``."""
    return _view(t) if _shareable(t) else t.numpy()


def to_tensor(a: np.ndarray, adopt: bool = False) -> tf.Tensor:
    """``a`` as a tensor: one memcpy into fresh aligned memory that the tensor uses as it is
    (see the module docstring); small arrays and other dtypes through
    ``tf.convert_to_tensor``.

    ``adopt``: the caller gives ``a`` up. When ``a`` is private memory (a bf16 tensor widened
    on receipt: ``downpour.memory.buffers.is_private``) the tensor takes that memory without the
    copy; a variable assigned from it may keep it and later write it in place, so nothing may
    read ``a`` afterwards."""
    if a.dtype not in SHARED_DTYPES or a.nbytes < SHARE_MIN_BYTES:
        return tf.convert_to_tensor(a)
    if adopt and is_private(a):
        out = a.view()
        out.flags.writeable = True  # DLPack exports writeable arrays only; ``a`` is given up
    else:
        out = aligned_empty(a.shape, a.dtype)
        np.copyto(out, a)
    return tf.experimental.dlpack.from_dlpack(out.__dlpack__())
