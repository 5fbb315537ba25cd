"""The server's compiled apply step and its versioned snapshots."""

from __future__ import annotations

import keras
import numpy as np

from downpour.models import build_model
from downpour.server.state import ParameterState
from downpour.spec import load_spec


def _grads(state: ParameterState, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.normal(size=s).astype(d) for s, d in zip(state.shapes, state.dtypes, strict=True)]


def test_apply_is_traced_once_and_matches_keras() -> None:
    spec = load_spec("tiny_models:tiny")
    state = ParameterState(spec, "adam", 0.01, seed=0)
    ref_model = build_model(spec, seed=0)
    ref_opt = keras.optimizers.Adam(0.01)
    for i in range(4):
        g = _grads(state, i)
        assert state.apply(g) == i + 1
        ref_opt.apply_gradients(zip(g, ref_model.trainable_variables, strict=True))
    assert state.apply_traces == 1
    assert state.version == 4
    for v, r in zip(state.variables, ref_model.trainable_variables, strict=True):
        np.testing.assert_allclose(v.numpy(), r.numpy(), rtol=1e-6, atol=1e-7)


def test_snapshot_is_shared_per_version_and_never_torn() -> None:
    state = ParameterState(load_spec("tiny_models:tiny"), "sgd", 0.5)
    v0, snap = state.weights()
    assert state.weights()[1] is snap  # same version: the same arrays, no new copy
    copy = [a.copy() for a in snap]
    state.apply(_grads(state, 1))
    for a, c in zip(snap, copy, strict=True):
        np.testing.assert_array_equal(a, c)  # the held snapshot did not change under the apply
    v1, snap1 = state.weights()
    assert (v0, v1) == (0, 1)
    assert any(not np.array_equal(a, c) for a, c in zip(snap1, copy, strict=True))
