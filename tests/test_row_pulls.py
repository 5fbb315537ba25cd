"""Row pulls, the server's side: a row request gets the requested rows only, every hostile
row request is refused with its own reason and counted, and the server keeps serving with
its parameters unchanged. Handlers on a real ParameterState, and a real server on sockets."""

from __future__ import annotations

import math
from typing import Any

import ml_dtypes
import msgpack  # to craft a header no well-behaved client would send
import numpy as np
import pytest
import zmq
from conftest import wait_until
from inproc import serving

from downpour import wire
from downpour.cli.status import fetch_status
from downpour.server.handlers import HandlerContext, handle_gradients, handle_request
from downpour.server.policies.base import parse_policy
from downpour.server.registry import WorkerRegistry
from downpour.server.state import ParameterState
from downpour.spec import load_spec
from downpour.wire import Message

TABLE = "embed/embeddings"


def make_ctx(model: str = "tiny_models:embedding", max_pull_rows: int = 1 << 20) -> HandlerContext:
    state = ParameterState(load_spec(model), "sgd", 0.1, seed=0)
    ctx = HandlerContext(
        state=state,
        policy=parse_policy("async"),
        registry=WorkerRegistry(missing_after_s=10.0, gone_after_s=60.0),
        model=model,
        incarnation="inc-1",
        shard={"shard": 0, "num_shards": 1, "partition": state.partition.digest},
        push_port=6001,
        status_port=6002,
        limits=wire.DEFAULT_LIMITS.for_payload(state.payload_bytes),
        request_limits=wire.Limits(max_pull_rows=max_pull_rows),
    )
    # w0 says hello as a ShardClient does, stating every encoding and id dtype it decodes
    hello = wire.HelloRequest(fingerprint=state.fingerprint, accepts=wire.ACCEPTS_ALL)
    assert handle_request(frames(wire.hello_request("w0", hello)), ctx).rejection is None
    return ctx


def frames(msg: Message) -> list[bytes]:
    return [bytes(memoryview(f)) for f in wire.encode(msg)]


def row_pull(
    ctx: HandlerContext, rows: dict[str, Any], have: int | None = None, encoding: str = wire.DENSE
) -> tuple[Message, list[bytes]]:
    """Send a row request through the handlers; (decoded reply, the reply's frames)."""
    body = wire.PullRequest(have, ctx.incarnation if have is not None else None, encoding)
    reply = frames(handle_request(frames(wire.pull_request("w0", body, rows)), ctx).message)
    return wire.decode(reply), reply


@pytest.fixture(scope="module")
def million() -> HandlerContext:
    return make_ctx("tiny_models:million_embedding")


def test_a_row_pull_of_a_million_row_table_carries_the_requested_rows_only(
    million: HandlerContext,
) -> None:
    ctx = million
    table = ctx.state.weights()[1][0]  # the reference (a whole snapshot, this test's own)
    assert table.shape == (1_000_000, 16)
    sizes = {}
    rng = np.random.default_rng(0)
    for n in (10, 1000):
        ids = rng.choice(1_000_000, n, replace=False).astype(np.int64)
        msg, raw = row_pull(ctx, {TABLE: np.concatenate([ids, ids[:3]])}, have=ctx.state.version)
        assert msg.body.get("unchanged") is True  # the dense variables are current: left out
        assert list(msg.tensors) == [TABLE]
        rows = msg.tensors[TABLE]
        assert isinstance(rows, wire.Sparse) and rows.dense_shape == (1_000_000, 16)
        np.testing.assert_array_equal(rows.indices, np.unique(ids))  # duplicates removed
        np.testing.assert_array_equal(rows.values, table[np.unique(ids)])
        sizes[n] = sum(len(f) for f in raw[1:])
        assert rows.indices.dtype == np.int32  # a million rows: int32 numbers them
        assert sizes[n] == n * (16 * 4 + 4)  # the rows' values and their int32 ids, no more
    assert sizes[1000] == 100 * sizes[10]  # grows with the ids, not with the 64 MB table
    print(
        f"row pull reply payload: 10 ids {sizes[10]} B, 1000 ids {sizes[1000]} B "
        f"of a {table.nbytes} B table"
    )


def test_a_row_pull_sends_the_dense_variables_and_a_whole_pull_still_works() -> None:
    ctx = make_ctx()
    msg, _ = row_pull(ctx, {TABLE: np.array([5, 1, 5], np.int32)})
    assert list(msg.tensors) == ctx.state.names and "unchanged" not in msg.body
    for name, want in zip(ctx.state.names[1:], ctx.state.weights()[1][1:], strict=True):
        np.testing.assert_array_equal(msg.tensors[name], want)
    np.testing.assert_array_equal(msg.tensors[TABLE].indices, [1, 5])
    empty, _ = row_pull(ctx, {TABLE: np.zeros(0, np.int64)}, have=0)
    assert empty.tensors[TABLE].indices.shape == (0,)  # nothing wanted: an empty entry
    whole = wire.decode(frames(handle_request(frames(wire.pull_request("w0")), ctx).message))
    np.testing.assert_array_equal(whole.tensors[TABLE], ctx.state.weights()[1][0])
    assert ctx.stats.counters["row_pulls"] == 2 and ctx.stats.counters["rows_served"] == 2


def test_a_row_pull_does_not_snapshot_the_table() -> None:
    """A per-version snapshot holds the table's buffer, so the next apply would copy all of
    it: a row pull gathers instead and snapshots only the dense variables."""
    ctx = make_ctx()
    version, arrays = ctx.state.dense_weights()
    assert arrays[0] is None and all(a is not None for a in arrays[1:])
    row_pull(ctx, {TABLE: np.array([3], np.int64)})
    assert ctx.state.snapshots._snap[0] is None


def test_a_bf16_row_pull_sends_the_rows_values_in_half_the_bytes() -> None:
    """--pull-compress bf16 covers row pulls: the rows' values frame is half the float32
    reply's, the ids frame the same, and the rows decode to the server's rounded to bf16."""
    ctx = make_ctx()
    table = ctx.state.weights()[1][0]
    ids = np.arange(0, 5000, 50, dtype=np.int64)  # 100 rows of float32
    f32, raw32 = row_pull(ctx, {TABLE: ids}, have=0)
    b16, raw16 = row_pull(ctx, {TABLE: ids}, have=0, encoding=wire.BF16)
    assert list(b16.tensors) == [TABLE] and b16.body.get("unchanged") is True
    (desc,) = msgpack.unpackb(raw16[0])["tensors"]
    assert desc["encoding"] == wire.SPARSE_BF16 and desc["dtype"] == "float32"
    ids32, values32 = len(raw32[1]), len(raw32[2])
    ids16, values16 = len(raw16[1]), len(raw16[2])
    print(
        f"row reply of {ids.size} rows x {table.shape[1]}: float32 ids {ids32} B + values "
        f"{values32} B, bf16 ids {ids16} B + values {values16} B"
    )
    assert ids16 == ids32 == ids.size * 4  # the same int32 ids (a 5,000-row table)
    assert 2 * values16 == values32 == ids.size * table.shape[1] * 4
    rows = b16.tensors[TABLE]
    assert isinstance(rows, wire.Sparse) and rows.values.dtype == np.float32
    np.testing.assert_array_equal(rows.indices, ids)
    rounded = table[ids].astype(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(rows.values, rounded)
    assert not np.array_equal(rows.values, f32.tensors[TABLE].values)  # rounded, not float32
    assert ctx.stats.counters["rows_served"] == 2 * ids.size
    assert ctx.stats.counters["rows_bf16"] == ids.size
    whole, _ = row_pull(ctx, {TABLE: ids[:2]}, encoding=wire.BF16)  # the dense variables too
    assert list(whole.tensors) == ctx.state.names
    for name, want in zip(ctx.state.names[1:], ctx.state.weights()[1][1:], strict=True):
        np.testing.assert_array_equal(
            whole.tensors[name], want.astype(ml_dtypes.bfloat16).astype(want.dtype)
        )


def test_a_malformed_bf16_rows_frame_is_refused_counted_and_changes_nothing() -> None:
    """sparse_bf16 rows pushed with a wrong ``nbytes`` (or a short values frame) are refused
    before anything is allocated, counted under their reason, and no parameter moves."""
    ctx = make_ctx()
    version, before = ctx.state.version, [a.copy() for a in ctx.state.weights()[1]]
    rows = wire.Sparse(np.array([1, 7], np.int64), np.ones((2, 8), np.float32), (5000, 8))
    tensors: dict[str, wire.WireTensor] = {TABLE: wire.as_bf16(rows)}
    for name, a in zip(ctx.state.names[1:], before[1:], strict=True):
        tensors[name] = np.zeros(a.shape, a.dtype)
    good = frames(wire.push_message("w0", 1, 0, wire.PushBody(), tensors))
    header = msgpack.unpackb(good[0])
    header["tensors"][0]["nbytes"] = 2 * 8 * 4  # what float32 rows would take
    wrong_nbytes = [msgpack.packb(header, use_bin_type=True), *good[1:]]
    short_values = [good[0], good[1], good[2][:-2], *good[3:]]
    for raw, code in ((wrong_nbytes, wire.R_NBYTES), (short_values, wire.R_TRUNCATED)):
        outcome = handle_gradients(raw, ctx)
        assert outcome.rejection is not None and outcome.rejection.code == code
    assert dict(ctx.stats.rejected) == {wire.R_NBYTES: 1, wire.R_TRUNCATED: 1}
    assert ctx.state.version == version
    for a, b in zip(ctx.state.weights()[1], before, strict=True):
        np.testing.assert_array_equal(a, b)
    assert handle_gradients(good, ctx).decision is not None  # the well-formed push is taken
    assert ctx.state.version == version + 1 and len(ctx.stats.rejected) == 2


def _hostile(ctx: HandlerContext) -> dict[str, list[bytes]]:
    """Every hostile row request, as the frames a socket would deliver."""

    def req(rows: dict[str, Any]) -> list[bytes]:
        return frames(wire.pull_request("evil", wire.PullRequest(), rows))

    header = {
        "version": wire.PROTOCOL_VERSION,
        "type": wire.PULL,
        "sender": "evil",
        "seq": 0,
        "base_version": 0,
        "body": {},
        "tensors": [
            {
                "name": TABLE,
                "dtype": "int64",
                "shape": [10**9],
                "encoding": "dense",
                "nbytes": 8 * 10**9,
            }
        ],
    }
    billion = [msgpack.packb(header, use_bin_type=True), b"\0" * 64]  # claims 10**9 ids
    return {
        wire.R_ROWS_RANGE: req({TABLE: np.array([1, 5000], np.int64)}),
        wire.R_ROWS_NEGATIVE: req({TABLE: np.array([3, -1], np.int32)}),
        wire.R_ROWS_TOO_MANY: billion,
        wire.R_ROWS_DTYPE: req({TABLE: np.array([1.0, 2.0], np.float32)}),
        "rows_dtype_int8": req({TABLE: np.array([1, 2], np.int8)}),
        wire.R_ROWS_DENSE: req({"logits/kernel": np.array([0], np.int64)}),
        wire.R_ROWS_UNKNOWN: req({"nope/embeddings": np.array([0], np.int64)}),
    }


def test_each_hostile_row_request_is_refused_counted_and_changes_nothing() -> None:
    ctx = make_ctx()
    before = [a.copy() for a in ctx.state.weights()[1]]
    for case, raw in _hostile(ctx).items():
        code = case.removesuffix("_int8")
        reply = wire.decode(frames(handle_request(raw, ctx).message))
        assert reply.type == wire.ERROR and reply.body["code"] == code, (case, reply.body)
    counts = dict(ctx.stats.rejected)
    assert counts.pop(wire.R_ROWS_DTYPE) == 2
    assert counts == dict.fromkeys(
        [
            wire.R_ROWS_RANGE,
            wire.R_ROWS_NEGATIVE,
            wire.R_ROWS_TOO_MANY,
            wire.R_ROWS_DENSE,
            wire.R_ROWS_UNKNOWN,
        ],
        1,
    )
    assert ctx.state.version == 0 and ctx.stats.counters["rows_served"] == 0
    for a, b in zip(ctx.state.weights()[1], before, strict=True):
        np.testing.assert_array_equal(a, b)
    ok, _ = row_pull(ctx, {TABLE: np.array([4999], np.int64)})  # still serving
    np.testing.assert_array_equal(ok.tensors[TABLE].values, before[0][[4999]])


def test_a_row_request_over_the_servers_bound_is_refused_before_any_frame_is_read() -> None:
    ctx = make_ctx(max_pull_rows=100)
    ok, _ = row_pull(ctx, {TABLE: np.arange(100, dtype=np.int64)})
    assert ok.tensors[TABLE].indices.shape == (100,)
    header = wire.encode(wire.pull_request("w0", None, {TABLE: np.arange(101, dtype=np.int64)}))
    reply = wire.decode(frames(handle_request([bytes(header[0])], ctx).message))  # no id frame
    assert reply.body["code"] == wire.R_ROWS_TOO_MANY


def test_a_real_server_refuses_hostile_row_requests_and_keeps_serving() -> None:
    with serving("tiny_models:embedding", optimizer="sgd") as server:
        ctx = zmq.Context()
        try:
            for case, raw in _hostile(make_ctx()).items():
                sock = ctx.socket(zmq.REQ)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.RCVTIMEO, 10_000)
                sock.connect(server.rep)
                sock.send_multipart(raw)
                reply = wire.decode(sock.recv_multipart())
                sock.close()
                assert reply.body["code"] == case.removesuffix("_int8")
        finally:
            ctx.destroy(linger=0)

        def counted() -> dict[str, Any] | None:  # the status document is published often
            doc = fetch_status(server.status)
            return doc if doc["rejected_total"] == 7 else None

        doc = wait_until(counted, 30, "the refusals in the status document")
        rejected = doc["rejected"]
        assert rejected[wire.R_ROWS_DTYPE] == 2 and rejected[wire.R_ROWS_TOO_MANY] == 1
        assert doc["version"] == 0
        from downpour.net.client import ShardClient
        from downpour.net.transport import make_context

        zctx = make_context()
        client = ShardClient(zctx, server.rep, sender="probe", timeout_s=10)
        try:
            w = client.pull(wire.PullRequest(), rows={TABLE: np.array([7, 7, 2], np.int64)})
        finally:
            client.close()
            zctx.term()
        assert list(w.tensors[TABLE].indices) == [2, 7]
        assert math.isfinite(float(w.tensors[TABLE].values.sum()))


def test_rows_only_without_ids_is_a_plain_pull() -> None:
    """The spec's row request is a pull with row-id tensors; ``rows_only`` without any is
    answered as a plain pull, every variable whole (docs/security.md)."""
    ctx = make_ctx()
    msg = wire.pull_request("w0", wire.PullRequest(rows_only=True), {})
    reply = wire.decode(frames(handle_request(frames(msg), ctx).message))
    assert reply.type == wire.WEIGHTS and list(reply.tensors) == ctx.state.names
    assert all(not isinstance(t, wire.Sparse) for t in reply.tensors.values())
