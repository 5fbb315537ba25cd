"""Unit tests for the weight- and staleness-aware policies,
``services/server/policies/compensation.py``:
delay compensation (dc, dc-a), gap-aware damping, asynchrony-aware momentum and look-ahead
pulls."""

from __future__ import annotations

import numpy as np
import pytest

from downpour.server.policies.base import APPLY, parse_policy
from downpour.server.policies.compensation import (
    DelayCompensatedPolicy,
    GapAwarePolicy,
    LookaheadPolicy,
    MomentumAwarePolicy,
    WeightRing,
)
from downpour.wire import Sparse


def _ro(a: np.ndarray) -> np.ndarray:
    a = np.asarray(a, dtype=np.float32)
    a.flags.writeable = False  # like decoded network buffers and the server's snapshots
    return a


def test_weight_ring_keeps_the_last_r_versions() -> None:
    ring = WeightRing(3)
    for v in range(5):
        assert ring.record(v, [_ro(np.full(4, v))])
    assert not ring.record(4, [_ro(np.zeros(4))])  # a version is kept once
    assert ring.get(0) is None and ring.get(1) is None
    assert [float(ring.get(v)[0][0]) for v in (2, 3, 4)] == [2.0, 3.0, 4.0]
    assert len(ring) == 3 and ring.nbytes == 3 * 16
    with pytest.raises(ValueError, match=">= 1"):
        WeightRing(0)


def test_dc_compensates_a_stale_gradient_elementwise() -> None:
    p = DelayCompensatedPolicy(0.5)
    base = [_ro([1.0, 2.0, -1.0]), _ro([[0.0, 0.0]])]
    now = [_ro([1.5, 1.0, -1.0]), _ro([[2.0, -2.0]])]
    p.observe(3, base)
    p.observe(5, now)
    g = [_ro([2.0, -1.0, 4.0]), _ro([[1.0, 3.0]])]
    d = p.offer(g, 3, 5, "w0")
    assert d.action == APPLY and d.staleness == 2 and d.lr_scale == 1.0
    # g + 0.5 * g*g * (now - base)
    np.testing.assert_allclose(d.grads[0], [2.0 + 0.5 * 4 * 0.5, -1.0 + 0.5 * 1 * -1.0, 4.0])
    np.testing.assert_allclose(d.grads[1], [[1.0 + 0.5 * 1 * 2.0, 3.0 + 0.5 * 9 * -2.0]])
    assert d.grads[0].dtype == np.float32
    assert p.counters["compensated"] == 1 and p.counters["applied"] == 1


def test_dc_fresh_or_out_of_ring_gradients_are_applied_as_async() -> None:
    p = DelayCompensatedPolicy(1.0, ring=2)
    for v in range(4):
        p.observe(v, [_ro(np.full(2, float(v)))])
    g = [_ro([1.0, 1.0])]
    fresh = p.offer(g, 3, 3, "w0")
    assert fresh.grads is not None and fresh.grads[0] is g[0] and fresh.staleness == 0
    old = p.offer(g, 0, 3, "w1")  # version 0 has left a ring of 2
    assert old.action == APPLY and old.grads is not None and old.grads[0] is g[0]
    assert p.counters["uncompensated"] == 1 and p.counters["compensated"] == 0


def test_dc_compensates_only_the_touched_rows_of_a_sparse_gradient() -> None:
    p = DelayCompensatedPolicy(1.0)
    base = [_ro(np.zeros((4, 2)))]
    now = [_ro(np.arange(8.0).reshape(4, 2))]
    p.observe(0, base)
    p.observe(1, now)
    g = Sparse(np.array([2, 0, 2]), _ro([[1.0, 1.0], [2.0, 0.0], [1.0, -1.0]]), (4, 2))
    d = p.offer([g], 0, 1, "w0")
    out = d.grads[0]
    assert isinstance(out, Sparse) and list(out.indices) == [0, 2]
    # row 0: g (2, 0) + g*g*(0, 1); row 2: g summed (2, 0) + g*g*(4, 5)
    np.testing.assert_allclose(out.values, [[2.0 + 4 * 0.0, 0.0], [2.0 + 4 * 4.0, 0.0]])


def test_dc_adaptive_divides_lambda_by_the_root_mean_square_gradient() -> None:
    p = DelayCompensatedPolicy(0.1, adaptive=True)
    p.observe(0, [_ro([0.0, 0.0])])
    p.observe(1, [_ro([1.0, 1.0])])
    g = [_ro([2.0, -0.5])]
    d = p.offer(g, 0, 1, "w0")  # first gradient: mean square = g*g, so lambda/|g|
    np.testing.assert_allclose(
        d.grads[0], [2.0 + 0.1 / 2.0 * 4.0, -0.5 + 0.1 / 0.5 * 0.25], rtol=1e-5
    )
    assert p.spec == "dc-a:0.1" and parse_policy("dc-a:0.1").adaptive


def test_gap_aware_scales_by_the_gap_over_the_mean_step() -> None:
    p = GapAwarePolicy()
    g = [_ro([1.0])]
    for v in range(5):  # each update moves the weight by 1: step_mean 1
        p.observe(v, [_ro([float(v)])])
    assert p.step_mean == pytest.approx(1.0)
    assert p.offer(g, 4, 4, "w0").lr_scale == 1.0  # fresh
    d = p.offer(g, 0, 4, "w0")  # moved 4 since its base: a quarter of the rate
    assert d.action == APPLY and d.lr_scale == pytest.approx(0.25) and d.grads[0] is g[0]
    assert p.offer(g, 3, 4, "w0").lr_scale == 1.0  # a gap of one step is no penalty
    assert p.counters["scaled"] == 1


def test_gap_aware_follows_distance_not_version_count() -> None:
    p = GapAwarePolicy()
    ws = [0.0, 1.0, 2.0, 3.0, 2.0, 1.0]  # moved away and back: 5 versions, a gap of 1 step
    for v, x in enumerate(ws):
        p.observe(v, [_ro([x])])
    assert p.offer([_ro([1.0])], 0, 5, "w0").lr_scale == pytest.approx(1.0)
    assert p.offer([_ro([1.0])], 2, 5, "w0").lr_scale == pytest.approx(1.0)
    assert p.offer([_ro([1.0])], 3, 5, "w0").lr_scale == pytest.approx(0.5)


def test_momentum_aware_lowers_beta_1_with_the_mean_staleness() -> None:
    p = MomentumAwarePolicy()
    assert p.momentum(0.0) == 0.9  # one worker: Adam's own
    assert p.momentum(1.0) == 0.4  # 2 workers: implicit 1 - 1/2
    assert p.momentum(7.0) == 0.025  # 8 workers: implicit 1 - 1/8
    assert p.momentum(20.0) == 0.0
    g = [_ro([1.0])]
    d = p.offer(g, 10, 10, "w0")
    assert d.action == APPLY and d.momentum == 0.9 and d.lr_scale == 1.0
    for _ in range(300):  # a steady staleness of 3: the mean converges to 3
        d = p.offer(g, 7, 10, "w0")
    assert p.mean_staleness == pytest.approx(3.0, abs=0.01)
    assert d.momentum == pytest.approx(0.15, abs=0.002)


def test_momentum_aware_parameter_and_parse_forms() -> None:
    p = parse_policy("momentum-aware:0.95")
    assert isinstance(p, MomentumAwarePolicy) and p.spec == "momentum-aware:0.95"
    assert p.momentum(1.0) == 0.45
    assert parse_policy("momentum-aware").spec == "momentum-aware"
    assert parse_policy("DC:0.04").spec == "dc:0.04"
    assert parse_policy("gap-aware").spec == "gap-aware"
    for bad in ("momentum-aware:1.5", "momentum-aware:x", "dc", "dc:-1", "dc:a"):
        with pytest.raises(ValueError, match=r"(dc|momentum-aware).*(L >= 0|B)"):
            parse_policy(bad)


def _steady(p: LookaheadPolicy, tau: int, n: int = 5) -> None:
    """Offer ``n`` gradients of staleness ``tau``: the mean staleness becomes ``tau``."""
    for _ in range(n):
        assert p.offer([_ro([0.0])], 10 - tau, 10, "w0").action == APPLY


def test_lookahead_serves_the_weights_extrapolated_over_the_mean_staleness() -> None:
    p = LookaheadPolicy(0.5)
    ws = [[_ro([v, -2.0 * v * v]), np.full(2, v, np.int32), _ro([[v]])] for v in range(6)]
    for v in range(5):
        p.observe(v, ws[v])
    _steady(p, 2)
    assert p.horizon() == 2
    out = p.pull_weights(5, ws[5], skip=[2])
    # w5 + 0.5 * (w5 - w3): [5 + 1, -50 + 0.5 * (-50 + 18)]
    np.testing.assert_allclose(out[0], [6.0, -66.0])
    assert out[0].dtype == np.float32 and not out[0].flags.writeable
    assert out[1] is ws[5][1] and out[2] is ws[5][2]  # integers and skipped arrays: as they are
    np.testing.assert_array_equal(ws[5][0], [5.0, -50.0])  # the snapshot is not touched
    assert p.pull_weights(5, ws[5]) is out  # once per version
    assert p.counters["extrapolated"] == 1
    assert p.describe()["horizon"] == 2


def test_lookahead_without_staleness_or_history_serves_the_snapshot() -> None:
    p = LookaheadPolicy()
    w = [_ro([1.0, 2.0])]
    _steady(p, 0)  # one worker: nothing moves while a gradient is in flight
    assert p.pull_weights(3, w)[0] is w[0]
    _steady(p, 3, n=20)
    assert p.horizon() > 0
    assert p.pull_weights(4, w)[0] is w[0]  # w_{4-k} was never observed
    assert p.counters["not_extrapolated"] == 2 and p.counters["extrapolated"] == 0


def test_lookahead_parse_forms_and_momentum() -> None:
    assert parse_policy("lookahead").spec == "lookahead"
    p = parse_policy("LOOKAHEAD:0.5")
    assert isinstance(p, LookaheadPolicy) and p.scale == 0.5 and p.momentum_policy is None
    assert p.offer([_ro([1.0])], 0, 7, "w0").momentum is None
    m = parse_policy("momentum-aware+lookahead:2")
    assert isinstance(m, LookaheadPolicy) and m.spec == "momentum-aware+lookahead:2"
    assert m.offer([_ro([1.0])], 0, 7, "w0").momentum == 0.025  # beta_1 for staleness 7
    assert parse_policy("momentum-aware:0.95+lookahead").spec == "momentum-aware:0.95+lookahead"
    for bad in ("lookahead:-1", "lookahead:x", "lookahead+momentum-aware", "gap-aware+lookahead"):
        with pytest.raises(ValueError, match="lookahead"):
            parse_policy(bad)
