"""The row-wise optimizers' one rule per kind (``downpour.server.tables.optim``): Keras's own
arithmetic on the touched rows, with the Keras optimizer's hyperparameters, through both of
its paths (NumPy, a dynamic table's; TensorFlow on a Keras variable, a fixed table's), and
the fixed and dynamic tables of one server training a row alike."""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

from downpour.server.state import ParameterState
from downpour.server.tables import optim, rows
from downpour.server.tables.optim import (
    KINDS,
    Hyper,
    Kind,
    Math,
    RowOptimizer,
    RowStep,
    Slots,
    update_rows,
)
from downpour.server.tables.rows import OPTIMIZERS, keras_slot, row_optimizer, row_update
from downpour.server.tables.table import COUNTERS, DynamicTable
from downpour.spec import load_spec
from downpour.wire import Sparse

SHAPE = (12, 4)
TOUCHED = np.array([1, 5, 8], np.int64)
LR = 0.1
KERAS = {  # kind -> the Keras optimizer it is checked against, hyperparameters not the defaults
    "sgd": lambda: keras.optimizers.SGD(LR),
    "adagrad": lambda: rows.Adagrad(LR, initial_accumulator_value=0.25, epsilon=1e-4),
    "lazy_adam": lambda: keras.optimizers.Adam(LR, beta_1=0.8, beta_2=0.99, epsilon=1e-5),
}


def _variable(seed: int = 0) -> keras.Variable:
    rng = np.random.default_rng(seed)
    return keras.Variable(rng.standard_normal(SHAPE).astype(np.float32), name="t")


def _grads(steps: int) -> list[np.ndarray]:
    rng = np.random.default_rng(1)
    return [rng.standard_normal((TOUCHED.size, SHAPE[1])).astype(np.float32) for _ in range(steps)]


def _slices(grad: np.ndarray) -> tf.IndexedSlices:
    return tf.IndexedSlices(tf.constant(grad), tf.constant(TOUCHED), SHAPE)


class NumpyTable:
    """A table and its slots as NumPy arrays, updated through ``update_rows`` on gathered
    rows (a dynamic table's path), from a Keras variable and its optimizer's initial slots."""

    def __init__(self, opt: RowOptimizer, var: keras.Variable) -> None:
        self.opt, self.rows = opt, var.numpy().copy()
        self.slots = {s: np.full(SHAPE, opt.initial_slot(s), np.float32) for s in opt.slots}

    def apply(self, grad: np.ndarray, step: int) -> None:
        r = self.rows[TOUCHED]
        gathered = {s: a[TOUCHED] for s, a in self.slots.items()}
        for s, a in update_rows(self.opt, r, gathered, grad, LR, step).items():
            self.slots[s][TOUCHED] = a
        self.rows[TOUCHED] = r


def _keras_run(kind: str, grads: list[np.ndarray]) -> tuple[keras.Variable, Any]:
    """A variable after Keras's own optimizer applies ``grads`` as IndexedSlices."""
    var, opt = _variable(), KERAS[kind]()
    opt.build([var])
    for g in grads:
        opt.apply([_slices(g)], [var])
    return var, opt


def _adapter_run(kind: str, grads: list[np.ndarray]) -> tuple[keras.Variable, Any]:
    """A variable after ``row_update`` applies ``grads`` with a Keras optimizer's slots and
    hyperparameters (a fixed table's path)."""
    var, opt = _variable(), KERAS[kind]()
    opt.build([var])
    for g in grads:
        row_update(kind, opt, var, tf.constant(TOUCHED), tf.constant(g), opt.learning_rate)
        opt.iterations.assign_add(1)
    return var, opt


@pytest.mark.parametrize("kind", ["sgd", "adagrad", "lazy_adam"])
def test_each_kind_is_keras_on_the_touched_rows_with_the_keras_hyperparameters(kind: str) -> None:
    """Keras's SGD, Adagrad and Adam, with hyperparameters other than the defaults: the rule on
    both paths gives the touched rows and slots within 1e-6. Every step touches the same rows,
    so lazy and dense Adam agree on them at every step (from the second step on, dense Adam
    would move a row touched before)."""
    grads = _grads(4)
    want, keras_opt = _keras_run(kind, grads)
    opt = row_optimizer(kind, keras_opt)
    assert opt.params == {k: getattr(keras_opt, k) for k in KINDS[kind].hyper}
    numpy_table = NumpyTable(opt, _variable())
    for t, g in enumerate(grads, start=1):
        numpy_table.apply(g, t)
    fixed, fixed_opt = _adapter_run(kind, grads)
    for got in (numpy_table.rows, fixed.numpy()):
        np.testing.assert_allclose(got[TOUCHED], want.numpy()[TOUCHED], rtol=0, atol=1e-6)
    for s in opt.slots:
        keras_values = keras_slot(keras_opt, s, want).numpy()[TOUCHED]
        np.testing.assert_allclose(numpy_table.slots[s][TOUCHED], keras_values, atol=1e-6)
        np.testing.assert_allclose(
            keras_slot(fixed_opt, s, fixed).numpy()[TOUCHED], keras_values, atol=1e-6
        )


def test_lazy_adam_leaves_untouched_rows_and_moments_bit_identical() -> None:
    """Later steps of lazy_adam on a Keras variable and Adam's slots: rows a step does not
    touch keep their values and moments exactly."""
    var, opt = _variable(), KERAS["lazy_adam"]()
    opt.build([var])
    rng = np.random.default_rng(2)
    for step in range(5):
        idx = np.sort(rng.choice(SHAPE[0], 3, replace=False)).astype(np.int64)
        before = [var.numpy().copy(), *(keras_slot(opt, s, var).numpy().copy() for s in "mv")]
        g = rng.standard_normal((idx.size, SHAPE[1])).astype(np.float32)
        row_update("lazy_adam", opt, var, tf.constant(idx), tf.constant(g), opt.learning_rate)
        opt.iterations.assign_add(1)
        after = [var.numpy(), *(keras_slot(opt, s, var).numpy() for s in "mv")]
        untouched = np.ones(SHAPE[0], bool)
        untouched[idx] = False
        for b, a in zip(before, after, strict=True):
            assert np.array_equal(b[untouched], a[untouched]), step
            assert not np.array_equal(b[idx], a[idx]), step


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_the_defaults_are_kerass_and_the_slot_names_the_checkpoint_formats(kind: str) -> None:
    """A table built from a kind's name alone trains with the hyperparameters the server's
    Keras optimizer has; the slots keep the names checkpoints hold (``slot_<name>``)."""
    keras_opt = OPTIMIZERS[kind](learning_rate=LR)
    assert RowOptimizer(kind) == row_optimizer(kind, keras_opt)
    saved = {"sgd": (), "adagrad": ("accumulator",), "lazy_adam": ("m", "v")}
    assert RowOptimizer(kind).slots == saved[kind]
    var = _variable()
    keras_opt.build([var])
    for s in RowOptimizer(kind).slots:  # a new row's slot as Keras builds it
        built = keras_slot(keras_opt, s, var).numpy()
        assert np.all(built == np.float32(RowOptimizer(kind).initial_slot(s)))


def test_a_row_optimizer_refuses_an_unknown_kind_or_hyperparameter() -> None:
    with pytest.raises(ValueError, match="optimizer must be one of"):
        RowOptimizer("adadelta")
    with pytest.raises(ValueError, match="adagrad has no hyperparameters"):
        RowOptimizer("adagrad", {"beta_1": 0.9})


def _dynamic_copy(state: ParameterState) -> DynamicTable:
    """A dynamic table holding the fixed table of ``state`` (ids 0..V-1), with its slots."""
    table = state.variables[0].numpy()
    opt = state.table_optimizer
    n = table.shape[0]
    arrays = {"ids": np.arange(n, dtype=np.int64), "rows": table}
    arrays |= {f"slot_{s}": keras_slot(state.optimizer, s, state.variables[0]).numpy()
               for s in opt.slots}  # fmt: skip
    arrays |= {"versions": np.zeros(n, np.int64), "counts": np.zeros(n, np.int64)}
    arrays["counters"] = np.zeros(len(COUNTERS), np.int64)
    return DynamicTable.from_state(arrays, "t", optimizer=opt)


@pytest.mark.parametrize("kind", ["sgd", "adagrad", "lazy_adam"])
def test_a_fixed_and_a_dynamic_table_train_a_row_alike(kind: str) -> None:
    """One server's fixed Embedding (its compiled apply) and a dynamic table with the row
    optimizer that server gives its dynamic tables: the same ids and gradients leave the
    same rows and slots."""
    state = ParameterState(load_spec("tiny_models:embedding"), kind, LR, seed=1)
    assert state.sparse[0]
    keras_params = row_optimizer(kind, state.optimizer).params  # beta_1 a float32 variable now
    assert state.table_optimizer.params == pytest.approx(keras_params, rel=1e-7)
    table = _dynamic_copy(state)
    rng = np.random.default_rng(3)
    for ids in ([3, 9, 3], [9, 40], [1, 2, 3, 40], [9]):
        idx = np.array(ids, np.int64)
        g = rng.standard_normal((idx.size, 8)).astype(np.float32)
        state.apply([Sparse(idx, g, state.shapes[0]), *(np.zeros(s, np.float32)
                                                        for s in state.shapes[1:])])  # fmt: skip
        step = int(state.optimizer.iterations.numpy())
        table.apply(idx, g, LR, state.version, step)
    touched = np.array([1, 2, 3, 9, 40], np.int64)
    tol = {"rtol": 1e-5, "atol": 1e-6}  # NumPy's float32 pow and TensorFlow's: an ulp at times
    np.testing.assert_allclose(table.gather(touched), state.gather(0, touched), **tol)
    state_arrays = table.export_state()
    order = np.searchsorted(state_arrays["ids"], touched)
    for s in table.opt.slots:
        fixed = keras_slot(state.optimizer, s, state.variables[0]).numpy()[touched]
        np.testing.assert_allclose(state_arrays[f"slot_{s}"][order], fixed, **tol)


# -- the next kind is one entry: FTRL (Keras's Ftrl arithmetic), registered here -------------


def _ftrl(xp: Math, h: Hyper, rows: Any, s: Slots, grad: Any, lr: Any, t: Any) -> RowStep:
    power = -h["learning_rate_power"]
    acc, linear = s["accumulator"], s["linear"]
    l2 = h["l2_regularization_strength"] + h["beta"] / (2 * lr)
    shrunk = grad + 2 * h["l2_shrinkage_regularization_strength"] * rows
    new_acc = acc + xp.square(grad)
    linear += shrunk - (xp.power(new_acc, power) - xp.power(acc, power)) / lr * rows
    quadratic = xp.power(new_acc, power) / lr + 2 * l2
    l1 = h["l1_regularization_strength"]
    new = (xp.clip(linear, -l1, l1) - linear) / quadratic
    return RowStep({"accumulator": new_acc, "linear": linear}, new=new)


FTRL = Kind(
    {"accumulator": "initial_accumulator_value", "linear": 0.0},
    {
        "learning_rate_power": -0.5,
        "initial_accumulator_value": 0.1,
        "l1_regularization_strength": 0.0,
        "l2_regularization_strength": 0.0,
        "l2_shrinkage_regularization_strength": 0.0,
        "beta": 0.0,
    },
    _ftrl,
    reads_rows=True,
)


def test_a_new_kind_is_one_entry_ftrl_as_keras_has_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """FTRL as one ``KINDS`` entry (and its ``linear`` slot's Keras name): both paths give
    Keras's ``Ftrl`` on the touched rows, each step on the same rows."""
    monkeypatch.setitem(optim.KINDS, "ftrl", FTRL)
    monkeypatch.setitem(rows.KERAS_SLOTS, "linear", "_linears")
    config = {"initial_accumulator_value": 0.2, "l1_regularization_strength": 0.01}
    config |= {"l2_regularization_strength": 0.02, "l2_shrinkage_regularization_strength": 0.01}
    monkeypatch.setitem(KERAS, "ftrl", lambda: keras.optimizers.Ftrl(LR, beta=0.1, **config))
    grads = _grads(3)
    want, keras_opt = _keras_run("ftrl", grads)
    opt = row_optimizer("ftrl", keras_opt)
    assert opt.params["beta"] == 0.1 and opt.initial_slot("accumulator") == 0.2
    numpy_table = NumpyTable(opt, _variable())
    for t, g in enumerate(grads, start=1):
        numpy_table.apply(g, t)
    fixed, _ = _adapter_run("ftrl", grads)
    for got in (numpy_table.rows, fixed.numpy()):
        np.testing.assert_allclose(got[TOUCHED], want.numpy()[TOUCHED], rtol=0, atol=1e-6)
    untouched = np.setdiff1d(np.arange(SHAPE[0]), TOUCHED)
    assert np.array_equal(fixed.numpy()[untouched], _variable().numpy()[untouched])
