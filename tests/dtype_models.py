"""Model plugins with trainable variables that are not float32, for tests/test_variable_dtypes.py.

Importable by spawned services through PYTHONPATH (the tests directory), like tiny_models.
"""

from __future__ import annotations

import keras
from tiny_models import blobs

from downpour import ModelSpec


class StepCounter(keras.layers.Layer):
    """Identity layer with an int64 non-trainable counter of training-mode forward passes."""

    def build(self, input_shape: tuple) -> None:
        self.count = self.add_weight(
            shape=(), dtype="int64", initializer="zeros", trainable=False, name="count"
        )

    def call(self, x, training=None):  # noqa: ANN001, ANN201
        if training:
            self.count.assign_add(1)
        return x


class IntParameter(keras.layers.Layer):
    """Identity layer with a *trainable* int32 variable: no gradient, so downpour refuses it."""

    def build(self, input_shape: tuple) -> None:
        self.offset = self.add_weight(
            shape=(), dtype="int32", initializer="zeros", trainable=True, name="offset"
        )

    def call(self, x):  # noqa: ANN001, ANN201
        return x


class TwinWeights(keras.layers.Layer):
    """Scales by two trainable vectors that were given the same name, hence the same path."""

    def build(self, input_shape: tuple) -> None:
        self.a = self.add_weight(shape=(input_shape[-1],), initializer="ones", name="scale")
        self.b = self.add_weight(shape=(input_shape[-1],), initializer="ones", name="scale")

    def call(self, x):  # noqa: ANN001, ANN201
        return x * self.a * self.b


def _spec(name: str, build) -> ModelSpec:  # noqa: ANN001
    return ModelSpec(name=name, build=build, load_data=lambda _d: blobs(), batch_size=32)


def mixed() -> ModelSpec:
    """float16, float64 and float32 trainable variables, and an int64 non-trainable one."""

    def build() -> keras.Model:
        inp = keras.Input((16,), name="features")
        h = StepCounter(name="steps")(inp)
        h = keras.layers.Dense(32, activation="relu", name="half", dtype="float16")(h)
        h = keras.layers.Dense(16, activation="relu", name="double", dtype="float64")(h)
        out = keras.layers.Dense(4, name="logits")(h)  # float32
        return keras.Model(inp, out, name="mixed")

    return _spec("mixed", build)


def bfloat16() -> ModelSpec:
    """A bfloat16 hidden layer: its variables cannot travel, refused at build."""

    def build() -> keras.Model:
        inp = keras.Input((16,), name="features")
        h = keras.layers.Dense(32, activation="relu", name="brain", dtype="bfloat16")(inp)
        out = keras.layers.Dense(4, name="logits")(h)
        return keras.Model(inp, out, name="bf16")

    return _spec("bf16", build)


def int_trainable() -> ModelSpec:
    """A trainable int32 variable: refused at build."""

    def build() -> keras.Model:
        inp = keras.Input((16,), name="features")
        h = IntParameter(name="shift")(inp)
        out = keras.layers.Dense(4, name="logits")(h)
        return keras.Model(inp, out, name="int_trainable")

    return _spec("int_trainable", build)


def twin_paths() -> ModelSpec:
    """Two trainable variables with one path: refused at build."""

    def build() -> keras.Model:
        inp = keras.Input((16,), name="features")
        h = TwinWeights(name="twin")(inp)
        out = keras.layers.Dense(4, name="logits")(h)
        return keras.Model(inp, out, name="twin_paths")

    return _spec("twin_paths", build)
