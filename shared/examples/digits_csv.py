"""scikit-learn's 8x8 digits streamed from CSV files, one line per example.

Write the files once, then train with ``--data-dir`` pointing at them::

    downpour data csv data/digits --dataset digits --shards 3
    downpour run-local --model downpour.examples.digits_csv:spec --data-dir data/digits --lr 1e-2

``input_fn`` reads this worker's files (``ctx.shard_files``) line by line
(``TextLineDataset``, the header skipped), shuffles lines in a bounded buffer, batches and
decodes whole batches (``tf.io.decode_csv``): ``id,label,p0..p63`` become 64 float features
in [0, 1] and an int64 label. The model is a small multilayer perceptron.
"""

from __future__ import annotations

from collections.abc import Sequence

import keras
import tensorflow as tf

from downpour import InputContext, ModelSpec
from downpour.examples.records import HELD_OUT, TRAIN, Meta, read_meta, split_files

FORMAT = "csv"
PIXELS = 64
CYCLE_LENGTH = 3
SHUFFLE_BUFFER = 2048  # lines


def read(
    files: Sequence[str],
    meta: Meta,
    batch_size: int,
    *,
    seed: int | None = None,
    with_ids: bool = False,
) -> tf.data.Dataset:
    """One pass over ``files`` as ``(pixels, labels)`` batches; shuffled when ``seed`` is
    given. ``with_ids=True`` makes the features ``{"pixels": ..., "id": ...}``."""
    files = list(files)
    ds = tf.data.Dataset.from_tensor_slices(files)
    if seed is not None:
        ds = ds.shuffle(len(files), seed=seed)
    ds = ds.interleave(
        lambda f: tf.data.TextLineDataset(f).skip(1),
        cycle_length=min(CYCLE_LENGTH, len(files)),
        num_parallel_calls=tf.data.AUTOTUNE,
        deterministic=True,
    )
    if seed is not None:
        ds = ds.shuffle(SHUFFLE_BUFFER, seed=seed)
    defaults = [tf.constant([], tf.int64)] * (2 + PIXELS)
    scale = float(meta.scale)

    def decode(lines: tf.Tensor) -> tuple[tf.Tensor | dict[str, tf.Tensor], tf.Tensor]:
        cols = tf.io.decode_csv(lines, record_defaults=defaults)
        pixels = tf.cast(tf.stack(cols[2:], axis=1), tf.float32) / scale
        if with_ids:
            return {"pixels": pixels, "id": cols[0]}, cols[1]
        return pixels, cols[1]

    ds = ds.batch(batch_size).map(decode, num_parallel_calls=tf.data.AUTOTUNE)
    return ds.prefetch(tf.data.AUTOTUNE)


def _meta(ctx: InputContext) -> Meta:
    meta = read_meta(ctx.data_dir, FORMAT)
    pixels = 1
    for d in meta.shape:
        pixels *= d
    if pixels != PIXELS:
        raise ValueError(
            f"{ctx.data_dir}: {pixels} pixels per example, this model takes {PIXELS} "
            "(write them with --dataset digits)"
        )
    return meta


def input_fn(ctx: InputContext, with_ids: bool = False) -> tf.data.Dataset:
    """One epoch of this worker's CSV files, shuffled with ``ctx.seed + ctx.epoch``."""
    meta = _meta(ctx)
    files = ctx.shard_files(split_files(ctx.data_dir, TRAIN, FORMAT))
    return read(files, meta, ctx.batch_size, seed=ctx.seed + ctx.epoch, with_ids=with_ids)


def held_out_fn(ctx: InputContext) -> tf.data.Dataset:
    """The whole held-out split, in order."""
    return read(split_files(ctx.data_dir, HELD_OUT, FORMAT), _meta(ctx), ctx.batch_size)


def build() -> keras.Model:
    """64 pixels -> 64 ReLU units -> 10 logits."""
    inp = keras.Input((PIXELS,), name="pixels")
    x = keras.layers.Dense(64, activation="relu", name="hidden")(inp)
    out = keras.layers.Dense(10, name="logits")(x)
    return keras.Model(inp, out, name="digits_mlp")


def spec() -> ModelSpec:
    """The digits MLP on CSV files written by ``downpour data csv --dataset digits``."""
    return ModelSpec(
        name="digits_csv", build=build, input_fn=input_fn, held_out_fn=held_out_fn, batch_size=32
    )
