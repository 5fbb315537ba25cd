"""The worker's one-pass gradient step: traced once, one forward/backward per batch."""

from __future__ import annotations

import gc

import numpy as np
import tensorflow as tf

from downpour.models import build_model
from downpour.spec import load_spec
from downpour.wire import Sparse
from downpour.worker.step import (
    ALIGN,
    Accumulator,
    GradientStep,
    _Capsule,
    as_array,
    to_tensor,
    to_wire,
)


def test_one_evaluation_returns_every_gradient_and_traces_once() -> None:
    spec = load_spec("tiny_models:counting")
    model = build_model(spec)
    data = spec.load_data(None)
    step = GradientStep(spec, model, data.x_train[:1])
    counter = model.get_layer("counter").calls
    for i in range(3):
        loss, grads = step(data.x_train[i * 32 : (i + 1) * 32], data.y_train[i * 32 : (i + 1) * 32])
    assert step.traces == 1
    assert len(grads) == len(model.trainable_variables) == 6
    # the forward pass ran once per batch, not once per variable
    assert float(counter.numpy()) == 3.0
    # and the gradients are the true ones
    x, y = data.x_train[64:96], data.y_train[64:96]
    with tf.GradientTape() as tape:
        ref_loss = spec.loss(y, model(x, training=True))
    ref = tape.gradient(ref_loss, model.trainable_variables)
    for g, r in zip(grads, ref, strict=True):
        np.testing.assert_allclose(g, r.numpy(), rtol=1e-5, atol=1e-6)
    assert abs(loss - float(ref_loss)) < 1e-5
    # a smaller final batch does not retrace
    step(data.x_train[:5], data.y_train[:5])
    assert step.traces == 1


def test_embedding_gradients_come_out_sparse() -> None:
    spec = load_spec("tiny_models:embedding")
    model = build_model(spec)
    data = spec.load_data(None)
    step = GradientStep(spec, model, data.x_train[:1])
    _, grads = step(data.x_train[:20], data.y_train[:20])
    emb = grads[0]
    assert isinstance(emb, Sparse)
    assert emb.dense_shape == (5000, 8)
    assert emb.values.shape == (120, 8)  # 20 examples x 6 tokens, not 5000 rows


def test_accumulator_averages_dense_and_concatenates_sparse() -> None:
    acc = Accumulator()
    a = [np.ones(3, np.float32), Sparse(np.array([1]), np.ones((1, 2), np.float32), (4, 2))]
    b = [3 * np.ones(3, np.float32), Sparse(np.array([1]), np.ones((1, 2), np.float32), (4, 2))]
    acc.add(a)
    acc.add(b)
    dense, sparse = acc.take()
    np.testing.assert_array_equal(dense, [2, 2, 2])
    np.testing.assert_array_equal(sparse.to_dense()[1], [1, 1])  # (1 + 1) / 2
    assert acc.count == 0
    assert a[0].tolist() == [1, 1, 1]  # inputs untouched: they may still be queued on the wire


def _buffer(t: tf.Tensor) -> int:
    """Address of an eager CPU tensor's data (NumPy views it without a copy)."""
    return int(np.asarray(t).__array_interface__["data"][0])


def test_rows_written_by_row_leave_the_table_readable_without_a_copy() -> None:
    """A sparse write puts a resource variable in copy-on-read mode, where each dense read
    (the step's Embedding lookup) copies the whole table; ``scatter_rows`` leaves it out of
    that mode, so two reads share the variable's one buffer."""
    spec = load_spec("tiny_models:embedding")
    model = build_model(spec)
    data = spec.load_data(None)
    step = GradientStep(spec, model, data.x_train[:1])
    table = model.get_layer("embed").embeddings.value
    before = table.numpy()
    rows = np.array([3, 70, 4999], np.int64)
    values = np.arange(24, dtype=np.float32).reshape(3, 8)
    for _ in range(2):  # the compiled write, then its second call
        step.scatter_rows(0, rows, values)
        first, second = table.read_value(), table.read_value()
        assert _buffer(first) == _buffer(second)
        del first, second
    after = table.numpy()
    np.testing.assert_array_equal(after[rows], values)
    untouched = np.setdiff1d(np.arange(5000), rows)
    np.testing.assert_array_equal(after[untouched], before[untouched])
    # the step reads the rows written and its table gradient stays row-sparse
    x, y = data.x_train[:20], data.y_train[:20]
    loss, grads = step(x, y)
    with tf.GradientTape() as tape:
        ref_loss = spec.loss(y, model(x, training=True))
    ref = tape.gradient(ref_loss, model.trainable_variables)
    assert isinstance(grads[0], Sparse) and isinstance(ref[0], tf.IndexedSlices)
    np.testing.assert_array_equal(grads[0].indices, ref[0].indices.numpy())
    np.testing.assert_allclose(grads[0].values, ref[0].values.numpy(), rtol=1e-6)
    assert abs(loss - float(ref_loss)) < 1e-6
    assert step.traces == 1


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
    assert _address(t) % ALIGN == 0  # what TensorFlow's kernels expect
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


def test_set_weights_from_arrays_and_prepared_tensors_load_the_same_values() -> None:
    spec = load_spec("tiny_models:tiny")
    model = build_model(spec)
    step = GradientStep(spec, model, spec.load_data(None).x_train[:1])
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(v.shape).astype(np.float32) for v in model.trainable_variables]
    step.set_weights(step.prepare(arrays))
    for v, a in zip(model.trainable_variables, arrays, strict=True):
        np.testing.assert_array_equal(v.numpy(), a)
    doubled = [2 * a for a in arrays]
    step.set_weights(doubled)
    for v, a in zip(model.trainable_variables, doubled, strict=True):
        np.testing.assert_array_equal(v.numpy(), a)
