"""Model plugins with tf.data input functions, for the input pipeline tests.

- ``ids``: blobs with an ``id`` feature (the example's index) next to ``x``; the model takes
  both (the id through a zero weight), so the ids travel in every batch the worker trains on.
  With ``DOWNPOUR_TEST_IDS_DIR`` set, its input_fn appends the ids of every batch it yields
  to ``ids-<worker index>-<epoch>-<pid>.txt`` there (a test hook of this plugin, not of
  downpour; by epoch, because a worker reads the next epoch's first batches ahead).
  With ``DOWNPOUR_TEST_GATE`` naming a file too, each batch, once recorded, waits (at most
  ``GATE_S``) while that file exists: a test holds the workers mid-split with it; with
  ``DOWNPOUR_TEST_GATE_FROM=N`` only from the N-th batch a process reads on. With
  ``DOWNPOUR_TEST_BATCH_S`` set, each batch takes at least that many seconds (pacing, so
  an epoch lasts long enough for a test to act in the middle of it).
- ``two_inputs``: a dict of two named inputs, four classes.
- ``multilabel``: 2-D float labels (four independent yes/no targets), sigmoid loss.
- ``not_a_dataset``, ``wrong_shape``, ``missing_key``, ``few_files``: bad input, refused.
- ``big_records``: streams the TFRecord files of ``--data-dir`` (``write_big_records``
  writes them): records of ``BLOB_FLOATS`` float32 each (512 KiB), read with ``interleave``
  and ``prefetch``; the model averages each blob down to 64 numbers before a Dense, so an
  epoch over a gigabyte is a few hundred cheap steps.

Importable by spawned services through PYTHONPATH (the tests directory).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import keras
import numpy as np
import tensorflow as tf

from downpour import InputContext, ModelSpec

N_IDS = 600  # training examples of ``ids`` (120 more are held out)
IDS_DIR_ENV = "DOWNPOUR_TEST_IDS_DIR"
GATE_ENV = "DOWNPOUR_TEST_GATE"
GATE_S = 120.0
GATE_FROM_ENV = "DOWNPOUR_TEST_GATE_FROM"
_read = 0  # batches this process has read through _record
PACE_ENV = "DOWNPOUR_TEST_BATCH_S"


def _blobs(n: int, dim: int = 8, classes: int = 4, seed: int = 3) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    centers = rng.normal(0, 3, (classes, dim)).astype(np.float32)
    y = rng.integers(0, classes, n).astype(np.int64)
    x = (centers[y] + rng.normal(0, 1, (n, dim))).astype(np.float32)
    return x, y


_X, _Y = _blobs(N_IDS + 120)


def _record(ids: tf.Tensor, worker_index: int, epoch: int) -> None:
    global _read
    _read += 1
    directory = os.environ.get(IDS_DIR_ENV)
    if directory:
        path = Path(directory) / f"ids-{worker_index}-{epoch}-{os.getpid()}.txt"
        with open(path, "a") as f:
            f.write("".join(f"{i}\n" for i in ids.numpy().tolist()))
    time.sleep(float(os.environ.get(PACE_ENV) or 0))
    gate = os.environ.get(GATE_ENV)
    if _read < int(os.environ.get(GATE_FROM_ENV) or 1):
        gate = None
    deadline = time.monotonic() + GATE_S
    while gate and os.path.exists(gate) and time.monotonic() < deadline:
        time.sleep(0.05)


def ids_input_fn(ctx: InputContext) -> tf.data.Dataset:
    """One epoch of this worker's share of the ``N_IDS`` examples: ({x, id}, label)."""
    ds = tf.data.Dataset.from_tensor_slices(
        ({"x": _X[:N_IDS], "id": np.arange(N_IDS, dtype=np.int64)}, _Y[:N_IDS])
    )
    ds = ctx.shard(ds.shuffle(N_IDS, seed=ctx.seed + ctx.epoch)).batch(ctx.batch_size)
    if os.environ.get(IDS_DIR_ENV):

        def record(features: dict, labels: tf.Tensor) -> tuple[dict, tf.Tensor]:
            def write(ids: tf.Tensor) -> tf.Tensor:
                _record(ids, ctx.worker_index, ctx.epoch)
                return ids

            ids = tf.py_function(write, [features["id"]], tf.int64)
            return {"x": features["x"], "id": tf.ensure_shape(ids, (None,))}, labels

        ds = ds.map(record)
    return ds.prefetch(tf.data.AUTOTUNE)


def ids_held_out_fn(ctx: InputContext) -> tf.data.Dataset:
    """The 120 held-out examples, ids following the training ones."""
    ids = np.arange(N_IDS, N_IDS + 120, dtype=np.int64)
    return tf.data.Dataset.from_tensor_slices(({"x": _X[N_IDS:], "id": ids}, _Y[N_IDS:])).batch(60)


def _ids_model() -> keras.Model:
    x = keras.Input((8,), name="x")
    ids = keras.Input((), dtype="int64", name="id")
    h = keras.layers.Dense(16, activation="relu", name="hidden")(x)
    logits = keras.layers.Dense(4, name="logits")(h)
    zero = keras.ops.expand_dims(keras.ops.cast(ids, "float32"), -1) * 0.0
    return keras.Model({"x": x, "id": ids}, logits + zero, name="ids")


def ids() -> ModelSpec:
    """Blobs with an id feature (see the module docstring)."""
    return ModelSpec(
        name="ids",
        build=_ids_model,
        input_fn=ids_input_fn,
        held_out_fn=ids_held_out_fn,
        batch_size=32,
    )


def _two_input_data(n: int, seed: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
    rng = np.random.default_rng(seed)
    wa = np.random.default_rng(0).normal(size=(6, 4)).astype(np.float32)
    wb = np.random.default_rng(1).normal(size=(3, 4)).astype(np.float32)
    a = rng.normal(size=(n, 6)).astype(np.float32)
    b = rng.normal(size=(n, 3)).astype(np.float32)
    return {"a": a, "b": b}, np.argmax(a @ wa + b @ wb, axis=1).astype(np.int32)


def _two_input_model() -> keras.Model:
    a = keras.Input((6,), name="a")
    b = keras.Input((3,), name="b")
    h = keras.layers.Concatenate(name="join")([a, b])
    return keras.Model({"a": a, "b": b}, keras.layers.Dense(4, name="logits")(h), name="two")


def two_inputs() -> ModelSpec:
    """Two named inputs (a dict of features), int32 labels: four linearly separable classes."""
    train = _two_input_data(1200, 5)
    held = _two_input_data(300, 6)

    def input_fn(ctx: InputContext) -> tf.data.Dataset:
        ds = tf.data.Dataset.from_tensor_slices(train).shuffle(1200, seed=ctx.seed + ctx.epoch)
        return ctx.shard(ds).batch(ctx.batch_size)

    return ModelSpec(
        name="two_inputs",
        build=_two_input_model,
        input_fn=input_fn,
        held_out_fn=lambda ctx: tf.data.Dataset.from_tensor_slices(held).batch(100),
        batch_size=32,
        label_dtype="int32",
    )


def _multilabel_data(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    w = np.random.default_rng(2).normal(size=(10, 4)).astype(np.float32)
    x = rng.normal(size=(n, 10)).astype(np.float32)
    return x, (x @ w > 0).astype(np.float32)


def bce(labels: tf.Tensor, logits: tf.Tensor) -> tf.Tensor:
    """Mean sigmoid cross-entropy over every (example, target)."""
    return tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=labels, logits=logits))


def bit_accuracy(labels: np.ndarray, logits: np.ndarray) -> float:
    """Fraction of (example, target) pairs predicted right."""
    return float(np.mean((logits > 0) == (labels > 0.5)))


def multilabel() -> ModelSpec:
    """2-D float labels: four yes/no targets per example, each a linear threshold of x."""
    train = _multilabel_data(1200, 7)
    held = _multilabel_data(300, 8)

    def input_fn(ctx: InputContext) -> tf.data.Dataset:
        ds = tf.data.Dataset.from_tensor_slices(train).shuffle(1200, seed=ctx.seed + ctx.epoch)
        return ctx.shard(ds).batch(ctx.batch_size)

    return ModelSpec(
        name="multilabel",
        build=lambda: keras.Sequential(
            [keras.Input((10,)), keras.layers.Dense(4, name="logits")], name="multilabel"
        ),
        input_fn=input_fn,
        held_out_fn=lambda ctx: tf.data.Dataset.from_tensor_slices(held).batch(100),
        loss=bce,
        metric=bit_accuracy,
        batch_size=32,
        label_dtype="float32",
    )


def not_a_dataset() -> ModelSpec:
    """input_fn returns NumPy arrays, not a tf.data.Dataset."""
    return ModelSpec(name="ids", build=_ids_model, input_fn=lambda ctx: (_X, _Y), batch_size=32)


def wrong_shape() -> ModelSpec:
    """``x`` with 5 columns where the model takes 8."""

    def input_fn(ctx: InputContext) -> tf.data.Dataset:
        feats = {"x": _X[:N_IDS, :5], "id": np.arange(N_IDS, dtype=np.int64)}
        return tf.data.Dataset.from_tensor_slices((feats, _Y[:N_IDS])).batch(32)

    return ModelSpec(name="ids", build=_ids_model, input_fn=input_fn, batch_size=32)


def missing_key() -> ModelSpec:
    """No ``id`` feature."""

    def input_fn(ctx: InputContext) -> tf.data.Dataset:
        return tf.data.Dataset.from_tensor_slices(({"x": _X[:N_IDS]}, _Y[:N_IDS])).batch(32)

    return ModelSpec(name="ids", build=_ids_model, input_fn=input_fn, batch_size=32)


def few_files() -> ModelSpec:
    """Two (named) files for however many workers: worker 2 of 3 has none."""

    def input_fn(ctx: InputContext) -> tf.data.Dataset:
        mine = ctx.shard_files(["part-0", "part-1"])
        return ids_input_fn(ctx).take(len(mine))

    return ModelSpec(name="ids", build=_ids_model, input_fn=input_fn, batch_size=32)


BLOB_FLOATS = 1 << 17  # float32 per record: 512 KiB
BLOB_ROWS = 64  # the model averages a blob to this many numbers
BIG_FEATURES = {
    "blob": tf.io.FixedLenFeature([], tf.string),
    "label": tf.io.FixedLenFeature([], tf.int64),
}


def write_big_records(directory: Path, files: int, records_per_file: int) -> int:
    """Write ``files`` TFRecord files of ``records_per_file`` records each (``big_records``'
    format) into ``directory``; return the bytes written. Eight distinct records, serialized
    once and written over and over: generation costs about what the disk write costs."""
    rng = np.random.default_rng(0)
    templates = []
    for k in range(8):
        label = k % 2
        blob = (rng.normal(size=BLOB_FLOATS) + label).astype(np.float32)
        example = tf.train.Example(
            features=tf.train.Features(
                feature={
                    "blob": tf.train.Feature(bytes_list=tf.train.BytesList(value=[blob.tobytes()])),
                    "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[label])),
                }
            )
        )
        templates.append(example.SerializeToString())
    directory.mkdir(parents=True, exist_ok=True)
    for f in range(files):
        path = directory / f"part-{f:03d}.tfrecord"
        with tf.io.TFRecordWriter(str(path)) as writer:
            for r in range(records_per_file):
                writer.write(templates[(f + r) % len(templates)])
    return sum(p.stat().st_size for p in directory.glob("*.tfrecord"))


def big_records_input_fn(ctx: InputContext) -> tf.data.Dataset:
    """This worker's files of ``--data-dir``, streamed: a few records in flight per file,
    parsed a batch at a time, batches prefetched."""
    files = ctx.shard_files(sorted(str(p) for p in Path(ctx.data_dir or ".").glob("*.tfrecord")))
    ds = tf.data.Dataset.from_tensor_slices(files).interleave(
        tf.data.TFRecordDataset, cycle_length=2, num_parallel_calls=tf.data.AUTOTUNE
    )

    def parse(serialized: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        ex = tf.io.parse_example(serialized, BIG_FEATURES)
        blob = tf.io.decode_raw(ex["blob"], tf.float32)
        return tf.ensure_shape(blob, (None, BLOB_FLOATS)), ex["label"]

    return ds.batch(ctx.batch_size).map(parse).prefetch(tf.data.AUTOTUNE)


def _big_model() -> keras.Model:
    blob = keras.Input((BLOB_FLOATS,), name="blob")
    rows = keras.layers.Reshape((BLOB_ROWS, BLOB_FLOATS // BLOB_ROWS))(blob)
    means = keras.layers.GlobalAveragePooling1D(data_format="channels_first")(rows)
    return keras.Model(blob, keras.layers.Dense(2, name="logits")(means), name="big_records")


def big_records() -> ModelSpec:
    """512 KiB records streamed from TFRecord files (see the module docstring)."""
    return ModelSpec(
        name="big_records", build=_big_model, input_fn=big_records_input_fn, batch_size=8
    )
