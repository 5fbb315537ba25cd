"""The worker's one-pass gradient step: traced once, one forward/backward per batch."""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from downpour.models import build_model
from downpour.spec import load_spec
from downpour.wire import Sparse
from downpour.worker.step import Accumulator, GradientStep


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
