"""A server's dynamic tables through its handlers and its state: admission, eviction by
idleness and by capacity (counted, re-touched ids starting again from their initial values),
hostile row requests and pushes refused and counted with nothing changed, and the tables in
``downpour status`` and on ``/metrics``."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from conftest import wait_until
from inproc import serving, train
from test_row_pulls import frames, make_ctx
from tiny_models import embedding_form, hashed

from downpour import wire
from downpour.cli.status import fetch_status, render
from downpour.server.handlers import HandlerContext, handle_gradients, handle_request
from downpour.server.observers.prometheus import render_text
from downpour.server.state import ParameterState, TableOptions
from downpour.spec import load_spec

TABLE = "embed/embeddings"
LR = 0.5
SPEC = embedding_form("tensor", dynamic=True)
IDS = hashed(np.arange(20))


def state_of(**options: Any) -> ParameterState:
    return ParameterState(SPEC, "sgd", LR, table_options=TableOptions(**options))


def push(state: ParameterState, ids: np.ndarray, value: float = 1.0, counts: Any = None) -> None:
    """One update: these ids' rows get gradient ``value`` (``counts``: the lookups each
    sums, as a worker pushes them), the dense variables zeros."""
    grads = [
        wire.Keyed(ids, np.full((ids.size, 8), value, np.float32), shape, counts) if dyn
        else np.zeros(shape, np.float32)
        for shape, dyn in zip(state.shapes, state.dynamic, strict=True)
    ]  # fmt: skip
    state.apply(grads)


def test_an_id_seen_fewer_times_than_admit_after_has_no_row_and_its_gradients_are_dropped() -> None:
    state = state_of(admit_after=3)
    table = state.tables[TABLE]
    one = IDS[:1]
    initial = state.gather(0, one)
    push(state, one)
    push(state, one)
    assert len(table) == 0 and table.counters["refused"] == 2
    np.testing.assert_array_equal(state.gather(0, one), initial)  # both gradients dropped
    push(state, one)  # the third sighting creates the row and applies that gradient only
    assert len(table) == 1 and table.counters["admitted"] == 1
    np.testing.assert_allclose(state.gather(0, one), initial - LR, rtol=1e-6)


def test_a_pushed_rows_lookups_count_for_admission() -> None:
    """A worker pushes each id once with the lookups it sums: three lookups in one batch
    admit an id under --admit-after 3 at once, and its row counts them."""
    state = state_of(admit_after=3)
    table = state.tables[TABLE]
    ids = IDS[:2]
    initial = state.gather(0, ids)
    push(state, ids, counts=np.array([3, 2], np.int32))
    assert len(table) == 1 and table.counters["admitted"] == 1
    assert table.counters["refused"] == 2  # the other id's two lookups
    after = state.gather(0, ids)
    np.testing.assert_allclose(after[0], initial[0] - LR, rtol=1e-6)
    np.testing.assert_array_equal(after[1], initial[1])
    assert table.export_state()["counts"].tolist() == [3]


def test_rows_idle_for_n_versions_are_evicted_and_start_again_from_their_initial_value() -> None:
    state = state_of(idle_versions=4)
    table = state.tables[TABLE]
    cold, hot = IDS[:1], IDS[1:2]
    initial = state.gather(0, cold)
    push(state, cold)
    for _ in range(5):
        push(state, hot)
    assert table.counters["evicted_idle"] == 1 and len(table) == 1  # cold went, hot stays
    np.testing.assert_array_equal(state.gather(0, cold), initial)
    push(state, cold)
    np.testing.assert_allclose(state.gather(0, cold), initial - LR, rtol=1e-6)


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_a_full_table_evicts_by_its_policy_and_counts_it(policy: str) -> None:
    state = state_of(shard_rows=10, evict=policy, admission="always")
    table = state.tables[TABLE]
    often = IDS[:1]
    for _ in range(3):
        push(state, often)  # touched three times, first
    push(state, IDS[1:10])  # 10 live rows: full
    push(state, IDS[10:11])  # one more: exactly one victim
    assert len(table) == 10 and table.counters["evicted_capacity"] == 1
    kept = set(table.export_state()["ids"].tolist())
    # lru: the least recently updated goes (often); lfu: the least often touched (one of
    # the batch), so often stays
    assert (int(often[0]) in kept) == (policy == "lfu")


def _push_frames(ctx: HandlerContext, table: Any, seq: int = 1) -> list[bytes]:
    tensors = {
        n: table if dyn else np.zeros(s, np.float32)
        for n, s, dyn in zip(ctx.state.names, ctx.state.shapes, ctx.state.dynamic, strict=True)
    }
    return frames(wire.push_message("w0", seq, 0, wire.PushBody(), tensors))


def test_every_int64_is_an_id_and_hostile_requests_are_refused_counted_and_change_nothing() -> None:
    ctx = make_ctx("tiny_models:dynamic_tensor", max_pull_rows=1000)
    extremes = np.array([-(2**63), -1, 0, 2**63 - 1], np.int64)
    reply = wire.decode(frames(handle_request(frames(wire.pull_request("w0", None, {
        TABLE: extremes})), ctx).message))  # fmt: skip
    assert isinstance(reply.tensors[TABLE], wire.Keyed)
    np.testing.assert_array_equal(reply.tensors[TABLE].indices, np.sort(extremes))
    hostile = {
        wire.R_ROWS_DTYPE: {TABLE: np.array([1.5, 2.5])},
        wire.R_ROWS_TOO_MANY: {TABLE: np.arange(1001, dtype=np.int64)},
    }
    for code, rows in hostile.items():
        raw = frames(wire.pull_request("w0", None, rows))
        got = wire.decode(frames(handle_request(raw, ctx).message))
        assert got.type == wire.ERROR and got.body["code"] == code, got.body
    nested = frames(wire.pull_request("w0", None, {TABLE: np.zeros((2, 2), np.int64)}))
    got = wire.decode(frames(handle_request(nested, ctx).message))
    assert got.body["code"] == wire.R_ROWS_DTYPE
    ids = IDS[:2]
    bad_pushes = [
        wire.Keyed(ids, np.full((2, 8), np.nan, np.float32), (1000, 8)),  # NaN
        wire.Keyed(ids, np.ones((2, 8), np.float64), (1000, 8)),  # dtype
        wire.Sparse(np.array([0, 1]), np.ones((2, 8), np.float32), (1000, 8)),  # not keyed
        np.ones((1000, 8), np.float32),  # whole
        wire.Keyed(ids, np.ones((2, 8), np.float32), (1000, 8), np.array([2, 0])),  # 0 lookups
    ]
    for seq, t in enumerate(bad_pushes, 1):
        outcome = handle_gradients(_push_frames(ctx, t, seq), ctx)
        assert outcome.decision is None, t
    assert sum(ctx.stats.rejected.values()) == len(bad_pushes) + len(hostile) + 1
    assert ctx.stats.rejected[wire.R_COUNTS] == 1
    assert ctx.state.version == 0 and len(ctx.state.tables[TABLE]) == 0
    good = wire.Keyed(ids, np.ones((2, 8), np.float32), (1000, 8), np.array([2, 1]))
    assert handle_gradients(_push_frames(ctx, good, 9), ctx).decision is not None
    assert ctx.state.version == 1 and len(ctx.state.tables[TABLE]) == 2
    assert sorted(ctx.state.tables[TABLE].export_state()["counts"].tolist()) == [1, 2]


@pytest.mark.parametrize("compress", ["none", "bf16"])
def test_the_gradient_socket_takes_a_counted_push_of_every_row(compress: str) -> None:
    """The gradient socket's bound (``socket_bounds``) and the payload limit hold the
    largest push a worker sends: every declared row of every dynamic table, each id once
    with its count (3 frames a table), here to shard 1 of 2 of the hashed click model (four
    dynamic tables beside one dense slice), received whole through a real socket and
    applied."""
    import zmq

    from downpour.net.receive import Oversize, recv_bounded
    from downpour.server.handlers import socket_bounds
    from downpour.worker.compress import parse_compression

    model = "downpour.examples.recsys_hashed:spec"
    ctx = make_ctx(model)
    state = ParameterState(load_spec(model), "sgd", LR, shard=1, num_shards=2)
    assert state.dynamic == [True, True, True, True, False]
    ctx.state, ctx.limits = state, wire.DEFAULT_LIMITS.for_payload(state.payload_bytes)
    ctx.shard = {"shard": 1, "num_shards": 2, "partition": state.partition.digest}
    _, bound = socket_bounds(ctx)
    grads: list[Any] = []
    for shape, dynamic in zip(state.shapes, state.dynamic, strict=True):
        ids = hashed(np.arange(shape[0]))
        values = np.ones(shape, np.float32)
        grads.append(wire.Keyed(ids, values, shape, np.full(shape[0], 3)) if dynamic else values)
    tensors = dict(zip(state.names, parse_compression(compress).compress(grads), strict=True))
    sent = wire.encode(wire.push_message("w0", 1, 0, wire.PushBody(), tensors))
    assert len(sent) == 1 + 4 * 3 + 1 <= bound.frames
    context = zmq.Context()
    try:
        a, b = context.socket(zmq.PAIR), context.socket(zmq.PAIR)
        a.setsockopt(zmq.LINGER, 0)
        b.setsockopt(zmq.LINGER, 0)
        b.connect(f"tcp://127.0.0.1:{a.bind_to_random_port('tcp://127.0.0.1')}")
        a.send_multipart(sent, copy=False)
        got = recv_bounded(b, bound)
        a.close()
        b.close()
    finally:
        context.term()
    assert not isinstance(got, Oversize), got
    outcome = handle_gradients([f.bytes for f in got], ctx)
    assert outcome.decision is not None and not ctx.stats.rejected
    # each table holds exactly this shard's share of its budget; the rest were refused
    assert all(len(t) == t.capacity == 32768 for t in state.tables.values())


def test_status_and_metrics_show_each_dynamic_table() -> None:
    spec = embedding_form("dict", dynamic=True)
    with serving(spec, optimizer="adagrad", learning_rate=LR, admit_after=2,
                 table_rows_per_shard=50, admission="always") as server:  # fmt: skip
        train(server.port, spec, steps=20, worker_id="w", n_fetch=1)
        doc = wait_until(
            lambda: (d := fetch_status(server.status))["version"] == 20 and d, 30, "the applies"
        )
        table = doc["dynamic_tables"][TABLE]
        assert 0 < table["live_rows"] <= 50 and table["evicted_capacity"] > 0
        assert table["refused"] > 0 and table["admitted"] == table["inserted"] > 0
        assert table["optimizer"] == "adagrad" and table["admit_after"] == 2
        assert doc["shard_bytes"] >= table["bytes_rows"] > 0
        assert f"dynamic table {TABLE}: {table['live_rows']:,} rows of 50" in render(doc)
        text = render_text(lambda: doc)
        assert f'downpour_dynamic_table_rows{{table="{TABLE}"}} {float(table["live_rows"])}' in text
        line = f'downpour_dynamic_table_events_total{{event="refused",table="{TABLE}"}}'
        assert line in text


def test_a_long_tail_seen_once_is_refused_trains_the_fallback_and_the_table_stays_bounded() -> None:
    """A log whose ids are mostly seen once, under --admit-after 2 with fallback rows: the
    ids seen once never get a row of their own and train their fallback rows (a gather reads
    them there), the hot ids are admitted at their second sighting, the table stays within
    its rows, and the counters say all of it."""
    state = state_of(admit_after=2, fallback_rows=64, shard_rows=64 + 100)
    table = state.tables[TABLE]
    assert (table.capacity, table.map.fallback_here) == (100, 64)
    hot = hashed(np.arange(50))
    tail = hashed(np.arange(1000, 3000))  # 2,000 ids, each in one step only
    start = table.fallback["row"].copy()
    for step in range(20):
        push(state, np.concatenate([hot, tail[step * 100 : (step + 1) * 100]]))
    stats = table.stats()
    # the sketch's collisions admit a few ids early (sketch.false_admit_rate: ~0.2 % here)
    lucky = int((table.map.locate(tail) >= 0).sum())
    assert (table.map.locate(hot) >= 0).all() and lucky <= 10
    assert stats["live_rows"] == 50 + lucky <= table.capacity  # hot ids, admitted at step 2
    assert (stats["admitted"], stats["refused"]) == (50 + lucky, 50 + 2000 - lucky)
    assert stats["fallback_lookups"] == stats["refused"] and stats["refused_victim"] == 0
    assert stats["evicted_capacity"] == stats["evicted_idle"] == 0
    used = np.unique(table.map.fallback_of(tail))
    assert not np.allclose(table.fallback["row"][used], start[used])  # trained by the tail
    refused = tail[table.map.locate(tail) == -1][:5]
    np.testing.assert_array_equal(
        state.gather(0, refused), table.fallback["row"][table.map.fallback_of(refused)]
    )
    status = state.table_status()[TABLE]
    assert (status["fallback_rows"], status["capacity"], status["admit_after"]) == (64, 100, 2)
