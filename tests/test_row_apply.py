"""The server's row-wise apply: a row-sparse table's update changes only the touched rows of
the variable and of its optimizer slots (sgd, adagrad, lazy_adam), and lazy_adam is Adam on
those rows (TF1's LazyAdamOptimizer), Keras's Adam on the dense variables."""

from __future__ import annotations

import numpy as np
import pytest

from downpour.server.state import ParameterState
from downpour.spec import load_spec
from downpour.wire import Sparse

SPEC = "tiny_models:embedding"


def _table_slots(state: ParameterState) -> list[np.ndarray]:
    """The table and every optimizer slot shaped like it, as copies."""
    shape = state.shapes[0]
    slots = [v.numpy().copy() for v in state.optimizer.variables if tuple(v.shape) == shape]
    return [state.variables[0].numpy().copy(), *slots]


def _push(state: ParameterState, rows: list[int], rng: np.random.Generator) -> None:
    idx = np.array(rows, np.int64)
    g = Sparse(idx, rng.standard_normal((len(rows), 8)).astype(np.float32), state.shapes[0])
    state.apply([g, *[rng.standard_normal(s).astype(np.float32) for s in state.shapes[1:]]])


@pytest.mark.parametrize(("optimizer", "slots"), [("sgd", 0), ("adagrad", 1), ("lazy_adam", 2)])
def test_untouched_rows_of_the_table_and_its_slots_stay_bit_identical(
    optimizer: str, slots: int
) -> None:
    state = ParameterState(load_spec(SPEC), optimizer, 0.1, seed=1)
    assert state.sparse[0]
    rng = np.random.default_rng(0)
    _push(state, [3, 9, 3], rng)  # the slots now hold values on rows 3 and 9
    before = _table_slots(state)
    assert len(before) == 1 + slots
    _push(state, [9, 40], rng)
    after = _table_slots(state)
    untouched = np.ones(state.shapes[0][0], bool)
    untouched[[9, 40]] = False
    for b, a in zip(before, after, strict=True):
        assert np.array_equal(b[untouched], a[untouched])  # bit-identical, row 3 included
        assert not np.array_equal(b[[9, 40]], a[[9, 40]])


def test_lazy_adam_is_adam_on_the_touched_rows() -> None:
    lr, b1, b2, eps = 0.1, 0.9, 0.999, 1e-7
    state = ParameterState(load_spec(SPEC), "lazy_adam", lr, seed=1)
    dense_ref = ParameterState(load_spec(SPEC), "adam", lr, seed=1, sparse_apply=False)
    table = state.variables[0].numpy().astype(np.float64)
    m = np.zeros_like(table)
    v = np.zeros_like(table)
    rng = np.random.default_rng(5)
    for t, rows in enumerate(([3, 9], [9, 40], [3]), start=1):
        idx = np.array(rows, np.int64)
        g = rng.standard_normal((len(rows), 8)).astype(np.float32)
        rest = [rng.standard_normal(s).astype(np.float32) for s in state.shapes[1:]]
        state.apply([Sparse(idx, g, state.shapes[0]), *rest])
        dense_g = np.zeros(state.shapes[0], np.float32)
        dense_g[idx] = g
        dense_ref.apply([dense_g, *rest])
        m[idx] = b1 * m[idx] + (1 - b1) * g
        v[idx] = b2 * v[idx] + (1 - b2) * g.astype(np.float64) ** 2
        alpha = lr * np.sqrt(1 - b2**t) / (1 - b1**t)
        table[idx] -= alpha * m[idx] / (np.sqrt(v[idx]) + eps)
    np.testing.assert_allclose(state.variables[0].numpy(), table, rtol=1e-5, atol=1e-6)
    for a, b in zip(state.variables[1:], dense_ref.variables[1:], strict=True):  # Keras's Adam
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6)
    # Keras's dense-moment Adam keeps moving row 40 after its last gradient; lazy Adam does not
    moved = dense_ref.variables[0].numpy()[[9, 40]] != state.variables[0].numpy()[[9, 40]]
    assert moved.any()
    assert int(state.optimizer.iterations.numpy()) == 3
