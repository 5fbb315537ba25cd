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


@pytest.mark.parametrize(("model", "optimizer"), [("tiny", "adam"), ("embedding", "lazy_adam")])
def test_the_flat_call_applies_what_the_structured_call_applies(model: str, optimizer: str) -> None:
    """The apply step is called through ``_call_flat`` on this TensorFlow (no per-apply
    binding of its inputs); it updates the weights and slots bit for bit as the public
    structured call does, dense and row-sparse variables alike."""
    from downpour.server.state import flat_call_problem
    from downpour.wire import Sparse

    assert flat_call_problem() is None  # TensorFlow 2.16+: the fast path is taken
    spec = load_spec(f"tiny_models:{model}")
    flat = ParameterState(spec, optimizer, 0.01, seed=0)
    bound = ParameterState(spec, optimizer, 0.01, seed=0)
    bound.apply_call_problem = "the structured call, for comparison"
    assert flat.apply_call_problem is None
    rng = np.random.default_rng(5)
    for i in range(4):
        grads: list[np.ndarray | Sparse] = []
        for shape, dtype, sparse in zip(flat.shapes, flat.dtypes, flat.sparse, strict=True):
            if sparse:  # a few rows, one repeated
                rows = rng.integers(0, shape[0], 5).astype(np.int64)
                rows[-1] = rows[0]
                values = rng.normal(size=(5, *shape[1:])).astype(dtype)
                grads.append(Sparse(rows, values, tuple(shape)))
            else:
                grads.append(rng.normal(size=shape).astype(dtype))
        assert flat.apply(grads, lr_scale=0.5 if i == 2 else 1.0) == bound.apply(
            grads, lr_scale=0.5 if i == 2 else 1.0
        )
    assert any(flat.sparse) == (model == "embedding")
    for a, b in zip(flat.variables, bound.variables, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    for a, b in zip(flat.optimizer.variables, bound.optimizer.variables, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_without_the_flat_call_the_server_says_so_in_the_log_and_in_status(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A TensorFlow without ``ConcreteFunction._call_flat`` (as it is here) still applies,
    through the structured call, and the server says why at warning level and in status."""
    import logging

    from inproc import serving

    from downpour.cli.status import fetch_status, render
    from downpour.server import state as state_module

    reason = "TensorFlow 9.9 has no ConcreteFunction._call_flat"
    monkeypatch.setattr(state_module, "flat_call_problem", lambda: reason)
    with (
        caplog.at_level(logging.WARNING, logger="downpour.server"),
        serving("tiny_models:tiny") as server,
    ):
        doc = fetch_status(server.status)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(m.startswith(reason) for m in warned), warned
    assert doc["apply_call"] == reason
    assert f"WARNING: {reason}: every apply binds its inputs again" in render(doc)
    state = ParameterState(load_spec("tiny_models:tiny"), "sgd", 0.1)
    assert state.apply_call_problem == reason and state.apply(_grads(state, 1)) == 1
