"""The worker's one-pass gradient step: traced once, one forward/backward per batch."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import tensorflow as tf

from downpour import wire
from downpour.inputs.context import InputContext
from downpour.inputs.pipeline import build_dataset, resolve_inputs
from downpour.model.build import build_model
from downpour.spec import load_spec
from downpour.wire import BFloat16, Keyed, Sparse
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
    x, y = data.x_train[:20], data.y_train[:20]
    _, grads = step(x, y)
    emb = grads[0]
    assert isinstance(emb, Sparse)
    assert emb.dense_shape == (5000, 8)
    # each of the batch's distinct tokens once, not 20 examples x 6 tokens, not 5000 rows
    tokens = np.unique(x)
    assert tokens.size < x.size
    np.testing.assert_array_equal(emb.indices, tokens)
    assert emb.indices.dtype == np.int32 and emb.values.shape == (tokens.size, 8)
    with tf.GradientTape() as tape:  # the repeats summed: TensorFlow's own dense gradient
        loss = spec.loss(y, model(x, training=True))
    dense = tf.convert_to_tensor(tape.gradient(loss, model.trainable_variables[0])).numpy()
    np.testing.assert_allclose(emb.to_dense(), dense, rtol=1e-5, atol=1e-7)


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


def test_accumulator_keeps_a_dynamic_tables_lookups() -> None:
    """--n-push: each id once in the push, its rows' mean over the steps and its lookups
    over all of them (the server admits and counts by lookups)."""
    acc = Accumulator()
    steps = [
        Keyed(np.array([5, 2**40]), np.ones((2, 2), np.float32), (9, 2), np.array([2, 1])),
        Keyed(np.array([5, 7]), 3 * np.ones((2, 2), np.float32), (9, 2), np.array([1, 4])),
    ]
    for g in steps:
        acc.add([g])
    (out,) = acc.take()
    assert type(out) is Keyed and out.indices.tolist() == [5, 7, 2**40]
    assert out.values.tolist() == [[2, 2], [1.5, 1.5], [0.5, 0.5]]  # sums over 2 steps, / 2
    assert out.counts.tolist() == [3, 4, 1]
    assert steps[0].counts.tolist() == [2, 1]  # inputs untouched


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
    np.testing.assert_array_equal(grads[0].indices, np.unique(ref[0].indices.numpy()))
    dense = tf.convert_to_tensor(ref[0]).numpy()
    np.testing.assert_allclose(grads[0].to_dense(), dense, rtol=1e-6, atol=1e-7)
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


def _first_batch(spec_name: str) -> tuple[Any, Any, Any]:
    """The model spec's first training batch (and the dataset's element spec)."""
    spec = load_spec(spec_name)
    inputs = resolve_inputs(spec)
    ds = build_dataset(inputs.train, InputContext(batch_size=spec.batch_size, seed=1))
    x, y = next(iter(ds))
    return spec, ds.element_spec, (x, y)


@pytest.mark.parametrize(
    "spec_name",
    [
        "tiny_models:tiny",  # one input, dense float32
        "tiny_models:embedding_list",  # a list of inputs, a row-sparse table
        "tiny_models:embedding_dict",  # a dict of inputs
        "dtype_models:mixed",  # float16 and float64 variables beside float32
    ],
)
def test_round_bf16_gives_the_bits_as_bf16_gives_of_the_float32_gradients(
    spec_name: str,
) -> None:
    """``round_bf16``: every dense float32 gradient comes out as ``BFloat16``, bit for bit
    what ``wire.as_bf16`` makes of the same gradient unrounded; the table's rows and the
    other dtypes come out as without it. Both steps share one model, so the same weights."""
    spec, element_spec, (x, y) = _first_batch(spec_name)
    model = build_model(spec)
    plain = GradientStep(spec, model, element_spec)
    rounded = GradientStep(spec, model, element_spec, round_bf16=True)
    loss, want = plain(x, y)
    loss_r, got = rounded(x, y)
    assert loss_r == loss and rounded.traces == 1
    assert len(got) == len(want) == len(model.trainable_variables)
    kinds = set()
    for g, w in zip(got, want, strict=True):
        if isinstance(w, np.ndarray) and w.dtype == np.float32:
            assert isinstance(g, BFloat16) and g.dtype == np.float32
            ref = wire.as_bf16(w)
            assert g.values.shape == w.shape
            np.testing.assert_array_equal(g.values.view(np.uint16), ref.values.view(np.uint16))
            kinds.add("rounded")
        elif isinstance(w, Sparse):
            assert isinstance(g, Sparse) and g.values.dtype == w.values.dtype
            np.testing.assert_array_equal(g.indices, w.indices)
            np.testing.assert_array_equal(g.values, w.values)
            kinds.add("rows")
        else:
            assert isinstance(g, np.ndarray) and g.dtype == w.dtype
            np.testing.assert_array_equal(g, w)
            kinds.add(str(w.dtype))
    expected = {
        "tiny_models:tiny": {"rounded"},
        "tiny_models:embedding_list": {"rounded", "rows"},
        "tiny_models:embedding_dict": {"rounded", "rows"},
        "dtype_models:mixed": {"rounded", "float16", "float64"},
    }[spec_name]
    assert kinds == expected


def test_bf16_rounded_gradients_split_across_shards_and_refuse_other_uses() -> None:
    """A rounded gradient splits by rows like its float32 one (a view of its bits); only the
    ``bf16`` compressor takes it, counting its float32 bytes as raw; it cannot be summed."""
    from downpour.model.partition import make_partition
    from downpour.worker.compress import parse_compression

    spec, element_spec, (x, y) = _first_batch("tiny_models:wide")
    model = build_model(spec)
    _, grads = GradientStep(spec, model, element_spec, round_bf16=True)(x, y)
    variables = model.trainable_variables
    part = make_partition(
        [v.path for v in variables],
        [tuple(v.shape) for v in variables],
        [v.dtype for v in variables],
        2,
        "fingerprint",
    )
    assert any(not p.whole for parts in part.shards for p in parts)  # a variable is sliced
    halves = part.split(grads)
    joined = part.join([[t.values.view(np.uint16) for t in shard] for shard in halves], len(grads))
    for g, j in zip(grads, joined, strict=True):
        np.testing.assert_array_equal(g.values.view(np.uint16), j)
    bf16 = parse_compression("bf16")
    out = bf16.compress(grads)
    assert all(o is g for o, g in zip(out, grads, strict=True))
    assert bf16.raw_bytes == sum(g.values.size * 4 for g in grads)
    assert bf16.sent_bytes == sum(g.values.size * 2 for g in grads)
    for other in ("none", "topk:0.01"):
        with pytest.raises(ValueError, match="already rounded to bf16"):
            parse_compression(other).compress(grads)
    acc = Accumulator()
    acc.add(grads)
    with pytest.raises(TypeError, match="cannot be accumulated"):
        acc.add(grads)
