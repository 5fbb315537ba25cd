"""The server's compiled apply step and its versioned snapshots."""

from __future__ import annotations

import keras
import numpy as np
import pytest

from downpour.model.build import build_model
from downpour.server.state import ParameterState
from downpour.spec import load_spec
from downpour.wire import BFloat16, Keyed, KeyedBF16, as_bf16


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


def _bits(t: object) -> tuple[str, np.ndarray]:
    """A pulled tensor's encoding payload as comparable bits."""
    if isinstance(t, BFloat16):
        return f"bf16 {t.dtype}", t.values.view(np.uint16)
    if isinstance(t, Keyed | KeyedBF16):
        return type(t).__name__, np.asarray(t.values)
    return f"as is {t.dtype}", np.asarray(t)  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "ref", ["tiny_models:tiny", "dtype_models:mixed", "tiny_models:dynamic_tensor"]
)
def test_bf16_weights_are_what_as_bf16_makes_of_the_snapshot_once_per_version(ref: str) -> None:
    """float32 variables rounded by TensorFlow, bit for bit what wire.as_bf16 gives (round to
    nearest even); float16 as it is, float64 rounded from a snapshot, dynamic tables empty."""
    state = ParameterState(load_spec(ref), "adam", 0.1)
    for seed in range(3):
        version, tensors = state.weights_bf16()
        assert version == state.version and state.weights_bf16()[1] is tensors  # cached
        expected = [as_bf16(a) for a in state.weights()[1]]
        for got, want in zip(tensors, expected, strict=True):
            (kind, bits), (kind_want, bits_want) = _bits(got), _bits(want)
            assert kind == kind_want
            np.testing.assert_array_equal(bits, bits_want)
        grads: list[object] = list(_grads(state, seed))
        for i, dim in enumerate(state.shapes):
            if state.dynamic[i]:  # two ids' rows, which a whole pull does not carry
                grads[i] = Keyed(np.array([7, -3]), np.ones((2, *dim[1:]), np.float32), dim)
        state.apply(grads)  # a new version: rounded again, from the new values
    assert any(isinstance(t, BFloat16) for t in tensors)


def test_momentum_changes_at_run_time_without_a_retrace() -> None:
    """momentum-aware sets Adam's beta_1 per update: the traced step follows each value, as a
    Keras Adam built with that beta_1 would, and is still traced once."""
    spec = load_spec("tiny_models:tiny")
    state = ParameterState(spec, "adam", 0.01, seed=0)
    n_opt_vars = len(state.optimizer.variables)
    ref_model = build_model(spec, seed=0)
    ref_opt = keras.optimizers.Adam(0.01)
    for i, beta_1 in enumerate([0.9, 0.0, 0.0, 0.5, 0.9]):
        g = _grads(state, i)
        assert state.set_momentum(beta_1)
        state.apply(g)
        ref_opt.beta_1 = beta_1
        ref_opt.apply_gradients(zip(g, ref_model.trainable_variables, strict=True))
    assert state.apply_traces == 1
    assert len(state.optimizer.variables) == n_opt_vars  # nothing new in a checkpoint
    for v, r in zip(state.variables, ref_model.trainable_variables, strict=True):
        np.testing.assert_allclose(v.numpy(), r.numpy(), rtol=1e-5, atol=1e-6)
    # and beta_1 matters: the same gradients with Adam's own 0.9 throughout end elsewhere
    other = ParameterState(spec, "adam", 0.01, seed=0)
    for i in range(5):
        other.apply(_grads(other, i))
    assert any(
        not np.allclose(a.numpy(), b.numpy(), atol=1e-6)
        for a, b in zip(state.variables, other.variables, strict=True)
    )


def test_momentum_is_refused_by_an_optimizer_without_one() -> None:
    state = ParameterState(load_spec("tiny_models:tiny"), "sgd", 0.1)
    assert state.momentum is None and not state.set_momentum(0.5)


@pytest.mark.parametrize(
    ("optimizer", "policy"),
    [("sgd", "momentum-aware"), ("adagrad", "momentum-aware"), ("sgd", "momentum-aware+lookahead")],
)
def test_momentum_aware_refuses_an_optimizer_without_beta_1(optimizer: str, policy: str) -> None:
    """momentum-aware steers Adam's beta_1; with SGD or Adagrad it could do nothing, so the
    server refuses to start (the CLI turns the ConfigError into exit 2) instead of training
    silently without its policy."""
    from downpour.config.settings import ConfigError
    from downpour.server.service import Server
    from downpour.server.settings import ServerConfig

    config = ServerConfig(port=0, push_port=0, status_port=0, optimizer=optimizer, policy=policy)
    with pytest.raises(ConfigError, match="needs --optimizer adam"):
        Server(load_spec("tiny_models:tiny"), config)
    assert ParameterState(load_spec("tiny_models:tiny"), optimizer, 0.1).momentum is None


@pytest.mark.parametrize("optimizer", ["adam", "adagrad", "sgd", "lazy_adam"])
def test_the_settings_know_which_optimizers_have_a_beta_1(optimizer: str) -> None:
    """``validate_server`` refuses a policy that sets beta_1 by the optimizer's name: the
    names it accepts are exactly the optimizers whose state has a beta_1 to set."""
    from downpour.server.settings import BETA_1_OPTIMIZERS, OPTIMIZERS

    assert optimizer in OPTIMIZERS
    state = ParameterState(load_spec("tiny_models:tiny"), optimizer, 0.1)
    assert (state.momentum is not None) == (optimizer in BETA_1_OPTIMIZERS)


def test_stage_copies_and_checks_in_one_pass_and_the_apply_reads_the_staged_buffers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from downpour.server import state as state_module

    monkeypatch.setattr(state_module, "STAGE_CHUNK", 7)  # several chunks per variable
    spec = load_spec("tiny_models:tiny")
    staged_state = ParameterState(spec, "adam", 0.01, seed=0)
    plain_state = ParameterState(spec, "adam", 0.01, seed=0)
    for i in range(3):
        g = _grads(staged_state, i)
        staged, bad = staged_state.stage(g)
        assert bad is None
        for s, buf, a in zip(staged, staged_state._staging, g, strict=True):
            assert s is buf  # the apply copies nothing more
            np.testing.assert_array_equal(s, a)
        staged_state.apply(staged)
        plain_state.apply(g)
    for a, b in zip(staged_state.variables, plain_state.variables, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy())

    before = [v.numpy().copy() for v in staged_state.variables]
    g = _grads(staged_state, 9)
    big = max(range(len(g)), key=lambda i: g[i].size)
    assert g[big].size > 7  # the bad value sits in a later chunk
    g[big].reshape(-1)[-1] = np.nan
    g[-1].reshape(-1)[0] = np.inf
    first_bad = staged_state.names[min(big, len(g) - 1)]
    assert staged_state.stage(g)[1] == first_bad  # the first, in variable order
    assert staged_state.stage(g, check=False)[1] is None
    for v, b in zip(staged_state.variables, before, strict=True):
        np.testing.assert_array_equal(v.numpy(), b)  # staging never touches a parameter
