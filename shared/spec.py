"""What a model plugin hands to downpour: the :class:`ModelSpec`, and how one is loaded.

A model is a plugin named ``module:function``; the function takes no arguments and returns a
``ModelSpec``. Both services call it, so both build the same variables in the same order (the
fingerprint in ``downpour.models`` proves it at hello).

This module imports neither TensorFlow nor Keras: ``import downpour`` stays light, and a
plugin's own import of TensorFlow is the first one.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import keras
    import tensorflow as tf

    from downpour.data import Dataset
    from downpour.inputs import InputContext
    from downpour.models_tf1 import Tf1Graph

DEFAULT_MODEL = "downpour.models:deep_mnist"


def sparse_softmax_loss(labels: tf.Tensor, logits: tf.Tensor) -> tf.Tensor:
    """Mean sparse softmax cross-entropy on logits (the default loss)."""
    import tensorflow as tf

    return tf.reduce_mean(
        tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
    )


def accuracy(labels: np.ndarray, logits: np.ndarray) -> float:
    """Fraction of rows whose arg-max logit is the label (the default held-out metric)."""
    return float(np.mean(np.argmax(logits, axis=-1) == labels))


@dataclass
class ModelSpec:
    """Everything both services need to know about a model.

    ``build`` must return a fresh, built Keras model (variables created) and be deterministic
    in variable names and order. The data comes from ``input_fn(ctx)``, a ``tf.data.Dataset``
    of ``(features, labels)`` batches for one epoch of this worker's share
    (``downpour.inputs``), and the held-out set from ``held_out_fn(ctx)``; or, for data that
    fits in memory, from ``load_data(data_dir)``, a NumPy ``downpour.Dataset`` that downpour
    turns into both (``downpour.data.dataset_input_fn``), its labels cast to ``label_dtype``
    (a dtype name or a ``tf.DType``; an ``input_fn``'s labels keep their own dtype: the step
    takes the dataset's ``element_spec``). ``batch_size`` is ``ctx.batch_size``. With a
    held_out_fn or load_data, the held-out set is scored with ``metric``. ``tf1_graph`` is the
    same model as a ``tf.compat.v1`` graph (``downpour.models_tf1.Tf1Graph``), for workers run
    with ``--graph tf1``.
    """

    name: str
    build: Callable[[], keras.Model]
    load_data: Callable[[str | None], Dataset] | None = None
    loss: Callable[[tf.Tensor, tf.Tensor], tf.Tensor] = sparse_softmax_loss
    metric: Callable[[np.ndarray, np.ndarray], float] = accuracy
    batch_size: int = 50
    label_dtype: Any = "int64"
    tf1_graph: Callable[[], Tf1Graph] | None = None
    input_fn: Callable[[InputContext], tf.data.Dataset] | None = None
    held_out_fn: Callable[[InputContext], tf.data.Dataset] | None = None

    def __post_init__(self) -> None:
        if self.load_data is None and self.input_fn is None:
            raise ValueError(f"model {self.name!r}: give input_fn (tf.data) or load_data (NumPy)")


def load_spec(ref: str = DEFAULT_MODEL) -> ModelSpec:
    """Import ``module:function`` and call it; the result must be a ModelSpec."""
    module_name, sep, func_name = ref.partition(":")
    if not sep or not module_name or not func_name:
        raise ValueError(f"model must be 'module:function', got {ref!r}")
    func = getattr(importlib.import_module(module_name), func_name)
    spec = func()
    if not isinstance(spec, ModelSpec):
        raise TypeError(f"{ref} returned {type(spec).__name__}, not a ModelSpec")
    return spec
