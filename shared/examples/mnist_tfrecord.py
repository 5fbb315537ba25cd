"""MNIST streamed from TFRecord files: an ``input_fn`` that reads its worker's shard of files.

Write the files once, then train with ``--data-dir`` pointing at them::

    downpour data tfrecord data/mnist --dataset mnist5k --shards 4
    downpour run-local --model downpour.examples.mnist_tfrecord:spec --data-dir data/mnist

The model is the built-in Deep-MNIST CNN (the same variables and fingerprint as
``downpour.models:deep_mnist``); only the input differs. ``input_fn`` never holds the data
in memory: it lists this worker's files (``ctx.shard_files``), reads several at once
(``interleave``), shuffles serialized records in a bounded buffer, batches, parses whole
batches (``tf.io.parse_example``) and keeps batches ready ahead of the step
(``prefetch(AUTOTUNE)``). Its memory does not grow with the data: what it holds is the
shuffle buffer and a few batches, for 4,000 examples as for a gigabyte of them.

``read`` is the pipeline with its knobs; ``with_ids=True`` makes the features
``{"image": ..., "id": ...}`` so a test can see which examples an epoch yielded.
"""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf

from downpour import InputContext, ModelSpec
from downpour.examples.records import HELD_OUT, TRAIN, Meta, read_meta, split_files
from downpour.models import deep_mnist

FORMAT = "tfrecord"
SHAPE = (28, 28, 1)
CYCLE_LENGTH = 4  # files read at once
SHUFFLE_BUFFER = 4096  # serialized records (about 0.85 kB each): a few MB whatever the data
FEATURES = {
    "image": tf.io.FixedLenFeature([], tf.string),
    "label": tf.io.FixedLenFeature([], tf.int64),
    "id": tf.io.FixedLenFeature([], tf.int64),
}


def read(
    files: Sequence[str],
    meta: Meta,
    batch_size: int,
    *,
    seed: int | None = None,
    with_ids: bool = False,
) -> tf.data.Dataset:
    """One pass over ``files`` as ``(images, labels)`` batches, float32 images in [0, 1].

    With ``seed`` the file order and the records are shuffled (the same on every worker for
    the same seed); without, the files are read in order, round robin. The interleave is
    deterministic, so a seed gives one order. The last batch may be smaller: every example
    of the files is yielded exactly once.
    """
    files = list(files)
    ds = tf.data.Dataset.from_tensor_slices(files)
    if seed is not None:
        ds = ds.shuffle(len(files), seed=seed)
    ds = ds.interleave(
        tf.data.TFRecordDataset,
        cycle_length=min(CYCLE_LENGTH, len(files)),
        num_parallel_calls=tf.data.AUTOTUNE,
        deterministic=True,
    )
    if seed is not None:
        ds = ds.shuffle(SHUFFLE_BUFFER, seed=seed)
    shape, scale = tuple(meta.shape), float(meta.scale)

    features = FEATURES if with_ids else {k: v for k, v in FEATURES.items() if k != "id"}

    def parse(serialized: tf.Tensor) -> tuple[tf.Tensor | dict[str, tf.Tensor], tf.Tensor]:
        ex = tf.io.parse_example(serialized, features)  # only what is returned
        pixels = tf.io.decode_raw(ex["image"], tf.uint8)
        images = tf.reshape(tf.cast(pixels, tf.float32) / scale, (-1, *shape))
        if with_ids:
            return {"image": images, "id": ex["id"]}, ex["label"]
        return images, ex["label"]

    ds = ds.batch(batch_size).map(parse, num_parallel_calls=tf.data.AUTOTUNE)
    return ds.prefetch(tf.data.AUTOTUNE)


def _meta(ctx: InputContext) -> Meta:
    meta = read_meta(ctx.data_dir, FORMAT)
    if tuple(meta.shape) != SHAPE:
        raise ValueError(
            f"{ctx.data_dir}: images of shape {tuple(meta.shape)}, this model takes {SHAPE} "
            "(write them with --dataset mnist5k)"
        )
    return meta


def input_fn(ctx: InputContext, with_ids: bool = False) -> tf.data.Dataset:
    """One epoch of this worker's training files, shuffled with ``ctx.seed + ctx.epoch``."""
    meta = _meta(ctx)
    files = ctx.shard_files(split_files(ctx.data_dir, TRAIN, FORMAT))
    return read(files, meta, ctx.batch_size, seed=ctx.seed + ctx.epoch, with_ids=with_ids)


def held_out_fn(ctx: InputContext) -> tf.data.Dataset:
    """The whole held-out split, in order (every evaluator scores all of it)."""
    meta = _meta(ctx)
    return read(split_files(ctx.data_dir, HELD_OUT, FORMAT), meta, ctx.batch_size)


def spec() -> ModelSpec:
    """Deep-MNIST on TFRecord files written by ``downpour data tfrecord``."""
    base = deep_mnist()
    return ModelSpec(
        name="mnist_tfrecord",
        build=base.build,
        input_fn=input_fn,
        held_out_fn=held_out_fn,
        batch_size=base.batch_size,
    )
