"""A model written for keras-rs's ``DistributedEmbedding`` (a candidate item and a history of
items looking up one shared table, a user table), and the same model with that one layer
swapped for ``downpour.layers.DistributedEmbedding``: the feature configs are keras-rs's own
objects in both. Importable by spawned services through PYTHONPATH (the tests directory)."""

from __future__ import annotations

from typing import Any

import keras
import keras_rs
import numpy as np
import tensorflow as tf

from downpour import ModelSpec

USERS, ITEMS, HISTORY, DIM = 200, 300, 4, 8
TRAIN, HELD_OUT = 20000, 4000


def feature_configs() -> dict[str, Any]:
    """keras-rs's declarations: the item table shared by ``item`` and ``history``."""
    items = keras_rs.layers.TableConfig(
        name="items", vocabulary_size=ITEMS, embedding_dim=DIM, combiner="mean",
        placement="default_device", initializer=keras.initializers.RandomUniform(-0.05, 0.05),
    )  # fmt: skip
    users = keras_rs.layers.TableConfig(
        name="users", vocabulary_size=USERS, embedding_dim=DIM, placement="default_device",
        initializer=keras.initializers.RandomUniform(-0.05, 0.05),
    )  # fmt: skip
    feature = keras_rs.layers.FeatureConfig
    return {
        "user": feature("user", users, (None,), (None, DIM)),
        "item": feature("item", items, (None,), (None, DIM)),
        "history": feature("history", items, (None, HISTORY), (None, DIM)),
    }


_TRUTH = np.random.default_rng(99)
_BIAS = _TRUTH.normal(0, 1.5, ITEMS)  # planted: an item's popularity
_USER_F = _TRUTH.normal(0, 1, (USERS, 2))  # and a user's and an item's factors
_ITEM_F = _TRUTH.normal(0, 1, (ITEMS, 2))


def data(n: int, seed: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Clicks drawn from planted truth: an item's popularity, the user's factors against the
    item's, and the history's mean factors against the item's."""
    rng = np.random.default_rng(seed)
    user = rng.integers(0, USERS, n)
    item = rng.integers(0, ITEMS, n)
    history = rng.integers(0, ITEMS, (n, HISTORY))
    logit = (_BIAS[item] + (_USER_F[user] * _ITEM_F[item]).sum(1)
             + (_ITEM_F[history].mean(1) * _ITEM_F[item]).sum(1))  # fmt: skip
    y = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(np.float32)
    return {"user": user, "item": item, "history": history}, y


def build(layer: type) -> keras.Model:
    """The model around ``layer`` (keras-rs's or downpour's ``DistributedEmbedding``)."""
    inputs = {
        "user": keras.Input((), dtype="int64", name="user"),
        "item": keras.Input((), dtype="int64", name="item"),
        "history": keras.Input((HISTORY,), dtype="int64", name="history"),
    }
    out = layer(feature_configs(), name="embedding")(inputs)
    x = keras.layers.Concatenate(name="join")(
        [out["user"] * out["item"], out["history"] * out["item"], out["item"]]
    )
    h = keras.layers.Dense(16, activation="relu", name="hidden")(x)
    return keras.Model(inputs, keras.layers.Dense(1, name="logit")(h), name="krs")


def _input_fn(n: int, seed: int) -> Any:
    def input_fn(ctx: Any) -> tf.data.Dataset:
        x, y = data(n, seed)
        ds = tf.data.Dataset.from_tensor_slices((x, y))
        if n == TRAIN:
            return ctx.shard(ds.shuffle(n, seed=ctx.seed + ctx.epoch)).batch(ctx.batch_size)
        return ds.batch(500)

    return input_fn


def spec() -> ModelSpec:
    """The keras-rs model with downpour's ``DistributedEmbedding`` in place of keras-rs's."""
    from downpour.layers import DistributedEmbedding
    from downpour.spec import auc, binary_logits_loss

    return ModelSpec(
        name="krs",
        build=lambda: build(DistributedEmbedding),
        input_fn=_input_fn(TRAIN, 1),
        held_out_fn=_input_fn(HELD_OUT, 2),
        batch_size=64,
        loss=binary_logits_loss,
        metric=auc,
        metric_name="auc",
        label_dtype="float32",
    )
