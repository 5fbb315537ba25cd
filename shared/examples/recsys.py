"""The recommendation example: a factorization model on a synthetic Zipf click log, scored by AUC.

The data is ``downpour.examples.clicks``'s generated log (nothing is downloaded). Train it::

    downpour server --model downpour.examples.recsys:spec --lr 0.01 --eval-every 100
    downpour worker --model downpour.examples.recsys:spec --server 127.0.0.1:5570 \\
        --num-workers 2 --worker-index 0 --epochs 1      # and --worker-index 1 beside it
    downpour run-local --model downpour.examples.recsys:spec --epochs 1 --lr 0.01

and the same model in one process, for comparison: ``python -m downpour.examples.recsys``.
One pass at Adam's lr 0.01 is the documented run: more passes overfit the long tail of users.

- **Model** (``build``): plain ``keras.layers.Embedding`` tables, a ``dim``-wide factor and a
  bias per user and per item; ``logit = w · [dot(user, item), user_bias, item_bias] + b``
  (a ``Dense(1)`` starting at ``w = 1, b = 0``); binary cross-entropy on the logit. Embedding
  gradients are ``IndexedSlices``, so workers push them as rows.
- **Metric**: the exact held-out AUC (``downpour.spec.auc``), reported as ``auc`` by the
  server's ``--eval-every``, ``downpour status``, run-local and export.
- **Input**: features ``{"user": ids, "item": ids}`` (int64), labels the clicks (float32).
  Without ``--data-dir`` the log is generated in memory in every process (the same arrays:
  the seed is fixed), shuffled with ``ctx.seed + ctx.epoch`` and sharded with ``ctx.shard``.
  With ``--data-dir`` it is read from the TFRecord files ``downpour data clicks DIR`` wrote,
  sharded by file; their ``clicks.json`` must describe tables of this spec's size.

``spec`` is 20,000 users x 5,000 items x 16 dims (240,000 events); ``large`` is 100,000 users
x 50,000 items x 16 dims (2,000,000 events, written with ``downpour data clicks DIR --large``).
``tower`` is ``spec``'s tables under a dense tower in place of the dot product (``build_tower``):
the shape of a two-tower or DLRM-style ranking model, whose dense part every batch updates.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable
from typing import Any

import keras
import tensorflow as tf

from downpour import InputContext, ModelSpec
from downpour.examples.clicks import (
    HASHED,
    LARGE,
    SMALL,
    ClickConfig,
    ClickLog,
    generate,
    read_config,
)
from downpour.examples.records import HELD_OUT, TRAIN, split_files
from downpour.spec import auc, binary_logits_loss

DIM = 16
BATCH_SIZE = 256
EVAL_BATCH = 4096  # held-out batches: inference only
SHUFFLE_BUFFER = 65_536  # records, when reading files
LR = 0.01  # Adam, the server's default optimizer, at this learning rate
RECORD = {
    "user": tf.io.FixedLenFeature([], tf.int64),
    "item": tf.io.FixedLenFeature([], tf.int64),
    "click": tf.io.FixedLenFeature([], tf.float32),
}


def _tables(users: int, items: int, dim: int) -> tuple[Any, Any, tuple[Any, ...]]:
    """The ``user`` and ``item`` inputs and their embedded rows: (user factors, item
    factors, user bias, item bias), factors drawn with stddev 0.05, biases at zero."""
    user = keras.Input((), dtype="int64", name="user")
    item = keras.Input((), dtype="int64", name="item")
    init = keras.initializers.RandomNormal(stddev=0.05)
    u = keras.layers.Embedding(users, dim, embeddings_initializer=init, name="user_factors")(user)
    i = keras.layers.Embedding(items, dim, embeddings_initializer=init, name="item_factors")(item)
    ub = keras.layers.Embedding(users, 1, embeddings_initializer="zeros", name="user_bias")(user)
    ib = keras.layers.Embedding(items, 1, embeddings_initializer="zeros", name="item_bias")(item)
    return user, item, (u, i, ub, ib)


def build_model(users: int, items: int, dim: int = DIM) -> keras.Model:
    """The factorization model (see the module); variables named by layer."""
    return factor_model(*_tables(users, items, dim), "recsys")


TOWER = (64, 32)  # the tower's hidden widths


def build_tower(users: int, items: int, dim: int = DIM) -> keras.Model:
    """``build_model``'s four tables under a dense tower: ``[user, item, user * item]``
    through ``Dense`` layers of ``TOWER`` widths (relu), then ``logit = Dense(1)(h) +
    user_bias + item_bias``. Its dense part (5,249 parameters at 16 dims) is what every batch
    updates; the tables are what it touches a row at a time."""
    user, item, (u, i, ub, ib) = _tables(users, items, dim)
    h = keras.layers.Concatenate(name="tower_in")([u, i, keras.layers.Multiply(name="uxi")([u, i])])
    for k, width in enumerate(TOWER):
        h = keras.layers.Dense(width, activation="relu", name=f"tower_{k}")(h)
    out = keras.layers.Dense(1, name="tower_out")(h)
    logit = keras.layers.Add(name="logit")([out, ub, ib])
    return keras.Model({"user": user, "item": item}, logit, name="recsys_tower")


def factor_model(user: Any, item: Any, rows: tuple[Any, ...], name: str) -> keras.Model:
    """The model over inputs ``user`` and ``item`` whose embedded ``rows`` are (user factors,
    item factors, user bias, item bias): ``logit = w · [dot(user, item), user_bias,
    item_bias] + b``, ``w`` starting at ones and ``b`` at zero."""
    u, i, ub, ib = rows
    dot = keras.layers.Dot(axes=1, name="dot")([u, i])
    parts = keras.layers.Concatenate(name="parts")([dot, ub, ib])
    logit = keras.layers.Dense(1, kernel_initializer="ones", name="logit")(parts)
    return keras.Model({"user": user, "item": item}, logit, name=name)


@functools.cache
def click_log(config: ClickConfig) -> ClickLog:
    """The generated log of ``config``, once per process."""
    return generate(config)


def _memory(log: ClickLog, part: str) -> tf.data.Dataset:
    features, clicks = log.split(part)
    return tf.data.Dataset.from_tensor_slices(
        ({"user": features["user"], "item": features["item"]}, clicks)
    )


def _parse(serialized: tf.Tensor) -> tuple[dict[str, tf.Tensor], tf.Tensor]:
    ex = tf.io.parse_example(serialized, RECORD)
    return {"user": ex["user"], "item": ex["item"]}, ex["click"]


def _ids_kind(config: ClickConfig) -> str:
    return "hashed ids" if config.hashed else "ids"


def _check_files(config: ClickConfig, data_dir: str) -> None:
    found = read_config(data_dir)
    if (found.users, found.items, found.hashed) != (config.users, config.items, config.hashed):
        flag = " --hashed" if config == HASHED else " --large" if config == LARGE else ""
        raise ValueError(
            f"{data_dir} holds a log of {found.users} users x {found.items} items "
            f"({_ids_kind(found)}); this model's is {config.users} x {config.items} "
            f"({_ids_kind(config)}) (write it with `downpour data clicks DIR{flag}`)"
        )


def as_strings(features: dict[str, tf.Tensor], clicks: tf.Tensor) -> tuple[dict, tf.Tensor]:
    """A batch with its user and item ids as decimal strings: the ids of a model that takes
    strings (``make_spec(..., features=as_strings)``)."""
    return {k: tf.strings.as_string(v) for k, v in features.items()}, clicks


Features = Callable[[dict[str, tf.Tensor], tf.Tensor], tuple[dict, tf.Tensor]]


def make_input_fn(
    config: ClickConfig, features: Features | None = None
) -> Callable[[InputContext], tf.data.Dataset]:
    """One epoch of this worker's training events (see the module), each batch mapped by
    ``features`` when given."""

    def input_fn(ctx: InputContext) -> tf.data.Dataset:
        seed = ctx.seed + ctx.epoch
        if ctx.data_dir:
            _check_files(config, ctx.data_dir)
            files = ctx.shard_files(split_files(ctx.data_dir, TRAIN, "tfrecord"))
            ds = tf.data.Dataset.from_tensor_slices(files).shuffle(len(files), seed=seed)
            ds = ds.interleave(tf.data.TFRecordDataset, cycle_length=min(4, len(files)))
            ds = ds.shuffle(SHUFFLE_BUFFER, seed=seed).batch(ctx.batch_size).map(_parse)
        else:
            ds = _memory(click_log(config), TRAIN)
            ds = ds.shuffle(ds.cardinality(), seed=seed, reshuffle_each_iteration=False)
            ds = ctx.shard(ds).batch(ctx.batch_size)
        ds = ds.map(features) if features else ds
        return ds.prefetch(tf.data.AUTOTUNE)

    return input_fn


def make_held_out_fn(
    config: ClickConfig, features: Features | None = None
) -> Callable[[InputContext], tf.data.Dataset]:
    """Every held-out event, in order, in batches of EVAL_BATCH (mapped by ``features``)."""

    def held_out_fn(ctx: InputContext) -> tf.data.Dataset:
        if ctx.data_dir:
            _check_files(config, ctx.data_dir)
            files = split_files(ctx.data_dir, HELD_OUT, "tfrecord")
            ds = tf.data.TFRecordDataset(files).batch(EVAL_BATCH).map(_parse)
        else:
            ds = _memory(click_log(config), HELD_OUT).batch(EVAL_BATCH)
        return ds.map(features) if features else ds

    return held_out_fn


def make_spec(
    config: ClickConfig,
    name: str,
    dim: int = DIM,
    *,
    build: Callable[[], keras.Model] | None = None,
    features: Features | None = None,
) -> ModelSpec:
    """The example's ModelSpec for a log of ``config``'s shape: ``build_model``'s tables of
    its sizes, or the model ``build`` makes; ``features`` maps every batch."""
    return ModelSpec(
        name=name,
        build=build or functools.partial(build_model, config.users, config.items, dim),
        input_fn=make_input_fn(config, features),
        held_out_fn=make_held_out_fn(config, features),
        loss=binary_logits_loss,
        metric=auc,
        metric_name="auc",
        batch_size=BATCH_SIZE,
        label_dtype="float32",
    )


def spec() -> ModelSpec:
    """The plugin: ``--model downpour.examples.recsys:spec`` (20k users x 5k items x 16)."""
    return make_spec(SMALL, "recsys")


def tower() -> ModelSpec:
    """``--model downpour.examples.recsys:tower``: ``spec``'s log and tables under a dense
    tower (``build_tower``)."""
    return make_spec(
        SMALL, "recsys_tower", build=functools.partial(build_tower, SMALL.users, SMALL.items)
    )


def large() -> ModelSpec:
    """``--model downpour.examples.recsys:large`` (100k users x 50k items x 16)."""
    return make_spec(LARGE, "recsys_large")


def _summed_rows(g: tf.Tensor | tf.IndexedSlices) -> tf.Tensor | tf.IndexedSlices:
    """A row-sparse gradient with each repeated row summed once, as the server applies it
    (``downpour.wire.dedupe_rows``); a dense gradient as it is."""
    if not isinstance(g, tf.IndexedSlices):
        return g
    rows, inverse = tf.unique(g.indices)
    values = tf.math.unsorted_segment_sum(g.values, inverse, tf.size(rows))
    return tf.IndexedSlices(values, rows, g.dense_shape)


def train_one_process(
    model_spec: ModelSpec,
    epochs: int,
    *,
    lr: float = LR,
    data_dir: str | None = None,
    seed: int = 0,
) -> float:
    """Train ``model_spec`` in this process for ``epochs`` passes over the whole training
    split (Adam at ``lr``, the server's optimizer, one update per batch as one worker makes
    them) from the same initialisation as the server's; return the held-out AUC."""
    from downpour.model.build import build_model as build_seeded
    from downpour.model.build import evaluate

    model = build_seeded(model_spec)  # the initialisation the server uses
    optimizer = keras.optimizers.Adam(learning_rate=lr)
    optimizer.build(model.trainable_variables)
    variables = model.trainable_variables

    @tf.function
    def step(x: dict[str, tf.Tensor], y: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as tape:
            loss = model_spec.loss(y, model(x, training=True))
        grads = [_summed_rows(g) for g in tape.gradient(loss, variables)]
        optimizer.apply_gradients(zip(grads, variables, strict=True))
        return loss

    assert model_spec.input_fn is not None and model_spec.held_out_fn is not None
    ctx = InputContext(seed=seed, data_dir=data_dir, batch_size=model_spec.batch_size)
    for epoch in range(epochs):
        for x, y in model_spec.input_fn(ctx.for_epoch(epoch)):
            step(x, y)
    return float(evaluate(model_spec, model, model_spec.held_out_fn(ctx)))


def one_process_parser(prog: str, doc: str, epochs: int) -> argparse.ArgumentParser:
    """The options of a one-process run (``--epochs``, ``--lr``, ``--data-dir``)."""
    p = argparse.ArgumentParser(prog=prog, description=doc)
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument(
        "--epochs", type=int, default=epochs, help=f"passes over the training split ({epochs})"
    )
    p.add_argument("--lr", type=float, default=LR, help=f"Adam learning rate ({LR})")
    p.add_argument("--data-dir", help="read the files `downpour data clicks` wrote")
    return p


def report(config: ClickConfig, model_spec: ModelSpec, args: argparse.Namespace) -> int:
    """Print the oracle and popularity AUC of ``config``'s log (generated in memory: not when
    reading files) and the held-out AUC of ``model_spec`` trained in this one process as
    ``args`` say."""
    if args.data_dir is None:
        log = click_log(config)
        print(f"oracle AUC {log.oracle_auc():.4f}, popularity AUC {log.popularity_auc():.4f}")
    got = train_one_process(model_spec, args.epochs, lr=args.lr, data_dir=args.data_dir)
    print(f"one-process held-out auc: {got:.4f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m downpour.examples.recsys``: the log's oracle and popularity AUC, and the
    held-out AUC of the model trained in this one process."""
    p = one_process_parser("python -m downpour.examples.recsys", __doc__, epochs=2)
    p.add_argument("--large", action="store_true", help="the large spec (100k x 50k)")
    args = p.parse_args(argv)
    config, model_spec = (LARGE, large()) if args.large else (SMALL, spec())
    return report(config, model_spec, args)


if __name__ == "__main__":
    sys.exit(main())
