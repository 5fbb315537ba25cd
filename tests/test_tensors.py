"""Tensors between TensorFlow and NumPy: views without a copy, and aligned tensors made in
one memcpy (``downpour.memory.tensors``)."""

from __future__ import annotations

import gc

import numpy as np
import tensorflow as tf

from downpour.memory.buffers import ALIGN_BYTES, aligned_empty, is_private, private_empty
from downpour.memory.tensors import _Capsule, as_array, to_tensor
from downpour.wire import Sparse
from downpour.worker.step import to_wire


def _address(t: tf.Tensor) -> int:
    """Where a CPU tensor's memory is (DLPack shares it without a copy)."""
    return np.from_dlpack(_Capsule(tf.experimental.dlpack.to_dlpack(t))).ctypes.data


def test_gradients_leave_tensorflow_without_a_copy_and_outlive_the_tensor() -> None:
    g = tf.random.stateless_uniform([256, 512], seed=(1, 2))  # 512 kB
    a = as_array(g)
    assert a.ctypes.data == _address(g)  # the tensor's own memory, not a copy of it
    assert not a.flags.writeable  # nobody may change what a tensor holds
    expected = g.numpy().copy()
    del g
    gc.collect()
    _ = [tf.random.stateless_uniform([256, 512], seed=(3, i)) for i in range(4)]
    np.testing.assert_array_equal(a, expected)  # the array keeps the buffer alive


def test_small_other_dtype_and_sparse_gradients_come_out_as_arrays() -> None:
    small = tf.constant([1.0, 2.0])
    assert isinstance(as_array(small), np.ndarray) and as_array(small).tolist() == [1.0, 2.0]
    bf = tf.cast(tf.ones([256, 512]), tf.bfloat16)  # NumPy has no DLPack bfloat16
    assert as_array(bf).dtype == bf.dtype.as_numpy_dtype and as_array(bf).shape == (256, 512)
    values = tf.random.stateless_uniform([300, 64], seed=(5, 6))
    s = to_wire(tf.IndexedSlices(values, tf.range(300, dtype=tf.int64), tf.constant([1000, 64])))
    assert isinstance(s, Sparse) and s.dense_shape == (1000, 64)
    np.testing.assert_array_equal(s.values, values.numpy())


def test_pulled_arrays_become_aligned_tensors_that_own_a_copy() -> None:
    src = np.arange(64 * 1024, dtype=np.float32).reshape(256, 256)
    view = np.frombuffer(src.tobytes(), dtype=np.float32).reshape(256, 256)  # read-only
    t = to_tensor(view)
    assert t.dtype == tf.float32 and t.shape == (256, 256)
    assert _address(t) % ALIGN_BYTES == 0  # what TensorFlow's kernels expect
    src_copy = src.copy()
    src[:] = -1  # the tensor holds its own copy
    np.testing.assert_array_equal(t.numpy(), src_copy)
    v = tf.Variable(tf.zeros([256, 256]))
    v.assign(t)
    del t
    gc.collect()
    np.testing.assert_array_equal(v.numpy(), src_copy)
    for a in (np.ones(3, np.float32), np.ones((256, 256), np.uint8), np.zeros((0, 8), np.float32)):
        b = to_tensor(a)  # small, other dtypes, empty: the plain conversion
        assert b.dtype.as_numpy_dtype == a.dtype and b.shape == a.shape


def test_aligned_empty_is_aligned_for_every_shape() -> None:
    for shape in [(), (1,), (3, 5), (1024, 10)]:
        a = aligned_empty(shape, np.dtype("float32"))
        assert a.shape == shape and a.ctypes.data % ALIGN_BYTES == 0


def test_private_arrays_given_up_become_tensors_without_a_copy() -> None:
    a = private_empty((256, 256), np.dtype("float32"))
    assert is_private(a) and a.ctypes.data % ALIGN_BYTES == 0
    a[:] = np.arange(a.size, dtype=np.float32).reshape(a.shape)
    expected = a.copy()
    a.flags.writeable = False  # as a decoded tensor is
    t = to_tensor(a, adopt=True)
    assert _address(t) == a.ctypes.data  # the tensor took the memory as it was
    v = tf.Variable(tf.zeros([256, 256]))
    v.assign(t)
    del t, a
    gc.collect()
    np.testing.assert_array_equal(v.numpy(), expected)  # the tensor kept the memory alive


def test_adopt_copies_every_array_that_is_not_private() -> None:
    plain = np.ones((256, 256), np.float32)
    frame = np.frombuffer(plain.tobytes(), np.float32).reshape(256, 256)  # read-only view
    sliced = private_empty((256, 257), np.dtype("float32"))[:, :256]  # not contiguous
    for a in (plain, frame, sliced, aligned_empty((256, 256), np.dtype("float32"))):
        assert not is_private(a)
        assert _address(to_tensor(a, adopt=True)) != a.ctypes.data  # copied
    private = private_empty((256, 256), np.dtype("float32"))
    assert _address(to_tensor(private)) != private.ctypes.data  # not given up: copied
