"""Bring your own model: a worked example on a problem other than MNIST.

The UCI wine data (178 wines from three cultivars, 13 chemical measurements each, shipped by
``mlxtend``: nothing is downloaded) and a small Keras *functional* model. Train it with::

    downpour server --model downpour.examples.wine:spec --lr 1e-2 --state-dir state
    downpour worker --model downpour.examples.wine:spec --server 127.0.0.1:5570 --steps 400

A plugin is a function that returns a ``ModelSpec``; the server and every worker call it, so
everything it builds must come out the same in every process:

- ``build`` makes a fresh model with deterministic layer names (variable paths such as
  ``hidden1/kernel`` name the tensors on the wire and in checkpoints). ``build_model`` seeds
  the initialisers, so do not seed anything yourself.
- ``load_data`` returns a ``downpour.inputs.data.Dataset``: float32 features, int64 labels, a fixed
  train / held-out split (the server scores the held-out part with ``--eval-every``).
- Standardising the features is part of the model: a ``Normalization`` layer given the
  training split's mean and variance holds them as constants, not variables, so the
  fingerprint and the variables sent are only the Dense layers', and an exported model takes
  raw measurements. (``Normalization.adapt()`` or ``BatchNormalization`` would keep state in
  non-trainable variables, which downpour does not synchronise between processes.)
"""

from __future__ import annotations

import functools

import keras
import numpy as np

from downpour import ModelSpec
from downpour.inputs.data import Dataset

SEED = 20_240
N_TRAIN = 134  # of 178; 44 held out
N_FEATURES = 13
N_CLASSES = 3


@functools.cache
def _wine() -> Dataset:
    from mlxtend.data import wine_data

    x, y = wine_data()
    order = np.random.default_rng(SEED).permutation(len(x))  # the file is sorted by class
    x, y = x[order].astype(np.float32), y[order].astype(np.int64)
    return Dataset(x[:N_TRAIN], y[:N_TRAIN], x[N_TRAIN:], y[N_TRAIN:])


def load_wine(data_dir: str | None = None) -> Dataset:
    """The wine data, shuffled with a fixed seed and split 134 / 44 (raw measurements)."""
    if data_dir:
        raise ValueError("the wine example uses the data mlxtend ships: drop --data-dir")
    return _wine()


def build() -> keras.Model:
    """Standardise (constants from the training split), two hidden layers, 3 logits."""
    train = _wine().x_train.astype(np.float64)
    inp = keras.Input((N_FEATURES,), name="measurements")
    x = keras.layers.Normalization(
        mean=train.mean(axis=0).astype(np.float32),
        variance=train.var(axis=0).astype(np.float32),
        name="standardize",
    )(inp)
    x = keras.layers.Dense(32, activation="relu", name="hidden1")(x)
    x = keras.layers.Dense(16, activation="relu", name="hidden2")(x)
    out = keras.layers.Dense(N_CLASSES, name="logits")(x)  # logits: the default loss's input
    return keras.Model(inp, out, name="wine")


def spec() -> ModelSpec:
    """The plugin: ``--model downpour.examples.wine:spec``."""
    return ModelSpec(name="wine", build=build, load_data=load_wine, batch_size=16)
