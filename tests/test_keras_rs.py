"""A model written for keras-rs trains through downpour with one layer swapped: keras-rs's
own ``TableConfig`` / ``FeatureConfig`` declare downpour's tables (a table shared by two
features), and its held-out AUC through a server and a worker is within 0.01 of keras-rs's
``DistributedEmbedding`` trained in one process on the same data."""

from __future__ import annotations

import logging

import keras
import keras_rs
import krs_models
import numpy as np
import pytest
import tensorflow as tf
from inproc import serving, train

from downpour.layers import DistributedEmbedding, DynamicEmbedding
from downpour.model.build import build_model
from downpour.serving.scoring import Evaluator
from downpour.spec import auc

EPOCHS = 2


def test_keras_rs_configs_declare_downpours_tables_one_per_shared_table() -> None:
    model = build_model(krs_models.spec())
    layer = model.get_layer("embedding")
    assert isinstance(layer, DistributedEmbedding)
    assert sorted(layer.tables) == ["items", "users"]  # history and item share one table
    items = layer.tables["items"]
    assert isinstance(items, DynamicEmbedding) and items.max_rows == krs_models.ITEMS
    assert (items.dim, items.combiner) == (krs_models.DIM, "mean")
    x, _ = krs_models.data(3, 0)
    out = model({k: tf.constant(v) for k, v in x.items()})
    assert out.shape == (3, 1)


@pytest.mark.parametrize(
    ("optimizer", "warned"),
    [("adam", False), (None, False), ("sgd", True), (keras.optimizers.Adagrad(), True)],
)
def test_a_table_naming_another_optimizer_is_said_at_warning_level(
    optimizer: object, warned: bool, caplog: pytest.LogCaptureFixture
) -> None:
    table = keras_rs.layers.TableConfig(
        name="t", vocabulary_size=10, embedding_dim=2, optimizer=optimizer
    )
    feature = keras_rs.layers.FeatureConfig("f", table, (None,), (None, 2))
    with caplog.at_level(logging.WARNING, logger="downpour"):
        DistributedEmbedding({"f": feature})
    said = [r for r in caplog.records if "declares optimizer" in r.getMessage()]
    assert len(said) == int(warned)
    if warned:
        assert said[0].levelno == logging.WARNING and "'t'" in said[0].getMessage()


def _one_process_auc() -> float:
    """keras-rs's own layer, in one process (Adam, the same batches and epochs)."""
    keras.utils.set_random_seed(0)
    model = krs_models.build(keras_rs.layers.DistributedEmbedding)
    model.compile(keras.optimizers.Adam(0.01), keras.losses.BinaryCrossentropy(from_logits=True))
    x, y = krs_models.data(krs_models.TRAIN, 1)
    model.fit(x, y, batch_size=64, epochs=EPOCHS, verbose=0, shuffle=True)
    hx, hy = krs_models.data(krs_models.HELD_OUT, 2)
    return auc(hy, np.asarray(model.predict(hx, batch_size=500, verbose=0)))


def test_the_keras_rs_model_trains_through_downpour_as_it_does_in_one_process() -> None:
    with serving("krs_models:spec", optimizer="adam", learning_rate=0.01) as server:
        train(server.port, "krs_models:spec", epochs=EPOCHS, n_fetch=1)
        _, downpour_auc = Evaluator("krs_models:spec", None).score_at([server.rep], None, "test")
    one = _one_process_auc()
    print(f"held-out AUC: keras-rs one process {one:.4f}, downpour {downpour_auc:.4f}")
    assert one > 0.7  # the planted signal is learnt
    assert abs(downpour_auc - one) <= 0.01
