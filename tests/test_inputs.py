"""The input pipeline in-process: static shards, epochs, the step's signature from the
dataset, inputs of other shapes training to a bar, and bad input refused before hello."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from typing import Any

import input_models
import keras
import numpy as np
import pytest
import tensorflow as tf
import tiny_models

from downpour import InputContext
from downpour.config.settings import ConfigError
from downpour.inputs import pipeline
from downpour.inputs.data import Dataset, dataset_input_fn
from downpour.inputs.pipeline import (
    InputError,
    build_dataset,
    epoch_batches,
    join_retired,
    resolve_inputs,
    retire,
)
from downpour.model.build import build_model, evaluate
from downpour.worker.service import Worker
from downpour.worker.settings import WORKER_OPTIONS, WorkerConfig, validate_worker
from downpour.worker.step import GradientStep


def config(**values: Any) -> WorkerConfig:
    base = {o.name: o.default for o in WORKER_OPTIONS}
    base.update(values)
    return WorkerConfig.from_values(base)


def worker_batches(spec: Any, n: int, **values: Any) -> Iterator[tuple[int, list[Any]]]:
    """(worker index, the batches its data iterator yields) for each of ``n`` workers."""
    for i in range(n):
        w = Worker(spec, config(num_workers=n, worker_index=i, **values))
        try:
            yield i, list(w.batches())
        finally:
            w.close()


def test_three_workers_read_each_training_example_once_per_epoch() -> None:
    spec = input_models.ids()
    seen = {
        i: np.concatenate([f["id"].numpy() for f, _ in batches])
        for i, batches in worker_batches(spec, 3, epochs=1.0, seed=11)
    }
    everything = np.concatenate(list(seen.values()))
    assert len(everything) == input_models.N_IDS  # none twice ...
    assert sorted(everything.tolist()) == list(range(input_models.N_IDS))  # ... none missing
    assert all(len(ids) == input_models.N_IDS // 3 for ids in seen.values())


def test_the_numpy_dataset_is_sharded_the_same_way() -> None:
    """A spec with only load_data: three workers' rows are the training set, once each."""
    spec = tiny_models.tiny()
    train = spec.load_data(None).x_train
    rows = [
        x.numpy()
        for _, batches in worker_batches(spec, 3, epochs=1.0)
        for x, _ in batches  # noqa: B007 - the features of every batch
    ]
    got = np.concatenate(rows)
    assert len(got) == len(train)
    assert {r.tobytes() for r in got} == {r.tobytes() for r in train}


def test_the_numpy_dataset_batches_are_the_seeded_permutation_share_in_order() -> None:
    """Each epoch of ``dataset_input_fn``: the permutation seeded with seed + epoch, every
    N-th from the i-th, gathered in batches (the last smaller), labels in the spec's dtype;
    the tensors it gathers from are made once and serve every epoch alike."""
    rng = np.random.default_rng(0)
    data = Dataset(
        rng.random((103, 3, 2), dtype=np.float32),
        rng.integers(0, 10, 103),
        np.zeros((1, 3, 2), np.float32),
        np.zeros(1, np.int64),
    )
    input_fn = dataset_input_fn(data, tf.int32)
    for epoch in (0, 1):
        ctx = InputContext(1, 3, seed=5, epoch=epoch, batch_size=8)
        share = np.random.default_rng(5 + epoch).permutation(103)[1::3]
        batches = list(input_fn(ctx))
        assert [len(y) for _, y in batches] == [8] * 4 + [2]  # 34 examples
        for k, (x, y) in enumerate(batches):
            ids = share[8 * k : 8 * k + 8]
            np.testing.assert_array_equal(x.numpy(), data.x_train[ids])
            assert y.dtype == tf.int32
            np.testing.assert_array_equal(y.numpy(), data.y_train[ids])
    # the method form keeps one input_fn, and its tensors, for every epoch
    assert data._input_fn is data._input_fn
    x0, _ = next(iter(data.input_fn(InputContext(seed=2, batch_size=4))))
    np.testing.assert_array_equal(
        x0.numpy(), data.x_train[np.random.default_rng(2).permutation(103)[:4]]
    )


def test_every_epoch_is_reshuffled_the_same_on_every_worker() -> None:
    inputs = resolve_inputs(input_models.ids())

    def ids(worker: int, epoch: int) -> list[int]:
        ctx = InputContext(worker, 3, seed=4, epoch=epoch, batch_size=32)
        return [i for f, _ in build_dataset(inputs.train, ctx) for i in f["id"].numpy().tolist()]

    assert ids(0, 0) == ids(0, 0)  # the same seed and epoch: the same order, on any worker
    assert ids(0, 0) != ids(0, 1)  # the next epoch: another permutation ...
    union = sorted(ids(0, 1) + ids(1, 1) + ids(2, 1))
    assert union == list(range(input_models.N_IDS))  # ... still divided exactly


def test_epochs_and_steps_bound_the_batches() -> None:
    spec = input_models.ids()  # 200 examples per worker of 3: 7 batches (6 of 32, one of 8)
    (_, two), *_ = worker_batches(spec, 3, epochs=2.0)
    assert len(two) == 14 and [len(y) for _, y in two[:7]] == [32] * 6 + [8]
    (_, half), *_ = worker_batches(spec, 3, epochs=0.5)
    assert len(half) == 4  # round(0.5 * 7)
    (_, steps), *_ = worker_batches(spec, 3, steps=9)
    assert len(steps) == 9  # into the second epoch


def test_an_input_fn_that_does_not_shard_gets_its_batches_dealt_round_robin() -> None:
    def unsharded(ctx: InputContext) -> tf.data.Dataset:
        return tf.data.Dataset.range(100).batch(10).map(lambda b: (b, b))

    shares = [
        [int(b[0]) for b, _ in build_dataset(unsharded, InputContext(i, 3, batch_size=10))]
        for i in range(3)
    ]
    assert shares == [[0, 30, 60, 90], [10, 40, 70], [20, 50, 80]]


@pytest.mark.parametrize(
    "model", [input_models.ids, input_models.two_inputs, input_models.multilabel]
)
def test_the_step_is_traced_once_for_any_batch_size(model: Any) -> None:
    """Dict features, int32 and 2-D float labels; a smaller last batch does not retrace."""
    spec = model()
    inputs = resolve_inputs(spec)
    ds = build_dataset(inputs.train, InputContext(batch_size=spec.batch_size, seed=1))
    step = GradientStep(spec, build_model(spec), ds.element_spec)
    sizes = set()
    for x, y in ds:
        loss, grads = step(x, y)
        sizes.add(int(y.shape[0]))
        assert np.isfinite(loss) and len(grads) == len(step.variables)
    assert len(sizes) == 2  # full batches and the smaller last one
    assert step.traces == 1


@pytest.mark.parametrize(
    ("model", "bar"), [(input_models.two_inputs, 0.9), (input_models.multilabel, 0.9)]
)
def test_dict_features_and_2d_labels_train_to_a_held_out_bar(model: Any, bar: float) -> None:
    """The worker's step on the model's own batches, applied by an optimizer as the server
    would, reaches the bar on the held-out set (chance: 0.25 and 0.5)."""
    spec = model()
    m = build_model(spec)
    inputs = resolve_inputs(spec)
    ctx = InputContext(batch_size=spec.batch_size, seed=2)
    first = build_dataset(inputs.train, ctx)
    step = GradientStep(spec, m, first.element_spec)
    opt = keras.optimizers.Adam(0.05)
    for _, (x, y) in epoch_batches(inputs.train, ctx, 4.0, first):
        _, grads = step(x, y)
        opt.apply(grads, step.variables)
    held = build_dataset(inputs.held_out, ctx, "held_out_fn")
    assert evaluate(spec, m, held) >= bar


@pytest.mark.parametrize(
    ("model", "workers", "expected"),
    [
        (input_models.not_a_dataset, 1, "not a tf.data.Dataset"),
        (input_models.wrong_shape, 1, "feature x has shape [None, 5]"),
        (input_models.missing_key, 1, "no feature 'id'"),
        (input_models.few_files, 3, "worker 2 of 3 has no file to read"),
    ],
)
def test_bad_input_is_refused_before_the_worker_speaks(
    model: Any, workers: int, expected: str
) -> None:
    with pytest.raises(InputError, match=expected.replace("[", r"\[").replace("]", r"\]")):
        Worker(model(), config(num_workers=workers, worker_index=workers - 1))


def test_an_empty_element_shard_is_refused() -> None:
    def two(ctx: InputContext) -> tf.data.Dataset:
        ds = tf.data.Dataset.from_tensor_slices((np.zeros((2, 8), np.float32), np.zeros(2)))
        return ctx.shard(ds).batch(4)

    ctx = InputContext(2, 3, batch_size=4)
    with pytest.raises(InputError, match="worker 2 of 3: input_fn gave no batch in epoch 0"):
        next(epoch_batches(two, ctx, 1.0))


def autotuned(ctx: InputContext) -> tf.data.Dataset:
    """Six batches of ids shifted by the epoch, through the autotuned stages input_fns use."""
    ds = tf.data.Dataset.range(24).map(lambda i: i + 100 * ctx.epoch, tf.data.AUTOTUNE)
    return ds.batch(4).map(lambda b: (b, b), tf.data.AUTOTUNE).prefetch(tf.data.AUTOTUNE)


def finalized_on(obj: Any) -> list[str]:
    """Filled with the name of the thread that deletes ``obj``, once it is deleted."""
    where: list[str] = []
    weakref.finalize(obj, lambda: where.append(threading.current_thread().name))
    return where


def test_retire_deletes_an_iterator_on_the_retiring_thread() -> None:
    it = iter(autotuned(InputContext(batch_size=4)))
    next(it)
    where = finalized_on(it)
    retire(it)
    del it
    join_retired()
    assert where == ["downpour-retire-iterators"]


def test_the_next_epoch_is_opened_ahead_and_finished_iterators_are_retired(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    opened: list[tuple[int, str]] = []
    retired: list[list[str]] = []  # per retired iterator: the thread that deleted it

    def recorded(ctx: InputContext) -> tf.data.Dataset:
        opened.append((ctx.epoch, threading.current_thread().name))
        return autotuned(ctx)

    def watched(it: Any) -> None:
        retired.append(finalized_on(it))
        retire(it)

    monkeypatch.setattr(pipeline, "retire", watched)
    stream = epoch_batches(recorded, InputContext(batch_size=4), 3.0)
    got = [(e, [int(i) for i in x.numpy()]) for e, (x, _) in stream]
    assert [e for e, _ in got] == [0] * 6 + [1] * 6 + [2] * 6
    assert got[6][1] == [100, 101, 102, 103] and got[-1][1] == [220, 221, 222, 223]
    assert [e for e, _ in opened] == [0, 1, 2]  # each epoch once; none past the last
    assert opened[0][1] == threading.current_thread().name
    assert all(name.startswith("downpour-next-epoch") for _, name in opened[1:])
    join_retired()
    assert retired == [["downpour-retire-iterators"]] * 3

    # a stream closed mid-epoch retires its open iterator and the one read ahead
    retired.clear()
    stream = epoch_batches(recorded, InputContext(batch_size=4))
    next(stream)
    stream.close()
    join_retired()
    assert retired == [["downpour-retire-iterators"]] * 2


def test_an_empty_later_epoch_is_refused_from_the_read_ahead() -> None:
    def first_only(ctx: InputContext) -> tf.data.Dataset:
        return autotuned(ctx).take(0 if ctx.epoch else 6)

    stream = epoch_batches(first_only, InputContext(batch_size=4), 2.0)
    assert len([next(stream) for _ in range(6)]) == 6
    with pytest.raises(InputError, match="input_fn gave no batch in epoch 1"):
        next(stream)


def test_the_tf1_graph_refuses_dict_features() -> None:
    with pytest.raises(ValueError, match="--graph tf1 feeds one input tensor"):
        Worker(input_models.ids(), config(graph="tf1"))


def test_the_worker_index_must_be_below_the_count() -> None:
    with pytest.raises(ConfigError, match="--worker-index 3 is not below --num-workers 3"):
        validate_worker(config(num_workers=3, worker_index=3))
