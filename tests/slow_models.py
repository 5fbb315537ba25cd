"""Test models whose training step takes a while: the tiny MLP with a layer that sleeps
inside ``tf.py_function`` on every forward pass, standing in for a long local computation
(a big batch, a slow accelerator). Importable by spawned services through PYTHONPATH."""

from __future__ import annotations

import time

import keras
import tensorflow as tf
from tiny_models import blobs

from downpour import ModelSpec

STEP_S = 0.3  # seconds one forward pass takes


class Slow(keras.layers.Layer):
    """Identity whose forward pass takes ``seconds`` (STEP_S) of host time (GIL released)."""

    def __init__(self, seconds: float = STEP_S, **kwargs) -> None:  # noqa: ANN003
        super().__init__(**kwargs)
        self.seconds = seconds

    def call(self, x):  # noqa: ANN001, ANN201
        def wait(v):  # noqa: ANN001, ANN202
            time.sleep(self.seconds)  # the computation this layer stands for
            return v

        y = tf.py_function(wait, [x], x.dtype)
        y.set_shape(x.shape)
        return y


def slow() -> ModelSpec:
    """A 16-32-4 MLP on blobs whose every step takes at least STEP_S seconds."""

    def build() -> keras.Model:
        inp = keras.Input((16,), name="features")
        h = Slow(name="slow")(inp)
        h = keras.layers.Dense(32, activation="relu", name="hidden")(h)
        out = keras.layers.Dense(4, name="logits")(h)
        return keras.Model(inp, out, name="slow")

    return ModelSpec(name="slow", build=build, load_data=lambda _d: blobs(), batch_size=32)


PACED_STEP_S = 0.05  # a step long enough that a pull of the tiny weights fits in a fraction


def paced() -> ModelSpec:
    """The slow MLP with PACED_STEP_S per forward pass: a step of a known, steady length, so
    when the worker's fetch schedule requests a pull (one step ahead) does not hang on the
    machine's noise."""

    def build() -> keras.Model:
        inp = keras.Input((16,), name="features")
        h = Slow(PACED_STEP_S, name="slow")(inp)
        h = keras.layers.Dense(32, activation="relu", name="hidden")(h)
        out = keras.layers.Dense(4, name="logits")(h)
        return keras.Model(inp, out, name="paced")

    return ModelSpec(name="paced", build=build, load_data=lambda _d: blobs(), batch_size=32)
