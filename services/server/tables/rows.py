"""The Keras side of the row-wise optimizers: the server's Keras optimizers, and the adapter
that runs ``optim``'s rules on a fixed table's rows inside the server's compiled apply.

A row-sparse table's gradient arrives as (unique rows, their values). Keras's optimizers
take it as ``tf.IndexedSlices`` and write only those rows of the variable and its slots
(``scatter_*``), but Adagrad and Adam still compute over the whole table on every apply
(Adagrad takes the square root of the whole accumulator; Adam's step reads every row of its
moments), so an apply costs O(table). ``row_update`` instead gathers the touched rows of the
slots (and of the variable, for a rule that reads them), runs the kind's rule
(``downpour.server.tables.optim``) with TensorFlow's math and scatters the results back:
O(rows) work. ``sgd`` (no momentum) is left to Keras: its own update is already one row
scatter.

The slots are the Keras optimizer's own (built on every variable, checkpointed as usual):
``lazy_adam`` runs a Keras ``Adam`` for the dense variables and uses its ``m`` and ``v``.
The hyperparameters are the Keras optimizer's attributes, read where the step is traced (a
variable, such as the ``beta_1`` the momentum-aware policy sets, is read on every apply);
``row_optimizer`` takes their values for a dynamic table, so both kinds of table train with
the one optimizer the server built. ``KERAS_SLOTS`` and ``keras_slot`` are the only code
that knows how Keras keeps its slots.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from downpour.server.tables.optim import KINDS, Math, RowOptimizer

ROW_WISE = frozenset({"adagrad", "lazy_adam"})  # optimizers whose fixed tables update here
TENSORFLOW = Math(tf.sqrt, tf.square, tf.pow, tf.clip_by_value)  # optim's rules on tensors
KERAS_SLOTS = {  # optim's slot name -> the Keras optimizer's list of that slot, by variable
    "accumulator": "_accumulators",
    "m": "_momentums",
    "v": "_velocities",
}


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


def _hyper(kind: str, optimizer: keras.optimizers.Optimizer) -> dict[str, Any]:
    """Row-wise optimizer ``kind``'s hyperparameters as ``optimizer``'s attributes (floats,
    or variables)."""
    return {name: getattr(optimizer, name) for name in KINDS[kind].hyper}


def row_optimizer(kind: str, optimizer: keras.optimizers.Optimizer) -> RowOptimizer:
    """Row-wise optimizer ``kind`` with ``optimizer``'s hyperparameter values now (what a
    dynamic table applies)."""
    return RowOptimizer(kind, {k: float(v) for k, v in _hyper(kind, optimizer).items()})


def _rows(var: keras.Variable) -> tf.Variable:
    return var.value if isinstance(var, keras.Variable) else var


def keras_slot(optimizer: keras.optimizers.Optimizer, slot: str, var: keras.Variable) -> Any:
    """``optimizer``'s slot ``slot`` (optim's name) of ``var``, as a ``tf.Variable``."""
    return _rows(getattr(optimizer, KERAS_SLOTS[slot])[optimizer._get_variable_index(var)])


def row_update(
    kind: str,
    optimizer: keras.optimizers.Optimizer,
    var: keras.Variable,
    rows: tf.Tensor,
    grad: tf.Tensor,
    lr: tf.Tensor,
) -> None:
    """Update rows ``rows`` (unique int64) of ``var`` and of its slots in ``optimizer`` by
    the gradient rows ``grad``, at learning rate ``lr``, as row-wise optimizer ``kind`` with
    ``optimizer``'s hyperparameters. Call it in the apply step before the optimizer's
    ``apply_gradients`` for the other variables (that increments ``iterations``, which Adam's
    step number reads)."""
    entry = KINDS[kind]
    v = _rows(var)
    dtype = v.dtype
    slots = {s: keras_slot(optimizer, s, var) for s in entry.slots}
    h = {k: tf.cast(x, dtype) for k, x in _hyper(kind, optimizer).items()}
    t = tf.cast(optimizer.iterations + 1, dtype) if entry.reads_step else None
    old = tf.gather(v, rows) if entry.reads_rows else None
    gathered = {s: tf.gather(x, rows) for s, x in slots.items()}
    out = entry.rule(TENSORFLOW, h, old, gathered, tf.cast(grad, dtype), tf.cast(lr, dtype), t)
    for s, x in slots.items():
        x.scatter_update(tf.IndexedSlices(out.slots[s], rows))
    if out.new is None:
        v.scatter_sub(tf.IndexedSlices(out.sub, rows))
    else:
        v.scatter_update(tf.IndexedSlices(out.new, rows))
