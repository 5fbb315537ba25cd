"""The server's handlers without sockets: real ParameterState on the tiny model, real wire
messages. Hello, pull and heartbeat replies, gradients accepted and applied, every refusal
counted with the parameters unchanged, and the order of the gradient checks."""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections.abc import Callable, Iterator
from typing import Any

import msgpack  # tests may craft raw headers; the services never import msgpack
import numpy as np
import pytest

from downpour import wire
from downpour.net import security
from downpour.server.handlers import (
    GradientOutcome,
    HandlerContext,
    check_status_request,
    handle_gradients,
    handle_request,
)
from downpour.server.policies.base import APPLY, DROP, parse_policy
from downpour.server.registry import ALIVE, GONE, MISSING, WorkerRegistry
from downpour.server.state import ParameterState
from downpour.server.status_doc import build_status
from downpour.spec import load_spec
from downpour.wire import Message

LR = 0.1


class Clock:
    """A clock the test moves by hand (liveness depends on time since last heard)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def spec() -> Any:
    return load_spec("tiny_models:tiny")


def make_ctx(
    spec: Any, policy: str = "async", authenticated: bool = False, clock: Clock | None = None
) -> HandlerContext:
    """A fresh context around a fresh tiny-model state (SGD, so an update is -LR * g)."""
    state = ParameterState(spec, "sgd", LR, seed=0)
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
        authenticated=authenticated,
        clock=clock or Clock(),
    )


@pytest.fixture
def ctx(spec: Any) -> HandlerContext:
    return make_ctx(spec)


def frames(msg: Message) -> list[bytes]:
    """The message as the bytes a socket would deliver."""
    return [bytes(memoryview(f)) for f in wire.encode(msg)]


def request(ctx: HandlerContext, msg: Message, peer_key: str | None = None) -> Message:
    return wire.decode(frames(handle_request(frames(msg), ctx, peer_key).message))


def hello(ctx: HandlerContext, sender: str = "w0", **body: Any) -> Message:
    fields = {"fingerprint": ctx.state.fingerprint, "model": ctx.model, **body}
    return request(ctx, Message(wire.HELLO, sender, body=fields))


def grads(ctx: HandlerContext, fill: float = 1.0) -> dict[str, np.ndarray]:
    st = ctx.state
    return {n: np.full(s, fill, d) for n, s, d in zip(st.names, st.shapes, st.dtypes, strict=True)}


def push(
    ctx: HandlerContext, seq: int, sender: str = "w0", base_version: int | None = None, **kw: Any
) -> Message:
    version = ctx.state.version if base_version is None else base_version
    tensors = kw.pop("tensors", None) or grads(ctx)
    return Message(wire.PUSH, sender, seq=seq, base_version=version, tensors=tensors, **kw)


def weights(ctx: HandlerContext) -> list[bytes]:
    return [a.tobytes() for a in ctx.state.weights()[1]]


def offer(ctx: HandlerContext, msg: Message, peer_key: str | None = None) -> GradientOutcome:
    """Handle a push as the loop does (the handler applies what the policy says to apply)."""
    return handle_gradients(frames(msg), ctx, peer_key)


# ---------------------------------------------------------------- hello / heartbeat


def test_hello_with_the_servers_model_is_accepted_and_enrols_the_worker(
    ctx: HandlerContext,
) -> None:
    reply = hello(ctx)
    assert reply.type == wire.HELLO
    assert reply.body["push_port"] == 6001 and reply.body["status_port"] == 6002
    assert reply.body["last_seq"] == 0 and reply.body["incarnation"] == "inc-1"
    assert reply.body["policy"] == "async" and reply.body["partition"] == ctx.shard["partition"]
    assert "w0" in ctx.registry and ctx.stats.counters["hellos"] == 1
    assert not ctx.stats.rejected


def test_hello_reply_offers_every_encoding_of_the_codec_table(ctx: HandlerContext) -> None:
    reply = wire.HelloReply.from_body(hello(ctx).body)
    assert reply.encodings == tuple(sorted(wire.CODECS))


def test_hello_with_another_model_is_refused_and_counted(ctx: HandlerContext) -> None:
    reply = hello(ctx, fingerprint="not-this-model")
    assert reply.type == wire.ERROR and reply.body["code"] == wire.R_FINGERPRINT
    assert "--model" in reply.body["message"]  # says how to fix it
    assert ctx.stats.rejected == {wire.R_FINGERPRINT: 1}
    assert "w0" not in ctx.registry


def test_hello_for_another_shard_is_refused(ctx: HandlerContext) -> None:
    reply = hello(ctx, shard=1, num_shards=2, partition="other")
    assert reply.type == wire.ERROR and reply.body["code"] == wire.R_PARTITION
    assert ctx.stats.rejected == {wire.R_PARTITION: 1}
    assert "w0" not in ctx.registry


def test_request_in_another_protocol_version_is_refused(ctx: HandlerContext) -> None:
    raw = frames(Message(wire.HELLO, "w0", body={"fingerprint": ctx.state.fingerprint}))
    header = msgpack.unpackb(raw[0])
    header["version"] = wire.PROTOCOL_VERSION + 1
    reply = handle_request([msgpack.packb(header)], ctx)
    assert reply.message.type == wire.ERROR and reply.message.body["code"] == wire.R_VERSION
    assert reply.rejection is not None and reply.rejection.code == wire.R_VERSION
    assert ctx.stats.rejected == {wire.R_VERSION: 1}
    assert "w0" not in ctx.registry


def test_a_push_sent_as_a_request_is_refused_as_wrong_socket(ctx: HandlerContext) -> None:
    reply = request(ctx, push(ctx, 1))
    assert reply.type == wire.ERROR and reply.body["code"] == wire.R_WRONG_SOCKET
    assert ctx.state.version == 0 and ctx.stats.rejected == {wire.R_WRONG_SOCKET: 1}


def test_the_status_socket_answers_only_status_requests() -> None:
    check_status_request(frames(Message(wire.STATUS, "reader")))  # accepted: no exception
    with pytest.raises(wire.ProtocolError) as err:
        check_status_request(frames(Message(wire.PULL, "reader")))
    assert err.value.code == wire.R_WRONG_SOCKET


def test_liveness_follows_the_time_since_the_worker_was_last_heard(spec: Any) -> None:
    clock = Clock()
    ctx = make_ctx(spec, clock=clock)
    assert hello(ctx).type == wire.HELLO
    rec = ctx.registry.get("w0")
    assert rec is not None
    seen = []
    for idle in (5.0, 30.0, 90.0):
        clock.now += idle
        seen.append(ctx.registry.liveness(rec, clock.now))
        if idle == 30.0:  # a heartbeat brings a missing worker back
            reply = request(ctx, Message(wire.HEARTBEAT, "w0", body={"stats": {"q": 1.5}}))
            assert reply.type == wire.HEARTBEAT and reply.base_version == 0
            seen.append(ctx.registry.liveness(rec, clock.now))
    assert seen == [ALIVE, MISSING, ALIVE, GONE]
    assert rec.reported == {"q": 1.5}


def test_a_workers_notices_ride_with_its_figures_into_its_status_entry(spec: Any) -> None:
    """Pushes and heartbeats carrying figures set the worker's notices (none: cleared); a
    message without figures leaves them; the status entry lists them."""
    ctx = make_ctx(spec)
    assert hello(ctx).type == wire.HELLO
    rec = ctx.registry.get("w0")
    assert rec is not None and rec.notices == ()
    slow = "--compress bf16: gradients are rounded in NumPy at each push"
    body = {"loss": 0.5, "steps": 1, "stats": {"q": 1.0}, "notices": [slow]}
    assert offer(ctx, push(ctx, 1, body=body)).decision is not None
    assert rec.notices == (slow,)
    assert rec.status(ALIVE, ctx.clock())["notices"] == [slow]
    assert offer(ctx, push(ctx, 2, body={"loss": 0.5, "steps": 2})).decision is not None
    assert rec.notices == (slow,)  # no figures: not a worker's report, nothing changes
    beat = {"stats": {"q": 2.0}, "notices": [slow, "row pulls off"]}
    assert request(ctx, Message(wire.HEARTBEAT, "w0", body=beat)).type == wire.HEARTBEAT
    assert rec.notices == (slow, "row pulls off")
    assert offer(ctx, push(ctx, 3, body={"steps": 3, "stats": {"q": 3.0}})).decision is not None
    assert rec.notices == () and rec.status(ALIVE, ctx.clock())["notices"] == []


# Each request with one body field of the wrong type: the server answers ERROR bad_header,
# counts it, and nothing it holds about the sender changes.
BAD_REQUESTS: dict[str, tuple[str, dict[str, Any]]] = {
    "hello fingerprint": (wire.HELLO, {"fingerprint": 12345}),
    "hello variables": (wire.HELLO, {"variables": "eight"}),
    "hello shard": (wire.HELLO, {"shard": "0", "num_shards": 1}),
    "hello partition": (wire.HELLO, {"partition": ["p"]}),
    "pull have": (wire.PULL, {"have": "0", "incarnation": "inc-1"}),
    "pull incarnation": (wire.PULL, {"have": 0, "incarnation": 1}),
    "pull encoding": (wire.PULL, {"encoding": 16}),
    "heartbeat stats": (wire.HEARTBEAT, {"stats": [1.0, 2.0]}),
    "heartbeat notices": (wire.HEARTBEAT, {"stats": {"q": 1.0}, "notices": ["slow"] * 9}),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_a_request_with_a_wrongly_typed_body_field_is_refused_as_bad_header(
    spec: Any, case: str
) -> None:
    ctx = make_ctx(spec, policy="bounded:0")
    assert offer(ctx, push(ctx, 1, body={"steps": 3})).decision is not None
    stale = offer(ctx, push(ctx, 2, base_version=0))  # a stale drop the next pull reports
    assert stale.decision is not None and stale.decision.action == DROP
    rec = ctx.registry.get("w0")
    assert rec is not None

    def held() -> tuple[Any, ...]:
        return (rec.last_seen, rec.pulls, rec.reported, rec.notices, rec.dropped_unreported)

    seen = (held(), rec.last_seq)
    before = weights(ctx)
    mtype, body = BAD_REQUESTS[case]
    if mtype == wire.HELLO:
        body = {"fingerprint": ctx.state.fingerprint, "model": ctx.model, **body}
    ctx.clock.now += 5.0  # type: ignore[attr-defined]
    reply = handle_request(frames(Message(mtype, "w0", body=body)), ctx)
    got = wire.decode(frames(reply.message))
    assert got.type == wire.ERROR and got.body["code"] == wire.R_HEADER
    field_name = case.split()[1]
    assert field_name in got.body["message"]  # names the field
    assert reply.rejection is not None and reply.rejection.code == wire.R_HEADER
    assert ctx.stats.rejected == {wire.R_HEADER: 1}
    assert (held(), rec.last_seq) == seen
    assert ctx.state.version == 1 and weights(ctx) == before
    # the worker's stale drop is still reported by its next well-formed pull
    assert request(ctx, Message(wire.PULL, "w0")).body["dropped_stale"] == 1


def test_a_body_that_is_not_a_map_is_refused_as_bad_header(ctx: HandlerContext) -> None:
    raw = _edit_header(frames(Message(wire.PULL, "w0")), lambda h: h.update(body=[1, 2]))
    reply = handle_request(raw, ctx)
    assert reply.message.type == wire.ERROR
    assert reply.message.body["code"] == wire.R_HEADER
    assert ctx.stats.rejected == {wire.R_HEADER: 1}


# ---------------------------------------------------------------- pull


def test_pull_sends_the_weights_then_unchanged_until_the_next_update(ctx: HandlerContext) -> None:
    first = request(ctx, Message(wire.PULL, "w0"))
    assert first.type == wire.WEIGHTS and first.base_version == 0
    assert list(first.tensors) == ctx.state.names
    have = {"have": 0, "incarnation": "inc-1"}
    same = request(ctx, Message(wire.PULL, "w0", body=have))
    assert same.body["unchanged"] is True and not same.tensors
    # the same version of an earlier incarnation (a restarted server) gets the weights
    other = request(ctx, Message(wire.PULL, "w0", body={"have": 0, "incarnation": "inc-0"}))
    assert len(other.tensors) == len(ctx.state.names)
    assert offer(ctx, push(ctx, 1)).decision is not None
    after = request(ctx, Message(wire.PULL, "w0", body=have))
    assert after.base_version == 1 and "unchanged" not in after.body
    assert ctx.stats.counters["pulls"] == 4 and ctx.stats.counters["pulls_unchanged"] == 1


def test_bf16_pull_rounds_the_weights_and_an_unknown_encoding_is_refused(
    ctx: HandlerContext,
) -> None:
    dense = request(ctx, Message(wire.PULL, "w0"))
    rounded = request(ctx, Message(wire.PULL, "w0", body={"encoding": wire.BF16}))
    for name, a in dense.tensors.items():
        b = rounded.tensors[name]
        assert b.dtype == a.dtype
        np.testing.assert_allclose(b, a, rtol=2**-8)
    bad = request(ctx, Message(wire.PULL, "w0", body={"encoding": "fp8"}))
    assert bad.type == wire.ERROR and bad.body["code"] == wire.R_HEADER
    assert ctx.stats.counters["pulls_bf16"] == 1 and ctx.stats.rejected == {wire.R_HEADER: 1}


def test_a_pull_tells_the_worker_once_about_its_stale_drops(spec: Any) -> None:
    ctx = make_ctx(spec, policy="bounded:0")
    assert offer(ctx, push(ctx, 1)).decision.action == APPLY  # type: ignore[union-attr]
    stale = offer(ctx, push(ctx, 2, base_version=0))
    assert stale.decision is not None and stale.decision.action == DROP
    assert ctx.state.version == 1
    assert request(ctx, Message(wire.PULL, "w0")).body["dropped_stale"] == 1
    assert "dropped_stale" not in request(ctx, Message(wire.PULL, "w0")).body


# ---------------------------------------------------------------- gradients


def test_a_valid_push_is_applied_and_credited_to_its_worker(ctx: HandlerContext) -> None:
    before = [a.copy() for a in ctx.state.weights()[1]]
    out = offer(ctx, push(ctx, 1, body={"loss": 0.5, "steps": 7}))
    assert out.rejection is None and out.decision is not None
    assert out.decision.action == APPLY and out.decision.workers == ("w0",)
    version, after = ctx.state.weights()
    assert version == 1
    for a, b in zip(before, after, strict=True):
        np.testing.assert_allclose(b, a - LR, rtol=1e-6, atol=1e-6)  # SGD on a gradient of ones
    rec = ctx.registry.get("w0")
    assert rec is not None
    assert (rec.pushes, rec.applied, rec.last_seq, rec.steps, rec.loss) == (1, 1, 1, 7, 0.5)
    assert ctx.stats.counters["pushes_received"] == 1 and ctx.stats.counters["bytes_in"] > 0
    doc = build_status(ctx, now=ctx.clock(), started=ctx.clock() - 1.0, started_wall=0.0)
    json.dumps(doc)  # plain types only
    assert doc["version"] == 1 and doc["workers"]["w0"]["applied"] == 1
    assert doc["workers"]["w0"]["state"] == ALIVE and doc["rejected_total"] == 0


def _edit_header(raw: list[bytes], change: Callable[[dict], None]) -> list[bytes]:
    header = msgpack.unpackb(raw[0])
    change(header)
    return [msgpack.packb(header), *raw[1:]]


def _tensors(ctx: HandlerContext, change: Callable[[list[np.ndarray]], None]) -> dict:
    arrays = list(grads(ctx).values())
    change(arrays)
    return dict(zip(ctx.state.names, arrays, strict=True))


def _set(arrays: list[np.ndarray], i: int, a: np.ndarray) -> None:
    arrays[i] = a


# Each bad push: (reason, how to build its frames from a fresh context whose worker "w0" has
# pushed seq 1 at version 0, so the server is at version 1).
BAD_PUSHES: dict[str, Callable[[HandlerContext], list[bytes]]] = {
    wire.R_TRUNCATED: lambda c: frames(push(c, 2))[:-1],
    wire.R_HEADER: lambda c: [b"\xc1 not msgpack", *frames(push(c, 2))[1:]],
    wire.R_VERSION: lambda c: _edit_header(frames(push(c, 2)), lambda h: h.update(version=99)),
    wire.R_TYPE: lambda c: _edit_header(frames(push(c, 2)), lambda h: h.update(type="bogus")),
    wire.R_NBYTES: lambda c: _edit_header(
        frames(push(c, 2)), lambda h: h["tensors"][0].update(nbytes=4)
    ),
    wire.R_TOO_LARGE: lambda c: _edit_header(
        frames(push(c, 2)),
        lambda h: h["tensors"][0].update(shape=[65536, 65536], nbytes=1 << 34),
    ),
    wire.R_WRONG_SOCKET: lambda c: frames(Message(wire.PULL, "w0", seq=2)),
    wire.R_DUPLICATE: lambda c: frames(push(c, 1)),
    wire.R_FUTURE: lambda c: frames(push(c, 2, base_version=2)),
    wire.R_COUNT: lambda c: frames(push(c, 2, tensors=dict(list(grads(c).items())[:1]))),
    wire.R_NAME: lambda c: frames(
        push(c, 2, tensors={f"t{i}": a for i, a in enumerate(grads(c).values())})
    ),
    wire.R_SHAPE: lambda c: frames(
        push(c, 2, tensors=_tensors(c, lambda a: _set(a, 0, a[0].T.copy())))
    ),
    wire.R_DTYPE: lambda c: frames(
        push(c, 2, tensors=_tensors(c, lambda a: _set(a, 1, a[1].astype(np.float64))))
    ),
    wire.R_NONFINITE: lambda c: frames(
        push(c, 2, tensors=_tensors(c, lambda a: a[2].__setitem__((0, 0), np.inf)))
    ),
}


# A push whose tensors are fine but one body field has the wrong type.
BAD_PUSH_BODIES: dict[str, dict[str, Any]] = {
    "loss": {"loss": "0.5", "steps": 2},
    "steps": {"loss": 0.5, "steps": 2.5},
    "stats": {"loss": 0.5, "steps": 2, "stats": [["steps_per_s", 3.0]]},
    "batch_size": {"batch_size": "32"},
    "notices": {"loss": 0.5, "steps": 2, "stats": {"q": 1.0}, "notices": ["x" * 301]},
}


@pytest.mark.parametrize("field_name", list(BAD_PUSH_BODIES))
def test_a_push_with_a_wrongly_typed_body_field_is_refused_and_changes_nothing(
    ctx: HandlerContext, field_name: str
) -> None:
    first = push(
        ctx, 1, body={"loss": 0.25, "steps": 1, "stats": {"steps_per_s": 2.0}, "notices": ["a"]}
    )
    assert offer(ctx, first).decision is not None
    before = weights(ctx)
    rec = ctx.registry.get("w0")
    assert rec is not None
    out = offer(ctx, push(ctx, 2, body=BAD_PUSH_BODIES[field_name]))
    assert out.decision is None and out.rejection is not None
    assert out.rejection.code == wire.R_HEADER and field_name in out.rejection.message
    assert out.rejection.sender == "w0"
    assert ctx.stats.rejected == {wire.R_HEADER: 1}
    assert ctx.state.version == 1 and weights(ctx) == before
    assert (rec.last_seq, rec.applied, rec.rejected) == (1, 1, 1)
    assert (rec.loss, rec.steps, rec.reported) == (0.25, 1, {"steps_per_s": 2.0})
    assert rec.notices == ("a",)
    assert ctx.stats.loss.value == 0.25  # the refused loss never reaches the server's figure
    # the same seq with a well-formed body is still accepted: the refusal consumed nothing
    assert offer(ctx, push(ctx, 2, body={"loss": 0.5, "steps": 2})).decision is not None
    assert ctx.state.version == 2 and (rec.last_seq, rec.steps, rec.loss) == (2, 2, 0.5)


@pytest.mark.parametrize("reason", list(BAD_PUSHES))
def test_every_bad_push_is_refused_counted_and_changes_nothing(
    ctx: HandlerContext, reason: str
) -> None:
    assert offer(ctx, push(ctx, 1)).decision is not None
    before = weights(ctx)
    rec = ctx.registry.get("w0")
    assert rec is not None
    out = handle_gradients(BAD_PUSHES[reason](ctx), ctx)
    assert out.decision is None and out.rejection is not None
    assert out.rejection.code == reason and out.rejection.message
    assert ctx.stats.rejected == {reason: 1}
    assert ctx.state.version == 1 and weights(ctx) == before
    assert rec.last_seq == 1 and rec.applied == 1
    decoded = reason not in (wire.R_TRUNCATED, wire.R_HEADER, wire.R_VERSION, wire.R_TYPE)
    decoded = decoded and reason not in (wire.R_NBYTES, wire.R_TOO_LARGE)
    assert rec.rejected == int(decoded)  # counted against the worker once it is known


def test_a_push_under_another_keys_name_is_refused_as_identity(spec: Any) -> None:
    ctx = make_ctx(spec, authenticated=True)
    assert offer(ctx, push(ctx, 1, sender="w0/replica-1"), peer_key="w0").decision is not None
    out = offer(ctx, push(ctx, 1, sender="w1"), peer_key="w0")
    assert out.rejection is not None and out.rejection.code == security.R_IDENTITY
    assert out.rejection.sender == "w0"  # counted against the key's owner, not the claim
    assert ctx.state.version == 1 and "w1" not in ctx.registry
    assert ctx.registry.get("w0") is None  # "w0/replica-1" is its own worker id
    refused = request(ctx, Message(wire.PULL, "w1"), peer_key="w0")
    assert refused.type == wire.ERROR and refused.body["code"] == security.R_IDENTITY
    assert ctx.stats.rejected == {security.R_IDENTITY: 2}


# ---------------------------------------------------------------- the order of the checks

# The gradient handler's checks in its documented order; "policy" is the last step (here a
# bounded:0 policy drops a stale gradient: accepted, not refused).
CHECK_ORDER = [
    "decode",
    "socket",
    "identity",
    "body",
    "duplicate",
    "future",
    "shape",
    "finite",
    "policy",
]
REASON = {
    "decode": wire.R_VERSION,
    "socket": wire.R_WRONG_SOCKET,
    "identity": security.R_IDENTITY,
    "body": wire.R_HEADER,
    "duplicate": wire.R_DUPLICATE,
    "future": wire.R_FUTURE,
    "shape": wire.R_SHAPE,
    "finite": wire.R_NONFINITE,
}


def _faulty(ctx: HandlerContext, faults: set[str]) -> tuple[list[bytes], str]:
    """A push from "w0" (after its seq 1 made version 1) failing exactly ``faults``; returns
    its frames and the key it arrives with."""
    version = ctx.state.version
    base = version + 1 if "future" in faults else version - 1 if "policy" in faults else version
    arrays = list(grads(ctx).values())
    if "finite" in faults:
        arrays[0] = arrays[0].copy()
        arrays[0][0, 0] = np.nan  # in the first tensor ...
    if "shape" in faults:
        arrays[-1] = np.ones(arrays[-1].shape[0] + 1, arrays[-1].dtype)  # ... the last is wrong
    msg = Message(
        wire.PULL if "socket" in faults else wire.PUSH,
        "w0",
        seq=1 if "duplicate" in faults else 2,
        base_version=base,
        tensors=dict(zip(ctx.state.names, arrays, strict=True)),
        body={"loss": "high"} if "body" in faults else {},
    )
    raw = frames(msg)
    if "decode" in faults:
        raw = _edit_header(raw, lambda h: h.update(version=99))
    return raw, "mallory" if "identity" in faults else "w0"


def _pairs() -> Iterator[tuple[str, str]]:
    for first, second in itertools.combinations(CHECK_ORDER, 2):
        if {first, second} != {"future", "policy"}:  # both set base_version: exclusive
            yield first, second


@pytest.mark.parametrize(("first", "second"), list(_pairs()))
def test_a_push_failing_two_checks_is_refused_for_the_earlier_one(
    spec: Any, first: str, second: str
) -> None:
    ctx = make_ctx(spec, policy="bounded:0", authenticated=True)
    assert offer(ctx, push(ctx, 1), peer_key="w0").decision is not None
    before = weights(ctx)
    raw, key = _faulty(ctx, {first, second})
    out = handle_gradients(raw, ctx, key)
    assert out.rejection is not None, f"{first}+{second} was not refused"
    assert out.rejection.code == REASON[first]
    assert ctx.stats.rejected == {REASON[first]: 1}
    assert ctx.state.version == 1 and weights(ctx) == before


def test_each_check_alone_refuses_and_a_clean_stale_push_reaches_the_policy(spec: Any) -> None:
    """The pairs test is only meaningful if every fault on its own trips its own check."""
    for fault in CHECK_ORDER:
        ctx = make_ctx(spec, policy="bounded:0", authenticated=True)
        assert offer(ctx, push(ctx, 1), peer_key="w0").decision is not None
        raw, key = _faulty(ctx, {fault})
        out = handle_gradients(raw, ctx, key)
        if fault == "policy":
            assert out.rejection is None and out.decision is not None
            assert out.decision.action == DROP
        else:
            assert out.rejection is not None and out.rejection.code == REASON[fault]
        assert ctx.state.version == 1


@pytest.mark.parametrize("policy", ["async", "bounded:0", "ssp:1", "sync:1/1", "dc:0.5"])
def test_a_push_from_a_future_version_is_refused_before_the_policy_sees_it(
    spec: Any, policy: str
) -> None:
    """The handler's check is the only one: the policy is never offered a gradient whose
    base_version is ahead of the server, whatever the policy."""
    ctx = make_ctx(spec, policy=policy)
    assert offer(ctx, push(ctx, 1)).decision is not None
    before, offered = weights(ctx), ctx.policy.counters["offered"]
    out = offer(ctx, push(ctx, 2, base_version=ctx.state.version + 1))
    assert out.decision is None and out.rejection is not None
    assert out.rejection.code == wire.R_FUTURE and "base_version 2 > server version 1" in (
        out.rejection.message
    )
    assert ctx.policy.counters["offered"] == offered and weights(ctx) == before
    assert ctx.stats.rejected == {wire.R_FUTURE: 1}


# ---------------------------------------------------------------- weight-aware policies


def test_dc_compensates_a_stale_push_with_the_weights_it_was_computed_from(spec: Any) -> None:
    """dc:2 through the handler: the second push, computed from version 0 and arriving at
    version 1, is applied as g + 2 * g * g * (w1 - w0); with SGD and g = 1 that is 1 - 2 * LR."""
    ctx = make_ctx(spec, policy="dc:2")
    w0 = [a.copy() for a in ctx.state.weights()[1]]
    assert offer(ctx, push(ctx, 1, "w0")).decision.action == APPLY
    out = offer(ctx, push(ctx, 1, "w1", base_version=0))
    assert out.decision is not None and out.decision.staleness == 1
    for a, b in zip(w0, ctx.state.weights()[1], strict=True):
        np.testing.assert_allclose(b, a - LR - LR * (1 - 2 * LR), rtol=1e-5, atol=1e-6)
    assert ctx.policy.counters["compensated"] == 1
    assert ctx.policy.describe()["ring_versions"] == 2


def test_lookahead_pull_serves_extrapolated_weights_and_async_serves_the_snapshot(
    spec: Any,
) -> None:
    """lookahead:2 through the handler: after pushes of staleness 1 (horizon 1) a pull of
    version v gets w_v + 2 * (w_v - w_{v-1}); with SGD and g = 1 that is w_v - 2 * LR."""
    ctx, plain = make_ctx(spec, policy="lookahead:2"), make_ctx(spec)
    for c in (ctx, plain):
        assert offer(c, push(c, 1, "w0")).decision.action == APPLY  # type: ignore[union-attr]
        for seq in range(2, 5):
            assert offer(c, push(c, seq, "w0", base_version=c.state.version - 1)).decision
    assert ctx.policy.horizon() == 1  # type: ignore[attr-defined]
    _, now = ctx.state.weights()
    got = request(ctx, Message(wire.PULL, "w0"))
    assert got.base_version == 4
    for name, a in zip(ctx.state.names, now, strict=True):
        np.testing.assert_allclose(got.tensors[name], a - 2 * LR, rtol=1e-5, atol=1e-6)
    again = request(ctx, Message(wire.PULL, "w1", body={"encoding": wire.BF16}))
    for name, a in zip(ctx.state.names, now, strict=True):
        np.testing.assert_allclose(again.tensors[name], a - 2 * LR, rtol=2**-7, atol=1e-6)
    assert ctx.policy.counters["extrapolated"] == 1  # one extrapolation per version
    served = request(plain, Message(wire.PULL, "w0"))
    for name, a in zip(plain.state.names, plain.state.weights()[1], strict=True):
        np.testing.assert_array_equal(served.tensors[name], a)
    unchanged = request(ctx, Message(wire.PULL, "w0", body={"have": 4, "incarnation": "inc-1"}))
    assert unchanged.body["unchanged"] is True and not unchanged.tensors


def test_momentum_aware_sets_the_servers_beta_1_as_staleness_grows(spec: Any) -> None:
    ctx = dataclasses.replace(
        make_ctx(spec, policy="momentum-aware"), state=ParameterState(spec, "adam", 1e-3)
    )
    assert offer(ctx, push(ctx, 1, "w0")).decision.momentum == pytest.approx(0.9)
    for seq in range(2, 6):  # each push computed from version 0: staleness 1, 2, 3, 4
        out = offer(ctx, push(ctx, seq, "w0", base_version=0))
    assert out.decision is not None and out.decision.momentum < 0.9
    assert float(ctx.state.momentum.numpy()) == pytest.approx(out.decision.momentum)
    assert ctx.state.apply_traces == 1
