"""The hybrid policy, ``services/server/policies/hybrid.py``: its text, its two halves through a
real ``ParameterState`` and the gradient handler (a fixed table and a dynamic one), the push
accounting, and two in-process workers training under it."""

from __future__ import annotations

import argparse
import contextlib
from typing import Any

import numpy as np
import pytest
from conftest import wait_until
from inproc import WorkerThread, make_worker, serving
from test_server_handlers import frames
from tiny_models import embedding_form, hashed

from downpour import wire
from downpour.cli.status import fetch_status
from downpour.server.handlers import HandlerContext, handle_gradients, handle_request
from downpour.server.policies.base import (
    APPLY,
    DENSE,
    DROP,
    HOLD,
    REASON_LATE,
    ROWS,
    AsyncPolicy,
    BoundedPolicy,
    SyncPolicy,
    parse_policy,
)
from downpour.server.policies.hybrid import HybridPolicy
from downpour.server.registry import WorkerRegistry
from downpour.server.settings import policy_text
from downpour.server.state import ParameterState
from downpour.server.status_doc import build_status

LR = 0.5
FIXED = embedding_form("tensor")
DYNAMIC = embedding_form("tensor", dynamic=True)

# ---------------------------------------------------------------- the text


@pytest.mark.parametrize(
    ("text", "dense", "rows", "spec"),
    [
        ("dense=sync:7/8,rows=async", SyncPolicy, AsyncPolicy, "dense=sync:7/8,rows=async"),
        (" Rows=bounded:8, dense=async ", AsyncPolicy, BoundedPolicy, "dense=async,rows=bounded:8"),
        ("dense=ssp:2,rows=staleness-aware", None, None, "dense=ssp:2,rows=staleness-aware"),
    ],
)
def test_parse_hybrid(text: str, dense: type | None, rows: type | None, spec: str) -> None:
    p = parse_policy(text)
    assert isinstance(p, HybridPolicy) and p.spec == spec and parse_policy(p.spec).spec == spec
    if dense is not None:
        assert type(p.dense) is dense and type(p.rows) is rows
    assert p.caps.holds_pulls == (p.dense.kind == "ssp")  # ssp's pull gate is the dense half's


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("dense=sync:2/2", "the rows half is missing"),
        ("rows=async", "the dense half is missing"),
        ("dense=async,rows=sync:2/2", "rows half must be one of async, staleness-aware, bounded"),
        ("dense=async,rows=lookahead", "rows half must be one of"),
        ("dense=async,rows=dc:0.5", "rows half must be one of"),
        ("dense=async,rows=ssp:2", "rows half must be one of"),
        ("dense=momentum-aware,rows=async", "dense half must be one of"),
        ("dense=async,rows=async,colour=async", "'colour=async' is not dense=SPEC nor rows=SPEC"),
        ("dense=async,dense=sync:1/1,rows=async", "names its dense half once"),
        ("dense=rows=async,rows=async", "is one policy"),
        ("dense=sync:3/2,rows=async", r"1 <= K <= N"),
        ("dense=async,rows=bounded:x", "bounded:K with an integer"),
    ],
)
def test_hybrid_refusals_name_what_is_wrong(text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match) as err:
        parse_policy(text)
    assert str(err.value).startswith(f"policy {text!r}: ")


def test_a_bad_hybrid_on_the_command_line_is_a_usage_error() -> None:
    assert policy_text(" DENSE=sync:2/2,rows=async") == "dense=sync:2/2,rows=async"
    with pytest.raises(argparse.ArgumentTypeError, match="rows half must be one of"):
        policy_text("dense=async,rows=sync:2/2")


# ---------------------------------------------------------------- the policy alone


def row_grads(n: int, value: float = 1.0) -> list[np.ndarray]:
    return [np.full((2, 3), value, np.float32) for _ in range(n)]


def test_a_push_without_a_dense_half_is_decided_by_the_rows_policy_and_counts_for_no_round() -> (
    None
):
    p = parse_policy("dense=sync:2/2,rows=async")
    p.layout([True])  # a shard holding only table rows
    for i, w in enumerate("abc"):
        d = p.offer(row_grads(1), i, i, w)
        assert (d.action, d.part, d.rows) == (APPLY, ROWS, None)
    doc = p.describe()
    assert doc["counters"]["no_dense"] == 3 and doc["counters"]["dense_offered"] == 0
    assert doc["dense"]["pending"] == 0 and p.flush(3) is None


def test_the_dense_half_sees_staleness_in_dense_updates_only() -> None:
    """Versions as the server makes them (rows first, then dense, one step each): a sync round
    is not broken by the row applies under it, and a push from before a dense update is late
    however many row applies happened since."""
    p = parse_policy("dense=sync:2/2,rows=async")
    p.layout([True, False])
    v = 0
    d = p.offer(row_grads(2), 0, v, "a")  # rows applied: v 1; dense held
    assert (d.action, d.rows.action, d.part) == (HOLD, APPLY, DENSE)
    v += 1
    d = p.offer(row_grads(2), 0, v, "b")  # base 0 is 1 behind, but no dense update since
    assert (d.action, d.reason, d.rows.action) == (APPLY, "aggregated", APPLY)
    v += 2  # rows, then the round
    assert p.dense_staleness(0) == 1 and p.dense_staleness(2) == 1 and p.dense_staleness(3) == 0
    d = p.offer(row_grads(2), 2, v, "a")  # from before the round's update: late
    assert (d.action, d.reason, d.rows.action) == (DROP, REASON_LATE, APPLY)
    v += 1
    d = p.offer(row_grads(2), 3, v, "c")  # after it: held in the next round
    assert d.action == HOLD
    c = p.describe()["counters"]
    assert c["updates"] == 5 == c["rows_updates"] + c["dense_updates"]


# ---------------------------------------------------------------- a real state, the handler


def make_ctx(spec: Any, policy: str, optimizer: str = "sgd") -> HandlerContext:
    state = ParameterState(spec, optimizer, LR, seed=0)
    return HandlerContext(
        state=state,
        policy=parse_policy(policy),
        registry=WorkerRegistry(missing_after_s=10.0, gone_after_s=60.0),
        model=spec.name,
        incarnation="inc-1",
        shard={"shard": 0, "num_shards": 1, "partition": state.partition.digest},
        push_port=6001,
        status_port=6002,
        limits=wire.DEFAULT_LIMITS.for_payload(state.payload_bytes),
    )


IDS = np.array([3, 60, 140], np.int64)


def push(ctx: HandlerContext, sender: str, seq: int, base: int, value: float) -> Any:
    """One push of gradient ``value`` everywhere: rows ``IDS`` of the table (keyed by their
    hashes for a dynamic one) and the whole of each dense variable."""
    st = ctx.state
    tensors: dict[str, Any] = {}
    for name, shape, sparse, dyn in zip(st.names, st.shapes, st.sparse, st.dynamic, strict=True):
        rows = np.full((IDS.size, *shape[1:]), value, np.float32)
        if dyn:
            tensors[name] = wire.Keyed(hashed(IDS), rows, shape)
        elif sparse:
            tensors[name] = wire.Sparse(IDS, rows, shape)
        else:
            tensors[name] = np.full(shape, value, np.float32)
    msg = wire.push_message(sender, seq, base, wire.PushBody(), tensors)
    out = handle_gradients(frames(msg), ctx)
    assert out.rejection is None, out.rejection
    return out.decision


def rows_and_dense(ctx: HandlerContext) -> tuple[np.ndarray, list[np.ndarray]]:
    st = ctx.state
    (table,) = st.row_parts
    rows = st.gather(table, hashed(IDS) if st.dynamic[table] else IDS)
    _, weights = st.dense_weights()
    return rows, [weights[i].copy() for i in st.dense_parts]


@pytest.mark.parametrize("spec", [FIXED, DYNAMIC], ids=["fixed", "dynamic"])
def test_dense_rounds_wait_for_k_dense_pushes_while_rows_are_applied_at_once(spec: Any) -> None:
    ctx = make_ctx(spec, "dense=sync:2/2,rows=async")
    rows0, dense0 = rows_and_dense(ctx)

    d = push(ctx, "a", 1, 0, 1.0)  # rows at once (version 1); dense held for the round
    assert (d.action, d.rows.action) == (HOLD, APPLY) and ctx.state.version == 1
    rows1, dense1 = rows_and_dense(ctx)
    np.testing.assert_allclose(rows0 - rows1, LR * 1.0, rtol=1e-5)
    assert all(np.array_equal(a, b) for a, b in zip(dense0, dense1, strict=True))

    d = push(ctx, "b", 1, 0, 3.0)  # computed before a's rows moved: still the round's
    assert (d.action, d.rows.action) == (APPLY, APPLY) and ctx.state.version == 3
    rows2, dense2 = rows_and_dense(ctx)
    np.testing.assert_allclose(rows1 - rows2, LR * 3.0, rtol=1e-5)
    for a, b in zip(dense0, dense2, strict=True):
        np.testing.assert_allclose(a - b, LR * 2.0, rtol=1e-5)  # the mean of 1 and 3, once

    d = push(ctx, "a", 2, 1, 5.0)  # from before the round's update: dense late, rows applied
    assert (d.action, d.reason, d.rows.action) == (DROP, REASON_LATE, APPLY)
    rows3, dense3 = rows_and_dense(ctx)
    np.testing.assert_allclose(rows2 - rows3, LR * 5.0, rtol=1e-5)
    assert all(np.array_equal(a, b) for a, b in zip(dense2, dense3, strict=True))
    doc = ctx.policy.describe()
    assert doc["dense_version"] == 1 and ctx.state.version == 4
    assert doc["rows"]["counters"]["applied"] == 3 and doc["dense"]["counters"]["applied"] == 2


def pulled_dense_version(ctx: HandlerContext, have: int = -1, row_ids: bool = False) -> Any:
    """What a pull reply of the handler says as ``dense_version`` (whole weights, unchanged,
    or a row request)."""
    body = wire.PullRequest(have, ctx.incarnation) if have >= 0 else None
    (table,) = ctx.state.row_parts
    rows = {ctx.state.names[table]: IDS} if row_ids else None
    reply = wire.decode(
        frames(handle_request(frames(wire.pull_request("a", body, rows)), ctx).message)
    )
    return wire.PullReply.from_body(reply.body).dense_version


def test_pull_replies_carry_the_dense_updates_under_a_hybrid_only() -> None:
    """A worker waits on ``dense_version`` after a push to a sync dense half: every kind of
    pull reply carries it under a hybrid (whole, unchanged, rows), it moves with dense
    updates only, and a plain policy's replies leave it out."""
    ctx = make_ctx(FIXED, "dense=sync:2/2,rows=async")
    assert pulled_dense_version(ctx) == 0
    push(ctx, "a", 1, 0, 1.0)  # rows applied, dense held: the version moves, dense does not
    assert ctx.state.version == 1
    assert [pulled_dense_version(ctx, 1), pulled_dense_version(ctx, row_ids=True)] == [0, 0]
    push(ctx, "b", 1, 0, 3.0)  # the round completes
    assert ctx.state.version == 3
    assert [pulled_dense_version(ctx), pulled_dense_version(ctx, 3)] == [1, 1]
    assert pulled_dense_version(ctx, row_ids=True) == 1
    plain = make_ctx(FIXED, "sync:2/2")
    assert pulled_dense_version(plain) is None
    assert "dense_version" not in wire.PullReply("i").to_body()
    rows_only = parse_policy("dense=sync:2/2,rows=async")
    rows_only.layout([True])  # a shard holding table rows only: nothing to wait for
    assert rows_only.dense_version is None


@pytest.mark.parametrize(
    ("policy", "dense", "sync", "ssp"),
    [
        ("dense=sync:7/8,rows=async", "sync:7/8", True, False),
        ("dense=ssp:2,rows=bounded:8", "ssp:2", False, True),
        ("dense=async,rows=async", "async", False, False),
        ("sync:2/4", "sync:2/4", True, False),
        ("ssp:3", "ssp:3", False, True),
        ("async", "async", False, False),
    ],
)
def test_a_worker_reads_its_dense_policy_from_the_hello(
    policy: str, dense: str, sync: bool, ssp: bool
) -> None:
    """The worker waits for rounds (``sync``) and counts its pushes for pull holds
    (``ssp``) by the policy its dense variables follow: a hybrid's dense half."""
    import zmq

    from downpour.model.partition import make_partition
    from downpour.net.cluster import ShardSet

    partition = make_partition(["v"], [(4,)], ["float32"], 1, "f")
    shards = ShardSet(zmq.Context.instance(), [("127.0.0.1", 1)], partition, sender="w")
    try:
        shards.policy = policy
        assert (shards.dense_policy, shards.sync, shards.ssp) == (dense, sync, ssp)
        assert shards.hybrid is ("=" in policy)
    finally:
        shards.close()


@pytest.mark.parametrize("optimizer", ["adam", "adagrad"])
def test_a_rows_apply_leaves_the_dense_variables_alone(optimizer: str) -> None:
    """Adam moves a variable with a zero gradient (its momentum): a rows apply must not feed
    the dense variables at all, whichever optimizer (Keras's Adam, or the row-wise Adagrad)."""
    ctx = make_ctx(FIXED, "dense=sync:2/2,rows=async", optimizer)
    push(ctx, "a", 1, 0, 1.0)  # a round to move Adam's moments
    push(ctx, "b", 1, 0, 1.0)
    rows0, dense0 = rows_and_dense(ctx)
    d = push(ctx, "a", 2, ctx.state.version, 1.0)  # rows applied, dense held
    assert (d.action, d.rows.action) == (HOLD, APPLY)
    rows1, dense1 = rows_and_dense(ctx)
    assert not np.allclose(rows0, rows1)
    assert all(np.array_equal(a, b) for a, b in zip(dense0, dense1, strict=True))


def test_every_gradient_offered_under_hybrid_is_applied_dropped_discarded_or_held() -> None:
    """Pushes from four workers with random base versions (some too old for the rows' bound,
    some late for the round, repeats in a round): each half's identity, the push count, the
    version steps and every worker's record add up."""
    ctx = make_ctx(DYNAMIC, "dense=sync:2/3,rows=bounded:2")
    rng = np.random.default_rng(5)
    seqs = dict.fromkeys("abcd", 0)
    for _ in range(60):
        w = str(rng.choice(list(seqs)))
        seqs[w] += 1
        base = max(0, ctx.state.version - int(rng.integers(0, 5)))
        push(ctx, w, seqs[w], base, float(rng.normal()))
    doc = build_status(ctx, now=1.0, started=0.0, started_wall=0.0)
    pol = doc["policy"]
    c, dense, rows = pol["counters"], pol["dense"]["counters"], pol["rows"]["counters"]
    assert c["offered"] == dense["offered"] == rows["offered"] == 60
    assert rows["offered"] == rows["applied"] + rows["dropped_stale"]
    assert dense["offered"] == dense["aggregated"] + dense["late"] + dense["duplicate"]
    assert dense["aggregated"] == dense["applied"] + dense["discarded"] + pol["dense"]["pending"]
    assert dense["applied"] == 2 * dense["updates"]
    assert min(rows["dropped_stale"], dense["late"], dense["duplicate"], dense["updates"]) > 0
    assert doc["version"] == c["updates"] == rows["updates"] + dense["updates"]
    # the workers' records count each push once, by its dense half: dropped, held for a
    # round, or the round's completing push (the round's K gradients are credited applied)
    recs = doc["workers"].values()
    assert {w: r["pushes"] for w, r in doc["workers"].items()} == seqs
    held, dropped = sum(r["held"] for r in recs), sum(r["dropped"] for r in recs)
    assert sum(seqs.values()) == dropped + held + dense["updates"]
    assert dropped == dense["late"] + dense["duplicate"]
    assert dense["aggregated"] == held + dense["updates"]
    assert sum(r["applied"] for r in recs) == dense["applied"]


# ---------------------------------------------------------------- training


def test_two_workers_train_a_dynamic_table_under_a_sync_dense_half() -> None:
    """A dynamic table's server takes a hybrid whose dense half is sync (plain sync it
    refuses): rows applied as they come, dense rounds of 2, and the model learns."""
    config = {"policy": "dense=sync:2/2,rows=async", "optimizer": "sgd", "learning_rate": 0.5}
    with serving(DYNAMIC, **config) as server:
        workers = [
            WorkerThread(make_worker(server.port, DYNAMIC, worker_id=f"w{i}", steps=60))
            for i in range(2)
        ]
        sums = [w.result() for w in workers]
        doc = wait_until(
            lambda: (
                (d := fetch_status(server.status))["policy"]["counters"]["offered"] == 120 and d
            ),
            30,
            "120 pushes offered",
        )
    pol = doc["policy"]
    rows, dense = pol["rows"]["counters"], pol["dense"]["counters"]
    assert rows["applied"] == 120  # every push's rows, at once
    assert dense["applied"] == 2 * dense["updates"] and dense["updates"] >= 10
    assert doc["version"] == rows["updates"] + dense["updates"]
    assert all(s["held_out"] is not None and s["held_out"] > 0.9 for s in sums), sums


@pytest.mark.parametrize(
    ("form", "dynamic", "shards"),
    [("tensor", False, 1), ("list", False, 3), ("dict", True, 1)],
    ids=["tensor-fixed-1-shard", "list-fixed-3-shards", "dict-dynamic-1-shard"],
)
def test_workers_wait_for_each_dense_round_while_their_rows_apply_at_once(
    form: str, dynamic: bool, shards: int
) -> None:
    """Under ``dense=sync:2/2,rows=async`` a worker waits after each push until the dense
    round it pushed to is applied, as under plain ``sync:K/N``: with two workers of equal
    steps every dense half joins its round (none late, none a duplicate), while every
    push's rows are applied when it arrives. The pull replies' ``dense_version`` is what
    they wait on; a shard that holds no dense variable reports none and is not waited for
    (over 3 shards the last holds only table rows)."""
    spec = embedding_form(form, dynamic=dynamic)
    steps = 60
    config = {"policy": "dense=sync:2/2,rows=async", "optimizer": "sgd", "learning_rate": 0.5}
    with contextlib.ExitStack() as stack:
        servers = [
            stack.enter_context(serving(spec, num_shards=shards, shard=k, **config))
            for k in range(shards)
        ]
        ports = [s.port for s in servers]
        workers = [
            WorkerThread(make_worker(ports, spec, worker_id=f"w{i}", steps=steps)) for i in range(2)
        ]
        sums = [w.result() for w in workers]
        docs = [
            wait_until(
                lambda s=s: (
                    (d := fetch_status(s.status))["policy"]["counters"]["offered"] == 2 * steps
                    and d
                ),
                30,
                f"{2 * steps} pushes offered",
            )
            for s in servers
        ]
    assert all(s["sync_wait_timeouts"] == 0 for s in sums), sums
    with_dense = [d for d in docs if d["policy"]["counters"]["no_dense"] == 0]
    with_rows = [d for d in docs if d["policy"]["rows"]["counters"]["offered"] > 0]
    assert len(with_dense) == min(shards, 2) and with_rows
    for doc in with_rows:  # every push's rows, when it arrived
        assert doc["policy"]["rows"]["counters"]["applied"] == 2 * steps
    for doc in docs:
        assert doc["version"] == doc["policy"]["counters"]["updates"]
    for doc in with_dense:
        dense = doc["policy"]["dense"]["counters"]
        assert dense["late"] == 0 and dense["duplicate"] == 0, dense
        assert dense["applied"] == 2 * steps and doc["policy"]["dense_version"] == steps
    assert all(s["held_out"] is not None and s["held_out"] > 0.9 for s in sums), sums
    assert all(s["notices"] == [] for s in sums), sums  # a rows-only shard is no old server


def test_a_hybrid_sync_worker_says_when_a_server_sends_no_dense_version(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A server whose pull replies carry no ``dense_version`` under ``dense=sync:K/N`` (one
    older than the worker) leaves the worker nothing to wait on: the worker says so at
    warning level, and its pushes carry the notice into the server's status, where
    ``downpour status`` prints it."""
    from downpour.cli.status import render

    monkeypatch.setattr(HybridPolicy, "dense_version", property(lambda self: None))
    config = {"policy": "dense=sync:2/2,rows=async", "optimizer": "sgd", "learning_rate": 0.5}
    with serving(FIXED, **config) as server:
        summary = WorkerThread(make_worker(server.port, FIXED, worker_id="w0", steps=4)).result(120)
        doc = wait_until(
            lambda: (d := fetch_status(server.status))["workers"]["w0"]["notices"] and d,
            30,
            "the worker's notice in the status",
        )
    (notice,) = summary["notices"]
    assert "carry no dense_version" in notice and "dense=sync:2/2,rows=async" in notice
    assert doc["workers"]["w0"]["notices"] == [notice]
    assert f"WARNING: worker w0: {notice}" in render(doc).splitlines()


@pytest.mark.parametrize("wait", [True, False], ids=["waits", "sync-wait-0"])
def test_a_fast_worker_follows_the_slow_ones_dense_rounds_unless_told_not_to_wait(
    wait: bool,
) -> None:
    """Two workers under ``dense=sync:2/2,rows=async``, one computing a step only when the
    test grants it. Waiting (the default), the fast one is never more than one push ahead:
    each of its pushes waits for the slow one's to complete the round, and no dense half is
    late or a duplicate. With ``--sync-wait 0`` it does not wait: it finishes all its steps
    while the slow one has made none, its rows applied at once and every dense half after
    its first dropped as a duplicate of its held one."""
    from test_policies_integration import GatedStep

    steps = 6
    config = {"policy": "dense=sync:2/2,rows=async", "optimizer": "sgd", "learning_rate": 0.5}
    with serving(FIXED, **config) as server:
        slow_worker = make_worker(server.port, FIXED, worker_id="slow", steps=steps)
        gate = GatedStep(slow_worker.step_fn)
        slow_worker.step_fn = gate  # type: ignore[assignment]
        slow = WorkerThread(slow_worker)
        fast = WorkerThread(
            make_worker(
                server.port, FIXED, worker_id="fast", steps=steps, sync_wait_s=60 if wait else 0
            )
        )
        try:

            def pushes() -> tuple[int, int]:
                workers = fetch_status(server.status)["workers"]
                got = tuple(int(workers.get(w, {}).get("pushes", 0)) for w in ("fast", "slow"))
                if wait:
                    assert got[0] - got[1] <= 1, got  # never further ahead, at every look
                return got

            if wait:
                wait_until(lambda: pushes() == (1, 0), 60, "the fast worker's first push")
                for k in range(1, steps + 1):
                    gate.grants.release()
                    ahead = min(k + 1, steps)
                    wait_until(lambda k=k, a=ahead: pushes() == (a, k), 60, f"slow push {k}")
            else:
                fast_summary = fast.result(120)  # all its steps, the slow one at none
                assert fast_summary["steps"] == steps
                wait_until(lambda: pushes() == (steps, 0), 60, "the fast worker's pushes taken")
                for _ in range(steps):
                    gate.grants.release()
        finally:
            for _ in range(steps):
                gate.grants.release()
        sums = [fast.result(120), slow.result(120)]
        doc = wait_until(
            lambda: (
                (d := fetch_status(server.status))["policy"]["counters"]["offered"] == 2 * steps
                and d
            ),
            30,
            "every push offered",
        )
    pol = doc["policy"]
    dense, rows = pol["dense"]["counters"], pol["rows"]["counters"]
    assert rows["applied"] == 2 * steps  # rows at once, waiting or not
    if wait:
        assert dense["late"] == dense["duplicate"] == 0 and dense["applied"] == 2 * steps
        assert all(s["sync_wait_timeouts"] == 0 for s in sums)
    else:
        assert dense["duplicate"] >= steps - 1 and dense["applied"] < 2 * steps


def test_a_dense_ssp_half_holds_the_fast_worker_within_k_of_the_slow_one() -> None:
    """``dense=ssp:2,rows=async``: the worker reads the dense half from the hello and
    counts its pushes in its pulls, as under plain ``ssp:2``, so the server holds the fast
    one's pull at K + 1 pushes ahead of the slow one (the dense half's clocks), no further,
    and it follows the slow one step by step."""
    from test_policies_integration import GatedStep, follow_the_slow_worker

    k = 2
    config = {"policy": f"dense=ssp:{k},rows=async", "optimizer": "sgd", "learning_rate": 0.5}
    with serving(FIXED, **config) as server:
        slow_worker = make_worker(server.port, FIXED, worker_id="slow", steps=100_000)
        gate = GatedStep(slow_worker.step_fn)
        slow_worker.step_fn = gate  # type: ignore[assignment]
        slow = WorkerThread(slow_worker)
        fast = WorkerThread(make_worker(server.port, FIXED, worker_id="fast", steps=100_000))
        try:
            follow_the_slow_worker(server.status, k, gate, lambda doc: doc["policy"]["dense"])
            assert fast.worker.shards.ssp and fast.worker.shards.hybrid
        finally:
            slow.worker.stop()
            fast.worker.stop()
            for _ in range(5):
                gate.grants.release()
        assert fast.result(60)["ssp_waits"] > 0
        slow.result(60)
