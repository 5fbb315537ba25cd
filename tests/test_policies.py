"""Unit tests for the server's staleness policies, ``services/server/policies/base.py``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from downpour.config.policy import POLICIES, POLICY_FORMS
from downpour.server.policies.base import (
    APPLY,
    DROP,
    HOLD,
    REASON_AGGREGATED,
    REASON_BUFFERED,
    REASON_DUPLICATE,
    REASON_FLUSH,
    REASON_FRESH,
    REASON_LATE,
    REASON_STALE,
    REASON_STALE_APPLIED,
    SSP_RETRY_MS,
    AsyncPolicy,
    BoundedPolicy,
    SSPPolicy,
    StalenessAwarePolicy,
    SyncPolicy,
    parse_policy,
)

SHAPES = [(2, 3), (3,)]


def grads(value: float, dtype: str = "float32") -> list[np.ndarray]:
    """A read-only gradient list filled with ``value``, like decoded network buffers."""
    out = []
    for s in SHAPES:
        a = np.full(s, value, dtype=dtype)
        a.flags.writeable = False
        out.append(a)
    return out


# ---------------------------------------------------------------- async


def test_async_applies_every_gradient_with_scale_one() -> None:
    p = AsyncPolicy()
    g = grads(1.0)
    for tau, version in [(0, 10), (1, 10), (5, 10)]:
        d = p.offer(g, version - tau, version, "w0")
        assert d.action == APPLY
        assert d.lr_scale == 1.0
        assert d.staleness == tau
        assert d.reason == (REASON_FRESH if tau == 0 else REASON_STALE_APPLIED)
        assert d.workers == ("w0",)
        assert d.grads is not None and all(a is b for a, b in zip(d.grads, g, strict=True))
    assert p.counters["offered"] == 3
    assert p.counters["applied"] == 3
    assert p.counters["updates"] == 3
    assert p.counters["dropped_stale"] == 0


# ---------------------------------------------------------------- staleness-aware


@pytest.mark.parametrize(("tau", "scale"), [(0, 1.0), (1, 1.0), (2, 0.5), (5, 0.2), (100, 0.01)])
def test_staleness_aware_scale(tau: int, scale: float) -> None:
    p = StalenessAwarePolicy()
    d = p.offer(grads(1.0), 100 - tau, 100, "w1")
    assert d.action == APPLY
    assert d.lr_scale == pytest.approx(scale, rel=0, abs=1e-15)
    assert d.staleness == tau
    assert p.counters["scaled"] == (1 if scale < 1 else 0)
    assert StalenessAwarePolicy.scale(tau) == pytest.approx(scale, abs=1e-15)


def test_staleness_aware_counters_over_a_sequence() -> None:
    p = StalenessAwarePolicy()
    scales = [p.offer(grads(1.0), 10 - tau, 10, "w").lr_scale for tau in (0, 1, 5, 4, 0)]
    assert scales == [1.0, 1.0, 0.2, 0.25, 1.0]
    assert p.counters["applied"] == 5
    assert p.counters["scaled"] == 2


# ---------------------------------------------------------------- bounded


@pytest.mark.parametrize("k", [0, 1, 3])
def test_bounded_applies_at_k_and_drops_at_k_plus_one(k: int) -> None:
    p = BoundedPolicy(k)
    at_k = p.offer(grads(1.0), 50 - k, 50, "w0")
    assert (at_k.action, at_k.lr_scale, at_k.staleness) == (APPLY, 1.0, k)
    over = p.offer(grads(1.0), 50 - (k + 1), 50, "w0")
    assert (over.action, over.reason, over.staleness, over.grads) == (
        DROP,
        REASON_STALE,
        k + 1,
        None,
    )
    fresh = p.offer(grads(1.0), 50, 50, "w0")
    assert fresh.action == APPLY
    assert p.counters["applied"] == 2
    assert p.counters["dropped_stale"] == 1
    assert p.counters["offered"] == 3


def test_bounded_rejects_negative_k() -> None:
    with pytest.raises(ValueError, match=r"bounded:K needs K >= 0 .*got K=-1"):
        BoundedPolicy(-1)


# ---------------------------------------------------------------- sync


def test_sync_holds_then_applies_the_exact_mean_of_k() -> None:
    p = SyncPolicy(3, 4)
    d1 = p.offer(grads(1.0), 5, 5, "w0")
    d2 = p.offer(grads(2.0), 5, 5, "w1")
    assert (d1.action, d1.reason, d1.grads) == (HOLD, REASON_BUFFERED, None)
    assert d2.action == HOLD
    assert p.pending == 2
    d3 = p.offer(grads(6.0), 5, 5, "w2")
    assert d3.action == APPLY
    assert d3.reason == REASON_AGGREGATED
    assert d3.lr_scale == 1.0
    assert d3.workers == ("w0", "w1", "w2")
    assert d3.grads is not None
    for a, shape in zip(d3.grads, SHAPES, strict=True):
        assert a.shape == shape and a.dtype == np.float32
        np.testing.assert_array_equal(a, np.full(shape, 3.0, np.float32))  # (1 + 2 + 6) / 3
    assert p.pending == 0
    assert p.counters["aggregated"] == 3
    assert p.counters["updates"] == 1
    assert p.counters["applied"] == 3


def test_sync_copies_the_held_gradient() -> None:
    """Held arrays are copies: the network buffer they came from may be reused."""
    p = SyncPolicy(2, 2)
    buf = [np.full(s, 4.0, np.float32) for s in SHAPES]
    assert p.offer(buf, 0, 0, "w0").action == HOLD
    for a in buf:
        a.fill(-100.0)  # the frame is overwritten by the next message
    d = p.offer(grads(2.0), 0, 0, "w1")
    assert d.grads is not None
    for a in d.grads:
        np.testing.assert_array_equal(a, 3.0)


def test_sync_discards_late_gradients_and_resets_after_apply() -> None:
    p = SyncPolicy(2, 3)
    assert p.offer(grads(1.0), 7, 7, "w0").action == HOLD
    late = p.offer(grads(50.0), 6, 7, "w1")  # computed from version 6: late
    assert (late.action, late.reason, late.staleness) == (DROP, REASON_LATE, 1)
    d = p.offer(grads(3.0), 7, 7, "w2")
    assert d.action == APPLY and d.grads is not None
    np.testing.assert_array_equal(d.grads[0], np.full((2, 3), 2.0))  # the late one left out
    first_round = d.grads[0]
    # the server applied: version 8. A third gradient from version 7 is now late
    assert p.offer(grads(9.0), 7, 8, "w1").reason == REASON_LATE
    # round two starts empty: its mean has nothing of round one
    assert p.offer(grads(10.0), 8, 8, "w1").action == HOLD
    d2 = p.offer(grads(20.0), 8, 8, "w0")
    assert d2.action == APPLY and d2.grads is not None
    np.testing.assert_array_equal(d2.grads[0], np.full((2, 3), 15.0))
    np.testing.assert_array_equal(d2.grads[1], np.full((3,), 15.0))
    assert np.shares_memory(d2.grads[0], first_round)  # the preallocated buffer, reused
    assert p.counters["late"] == 2
    assert p.counters["updates"] == 2
    assert p.counters["applied"] == 4
    assert p.counters["aggregated"] == 4
    assert p.counters["offered"] == 6


def test_sync_duplicate_worker_in_a_round_is_dropped() -> None:
    p = SyncPolicy(2, 3)
    assert p.offer(grads(1.0), 0, 0, "w0").action == HOLD
    dup = p.offer(grads(100.0), 0, 0, "w0")
    assert (dup.action, dup.reason) == (DROP, REASON_DUPLICATE)
    d = p.offer(grads(3.0), 0, 0, "w1")
    assert d.action == APPLY and d.grads is not None
    np.testing.assert_array_equal(d.grads[1], np.full((3,), 2.0))
    assert p.counters["duplicate"] == 1


def test_sync_k1_applies_each_fresh_gradient_at_once() -> None:
    p = SyncPolicy(1, 2)
    d = p.offer(grads(5.0), 3, 3, "w0")
    assert d.action == APPLY and d.grads is not None
    np.testing.assert_array_equal(d.grads[0], 5.0)
    assert p.offer(grads(5.0), 3, 4, "w1").action == DROP


def test_sync_discards_held_gradients_when_the_version_moved_under_them() -> None:
    p = SyncPolicy(2, 2)
    assert p.offer(grads(1.0), 4, 4, "w0").action == HOLD
    # the version moved without this policy (e.g. a checkpoint restore): round 4 is gone
    assert p.offer(grads(2.0), 5, 5, "w1").action == HOLD
    assert p.counters["discarded"] == 1
    d = p.offer(grads(4.0), 5, 5, "w0")
    assert d.action == APPLY and d.grads is not None
    np.testing.assert_array_equal(d.grads[0], 3.0)


def test_sync_mean_keeps_float64_and_sums_float16_in_float32() -> None:
    p = SyncPolicy(2, 2)
    p.offer(grads(0.1, "float64"), 0, 0, "a")
    d = p.offer(grads(0.2, "float64"), 0, 0, "b")
    assert d.grads is not None and d.grads[0].dtype == np.float64
    np.testing.assert_array_equal(d.grads[0], (0.1 + 0.2) / 2)
    q = SyncPolicy(2, 2)
    q.offer(grads(2048.0, "float16"), 0, 0, "a")
    d = q.offer(grads(1.0, "float16"), 0, 0, "b")
    assert d.grads is not None and d.grads[0].dtype == np.float16
    # 2049 is not a float16 but the float32 sum is: (2048 + 1) / 2 = 1024.5 exactly
    np.testing.assert_array_equal(d.grads[0], np.float16(1024.5))


def test_sync_flush_applies_the_partial_round() -> None:
    p = SyncPolicy(3, 3)
    assert p.flush(2) is None
    p.offer(grads(1.0), 2, 2, "w0")
    p.offer(grads(2.0), 2, 2, "w1")
    assert p.flush(3) is None  # held for version 2, not 3
    d = p.flush(2)
    assert d is not None and d.action == APPLY and d.reason == REASON_FLUSH
    assert d.grads is not None
    np.testing.assert_array_equal(d.grads[0], 1.5)
    assert d.workers == ("w0", "w1")
    assert p.flush(2) is None
    assert AsyncPolicy().flush(0) is None


def test_sync_rejects_changed_shapes() -> None:
    p = SyncPolicy(2, 2)
    p.offer(grads(1.0), 0, 0, "w0")
    with pytest.raises(ValueError, match="shapes"):
        p.offer([np.zeros((3, 2), np.float32), np.zeros(3, np.float32)], 0, 0, "w1")


def test_describe() -> None:
    p = SyncPolicy(2, 3)
    p.offer(grads(1.0), 0, 0, "w0")
    doc = p.describe()
    assert doc["policy"] == "sync:2/3"
    assert doc["kind"] == "sync"
    assert (doc["aggregate"], doc["expected_workers"], doc["pending"]) == (2, 3, 1)
    assert doc["round_version"] == 0
    assert doc["counters"]["aggregated"] == 1
    assert BoundedPolicy(4).describe()["max_staleness"] == 4
    assert AsyncPolicy().describe() == {
        "policy": "async",
        "kind": "async",
        "counters": dict.fromkeys(AsyncPolicy().counters, 0),
    }


# ---------------------------------------------------------------- parser


@pytest.mark.parametrize(
    ("text", "cls", "spec"),
    [
        ("async", AsyncPolicy, "async"),
        (" ASYNC ", AsyncPolicy, "async"),
        ("staleness-aware", StalenessAwarePolicy, "staleness-aware"),
        ("bounded:0", BoundedPolicy, "bounded:0"),
        ("bounded:16", BoundedPolicy, "bounded:16"),
        ("sync:1/1", SyncPolicy, "sync:1/1"),
        ("sync:3/4", SyncPolicy, "sync:3/4"),
        ("ssp:0", SSPPolicy, "ssp:0"),
        ("SSP:3", SSPPolicy, "ssp:3"),
    ],
)
def test_parse_policy(text: str, cls: type, spec: str) -> None:
    p = parse_policy(text)
    assert type(p) is cls
    assert p.spec == spec == str(p)
    assert parse_policy(p.spec).spec == spec


def test_parse_policy_parameters() -> None:
    b = parse_policy("bounded:7")
    assert isinstance(b, BoundedPolicy) and b.max_staleness == 7
    s = parse_policy("sync:2/5")
    assert isinstance(s, SyncPolicy) and (s.aggregate, s.expected_workers) == (2, 5)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("bounded:-1", r"K >= 0"),
        ("bounded", r"bounded:K"),
        ("bounded:x", r"bounded:K"),
        ("bounded:1.5", r"bounded:K"),
        ("sync:5/3", r"1 <= K <= N.*K=5, N=3"),
        ("sync:0/2", r"1 <= K <= N.*K=0, N=2"),
        ("sync:1/0", r"N >= 1"),
        ("sync:-1/2", r"1 <= K <= N"),
        ("sync:2", r"sync:K/N"),
        ("sync", r"sync:K/N"),
        ("sync:a/b", r"sync:K/N"),
        ("ssp:-1", r"ssp:K needs K >= 0"),
        ("ssp", r"ssp:K with an integer"),
        ("ssp:1/2", r"ssp:K with an integer"),
        ("downpour", r"unknown policy 'downpour'.*async, staleness-aware, bounded:K.*ssp:K"),
        ("", r"unknown policy"),
        ("async:1", r"unknown policy"),
    ],
)
def test_parse_policy_errors(text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_policy(text)


def test_parse_policy_not_a_string() -> None:
    with pytest.raises(ValueError, match="string"):
        parse_policy(3)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "cls", "match"),
    [
        ("bounded:-1", BoundedPolicy, "bounded:K needs K >= 0"),
        ("ssp:-2", SSPPolicy, "ssp:K needs K >= 0"),
        ("sync:3/2", SyncPolicy, "sync:K/N needs 1 <= K <= N"),
    ],
)
def test_a_range_error_is_the_constructors_prefixed_with_the_text(
    text: str, cls: type, match: str
) -> None:
    """One place per check: parse_policy raises what the constructor raises, naming the text."""
    with pytest.raises(ValueError, match=match) as direct:
        cls(*[int(x) for x in text.split(":")[1].split("/")])
    with pytest.raises(ValueError, match=match) as parsed:
        parse_policy(text)
    assert str(parsed.value) == f"policy {text!r}: {direct.value}"


def test_every_form_in_the_registry_parses_and_is_listed() -> None:
    examples = {
        "async": "async",
        "staleness-aware": "staleness-aware",
        "bounded:K": "bounded:3",
        "ssp:K": "ssp:2",
        "sync:K/N": "sync:3/4",
        "dc:L": "dc:0.04",
        "dc-a:L": "dc-a:0.1",
        "gap-aware": "gap-aware",
        "momentum-aware[:B]": "momentum-aware:0.8",
        "lookahead[:A]": "lookahead:0.5",
        "momentum-aware[:B]+lookahead[:A]": "momentum-aware:0.8+lookahead:0.5",
        "dense=SPEC,rows=SPEC": "dense=sync:7/8,rows=async",
    }
    assert list(POLICIES.forms) == list(examples)
    for form, text in examples.items():
        assert parse_policy(text).spec == text
        assert form in POLICY_FORMS


def test_the_docs_table_of_policies_is_the_registry() -> None:
    docs = (Path(__file__).resolve().parents[1] / "docs" / "policies.md").read_text()
    assert POLICIES.table() in docs, (
        "docs/policies.md's table of forms differs from:\n" + POLICIES.table()
    )


# ---------------------------------------------------------------- ssp:K


def _push(p: SSPPolicy, worker: str, n: int = 1) -> None:
    """``n`` accepted pushes of ``worker``: each applied, whatever its staleness."""
    for _ in range(n):
        d = p.offer(grads(1.0), 0, 3, worker)
        assert d.action == APPLY and d.lr_scale == 1.0 and d.workers == (worker,)


def test_ssp_holds_a_pull_more_than_k_clocks_ahead_of_the_slowest_live_worker() -> None:
    p = SSPPolicy(2)
    live = {"fast", "slow"}
    assert p.pull_wait_ms("fast", 0, live) == 0  # both join at clock 0
    assert p.pull_wait_ms("slow", 0, live) == 0
    _push(p, "fast", 2)
    assert p.pull_wait_ms("fast", 0, live) == 0  # 2 ahead: within K
    assert p.pull_wait_ms("fast", 1, live) == SSP_RETRY_MS  # its third push is on its way
    _push(p, "fast")
    assert p.lead("fast") == 3
    assert p.pull_wait_ms("fast", 0, live) == SSP_RETRY_MS  # 3 ahead: waits
    assert p.pull_wait_ms("slow", 0, live) == 0  # the slowest is never held
    _push(p, "slow")
    assert p.pull_wait_ms("fast", 0, live) == 0  # the slowest caught up to within K
    assert p.counters["held_pulls"] == 2
    assert p.counters["applied"] == p.counters["updates"] == 4  # nothing dropped, ever
    assert p.describe()["clocks"] == {"fast": 3, "slow": 1}
    assert p.describe()["max_lead"] == 2


def test_ssp_k0_is_lockstep_and_the_slowest_is_never_held_even_with_pushes_in_flight() -> None:
    p = SSPPolicy(0)
    live = {"a", "b"}
    p.pull_wait_ms("a", 0, live)
    p.pull_wait_ms("b", 0, live)
    _push(p, "a")
    assert p.pull_wait_ms("a", 0, live) == SSP_RETRY_MS
    # b is the slowest: not held, even if it claims pushes the server never received
    assert p.pull_wait_ms("b", 5, live) == 0
    _push(p, "b")
    assert p.pull_wait_ms("a", 0, live) == 0 and p.pull_wait_ms("b", 0, live) == 0


def test_ssp_a_worker_not_alive_stops_holding_the_others_and_rejoins_at_the_slowest() -> None:
    p = SSPPolicy(1)
    p.pull_wait_ms("fast", 0, {"fast", "slow"})
    p.pull_wait_ms("slow", 0, {"fast", "slow"})
    _push(p, "fast", 5)
    assert p.pull_wait_ms("fast", 0, {"fast", "slow"}) == SSP_RETRY_MS
    assert p.pull_wait_ms("fast", 0, {"fast"}) == 0  # slow went missing: forgotten
    assert "slow" not in p.clocks
    _push(p, "fast", 5)
    # back (a restart, or a long pause): it starts at the slowest live clock, so it neither
    # waits for the others nor holds them back for the steps it missed
    assert p.pull_wait_ms("slow", 0, {"fast", "slow"}) == 0
    assert p.clocks["slow"] == p.clocks["fast"] == 10
    assert p.pull_wait_ms("fast", 0, {"fast", "slow"}) == 0


def test_ssp_a_newcomer_starts_at_the_slowest_clock_and_a_lone_worker_never_waits() -> None:
    p = SSPPolicy(1)
    assert p.pull_wait_ms("a", 0, {"a"}) == 0
    _push(p, "a", 10)
    assert p.pull_wait_ms("a", 3, {"a"}) == 0  # alone: nobody to wait for
    _push(p, "b")  # a first push, before any pull: joins at a's clock, then ticks
    assert p.clocks == {"a": 10, "b": 11}
    _push(p, "c")  # joins at the slowest (10)
    assert p.clocks["c"] == 11
    assert p.lead("b") == 1 and p.pull_wait_ms("b", 0, {"a", "b", "c"}) == 0
