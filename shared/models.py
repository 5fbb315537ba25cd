"""The built-in models, named on the command line as ``--model downpour.models:<name>``.

``deep_mnist`` is the default model (``downpour.spec.DEFAULT_MODEL``): TensorFlow's
"Deep MNIST for experts" CNN as a Keras model, with the seed's own TF1 graph of it for
``--graph tf1``. Checkpoints record this reference, so it keeps its name.
"""

from __future__ import annotations

import keras

from downpour.inputs.data import load_mnist
from downpour.model.tf1 import deep_mnist_graph
from downpour.spec import ModelSpec


def _deep_mnist_model() -> keras.Model:
    layers = keras.layers
    inp = keras.Input((28, 28, 1), name="image")
    x = layers.Conv2D(32, 5, padding="same", activation="relu", name="conv1")(inp)
    x = layers.MaxPool2D(2, name="pool1")(x)
    x = layers.Conv2D(64, 5, padding="same", activation="relu", name="conv2")(x)
    x = layers.MaxPool2D(2, name="pool2")(x)
    x = layers.Flatten(name="flatten")(x)
    x = layers.Dense(1024, activation="relu", name="fc1")(x)
    x = layers.Dropout(0.5, name="dropout")(x)
    out = layers.Dense(10, name="logits")(x)
    return keras.Model(inp, out, name="deep_mnist")


def deep_mnist() -> ModelSpec:
    """TensorFlow's "Deep MNIST" CNN (3,274,634 parameters) on MNIST-5k or ``--data-dir``."""
    return ModelSpec(
        name="deep_mnist",
        build=_deep_mnist_model,
        load_data=load_mnist,
        tf1_graph=deep_mnist_graph,  # the seed's own graph, for --graph tf1
    )
