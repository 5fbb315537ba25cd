"""``downpour.layers.DynamicEmbedding``: ids of any value, rows created on first touch, within
a row budget: past it the layer evicts and falls back exactly as a server's table does."""

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
    e = DynamicEmbedding(dim, max_rows=capacity, seed=seed, name="items")(ids)
    out = keras.layers.Dense(1, activation="sigmoid", name="head")(keras.layers.Flatten()(e))
    return keras.Model(ids, out)


def _rows(layer: DynamicEmbedding, ids: np.ndarray) -> np.ndarray:
    return layer(tf.constant(ids[None, :])).numpy()[0]


def test_an_ids_initial_row_depends_on_seed_layer_and_id_only() -> None:
    a = DynamicEmbedding(5, max_rows=32, seed=3, name="t")
    b = DynamicEmbedding(5, max_rows=32, seed=3, name="t")
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
    layer = DynamicEmbedding(4, max_rows=16, name="g")
    ids = tf.constant([[5, 6, 5]], tf.int64)
    layer(ids)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(layer(ids, training=True))
    (grad,) = tape.gradient(loss, [layer.embeddings.value])
    assert isinstance(grad, tf.IndexedSlices)
    assert sorted(set(grad.indices.numpy().tolist())) == [0, 1]


def test_strings_hash_to_stable_ids() -> None:
    ids = string_ids(tf.constant([["downpour", "ps"], ["downpour", ""]])).numpy()
    assert ids.shape == (2, 2) and ids.dtype == np.int64
    assert ids[0, 0] == ids[1, 0] and len({ids[0, 0], ids[0, 1], ids[1, 1]}) == 3
    fp = tf.fingerprint(tf.constant(["downpour"])).numpy()[0].tobytes()  # FarmHash64 bytes
    assert ids[0, 0] == np.frombuffer(fp, "<i8")[0]
    layer = DynamicEmbedding(3, max_rows=8, name="s")
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
    assert len(layer._map) == 40


def test_a_read_outside_training_creates_no_row() -> None:
    layer = DynamicEmbedding(3, max_rows=8, name="r")
    _rows(layer, HUGE)
    assert len(layer._map) == 0
    layer(tf.constant(HUGE[:2]), training=True)
    assert len(layer._map) == 2


def test_past_its_budget_the_layer_evicts_and_falls_back_as_a_servers_table_does() -> None:
    """One process, more ids than rows: no failure. The layer holds exactly its own rows,
    the others read and train their fallback rows, and which ids hold rows is what a
    server's DynamicTable of the same policy decides for the same steps."""
    from downpour.server.tables.table import DynamicTable

    rng = np.random.default_rng(1)
    layer = DynamicEmbedding(2, max_rows=12, fallback_rows=4, name="budget", seed=2)
    table = DynamicTable("budget", 2, policy=layer.policy, seed=2, rule=layer.rule)
    zipf = rng.zipf(1.3, (30, 16)) % 50
    for step, batch in enumerate(zipf, start=1):
        ids, counts = np.unique(batch.astype(np.int64), return_counts=True)
        layer(tf.constant(batch, tf.int64), training=True)
        table.apply(ids, np.zeros((ids.size, 2), np.float32), 0.0, step, lookups=counts)
        assert len(layer._map) <= layer.own == 8
    assert sorted(layer._map.live()[0].tolist()) == sorted(table.map.live()[0].tolist())
    assert layer._map.counters == table.map.counters
    outside = np.setdiff1d(np.arange(50), layer._map.live()[0])
    fb = layer._map.fallback_of(outside)
    got = _rows(layer, outside)  # a read: the fallback rows, as the server's gather gives
    np.testing.assert_allclose(got, layer.embeddings.numpy()[layer.own + fb])
    np.testing.assert_allclose(got, table.gather(outside))


def test_a_refused_id_trains_its_fallback_row() -> None:
    layer = DynamicEmbedding(2, max_rows=3, fallback_rows=1, admit_after=5, name="fb")
    ids = tf.constant([7, 8], tf.int64)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(layer(ids, training=True))
    (grad,) = tape.gradient(loss, [layer.embeddings.value])
    assert len(layer._map) == 0  # seen once, admitted after five
    assert grad.indices.numpy().tolist() == [2, 2]  # both ids: the one fallback row (own 2)


def test_the_old_capacity_argument_is_refused_naming_its_successor() -> None:
    with pytest.raises(TypeError, match="takes max_rows"):
        DynamicEmbedding(4, capacity=16)


def test_a_table_without_a_budget_trains_only_on_the_servers() -> None:
    layer = DynamicEmbedding(2, max_rows=None, name="open")
    _rows(layer, HUGE)  # a read (a copy of the servers' model) is fine
    with pytest.raises(ValueError, match="no row budget"):
        layer(tf.constant(HUGE), training=True)


def test_an_initialiser_drawn_whole_is_refused() -> None:
    with pytest.raises(ValueError, match="draws a whole table at once"):
        DynamicEmbedding(4, embeddings_initializer="orthogonal")
