"""Data in files: ``downpour data`` writes the shipped data as TFRecord and CSV shards, and the
two file examples' ``input_fn`` give N workers disjoint shares that together are the whole
training set, with the element spec the model takes, and train a model to a held-out bar.

The input functions are driven directly with an ``InputContext`` per worker, in this process:
the pipelines themselves are under test, not the worker that will call them.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

from downpour import InputContext, cli
from downpour.cli.data import digits
from downpour.examples import digits_csv, mnist_tfrecord
from downpour.inputs.data import load_mnist_5k
from downpour.model.build import build_model
from downpour.spec import load_spec


def write(*args: str) -> int:
    return cli.main(["data", *args])


def digest(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in directory.iterdir()}


@pytest.fixture(scope="module")
def mnist_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("mnist") / "records"
    assert write("tfrecord", str(out), "--dataset", "mnist5k", "--shards", "4") == 0
    return out


@pytest.fixture(scope="module")
def digits_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("digits") / "csv"
    assert write("csv", str(out), "--dataset", "digits", "--shards", "3") == 0
    return out


def epoch_by_worker(module, data_dir: Path, workers: int, key: str) -> list[dict[int, tuple]]:
    """For each of ``workers`` workers: id -> (features, label) of the examples it read."""
    seen = []
    for i in range(workers):
        ctx = InputContext(i, workers, seed=7, data_dir=str(data_dir), batch_size=50)
        mine: dict[int, tuple] = {}
        for features, labels in module.input_fn(ctx, with_ids=True):
            rows = zip(features["id"].numpy(), features[key].numpy(), labels.numpy(), strict=True)
            for ident, x, y in rows:
                assert int(ident) not in mine, f"worker {i} read example {ident} twice"
                mine[int(ident)] = (x, int(y))
        seen.append(mine)
    return seen


def test_tfrecords_are_deterministic_and_hold_the_shipped_split(
    mnist_dir: Path, tmp_path: Path
) -> None:
    again = tmp_path / "again"
    assert write("tfrecord", str(again), "--dataset", "mnist5k", "--shards", "4") == 0
    assert digest(again) == digest(mnist_dir)
    names = sorted(p.name for p in mnist_dir.iterdir())
    assert names == [
        "dataset.json",
        "held_out-00000-of-00001.tfrecord",
        *[f"train-0000{i}-of-00004.tfrecord" for i in range(4)],
    ]
    ctx = InputContext(data_dir=str(mnist_dir), batch_size=100)
    held = [(x.numpy(), y.numpy()) for x, y in mnist_tfrecord.held_out_fn(ctx)]
    ref = load_mnist_5k()
    np.testing.assert_array_equal(np.concatenate([x for x, _ in held]), ref.x_test)
    np.testing.assert_array_equal(np.concatenate([y for _, y in held]), ref.y_test)


def test_three_workers_read_every_tfrecord_example_exactly_once(mnist_dir: Path) -> None:
    seen = epoch_by_worker(mnist_tfrecord, mnist_dir, 3, "image")
    assert all(seen), "a worker read nothing"
    ids = [i for mine in seen for i in mine]
    assert len(ids) == len(set(ids)) == 4000  # no example on two workers
    assert set(ids) == set(range(4000))
    ref = load_mnist_5k()  # id i is the i-th training example, image and label
    for mine in seen:
        for ident, (x, y) in list(mine.items())[::97]:
            np.testing.assert_array_equal(x, ref.x_train[ident])
            assert y == ref.y_train[ident]

    ds = mnist_tfrecord.input_fn(InputContext(0, 3, data_dir=str(mnist_dir)))
    assert ds.element_spec == (
        tf.TensorSpec((None, 28, 28, 1), tf.float32),
        tf.TensorSpec((None,), tf.int64),
    )


def test_epochs_reshuffle_and_a_seed_repeats_its_order(mnist_dir: Path) -> None:
    def first_ids(epoch: int) -> list[int]:
        ctx = InputContext(seed=3, epoch=epoch, data_dir=str(mnist_dir), batch_size=20)
        features, _ = next(iter(mnist_tfrecord.input_fn(ctx, with_ids=True)))
        return features["id"].numpy().tolist()

    assert first_ids(0) == first_ids(0)
    assert first_ids(0) != first_ids(1)


def test_more_workers_than_files_and_a_missing_data_dir_are_clear_errors(
    mnist_dir: Path, tmp_path: Path
) -> None:
    with pytest.raises(ValueError, match="worker 4 of 5 has no file to read: 4 file"):
        mnist_tfrecord.input_fn(InputContext(4, 5, data_dir=str(mnist_dir)))
    with pytest.raises(ValueError, match="downpour data tfrecord DIR"):
        mnist_tfrecord.input_fn(InputContext())
    with pytest.raises(ValueError, match="no dataset.json"):
        mnist_tfrecord.input_fn(InputContext(data_dir=str(tmp_path)))


def test_deep_mnist_trains_on_the_tfrecord_input_fn_to_a_held_out_bar(mnist_dir: Path) -> None:
    spec = load_spec("downpour.examples.mnist_tfrecord:spec")
    model = build_model(spec, seed=0)
    accuracy = train(spec, model, epochs=2, data_dir=mnist_dir, lr=1e-3)
    assert accuracy >= 0.9, f"held-out accuracy {accuracy:.3f}"


def test_three_workers_read_every_csv_example_exactly_once(digits_dir: Path) -> None:
    seen = epoch_by_worker(digits_csv, digits_dir, 3, "pixels")
    ids = [i for mine in seen for i in mine]
    assert len(ids) == len(set(ids)) == 1437 and set(ids) == set(range(1437))
    src = digits()
    for mine in seen:
        for ident, (x, y) in list(mine.items())[::53]:
            np.testing.assert_allclose(x, src.x_train[ident].ravel() / 16.0)
            assert y == src.y_train[ident]
    ds = digits_csv.input_fn(InputContext(1, 3, data_dir=str(digits_dir)))
    assert ds.element_spec == (
        tf.TensorSpec((None, 64), tf.float32),
        tf.TensorSpec((None,), tf.int64),
    )
    with pytest.raises(ValueError, match="holds csv files, this example reads tfrecord"):
        mnist_tfrecord.input_fn(InputContext(data_dir=str(digits_dir)))


def test_digits_mlp_trains_on_the_csv_input_fn_to_a_held_out_bar(digits_dir: Path) -> None:
    spec = load_spec("downpour.examples.digits_csv:spec")
    model = build_model(spec, seed=0)
    accuracy = train(spec, model, epochs=8, data_dir=digits_dir, lr=1e-2)
    assert accuracy >= 0.9, f"held-out accuracy {accuracy:.3f}"


def test_repeat_and_size_mb_write_a_larger_perturbed_set_with_fresh_ids(tmp_path: Path) -> None:
    out = tmp_path / "big"
    assert write("tfrecord", str(out), "--dataset", "digits", "--shards", "2", "--repeat", "3") == 0
    seen = epoch_by_worker(mnist_tfrecord_like_digits(), out, 2, "image")
    ids = sorted(i for mine in seen for i in mine)
    assert ids == list(range(3 * 1437))
    src = digits()
    by_id = {i: xy for mine in seen for i, xy in mine.items()}
    for i in range(0, 1437, 101):  # a later pass: same label, the image moved, not replaced
        x1, y1 = by_id[1437 + i]
        assert y1 == src.y_train[i]
        assert sorted(x1.ravel().tolist()) == sorted((src.x_train[i] / 16.0).ravel().tolist())
    moved = sum(not np.array_equal(by_id[1437 + i][0], by_id[i][0]) for i in range(1437))
    assert moved > 1437 // 2

    sized = tmp_path / "sized"
    assert write("tfrecord", str(sized), "--dataset", "digits", "--size-mb", "0.5") == 0
    train_bytes = sum(p.stat().st_size for p in sized.glob("train-*"))
    assert 0.5 * 2**20 <= train_bytes < 0.5 * 2**20 + 1437 * 200  # at most one pass more


def mnist_tfrecord_like_digits():
    """The TFRecord pipeline with digits' 8x8 images (``read`` takes the shape from the
    metadata; only the example's ``input_fn`` insists on 28x28)."""
    from downpour.examples.records import TRAIN, read_meta, split_files

    class Reader:
        @staticmethod
        def input_fn(ctx: InputContext, with_ids: bool = False) -> tf.data.Dataset:
            files = ctx.shard_files(split_files(ctx.data_dir, TRAIN, "tfrecord"))
            meta = read_meta(ctx.data_dir, "tfrecord")
            return mnist_tfrecord.read(files, meta, ctx.batch_size, seed=0, with_ids=with_ids)

    return Reader


def test_data_command_refuses_bad_arguments_and_existing_data(
    mnist_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert write("tfrecord", str(mnist_dir)) == 2
    assert "already holds a data set" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        write("tfrecord", str(mnist_dir / "x"), "--shards", "0")
    assert exc.value.code == 2
    for bad in (["--repeat", "2", "--size-mb", "3"], ["--size-mb", "0"], ["--dataset", "x"]):
        with pytest.raises(SystemExit) as exc:
            write("csv", str(mnist_dir / "x"), *bad)
        assert exc.value.code == 2
    assert not (mnist_dir / "x").exists()
    with pytest.raises(SystemExit):
        write("--help")
    assert "tfrecord" in capsys.readouterr().out


def train(spec, model: keras.Model, *, epochs: int, data_dir: Path, lr: float) -> float:
    """Train ``model`` on ``spec.input_fn`` epoch by epoch with one compiled step whose
    signature is the dataset's element spec; return the held-out accuracy."""
    ctx = InputContext(seed=1, data_dir=str(data_dir), batch_size=spec.batch_size)
    x_spec, y_spec = spec.input_fn(ctx).element_spec
    optimizer = keras.optimizers.Adam(lr)
    optimizer.build(model.trainable_variables)

    @tf.function(input_signature=[x_spec, y_spec])
    def step(x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as tape:
            loss = spec.loss(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)
        return loss

    for epoch in range(epochs):
        for x, y in spec.input_fn(ctx.for_epoch(epoch)):
            step(x, y)
    assert step.experimental_get_tracing_count() == 1  # the last, smaller batch did not retrace
    right = total = 0
    for x, y in spec.held_out_fn(ctx):
        right += int(np.sum(np.argmax(model(x, training=False), axis=-1) == y.numpy()))
        total += int(y.shape[0])
    return right / total
