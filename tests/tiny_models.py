"""Small model plugins for tests: seconds to train, so process tests stay fast.

Importable by spawned services through PYTHONPATH (the tests directory).
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import tensorflow as tf

from downpour import ModelSpec
from downpour.inputs.data import Dataset
from downpour.layers import DynamicEmbedding
from downpour.model.hashing import mix64
from downpour.model.tf1 import Tf1Graph, finish


def blobs(seed: int = 7, n: int = 1200, dim: int = 16, classes: int = 4) -> Dataset:
    """Gaussian blobs: linearly separable enough to learn in a few dozen steps."""
    rng = np.random.default_rng(seed)
    centers = rng.normal(0, 3, (classes, dim)).astype(np.float32)
    y = rng.integers(0, classes, n).astype(np.int64)
    x = (centers[y] + rng.normal(0, 1, (n, dim))).astype(np.float32)
    cut = n * 4 // 5
    return Dataset(x[:cut], y[:cut], x[cut:], y[cut:])


def _mlp(hidden: int) -> keras.Model:
    inp = keras.Input((16,), name="features")
    h = keras.layers.Dense(hidden, activation="relu", name="hidden")(inp)
    out = keras.layers.Dense(4, name="logits")(h)
    return keras.Model(inp, out, name=f"mlp{hidden}")


def tiny() -> ModelSpec:
    """A 16-32-4 MLP on blobs."""
    return ModelSpec(
        name="tiny", build=lambda: _mlp(32), load_data=lambda _d: blobs(), batch_size=32
    )


def tiny_other() -> ModelSpec:
    """Same problem, another hidden width: a different fingerprint."""
    return ModelSpec(
        name="tiny_other", build=lambda: _mlp(48), load_data=lambda _d: blobs(), batch_size=32
    )


class CountingLayer(keras.layers.Layer):
    """Identity layer that counts how often its forward pass executes (not traces)."""

    def build(self, input_shape: tuple) -> None:
        self.calls = self.add_weight(shape=(), initializer="zeros", trainable=False, name="calls")

    def call(self, x):  # noqa: ANN001, ANN201
        self.calls.assign_add(1.0)
        return x


def counting() -> ModelSpec:
    """An MLP whose forward passes are counted by a non-trainable variable."""

    def build() -> keras.Model:
        inp = keras.Input((16,), name="features")
        h = CountingLayer(name="counter")(inp)
        h = keras.layers.Dense(8, activation="relu", name="h1")(h)
        h = keras.layers.Dense(8, activation="relu", name="h2")(h)
        out = keras.layers.Dense(4, name="logits")(h)
        return keras.Model(inp, out, name="counting")

    return ModelSpec(name="counting", build=build, load_data=lambda _d: blobs(), batch_size=32)


EMBED_VOCAB = 5000
DYNAMIC_ROWS = 1000  # a worker's rows of the dynamic table (the data has 200 distinct ids)


def embedding_tf1_graph() -> Tf1Graph:
    """``embedding``'s function as a TF1 graph: ``embedding_lookup`` on a ``get_variable``
    table (its gradient is an IndexedSlices, as the Keras Embedding's), mean over tokens,
    dense logits; the variable scopes give the Keras paths."""
    v1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.int32, [None, 6], name="tokens")
        y = v1.placeholder(tf.int64, [None], name="y")
        with v1.variable_scope("embed"):
            init = v1.random_uniform_initializer(-0.05, 0.05)
            table = v1.get_variable("embeddings", [EMBED_VOCAB, 8], tf.float32, init)
        h = tf.reduce_mean(tf.nn.embedding_lookup(table, x), axis=1)
        with v1.variable_scope("logits"):
            w = v1.get_variable("kernel", [8, 4], tf.float32, v1.glorot_uniform_initializer())
            b = v1.get_variable("bias", [4], tf.float32, v1.zeros_initializer())
        logits = tf.matmul(h, w) + b
        loss = tf.reduce_mean(
            tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
        )
        return finish(graph, x, y, logits, loss, [table, w, b])


def embedding() -> ModelSpec:
    """A bag-of-tokens classifier whose Embedding gradient is row-sparse (IndexedSlices)."""
    vocab = EMBED_VOCAB

    def build() -> keras.Model:
        inp = keras.Input((6,), dtype="int32", name="tokens")
        e = keras.layers.Embedding(vocab, 8, name="embed")(inp)
        h = keras.layers.GlobalAveragePooling1D(name="pool")(e)
        out = keras.layers.Dense(4, name="logits")(h)
        return keras.Model(inp, out, name="embedding")

    def data(_d: str | None) -> Dataset:
        rng = np.random.default_rng(3)
        y = rng.integers(0, 4, 600).astype(np.int64)
        x = (rng.integers(0, 50, (600, 6)) + 50 * y[:, None]).astype(np.int32)
        return Dataset(x[:500], y[:500], x[500:], y[500:])

    return ModelSpec(
        name="embedding",
        build=build,
        load_data=data,
        batch_size=20,
        tf1_graph=embedding_tf1_graph,
    )


def wide() -> ModelSpec:
    """Cheap to compute, 8.5 MB to send: makes pushes long enough to be caught mid-flight."""

    def build() -> keras.Model:
        inp = keras.Input((16,), name="features")
        h = keras.layers.Dense(2048, activation="relu", name="h1")(inp)
        h = keras.layers.Dense(1024, activation="relu", name="h2")(h)
        out = keras.layers.Dense(4, name="logits")(h)
        return keras.Model(inp, out, name="wide")

    return ModelSpec(name="wide", build=build, load_data=lambda _d: blobs(), batch_size=32)


def batchnorm() -> ModelSpec:
    """Dense -> BatchNormalization -> relu -> logits on blobs moved far from zero (offset 40,
    scale 4): inference with the initial moving statistics (mean 0, variance 1) is far off,
    so it shows whether a BatchNorm policy gives the server's weights usable statistics."""

    def data(_d: str | None) -> Dataset:
        d = blobs()
        return Dataset(d.x_train * 4 + 40, d.y_train, d.x_test * 4 + 40, d.y_test)

    def build() -> keras.Model:
        inp = keras.Input((16,), name="features")
        h = keras.layers.Dense(32, name="hidden")(inp)
        h = keras.layers.BatchNormalization(name="bn")(h)
        h = keras.layers.Activation("relu", name="relu")(h)
        out = keras.layers.Dense(4, name="logits")(h)
        return keras.Model(inp, out, name="batchnorm")

    return ModelSpec(name="batchnorm", build=build, load_data=data, batch_size=32)


def big_embedding() -> ModelSpec:
    """The embedding classifier with a 100,000-row table (6.4 MB): a batch touches at most
    120 rows, so a push should carry about 0.1 % of the table."""
    vocab = 100_000

    def build() -> keras.Model:
        inp = keras.Input((6,), dtype="int32", name="tokens")
        e = keras.layers.Embedding(vocab, 16, name="embed")(inp)
        h = keras.layers.GlobalAveragePooling1D(name="pool")(e)
        out = keras.layers.Dense(4, name="logits")(h)
        return keras.Model(inp, out, name="big_embedding")

    def data(_d: str | None) -> Dataset:
        rng = np.random.default_rng(4)
        y = rng.integers(0, 4, 800).astype(np.int64)
        x = (rng.integers(0, 50, (800, 6)) + 25_000 * y[:, None]).astype(np.int32)
        return Dataset(x[:640], y[:640], x[640:], y[640:])

    return ModelSpec(name="big_embedding", build=build, load_data=data, batch_size=20)


def million_embedding() -> ModelSpec:
    """``big_embedding`` with a 1,000,000 x 16 table (64 MB): a row pull of a batch's rows
    must cost bytes in proportion to the rows, not to the table."""
    vocab = 1_000_000

    def build() -> keras.Model:
        inp = keras.Input((6,), dtype="int32", name="tokens")
        e = keras.layers.Embedding(vocab, 16, name="embed")(inp)
        h = keras.layers.GlobalAveragePooling1D(name="pool")(e)
        out = keras.layers.Dense(4, name="logits")(h)
        return keras.Model(inp, out, name="million_embedding")

    def data(_d: str | None) -> Dataset:
        rng = np.random.default_rng(5)
        y = rng.integers(0, 4, 800).astype(np.int64)
        x = (rng.integers(0, 50, (800, 6)) + 250_000 * y[:, None]).astype(np.int32)
        return Dataset(x[:640], y[:640], x[640:], y[640:])

    return ModelSpec(name="million_embedding", build=build, load_data=data, batch_size=20)


def ten_million_embedding() -> ModelSpec:
    """A 10,000,000 x 64 table (2.56 GB) and a 2-class head: larger than a worker should
    hold, for ``--row-cache-rows``. Each example gathers 8 ids drawn uniformly over the
    table (a batch of 64: 512 ids, nearly all distinct); the label is planted in them
    (whether most are even)."""
    vocab, dim, features = 10_000_000, 64, 8

    def build() -> keras.Model:
        inp = keras.Input((features,), dtype="int32", name="ids")
        e = keras.layers.Embedding(vocab, dim, name="embed")(inp)  # uniform, Keras's default
        h = keras.layers.GlobalAveragePooling1D(name="pool")(e)
        out = keras.layers.Dense(2, name="logits")(h)
        return keras.Model(inp, out, name="ten_million_embedding")

    def data(_d: str | None) -> Dataset:
        rng = np.random.default_rng(10)
        x = rng.integers(0, vocab, (20_480 + 512, features)).astype(np.int32)
        y = ((x % 2 == 0).sum(axis=1) > features // 2).astype(np.int64)
        return Dataset(x[:20_480], y[:20_480], x[20_480:], y[20_480:])

    return ModelSpec(name="ten_million_embedding", build=build, load_data=data, batch_size=64)


# The embedding classifier in every input form Keras accepts, with a dense side feature: the
# row-sparse table must be found, served and pulled by row whatever the form.
FORMS = ("tensor", "list", "dict", "nested")


def _form_data(n: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 4, n).astype(np.int64)
    tokens = (rng.integers(0, 50, (n, 6)) + 50 * y[:, None]).astype(np.int32)
    side = rng.normal(size=(n, 2)).astype(np.float32)
    return tokens, side, y


def _arrange(form: str, tokens: Any, side: Any) -> Any:
    """The features of ``form`` from the token ids and the side feature."""
    if form == "tensor":
        return tokens
    if form == "list":
        return (tokens, side)
    if form == "dict":
        return {"tokens": tokens, "side": side}
    return {"ids": {"tokens": tokens}, "side": side}


def _form_model(form: str, dynamic: bool = False, rows: int = DYNAMIC_ROWS) -> keras.Model:
    tokens = keras.Input((6,), dtype="int64" if dynamic else "int32", name="tokens")
    side = keras.Input((2,), name="side")
    table = (
        DynamicEmbedding(8, max_rows=rows, name="embed")
        if dynamic
        else keras.layers.Embedding(EMBED_VOCAB, 8, name="embed")
    )
    pooled = keras.layers.GlobalAveragePooling1D(name="pool")(table(tokens))
    if form == "tensor":
        return keras.Model(tokens, keras.layers.Dense(4, name="logits")(pooled), name=form)
    h = keras.layers.Concatenate(name="join")([pooled, side])
    out = keras.layers.Dense(4, name="logits")(h)
    inputs = {"tokens": tokens, "side": side}
    return keras.Model(_arrange(form, tokens, side) if form != "dict" else inputs, out, name=form)


def hashed(tokens: np.ndarray) -> np.ndarray:
    """Token ids as 64-bit hashes (negative and huge values among them): ids a dynamic
    table takes and a fixed one cannot."""
    return mix64(tokens.astype(np.uint64) + np.uint64(12345)).view(np.int64)


def embedding_form(form: str, dynamic: bool = False, rows: int = DYNAMIC_ROWS) -> ModelSpec:
    """The embedding classifier taking its features as ``form`` (one of ``FORMS``); with
    ``dynamic``, its table is a ``DynamicEmbedding`` of ``rows`` rows a worker holds, fed
    hashed ids."""
    ids = hashed if dynamic else (lambda t: t)

    def input_fn(ctx: Any) -> tf.data.Dataset:
        tokens, side, y = _form_data(600, 3)
        ds = tf.data.Dataset.from_tensor_slices((_arrange(form, ids(tokens), side), y))
        return ctx.shard(ds).batch(ctx.batch_size)

    def held_out_fn(ctx: Any) -> tf.data.Dataset:
        tokens, side, y = _form_data(200, 4)
        features = _arrange(form, ids(tokens), side)
        return tf.data.Dataset.from_tensor_slices((features, y)).batch(100)

    return ModelSpec(
        name=f"{'dynamic' if dynamic else 'embedding'}_{form}",
        build=lambda: _form_model(form, dynamic, rows),
        input_fn=input_fn,
        held_out_fn=held_out_fn,
        batch_size=20,
    )


def embedding_tensor() -> ModelSpec:
    return embedding_form("tensor")


def embedding_list() -> ModelSpec:
    return embedding_form("list")


def embedding_dict() -> ModelSpec:
    return embedding_form("dict")


def embedding_nested() -> ModelSpec:
    return embedding_form("nested")


class _Bag(keras.Model):
    """A subclassed bag-of-tokens model: no declared inputs, so nothing says how to call it."""

    def __init__(self) -> None:
        super().__init__(name="bag")
        self.embed = keras.layers.Embedding(EMBED_VOCAB, 8, name="embed")
        self.out = keras.layers.Dense(4, name="logits")

    def call(self, x):  # noqa: ANN001, ANN201
        return self.out(keras.ops.mean(self.embed(x), axis=1))


def subclassed_embedding() -> ModelSpec:
    """The bag-of-tokens classifier as a subclassed model (built by one call)."""

    def build() -> keras.Model:
        model = _Bag()
        model(np.zeros((1, 6), np.int32))
        return model

    spec = embedding()
    return ModelSpec(name="subclassed_embedding", build=build, load_data=spec.load_data)


def lambda_mlp() -> ModelSpec:
    """The tiny MLP with a ``Lambda`` layer: a .keras archive of it does not load in safe mode."""

    def build() -> keras.Model:
        inp = keras.Input((16,), name="features")
        x = keras.layers.Lambda(lambda t: t * 0.5, name="halve")(inp)
        h = keras.layers.Dense(32, activation="relu", name="hidden")(x)
        return keras.Model(inp, keras.layers.Dense(4, name="logits")(h), name="lambda_mlp")

    return ModelSpec(name="lambda_mlp", build=build, load_data=lambda _d: blobs(), batch_size=32)


def dynamic_tensor() -> ModelSpec:
    return embedding_form("tensor", dynamic=True)


def dynamic_dict() -> ModelSpec:
    return embedding_form("dict", dynamic=True)


def dynamic_wide() -> ModelSpec:
    """The dynamic table whose workers hold 100,000 rows: pushes of that many ids fit."""
    return embedding_form("tensor", dynamic=True, rows=100_000)


# -------------------------------------------------- multi-valued features (bags of ids)

BAG_ITEMS, BAG_USERS, BAG_TAGS, BAG_TAG_WIDTH = 60, 40, 30, 4
TAG_PAD = 0  # the tags' pad id: never a row, never sent to a server


def bag_data(n: int, seed: int) -> tuple[dict[str, Any], np.ndarray]:
    """Features of the ``bags`` model: a user and a candidate item (one id each), a history
    of 0 to 5 items (ragged; some empty), 1 to 4 tags padded with ``TAG_PAD``; the label is
    whether the candidate is in the history or shares the user's parity (a planted signal
    the shared item table and the history's mean can learn)."""
    rng = np.random.default_rng(seed)
    user = rng.integers(1, BAG_USERS, n)
    item = rng.integers(1, BAG_ITEMS, n)
    lengths = rng.integers(0, 6, n)
    history = [rng.integers(1, BAG_ITEMS, k) for k in lengths]
    for i in range(n):  # half the histories hold the candidate
        if rng.random() < 0.5 and lengths[i]:
            history[i][rng.integers(lengths[i])] = item[i]
    tags = np.full((n, BAG_TAG_WIDTH), TAG_PAD, np.int64)
    for i in range(n):
        k = rng.integers(1, BAG_TAG_WIDTH + 1)
        tags[i, :k] = rng.integers(1, BAG_TAGS, k)
    y = np.array([float(item[i] in history[i] or (user[i] + item[i]) % 2 == 0)
                  for i in range(n)], np.float32)  # fmt: skip
    features = {
        "user": hashed(user),
        "item": hashed(item),
        "history": tf.ragged.constant([hashed(h).tolist() for h in history], dtype=tf.int64),
        "tags": np.where(tags == TAG_PAD, TAG_PAD, hashed(tags)),
    }
    return features, y


def _bags_model() -> keras.Model:
    """A candidate item, the mean of a ragged history of items (one item table, shared by
    the two features), a user, and the sum of padded tags; a small head."""
    user = keras.Input((), dtype="int64", name="user")
    item = keras.Input((), dtype="int64", name="item")
    history = keras.Input((None,), dtype="int64", ragged=True, name="history")
    tags = keras.Input((BAG_TAG_WIDTH,), dtype="int64", name="tags")
    items = DynamicEmbedding(8, max_rows=DYNAMIC_ROWS, combiner="mean", name="items")
    u = DynamicEmbedding(8, max_rows=DYNAMIC_ROWS, name="users")(user)
    t = DynamicEmbedding(8, max_rows=DYNAMIC_ROWS, combiner="sum", pad_id=TAG_PAD, name="tag")(tags)
    i, h = items(item), items(history)
    x = keras.layers.Concatenate(name="join")(
        [keras.layers.Multiply()([u, i]), keras.layers.Multiply()([h, i]), t]
    )
    out = keras.layers.Dense(1, name="logit")(keras.layers.Dense(8, "relu", name="hidden")(x))
    return keras.Model({"user": user, "item": item, "history": history, "tags": tags}, out)


def bags() -> ModelSpec:
    """The multi-valued model (``_bags_model``) on ``bag_data``, scored by AUC."""
    from downpour.spec import auc, binary_logits_loss

    def input_fn(ctx: Any) -> tf.data.Dataset:
        features, y = bag_data(800, 5)
        return ctx.shard(tf.data.Dataset.from_tensor_slices((features, y))).batch(ctx.batch_size)

    def held_out_fn(ctx: Any) -> tf.data.Dataset:
        features, y = bag_data(200, 6)
        return tf.data.Dataset.from_tensor_slices((features, y)).batch(100)

    return ModelSpec(
        name="bags",
        build=_bags_model,
        input_fn=input_fn,
        held_out_fn=held_out_fn,
        batch_size=20,
        loss=binary_logits_loss,
        metric=auc,
        metric_name="auc",
        label_dtype="float32",
    )
