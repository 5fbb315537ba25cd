"""What a model plugin hands to downpour: the :class:`ModelSpec`, and how one is loaded.

A model is a plugin named ``module:function``; the function takes no arguments and returns a
``ModelSpec``. Both services call it, so both build the same variables in the same order (the
fingerprint in ``downpour.model.build`` proves it at hello).

This module imports neither TensorFlow nor Keras: ``import downpour`` stays light, and a
plugin's own import of TensorFlow is the first one.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import keras
    import tensorflow as tf

    from downpour.inputs.context import InputContext
    from downpour.inputs.data import Dataset
    from downpour.model.tf1 import Tf1Graph

DEFAULT_MODEL = "downpour.models:deep_mnist"
METRIC_NAME = re.compile(r"[a-z][a-z0-9_]{0,31}")
# Keys of a held-out evaluation result beside the metric's own
# (downpour.server.observers.evaluation)
EVAL_KEYS = frozenset({"metric", "version", "time", "seconds", "count", "every", "examples"})


def sparse_softmax_loss(labels: tf.Tensor, logits: tf.Tensor) -> tf.Tensor:
    """Mean sparse softmax cross-entropy on logits (the default loss)."""
    import tensorflow as tf

    return tf.reduce_mean(
        tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
    )


def accuracy(labels: np.ndarray, logits: np.ndarray) -> float:
    """Fraction of rows whose arg-max logit is the label (the default held-out metric)."""
    return float(np.mean(np.argmax(logits, axis=-1) == labels))


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Exact ROC AUC of binary ``labels`` (1 = positive) ranked by ``scores`` (logits or
    probabilities, any monotone score): the Mann-Whitney U statistic over all positive /
    negative pairs, ties counted as half. Both are flattened; a model's ``(N, 1)`` logits
    and ``(N,)`` labels fit. ValueError when either class is missing (AUC is undefined)."""
    y = np.asarray(labels).reshape(-1)
    s = np.asarray(scores, dtype=np.float64).reshape(-1)
    if len(y) != len(s):
        raise ValueError(f"auc: {len(y)} labels for {len(s)} scores")
    positive = y > 0.5
    n_pos = int(positive.sum())
    n_neg = len(y) - n_pos
    if n_pos == 0 or n_neg == 0:
        raise ValueError(f"auc needs both classes: {n_pos} positive, {n_neg} negative")
    _, inverse, counts = np.unique(s, return_inverse=True, return_counts=True)
    ends = np.cumsum(counts)
    ranks = (ends - (counts - 1) / 2.0)[inverse]  # 1-based ranks, ties get their mean rank
    u = ranks[positive].sum() - n_pos * (n_pos + 1) / 2.0
    return float(u / (n_pos * n_neg))


def binary_logits_loss(labels: tf.Tensor, logits: tf.Tensor) -> tf.Tensor:
    """Mean sigmoid cross-entropy of 0/1 ``labels`` and logits of the same number of
    elements (``(N,)`` labels with ``(N, 1)`` logits fit)."""
    import tensorflow as tf

    logits = tf.reshape(logits, [-1])
    labels = tf.cast(tf.reshape(labels, [-1]), logits.dtype)
    return tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=labels, logits=logits))


@dataclass
class ModelSpec:
    """Everything both services need to know about a model.

    ``build`` must return a fresh, built Keras model (variables created) and be deterministic
    in variable names and order. The data comes from ``input_fn(ctx)``, a ``tf.data.Dataset``
    of ``(features, labels)`` batches for one epoch of this worker's share
    (``downpour.inputs.context``), and the held-out set from ``held_out_fn(ctx)``; or, for data that
    fits in memory, from ``load_data(data_dir)``, a NumPy ``downpour.Dataset`` that downpour
    turns into both (``downpour.inputs.data.dataset_input_fn``), its labels cast to ``label_dtype``
    (a dtype name or a ``tf.DType``; an ``input_fn``'s labels keep their own dtype: the step
    takes the dataset's ``element_spec``). ``batch_size`` is ``ctx.batch_size``. With a
    held_out_fn or load_data, the held-out set is scored with ``metric`` (``labels, outputs ->
    float``), reported as ``metric_name`` (``accuracy`` by default; ``auc`` with
    ``downpour.spec.auc``) by the server's evaluation, run-local and export. ``tf1_graph`` is the
    same model as a ``tf.compat.v1`` graph (``downpour.model.tf1.Tf1Graph``), for workers run
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
    metric_name: str = "accuracy"

    def __post_init__(self) -> None:
        if not METRIC_NAME.fullmatch(self.metric_name) or self.metric_name in EVAL_KEYS:
            raise ValueError(
                f"model {self.name!r}: metric_name must match {METRIC_NAME.pattern} (it names "
                f"a status key, a log line and a summary tag) and be none of {sorted(EVAL_KEYS)}, "
                f"got {self.metric_name!r}"
            )
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
