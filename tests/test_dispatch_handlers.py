"""The server's split handling without sockets: real ParameterState on the tiny model, real
wire messages through ``handle_request``. Splits handed out and acknowledged, bad requests
refused and counted, release on a restarted worker's hello and on liveness, acks held until
their split's last push arrives (through the gradient handler), the dispatcher in
checkpoints, the status document and the Prometheus text."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from downpour import wire
from downpour.checkpoints.store import CheckpointStore
from downpour.server.checkpointing.capture import capture
from downpour.server.checkpointing.restore import restore_dispatcher
from downpour.server.dispatch import Dispatcher
from downpour.server.handlers import (
    HandlerContext,
    handle_gradients,
    handle_request,
    release_gone,
)
from downpour.server.observers.prometheus import render_text
from downpour.server.policies.base import parse_policy
from downpour.server.registry import WorkerRegistry
from downpour.server.state import ParameterState
from downpour.server.status_doc import build_status
from downpour.spec import load_spec
from downpour.wire import Message

FILES = wire.DataUniverse(files=("a.tfrecord", "b.tfrecord", "c.tfrecord"))


class Clock:
    """A clock the test moves by hand (liveness depends on time since last heard)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def spec() -> Any:
    return load_spec("tiny_models:tiny")


def make_ctx(spec: Any, dispatch: bool = True, clock: Clock | None = None) -> HandlerContext:
    state = ParameterState(spec, "sgd", 0.1, seed=0)
    return HandlerContext(
        state=state,
        policy=parse_policy("async"),
        registry=WorkerRegistry(missing_after_s=10.0, gone_after_s=60.0),
        model=spec.name,
        incarnation="inc-1",
        shard={"shard": 0, "num_shards": 1, "partition": state.partition.digest},
        push_port=6001,
        status_port=6002,
        limits=wire.DEFAULT_LIMITS.for_payload(state.payload_bytes),
        clock=clock or Clock(),
        dispatcher=Dispatcher(seed=1) if dispatch else None,
    )


@pytest.fixture
def ctx(spec: Any) -> HandlerContext:
    return make_ctx(spec)


def frames(msg: Message) -> list[bytes]:
    return [bytes(memoryview(f)) for f in wire.encode(msg)]


def ask(
    ctx: HandlerContext,
    sender: str,
    acks: tuple[tuple[int, ...], ...] = (),
    universe: wire.DataUniverse = FILES,
    process: str = "p1",
    raw: dict[str, Any] | None = None,
) -> Message:
    """A split request through the REP handler, as the socket would deliver it (``raw``:
    body fields to overwrite, as a faulty client would send them)."""
    req = wire.SplitRequest(universe.digest(), acks, universe=universe, process=process)
    msg = wire.split_request(sender, req)
    msg.body.update(raw or {})
    return wire.decode(frames(handle_request(frames(msg), ctx).message))


def granted(reply: Message) -> wire.SplitReply:
    assert reply.type == wire.SPLIT, reply.body
    return wire.SplitReply.from_body(reply.body)


def test_workers_get_each_split_once_and_the_epoch_moves_on(ctx: HandlerContext) -> None:
    got = {w: granted(ask(ctx, w)) for w in ("w0", "w1", "w2")}
    assert sorted(r.file for r in got.values()) == sorted(FILES.files or ())
    assert granted(ask(ctx, "w3")).grant == "wait"
    acks = {w: ((r.epoch, r.index),) for w, r in got.items()}
    replies = [granted(ask(ctx, w, acks[w])) for w in ("w0", "w1", "w2")]
    assert [r.acked for r in replies] == [1, 1, 1]
    assert replies[-1].grant == "split" and replies[-1].epoch == 1  # the last ack ended it
    assert ctx.dispatcher is not None and ctx.dispatcher.epochs_done == 1
    assert "w0" in ctx.registry  # a split request enrols its worker for liveness


def push(ctx: HandlerContext, sender: str, seq: int, value: float = 0.01) -> None:
    """A gradient push through the gradient handler (which applies it), as the loop does it."""
    tensors = {
        n: np.full(shape, value, dtype)
        for n, shape, dtype in zip(ctx.state.names, ctx.state.shapes, ctx.state.dtypes, strict=True)
    }
    msg = wire.push_message(sender, seq, ctx.state.version, wire.PushBody(), tensors)
    handle_gradients(frames(msg), ctx)


def test_an_ack_that_overtakes_its_push_is_held_until_the_push_arrives(
    ctx: HandlerContext,
) -> None:
    r = granted(ask(ctx, "w0"))
    push(ctx, "w0", seq=1)
    # the split's last push (seq 2) is still on the gradient socket when its ack comes
    reply = granted(ask(ctx, "w0", acks=((r.epoch, r.index, 2),)))
    assert (reply.acked, reply.held, reply.stale) == (0, 1, 0)
    assert reply.grant == "split" and reply.index != r.index  # the next split, not a resend
    d = ctx.dispatcher
    assert d is not None and d.progress()["splits_done"] == 0
    assert r.index in d.state()["in_flight"]  # a checkpoint now would redo the split
    push(ctx, "w0", seq=2)
    assert d.progress()["splits_done"] == 1 and r.index in d.state()["acked"]
    assert ctx.state.version == 2 and d.counters["acks_held"] == 1


def test_an_ack_after_its_push_completes_at_once(ctx: HandlerContext) -> None:
    r = granted(ask(ctx, "w0"))
    push(ctx, "w0", seq=1)
    reply = granted(ask(ctx, "w0", acks=((r.epoch, r.index, 1),)))
    assert (reply.acked, reply.held, reply.stale) == (1, 0, 0)
    d = ctx.dispatcher
    assert d is not None and d.progress()["splits_done"] == 1 and d.counters["acks_held"] == 0


def test_a_refused_last_push_still_completes_its_held_ack(ctx: HandlerContext) -> None:
    """A refused push is never sent again: the ack waiting for it must not wait forever."""
    r = granted(ask(ctx, "w0"))
    granted(ask(ctx, "w0", acks=((r.epoch, r.index, 1),)))
    push(ctx, "w0", seq=1, value=float("nan"))
    d = ctx.dispatcher
    assert ctx.stats.rejected[wire.R_NONFINITE] == 1 and ctx.state.version == 0
    assert d is not None and d.progress()["splits_done"] == 1


def test_a_gone_workers_held_ack_is_released(spec: Any) -> None:
    clock = Clock()
    ctx = make_ctx(spec, clock=clock)
    r = granted(ask(ctx, "w0"))
    assert granted(ask(ctx, "w0", acks=((r.epoch, r.index, 3),))).held == 1
    clock.now += 61.0  # w0 is gone before its last push arrived
    assert release_gone(ctx) == ["w0"]
    d = ctx.dispatcher
    assert d is not None and d.progress()["splits_done"] == 0
    assert granted(ask(ctx, "w1")).index == r.index  # the split is read again
    push(ctx, "w0", seq=3)  # the push arriving late completes nothing
    assert d.progress()["splits_done"] == 0 and d.held_by("w1") == [r.index]


def test_a_server_without_dispatch_refuses_split_requests(spec: Any) -> None:
    ctx = make_ctx(spec, dispatch=False)
    reply = ask(ctx, "w0")
    assert reply.type == wire.ERROR and reply.body["code"] == wire.R_DISPATCH_OFF
    assert "--data-dispatch server" in reply.body["message"]
    assert ctx.stats.rejected[wire.R_DISPATCH_OFF] == 1


def test_a_worker_with_other_data_is_refused_and_counted(ctx: HandlerContext) -> None:
    granted(ask(ctx, "w0"))
    other = wire.DataUniverse(files=("x.tfrecord",))
    reply = ask(ctx, "w1", universe=other)
    assert reply.type == wire.ERROR and reply.body["code"] == wire.R_UNIVERSE
    assert "differs" in reply.body["message"]
    assert ctx.stats.rejected[wire.R_UNIVERSE] == 1
    assert ctx.dispatcher is not None and ctx.dispatcher.counters["refused_universe"] == 1
    assert ctx.dispatcher.held_by("w1") == []


def test_a_first_request_without_the_universe_is_refused(ctx: HandlerContext) -> None:
    req = wire.SplitRequest(FILES.digest())
    reply = wire.decode(frames(handle_request(frames(wire.split_request("w", req)), ctx).message))
    assert reply.type == wire.ERROR and reply.body["code"] == wire.R_UNIVERSE
    assert ctx.dispatcher is not None and not ctx.dispatcher.configured


@pytest.mark.parametrize(
    "change, code",
    [
        ({"acks": [[0, 99]]}, wire.R_HEADER),  # no such split
        ({"acks": "all"}, wire.R_HEADER),
        ({"digest": "f" * 64}, wire.R_HEADER),  # does not match the universe sent
        ({"want": 1}, wire.R_HEADER),
    ],
)
def test_a_bad_split_request_is_refused_counted_and_changes_nothing(
    ctx: HandlerContext, change: dict, code: str
) -> None:
    first = granted(ask(ctx, "w0"))
    reply = ask(ctx, "w0", raw={"acks": [[first.epoch, first.index]], **change})
    assert reply.type == wire.ERROR and reply.body["code"] == code
    assert ctx.stats.rejected[code] == 1
    d = ctx.dispatcher
    assert d is not None and d.counters["acked"] == 0 and d.held_by("w0") == [first.index]


def test_a_restarted_worker_saying_hello_gets_its_splits_taken_back(ctx: HandlerContext) -> None:
    lost = granted(ask(ctx, "w0", process="old"))
    hello = Message(
        wire.HELLO,
        "w0",
        body={"fingerprint": ctx.state.fingerprint, "model": ctx.model, "process": "new"},
    )
    assert wire.decode(frames(handle_request(frames(hello), ctx).message)).type == wire.HELLO
    d = ctx.dispatcher
    assert d is not None and d.held_by("w0") == [] and d.counters["released"] == 1
    assert granted(ask(ctx, "w1")).index == lost.index


def test_a_restarted_worker_asking_again_gets_a_fresh_lease(ctx: HandlerContext) -> None:
    lost = granted(ask(ctx, "w0", process="old"))
    again = granted(ask(ctx, "w0", process="new"))
    d = ctx.dispatcher
    assert d is not None and d.counters["released"] == 1 and d.counters["resent"] == 0
    assert again.index == lost.index  # released to the front, leased anew to the new process
    assert d.held_by("w0") == [lost.index]
    assert granted(ask(ctx, "w1")).index != lost.index


def test_the_splits_of_a_gone_worker_go_back_to_the_queue(spec: Any) -> None:
    clock = Clock()
    ctx = make_ctx(spec, clock=clock)
    lost = granted(ask(ctx, "w0"))
    granted(ask(ctx, "w1"))
    clock.now += 30.0  # missing, not gone
    ask(ctx, "w1")  # w1 keeps talking
    assert release_gone(ctx) == []
    clock.now += 31.0
    assert release_gone(ctx) == ["w0"]
    assert granted(ask(ctx, "w2")).index == lost.index
    late = ask(ctx, "w0", acks=((lost.epoch, lost.index),))
    assert granted(late).stale == 1  # w0 came back: its ack is ignored, it gets new work


def test_status_and_prometheus_show_the_epoch_and_the_splits(ctx: HandlerContext) -> None:
    r = granted(ask(ctx, "w0"))
    granted(ask(ctx, "w0", acks=((r.epoch, r.index),)))
    doc = build_status(ctx, now=ctx.clock(), started=ctx.clock(), started_wall=0.0)
    d = doc["dispatch"]
    assert (d["epoch"], d["splits_done"], d["splits_in_flight"], d["splits_left"]) == (0, 1, 1, 1)
    assert d["universe"] == "3 files" and d["in_flight"] == {"w0": d["in_flight"]["w0"]}
    text = render_text(lambda: doc)
    assert "downpour_dispatch_epoch 0.0" in text
    assert 'downpour_dispatch_splits{state="done"} 1.0' in text
    assert 'downpour_dispatch_splits{state="in_flight"} 1.0' in text
    assert 'downpour_dispatch_splits{state="left"} 1.0' in text
    assert 'downpour_dispatch_events_total{event="acked"} 1.0' in text


def test_a_server_without_dispatch_reports_none(spec: Any) -> None:
    ctx = make_ctx(spec, dispatch=False)
    doc = build_status(ctx, now=0.0, started=0.0, started_wall=0.0)
    assert doc["dispatch"] is None and "downpour_dispatch" not in render_text(lambda: doc)


def test_the_dispatcher_survives_a_checkpoint_with_its_epoch(
    ctx: HandlerContext, tmp_path: Path
) -> None:
    done = granted(ask(ctx, "w0"))
    granted(ask(ctx, "w0", acks=((done.epoch, done.index),)))  # one done, one in flight
    d = ctx.dispatcher
    assert d is not None
    store = CheckpointStore(tmp_path)
    store.write(ctx.state.version, capture(ctx.state), {"dispatch": d.state()})
    ckpt = store.latest()
    assert ckpt is not None
    back = restore_dispatcher(ckpt, seed=1)
    p = back.progress()
    assert (p["epoch"], p["splits_done"], p["splits_in_flight"], p["splits_left"]) == (0, 1, 0, 2)
    ckpt.meta["dispatch"]["queue"] = []
    with pytest.raises(ValueError, match="dispatcher state"):
        restore_dispatcher(ckpt, seed=1)
    ckpt.meta.pop("dispatch")
    assert not restore_dispatcher(ckpt, seed=1).configured
