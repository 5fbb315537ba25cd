"""The XLA-compiled apply step gives the same parameters as the op-by-op graph.

XLA is the default because it is faster (``make bench`` shows both); it may fuse and reorder
float operations, so the results agree within float tolerance, not bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest

from downpour.server.state import ParameterState
from downpour.spec import load_spec


def _grads(state: ParameterState, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.normal(size=s).astype(d) for s, d in zip(state.shapes, state.dtypes, strict=True)]


def _unaligned(a: np.ndarray) -> np.ndarray:
    """A copy of ``a`` on an odd address, as gradients arrive inside received ZeroMQ frames."""
    raw = np.empty(a.nbytes + 1, dtype=np.uint8)
    view = np.ndarray(a.shape, a.dtype, buffer=raw, offset=1)
    view[...] = a
    return view


def test_default_is_jit() -> None:
    assert ParameterState(load_spec("tiny_models:tiny")).jit is True


@pytest.mark.parametrize("optimizer", ["adam", "adagrad", "sgd"])
def test_jit_matches_graph_within_float_tolerance(optimizer: str) -> None:
    spec = load_spec("tiny_models:tiny")
    xla = ParameterState(spec, optimizer, 0.01, seed=0, jit=True)
    graph = ParameterState(spec, optimizer, 0.01, seed=0, jit=False)
    for v, g in zip(xla.variables, graph.variables, strict=True):
        np.testing.assert_array_equal(v.numpy(), g.numpy())  # same start
    for i in range(5):
        grads = _grads(xla, i)
        assert xla.apply([_unaligned(a) for a in grads]) == graph.apply(grads) == i + 1
    assert xla.apply_traces == graph.apply_traces == 1
    for v, g in zip(xla.variables, graph.variables, strict=True):
        np.testing.assert_allclose(v.numpy(), g.numpy(), rtol=1e-5, atol=1e-6)
    for v, g in zip(xla.optimizer.variables, graph.optimizer.variables, strict=True):
        np.testing.assert_allclose(v.numpy(), g.numpy(), rtol=1e-5, atol=1e-6)


def test_jit_snapshot_is_never_torn() -> None:
    state = ParameterState(load_spec("tiny_models:tiny"), "adam", 0.1, jit=True)
    _, snap = state.weights()
    copy = [a.copy() for a in snap]
    state.apply(_grads(state, 3))
    for a, c in zip(snap, copy, strict=True):
        np.testing.assert_array_equal(a, c)


def test_apply_refuses_a_wrong_shape_instead_of_broadcasting() -> None:
    state = ParameterState(load_spec("tiny_models:tiny"), "sgd", 0.1)
    grads = _grads(state, 0)
    grads[0] = grads[0][:1]  # would broadcast silently into the staging buffer
    with pytest.raises(ValueError, match="shape"):
        state.apply(grads)
    assert state.version == 0
