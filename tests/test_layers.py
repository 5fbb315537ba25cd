"""``downpour.layers.DynamicEmbedding``: ids of any value, rows created on first touch."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from downpour.layers import DynamicEmbedding, string_ids
from downpour.model import initial

HUGE = np.array([-(2**63), 2**63 - 1, 0, -1, 123456789012345, -987654321098], np.int64)


def _model(capacity: int = 64, dim: int = 4, seed: int = 0) -> keras.Model:
    ids = keras.Input((3,), dtype="int64", name="ids")
    e = DynamicEmbedding(dim, capacity=capacity, seed=seed, name="items")(ids)
    out = keras.layers.Dense(1, activation="sigmoid", name="head")(keras.layers.Flatten()(e))
    return keras.Model(ids, out)


def _rows(layer: DynamicEmbedding, ids: np.ndarray) -> np.ndarray:
    return layer(tf.constant(ids[None, :])).numpy()[0]


def test_an_ids_initial_row_depends_on_seed_layer_and_id_only() -> None:
    a = DynamicEmbedding(5, capacity=32, seed=3, name="t")
    b = DynamicEmbedding(5, capacity=32, seed=3, name="t")
    first = _rows(a, HUGE)
    _rows(b, np.array([7, 8, 9], np.int64))  # other ids first: other rows taken
    second = _rows(b, HUGE[::-1])[::-1]
    np.testing.assert_array_equal(first, second)
    expected = initial.initial_rows(a.rule, 3, "t", HUGE, 5)
    np.testing.assert_array_equal(first, expected)
    assert not np.array_equal(first, _rows(DynamicEmbedding(5, 32, seed=4, name="t"), HUGE))
    assert len({r.tobytes() for r in first}) == len(HUGE)  # each id its own row
    assert np.all(np.abs(first) <= 0.05)  # Keras's "uniform": RandomUniform(-0.05, 0.05)


def test_the_gradient_touches_the_batchs_rows_only() -> None:
    layer = DynamicEmbedding(4, capacity=16, name="g")
    ids = tf.constant([[5, 6, 5]], tf.int64)
    layer(ids)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(layer(ids))
    (grad,) = tape.gradient(loss, [layer.embeddings.value])
    assert isinstance(grad, tf.IndexedSlices)
    assert sorted(set(grad.indices.numpy().tolist())) == [0, 1]


def test_strings_hash_to_stable_ids() -> None:
    ids = string_ids(tf.constant([["downpour", "ps"], ["downpour", ""]])).numpy()
    assert ids.shape == (2, 2) and ids.dtype == np.int64
    assert ids[0, 0] == ids[1, 0] and len({ids[0, 0], ids[0, 1], ids[1, 1]}) == 3
    fp = tf.fingerprint(tf.constant(["downpour"])).numpy()[0].tobytes()  # FarmHash64 bytes
    assert ids[0, 0] == np.frombuffer(fp, "<i8")[0]
    layer = DynamicEmbedding(3, capacity=8, name="s")
    by_string = layer(tf.constant(["downpour"])).numpy()[0]
    np.testing.assert_array_equal(by_string, layer(tf.constant([ids[0, 0]])).numpy()[0])


def test_a_model_with_hashed_ids_trains_in_one_process() -> None:
    rng = np.random.default_rng(0)
    vocab = rng.integers(-(2**62), 2**62, 40, dtype=np.int64)  # 64-bit hashes
    good = set(vocab[:20].tolist())
    x = rng.choice(vocab, (2000, 3))
    y = np.array([[float(sum(v in good for v in row) >= 2)] for row in x], np.float32)
    model = _model(capacity=64)
    model.compile(optimizer=keras.optimizers.Adam(0.05), loss="binary_crossentropy",
                  metrics=["accuracy"])  # fmt: skip
    hist = model.fit(x, y, epochs=8, batch_size=50, verbose=0)
    assert hist.history["accuracy"][-1] > 0.95
    layer = model.get_layer("items")
    assert int(layer.rows_used.numpy()) == 40


def test_more_ids_than_capacity_fail_naming_the_layer() -> None:
    layer = DynamicEmbedding(2, capacity=4, name="small")
    layer(tf.constant([1, 2, 3], tf.int64))
    with pytest.raises(tf.errors.InvalidArgumentError, match="'small' holds at most 4 ids"):
        layer(tf.constant([4, 5], tf.int64))


def test_an_initialiser_drawn_whole_is_refused() -> None:
    with pytest.raises(ValueError, match="draws a whole table at once"):
        DynamicEmbedding(4, embeddings_initializer="orthogonal")
