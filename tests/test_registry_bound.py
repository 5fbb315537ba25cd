"""The worker registry is bounded: only a successful hello or a valid push creates a record,
at most --max-workers records exist, silent ones are forgotten after --forget-after, and a
forgotten worker's last seq still refuses replays. A flood of pushes under random ids leaves
the registry, the status document, the Prometheus label sets and the server's RSS bounded."""

from __future__ import annotations

import json
import secrets
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq
from conftest import Cluster, pull_weights, wait_until
from test_server_handlers import Clock, hello, make_ctx, offer, push, request, weights

from downpour import wire
from downpour.config.loading import ConfigError
from downpour.net.client import fetch_status
from downpour.runtime.metrics import new_worker_stats
from downpour.server.handlers import HandlerContext
from downpour.server.registry import SEQ_MEMORY_FACTOR, WorkerRegistry
from downpour.server.settings import ServerConfig, validate_server
from downpour.server.status_doc import build_status
from downpour.spec import load_spec
from downpour.wire import Message


@pytest.fixture(scope="module")
def spec() -> Any:
    return load_spec("tiny_models:tiny")


def bounded_ctx(spec: Any, max_workers: int, forget_after_s: float = 600.0) -> HandlerContext:
    ctx = make_ctx(spec, clock=Clock())
    ctx.registry = WorkerRegistry(
        missing_after_s=10.0,
        gone_after_s=60.0,
        max_workers=max_workers,
        forget_after_s=forget_after_s,
    )
    return ctx


def status_workers(ctx: HandlerContext) -> dict[str, Any]:
    doc = build_status(ctx, now=ctx.clock(), started=0.0, started_wall=0.0)
    return doc["workers"]


def test_a_refused_push_from_an_unknown_sender_creates_no_record(spec: Any) -> None:
    ctx = make_ctx(spec)
    st = ctx.state
    bad_shape = {n: np.zeros((3,), d) for n, d in zip(st.names, st.dtypes, strict=True)}
    refused = {
        wire.R_DUPLICATE: push(ctx, 0, sender="fake-dup"),
        wire.R_FUTURE: push(ctx, 1, sender="fake-future", base_version=5),
        wire.R_SHAPE: push(ctx, 1, sender="fake-shape", tensors=bad_shape),
        wire.R_NONFINITE: push(ctx, 1, sender="fake-nan", tensors=_grads(ctx, np.nan)),
    }
    for code, msg in refused.items():
        out = offer(ctx, msg)
        assert out.rejection is not None and out.rejection.code == code
    assert len(ctx.registry) == 0 and status_workers(ctx) == {}
    assert ctx.stats.rejected == dict.fromkeys(refused, 1)


def _grads(ctx: HandlerContext, fill: float) -> dict[str, np.ndarray]:
    st = ctx.state
    return {n: np.full(s, fill, d) for n, s, d in zip(st.names, st.shapes, st.dtypes, strict=True)}


def test_a_new_id_beyond_the_bound_is_refused_and_counted(spec: Any) -> None:
    ctx = bounded_ctx(spec, max_workers=3)
    assert hello(ctx, "w0").type == wire.HELLO
    assert hello(ctx, "w1").type == wire.HELLO
    assert offer(ctx, push(ctx, 1, sender="w2")).decision is not None  # a valid push enrols
    before, version = weights(ctx), ctx.state.version

    reply = hello(ctx, "w3")
    assert reply.type == wire.ERROR and reply.body["code"] == wire.R_TOO_MANY_WORKERS
    assert "--max-workers 3" in reply.body["message"]
    out = offer(ctx, push(ctx, 1, sender="w4"))
    assert out.rejection is not None and out.rejection.code == wire.R_TOO_MANY_WORKERS
    assert ctx.state.version == version and weights(ctx) == before  # the push changed nothing
    assert ctx.stats.rejected == {wire.R_TOO_MANY_WORKERS: 2}
    assert set(status_workers(ctx)) == {"w0", "w1", "w2"}
    assert offer(ctx, push(ctx, 2, sender="w2")).decision is not None  # the enrolled go on
    doc = build_status(ctx, now=ctx.clock(), started=0.0, started_wall=0.0)
    assert doc["registry"]["size"] == 3 and doc["registry"]["max_workers"] == 3


def test_a_gone_worker_makes_room_and_its_seq_still_refuses_replays(spec: Any) -> None:
    ctx = bounded_ctx(spec, max_workers=2)
    clock: Clock = ctx.clock  # type: ignore[assignment]
    assert offer(ctx, push(ctx, 5, sender="w0")).decision is not None
    assert hello(ctx, "w1").type == wire.HELLO
    clock.now += 61.0  # both gone ...
    assert request(ctx, Message(wire.HEARTBEAT, "w1")).type == wire.HEARTBEAT  # ... w1 is back
    assert hello(ctx, "w2").type == wire.HELLO  # takes the place of gone w0, not of w1
    assert set(ctx.registry) == {"w1", "w2"}

    replay = offer(ctx, push(ctx, 5, sender="w0"))
    assert replay.rejection is not None and replay.rejection.code == wire.R_DUPLICATE
    full = hello(ctx, "w0")  # w1 and w2 are alive: no room
    assert full.type == wire.ERROR and full.body["code"] == wire.R_TOO_MANY_WORKERS
    clock.now += 61.0
    back = hello(ctx, "w0")
    assert back.type == wire.HELLO and back.body["last_seq"] == 5  # it continues from seq 5


def test_silent_workers_are_forgotten_after_forget_after(spec: Any) -> None:
    ctx = bounded_ctx(spec, max_workers=8, forget_after_s=120.0)
    clock: Clock = ctx.clock  # type: ignore[assignment]
    assert offer(ctx, push(ctx, 3, sender="w0")).decision is not None
    assert hello(ctx, "w1").type == wire.HELLO
    clock.now += 100.0
    assert request(ctx, Message(wire.HEARTBEAT, "w1")).type == wire.HEARTBEAT
    clock.now += 21.0
    assert ctx.registry.forget_idle(clock.now) == ["w0"]  # w1 was heard 21 s ago
    assert set(status_workers(ctx)) == {"w1"}
    assert ctx.registry.last_seqs() == {"w0": 3, "w1": 0}  # what a checkpoint keeps
    replay = offer(ctx, push(ctx, 3, sender="w0"))
    assert replay.rejection is not None and replay.rejection.code == wire.R_DUPLICATE
    assert "w0" not in ctx.registry  # a refused push does not bring the record back
    assert hello(ctx, "w0").body["last_seq"] == 3


def test_a_heartbeat_from_an_unknown_id_enrols_nobody(spec: Any) -> None:
    ctx = make_ctx(spec)
    reply = request(ctx, Message(wire.HEARTBEAT, "stranger", body={"stats": {"q": 1.0}}))
    assert reply.type == wire.HEARTBEAT  # answered (it learns the incarnation), not enrolled
    assert "stranger" not in ctx.registry


def test_the_seq_memory_is_bounded_oldest_first() -> None:
    restored = {f"w{i}": i + 1 for i in range(100)}
    reg = WorkerRegistry(10.0, 60.0, restored, max_workers=2)
    seqs = reg.last_seqs()
    assert len(seqs) == 2 * SEQ_MEMORY_FACTOR and reg.seqs_dropped == 100 - len(seqs)
    assert reg.last_seq("w99") == 100 and reg.last_seq("w0") == 0  # the newest are kept


def test_forget_after_must_exceed_gone_after() -> None:
    with pytest.raises(ConfigError, match="--forget-after"):
        validate_server(ServerConfig(gone_after_s=60.0, forget_after_s=30.0))
    validate_server(ServerConfig(forget_after_s=0.0))  # 0: never by time


# ---------------------------------------------------------------- a flood, real sockets

NAMES = ["hidden/kernel", "hidden/bias", "logits/kernel", "logits/bias"]
FLOOD = 50_000
MAX_WORKERS = 256


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _worker_labels(port: int) -> set[str]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {
        s.labels["worker"]
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if "worker" in s.labels
    }


@pytest.mark.slow  # a real server process and 50,000 pushes
def test_a_flood_of_random_ids_leaves_the_server_bounded(cluster: Cluster) -> None:
    server = cluster.server(
        "--max-workers", str(MAX_WORKERS), "--metrics-port", "0", "--optimizer", "sgd"
    )
    pid, status = server.proc.pid, server.status
    _, w = pull_weights(server.rep)
    zeros = {name: np.zeros_like(a) for name, a in zip(NAMES, w, strict=True)}
    tensor_frames = wire.encode(Message(wire.PUSH, "x", seq=1, tensors=zeros))[1:]
    # every push valid, each under a new random id: headers encoded up front, tensors shared
    headers = [
        wire.encode(Message(wire.PUSH, f"fake-{secrets.token_hex(6)}", seq=1, tensors=zeros))[0]
        for _ in range(FLOOD)
    ]
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, 30_000)
    sock.connect(f"tcp://127.0.0.1:{server.info['push_port']}")

    def received(n: int) -> dict[str, Any]:
        return wait_until(
            lambda: (d := fetch_status(status))["pushes_received"] >= n and d,
            180,
            f"the server to take {n} pushes",
        )

    try:
        warm = FLOOD // 10  # the registry fills, the server's memory settles
        for h in headers[:warm]:
            sock.send_multipart([h, *tensor_frames], copy=False)
        doc_warm = received(warm)
        rss_warm = _rss_bytes(pid)
        for h in headers[warm:]:
            sock.send_multipart([h, *tensor_frames], copy=False)
        doc = received(FLOOD)
        rss_end = _rss_bytes(pid)
    finally:
        sock.close(0)
        ctx.term()

    assert len(doc["workers"]) == MAX_WORKERS and doc["registry"]["size"] == MAX_WORKERS
    assert doc["version"] == MAX_WORKERS  # the first MAX_WORKERS ids were valid workers
    assert doc["rejected"] == {wire.R_TOO_MANY_WORKERS: FLOOD - MAX_WORKERS}
    size_warm, size_end = len(json.dumps(doc_warm)), len(json.dumps(doc))
    assert size_end < 1.05 * size_warm, (size_warm, size_end)  # only the counters' digits grew
    labels = _worker_labels(server.info["metrics_port"])
    assert len(labels) == MAX_WORKERS and labels == set(doc["workers"])
    # 45,000 more ids: without the bound their records, status entries and labels would add
    # tens of MB; allocator noise is a few MB
    assert rss_end - rss_warm < 24 << 20, (rss_warm, rss_end)
    print(
        f"flood: status {size_warm} -> {size_end} bytes, RSS {rss_warm >> 20} -> "
        f"{rss_end >> 20} MiB"
    )


def test_a_full_registry_at_the_default_bound_still_gives_a_readable_status(spec: Any) -> None:
    ctx = make_ctx(spec)  # the default --max-workers
    reg = ctx.registry
    stats = new_worker_stats()
    for i in range(reg.max_workers + 10):
        rec = reg.admit(f"worker-{i:05d}", ctx.clock())
        if rec is not None:
            rec.reported = dict(stats)
    assert len(reg) == reg.max_workers == ServerConfig().max_workers
    doc = build_status(ctx, now=ctx.clock(), started=0.0, started_wall=0.0)
    frames_out = [bytes(memoryview(f)) for f in wire.encode(wire.status_reply(doc))]
    with pytest.raises(wire.ProtocolError):  # more than a request's bounds ...
        wire.decode(frames_out, wire.DEFAULT_LIMITS)
    got = wire.decode(frames_out, wire.STATUS_LIMITS)  # ... within a status reply's
    assert len(got.body["workers"]) == reg.max_workers


def test_max_workers_is_capped_by_what_a_status_reply_can_carry() -> None:
    with pytest.raises(ConfigError, match="--max-workers"):
        validate_server(ServerConfig(max_workers=wire.MAX_STATUS_WORKERS + 1))
