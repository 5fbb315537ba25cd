"""Row-wise optimizer updates for row-sparse tables: only the rows a gradient touches change.

A row-sparse table's gradient arrives as (unique rows, their values). Keras's optimizers
take it as ``tf.IndexedSlices`` and write only those rows of the variable and its slots
(``scatter_*``), but Adagrad and Adam still compute over the whole table on every apply
(Adagrad takes the square root of the whole accumulator; Adam's step reads every row of its
moments), so an apply costs O(table). Here the touched rows of the variable and its slots
are gathered, updated and scattered back: O(rows) work.

- ``sgd`` (no momentum): Keras's own update is already a row scatter; it is kept.
- ``adagrad``: the same arithmetic as Keras's, on the touched rows.
- ``lazy_adam``: Adam whose moments and rows change only where touched (TF1's
  ``LazyAdamOptimizer``, TensorFlow Addons' ``LazyAdam``): a row that no batch touches keeps
  its moments and stops moving. Keras's ``adam`` decays every row's moments each step and
  keeps moving a row as long as its first moment is not zero, at O(table) per apply.

The slots are the Keras optimizer's own (built on every variable, checkpointed as usual):
``lazy_adam`` runs a Keras ``Adam`` for the dense variables and uses its ``m`` and ``v``.
"""

from __future__ import annotations

import keras
import tensorflow as tf

ROW_WISE = frozenset({"adagrad", "lazy_adam"})  # optimizers whose tables update here


class _Fill(keras.initializers.Initializer):
    """A constant as one ``tf.fill``: one buffer, which the new variable takes over (Keras's
    ``Constant`` multiplies a tensor of ones, two buffers the size of the slot)."""

    def __init__(self, value: float) -> None:
        self.value = value

    def __call__(self, shape: tuple[int, ...], dtype: str | None = None) -> tf.Tensor:
        return tf.fill(shape, tf.constant(self.value, tf.as_dtype(dtype or "float32")))


class Adagrad(keras.optimizers.Adagrad):
    """Keras's Adagrad, whose accumulators are built at the size of the variable once: a
    shard's peak memory while it starts is its variables and slots, not one slot more."""

    def build(self, var_list: list[keras.Variable]) -> None:
        if self.built:
            return
        super(keras.optimizers.Adagrad, self).build(var_list)
        self._accumulators = self.add_optimizer_variables(
            var_list, "accumulator", initializer=_Fill(self.initial_accumulator_value)
        )


OPTIMIZERS = {  # --optimizer: the Keras optimizer behind each (lazy_adam's dense part is Adam)
    "adam": keras.optimizers.Adam,
    "adagrad": Adagrad,
    "sgd": keras.optimizers.SGD,
    "lazy_adam": keras.optimizers.Adam,
}


def make_optimizer(name: str, learning_rate: float) -> keras.optimizers.Optimizer:
    """The Keras optimizer behind ``--optimizer name`` (``lazy_adam``: an Adam, whose slots
    the row-wise update shares)."""
    try:
        cls = OPTIMIZERS[name]
    except KeyError:
        raise ValueError(f"optimizer must be one of {sorted(OPTIMIZERS)}, got {name!r}") from None
    return cls(learning_rate=learning_rate)


def _rows(var: keras.Variable) -> tf.Variable:
    return var.value if isinstance(var, keras.Variable) else var


def row_update(
    kind: str,
    optimizer: keras.optimizers.Optimizer,
    var: keras.Variable,
    rows: tf.Tensor,
    grad: tf.Tensor,
    lr: tf.Tensor,
) -> None:
    """Update rows ``rows`` (unique int64) of ``var`` and of its slots in ``optimizer`` by
    the gradient rows ``grad``, at learning rate ``lr``, as optimizer ``kind`` (one of
    ROW_WISE). Call it in the apply step before the optimizer's ``apply_gradients`` for the
    other variables (that increments ``iterations``, which Adam's step number reads)."""
    i = optimizer._get_variable_index(var)  # Keras's slot lists are indexed this way
    v = _rows(var)
    grad = tf.cast(grad, v.dtype)
    lr = tf.cast(lr, v.dtype)
    if kind == "adagrad":
        acc = _rows(optimizer._accumulators[i])
        acc_rows = tf.gather(acc, rows) + tf.square(grad)
        acc.scatter_update(tf.IndexedSlices(acc_rows, rows))
        step = lr * grad / tf.sqrt(acc_rows + tf.cast(optimizer.epsilon, v.dtype))
        v.scatter_sub(tf.IndexedSlices(step, rows))
        return
    if kind == "lazy_adam":
        m, s = _rows(optimizer._momentums[i]), _rows(optimizer._velocities[i])
        b1 = tf.cast(optimizer.beta_1, v.dtype)
        b2 = tf.cast(optimizer.beta_2, v.dtype)
        t = tf.cast(optimizer.iterations + 1, v.dtype)
        alpha = lr * tf.sqrt(1 - tf.pow(b2, t)) / (1 - tf.pow(b1, t))
        m_rows = b1 * tf.gather(m, rows) + (1 - b1) * grad
        s_rows = b2 * tf.gather(s, rows) + (1 - b2) * tf.square(grad)
        m.scatter_update(tf.IndexedSlices(m_rows, rows))
        s.scatter_update(tf.IndexedSlices(s_rows, rows))
        eps = tf.cast(optimizer.epsilon, v.dtype)
        v.scatter_sub(tf.IndexedSlices(alpha * m_rows / (tf.sqrt(s_rows) + eps), rows))
        return
    raise ValueError(f"no row-wise update for optimizer {kind!r}")
