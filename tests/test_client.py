"""The client layer on real sockets: typed bodies, deadlines, Lazy Pirate, back-pressure.

The servers here are REP/PULL sockets on 127.0.0.1 driven by a test thread, so each test can
make a server that does not answer, answers late, refuses, or answers garbage.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import zmq

from downpour import wire
from downpour.model.partition import make_partition
from downpour.net.client import ShardClient
from downpour.net.cluster import ShardSet
from downpour.net.transport import (
    PushSocket,
    Refused,
    RemoteError,
    RequestTimeout,
    ServerUnavailable,
    Stopped,
    backoff_delays,
    make_context,
    retry_until,
    tcp,
)
from downpour.wire import Message, ProtocolError


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    c = make_context()
    yield c
    c.destroy(linger=0)


class FakeServer:
    """A REP socket on a random loopback port; ``serve(handler)`` answers on a thread."""

    def __init__(self, ctx: zmq.Context) -> None:
        self.sock = ctx.socket(zmq.REP)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = tcp("127.0.0.1", self.port)
        self.received: list[Message] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def serve(self, handler: Callable[[Message], Message]) -> None:
        def loop() -> None:
            while not self._stop.is_set():
                if not self.sock.poll(50, zmq.POLLIN):
                    continue
                msg = wire.decode(self.sock.recv_multipart(copy=False))
                self.received.append(msg)
                self.sock.send_multipart(wire.encode(handler(msg)))

        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            assert not self._thread.is_alive()
        self.sock.close(linger=0)


@pytest.fixture
def server(ctx: zmq.Context) -> Iterator[FakeServer]:
    s = FakeServer(ctx)
    yield s
    s.close()


def weights_at(version: int) -> Callable[[Message], Message]:
    """A handler answering every pull with one tensor at ``version``."""

    def handle(msg: Message) -> Message:
        body = wire.PullReply(incarnation="inc-1")
        return wire.weights_reply(version, body, {"w": np.arange(3, dtype=np.float32)})

    return handle


# ------------------------------------------------------------ typed bodies

BODIES = [
    wire.HelloRequest("fp", "mnist", 4, 1, 2, "abcd"),
    wire.HelloRequest(),
    wire.HelloReply(5571, 5572, "fp", "mnist", 7, 1024, "inc", ("dense", "bf16"), "sync:2/2"),
    wire.HelloReply(5571),
    wire.PullRequest(3, "inc", wire.BF16),
    wire.PullRequest(3, "inc", pushed=17),
    wire.PullRequest(),
    wire.PullReply("inc", unchanged=True, dropped_stale=2),
    wire.PullReply("inc", unchanged=True, wait_ms=20),
    wire.PullReply(),
    wire.PushBody(0.25, 32, 10, {"steps_per_s": 3.5}),
    wire.HeartbeatRequest({"loss": 1.0}),
    wire.HeartbeatReply("inc"),
    wire.StatusReply({"version": 3, "workers": {"w0": {"state": "alive"}}}),
    wire.ErrorReply(wire.R_FINGERPRINT, "another model"),
]


@pytest.mark.parametrize("body", BODIES, ids=lambda b: type(b).__name__)
def test_a_typed_body_round_trips_through_the_wire(body: object) -> None:
    msg = Message(wire.STATUS, "t", body=body.to_body())  # type: ignore[attr-defined]
    again = wire.decode(wire.encode(msg))
    assert type(body).from_body(again.body) == body  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("cls", "body", "field"),
    [
        (wire.PullRequest, {"have": "3"}, "have"),
        (wire.PullRequest, {"have": True}, "have"),
        (wire.PullRequest, {"encoding": 16}, "encoding"),
        (wire.HelloReply, {"last_seq": 3}, "push_port"),
        (wire.HelloReply, {"push_port": 70000}, "push_port"),
        (wire.HelloReply, {"push_port": 5, "encodings": "dense"}, "encodings"),
        (wire.PullReply, {"dropped_stale": -1}, "dropped_stale"),
        (wire.PullReply, {"unchanged": 1}, "unchanged"),
        (wire.PullReply, {"wait_ms": -5}, "wait_ms"),
        (wire.PullReply, {"wait_ms": 10**9}, "wait_ms"),
        (wire.PullRequest, {"pushed": 1.5}, "pushed"),
        (wire.PushBody, {"loss": "low"}, "loss"),
        (wire.HeartbeatRequest, {"stats": [1, 2]}, "stats"),
    ],
)
def test_a_malformed_body_is_refused_naming_the_field(
    cls: type, body: dict[str, object], field: str
) -> None:
    with pytest.raises(ProtocolError) as err:
        cls.from_body(body)
    assert err.value.code == wire.R_HEADER
    assert field in err.value.message


def test_a_pull_body_without_weights_held_says_nothing_of_versions() -> None:
    # a server answers a pull without "have" with every tensor: what a fresh client needs
    assert wire.PullRequest().to_body() == {}
    assert wire.PullRequest(encoding=wire.BF16).to_body() == {"encoding": "bf16"}
    assert wire.PullRequest(4, "inc").to_body() == {"have": 4, "incarnation": "inc"}


def test_bodies_keep_their_wire_maps() -> None:
    # fields declared ``always`` travel at their defaults; others are left out there
    assert wire.HelloReply(5571).to_body() == {"push_port": 5571, "last_seq": 0, "policy": ""}
    assert wire.HelloReply(5571, encodings=("dense",)).to_body()["encodings"] == ["dense"]
    assert wire.PullReply().to_body() == {}
    assert wire.PullReply("i", wait_ms=5).to_body() == {"incarnation": "i", "wait_ms": 5}
    assert wire.ErrorReply(wire.R_NAME).to_body() == {"code": wire.R_NAME, "message": ""}
    end = {"grant": "end", "epoch": 2, "retry_ms": 0, "acked": 0, "stale": 0, "held": 0}
    assert wire.SplitReply("end", 2).to_body() == end
    assert wire.SplitRequest("0" * 64).to_body() == {"digest": "0" * 64, "want": True}


def test_a_body_ignores_keys_it_does_not_declare() -> None:
    body = {"model": "m", "not_a_field": [1, 2]}
    assert wire.HelloRequest.from_body(body) == wire.HelloRequest(model="m")


@dataclass(frozen=True)
class Probe(wire.Body):
    """A body declared for this test only: what a new message body takes."""

    level: int = wire.wire_field("int", lo=0, hi=9)
    mode: str = wire.wire_field("str", "a", choices=("a", "b"))
    tags: tuple[str, ...] = wire.wire_field("list", (), read=lambda k, v: tuple(v), write=list)


def test_a_new_body_gets_its_wire_map_from_its_field_declarations() -> None:
    probe = Probe(3, "b", ("x", "y"))
    assert probe.to_body() == {"level": 3, "mode": "b", "tags": ["x", "y"]}
    assert Probe.from_body(probe.to_body()) == probe
    assert Probe(0).to_body() == {"level": 0}
    for body, field in [
        ({}, "level"),
        ({"level": 10}, "level"),
        ({"level": -1}, "level"),
        ({"level": 1.0}, "level"),
        ({"level": 1, "mode": "c"}, "mode"),
        ({"level": 1, "tags": "x"}, "tags"),
    ]:
        with pytest.raises(ProtocolError) as err:
            Probe.from_body(body)
        assert err.value.code == wire.R_HEADER and field in err.value.message


# ------------------------------------------------------------ requests on real sockets


def test_pull_returns_typed_weights(ctx: zmq.Context, server: FakeServer) -> None:
    server.serve(weights_at(7))
    client = ShardClient(ctx, server.endpoint, sender="t", timeout_s=10)
    try:
        got = client.pull(wire.PullRequest(6, "inc-0", wire.BF16))
    finally:
        client.close()
    assert got.version == 7 and got.reply.incarnation == "inc-1" and not got.unchanged
    np.testing.assert_array_equal(got.tensors["w"], np.arange(3, dtype=np.float32))
    sent = server.received[0]
    assert (sent.type, sent.sender) == (wire.PULL, "t")
    assert wire.PullRequest.from_body(sent.body) == wire.PullRequest(6, "inc-0", wire.BF16)


def test_a_silent_server_raises_the_named_error_and_the_socket_is_recreated(
    ctx: zmq.Context, server: FakeServer
) -> None:
    client = ShardClient(ctx, server.endpoint, sender="t", timeout_s=0.2)
    try:
        with pytest.raises(RequestTimeout) as err:
            client.pull()
        assert isinstance(err.value, ServerUnavailable)  # how to recover: retry later
        assert client.recreated == 1  # Lazy Pirate: the stuck REQ socket was replaced
        # the recreated socket works once the server answers (a stuck REQ never would)
        server.serve(weights_at(3))
        client.req.timeout_s = 10  # patient now: the answer comes on the new socket
        assert client.pull().version == 3
    finally:
        client.close()


def test_a_patient_client_retries_until_its_deadline_and_counts_reconnects(
    ctx: zmq.Context, server: FakeServer
) -> None:
    counters: dict[str, float] = {}
    client = ShardClient(
        ctx, server.endpoint, sender="t", timeout_s=0.1, server_timeout_s=0.5, counters=counters
    )
    try:
        with pytest.raises(ServerUnavailable, match="did not answer for"):
            client.pull()
        assert counters["reconnects"] >= 1  # one per retry, as the worker reports them
        assert client.recreated >= 2  # each attempt's stuck socket was replaced
    finally:
        client.close()


def test_a_stop_flag_ends_the_wait_with_stopped(ctx: zmq.Context, server: FakeServer) -> None:
    stop = threading.Event()
    stop.set()
    client = ShardClient(
        ctx, server.endpoint, sender="t", timeout_s=0.1, server_timeout_s=60, stop=stop
    )
    try:
        with pytest.raises(Stopped):
            client.pull()
    finally:
        client.close()


def test_retry_until_returns_once_the_call_succeeds() -> None:
    attempts: list[int] = []

    def flaky() -> str:
        attempts.append(1)
        if len(attempts) < 3:
            raise ServerUnavailable("not yet")
        return "ok"

    seen: list[ServerUnavailable] = []
    assert retry_until(flaky, 60, on_retry=seen.append, base_s=0.001, cap_s=0.002) == "ok"
    assert len(attempts) == 3 and len(seen) == 2


def test_backoff_never_exceeds_its_cap_even_from_a_larger_base() -> None:
    delay = backoff_delays(5.0, 0.5, seed=3)
    assert all(0.25 <= delay() <= 0.5 for _ in range(100))


def test_a_refused_hello_is_refused_with_the_servers_reason(
    ctx: zmq.Context, server: FakeServer
) -> None:
    server.serve(lambda m: wire.error_message(wire.R_FINGERPRINT, "start the same --model"))
    client = ShardClient(ctx, server.endpoint, sender="t", timeout_s=10)
    try:
        with pytest.raises(Refused) as err:
            client.hello(wire.HelloRequest("fp", "mnist"))
        assert err.value.code == wire.R_FINGERPRINT
        assert err.value.endpoint == server.endpoint
        assert "same --model" in err.value.message
        # an ERROR to a pull is the request's fault, not a refusal of the client
        with pytest.raises(RemoteError) as pull_err:
            client.pull()
        assert not isinstance(pull_err.value, Refused)
    finally:
        client.close()
    assert wire.HelloRequest.from_body(server.received[0].body).model == "mnist"


def test_a_malformed_reply_body_is_a_protocol_error(ctx: zmq.Context, server: FakeServer) -> None:
    server.serve(lambda m: Message(wire.HELLO, "server", body={"push_port": "5571"}))
    client = ShardClient(ctx, server.endpoint, sender="t", timeout_s=10)
    try:
        with pytest.raises(ProtocolError, match="push_port"):
            client.hello(wire.HelloRequest())
        with pytest.raises(ProtocolError) as err:  # a hello reply is no answer to a pull
            client.pull()
        assert err.value.code == wire.R_TYPE
    finally:
        client.close()


def test_status_reads_the_document_from_the_status_socket(
    ctx: zmq.Context, server: FakeServer
) -> None:
    server.serve(lambda m: wire.status_reply({"version": 12, "service": "server"}))
    client = ShardClient(ctx, None, sender="cli", timeout_s=10, status_endpoint=server.endpoint)
    try:
        assert client.status() == {"version": 12, "service": "server"}
        with pytest.raises(ValueError, match="no request endpoint"):
            client.pull()
    finally:
        client.close()
    assert server.received[0].type == wire.STATUS


# ------------------------------------------------------------ pushes


def unreachable_endpoint(directory: Path) -> str:
    """An endpoint nothing is bound to, nor can be (a path in this test's own directory): a
    PUSH there queues up to its HWM, no more. A loopback port freed for the test could be
    taken by another process, or still be accepting while the PUSH connects."""
    return f"ipc://{directory}/nobody-listens"


def test_a_push_at_the_high_water_mark_counts_backpressure_then_gives_up(
    ctx: zmq.Context, tmp_path: Path
) -> None:
    counters: dict[str, float] = {}
    push = PushSocket(ctx, unreachable_endpoint(tmp_path), hwm=1, timeout_s=0.05, counters=counters)
    frames = wire.encode(Message(wire.PUSH, "t", seq=1))
    try:
        sent = 0
        with pytest.raises(ServerUnavailable, match="not taking them"):
            for _ in range(10):  # the queue holds at most a few: the 10th cannot go
                push.send(frames, deadline_s=0.2)
                sent += 1
        assert sent >= 1 and counters["backpressure"] >= 1
        stop = threading.Event()
        stop.set()
        assert push.send(frames, deadline_s=60, stop=stop) is False  # a planned stop drops it
        assert counters["dropped"] == 1
    finally:
        push.close()


# ------------------------------------------------------------ every shard


def test_a_shard_set_says_hello_pulls_joins_and_pushes_each_shard_its_slice(
    ctx: zmq.Context,
) -> None:
    """Two shards of a (8, 3) kernel and a (3,) bias: hello carries each shard's place in the
    partition, a pull joins the slices, a push splits the gradient under one seq, and a
    shard answering with a new incarnation is noticed."""
    names, shapes = ["kernel", "bias"], [(8, 3), (3,)]
    part = make_partition(names, shapes, ["float32", "float32"], 2, "fp")
    full = [np.arange(24, dtype=np.float32).reshape(8, 3), np.full(3, 0.5, np.float32)]
    servers = [FakeServer(ctx), FakeServer(ctx)]
    pulls = [ctx.socket(zmq.PULL) for _ in servers]
    incarnations = ["a", "a"]
    for i, (srv, sock) in enumerate(zip(servers, pulls, strict=True)):
        push_port = sock.bind_to_random_port("tcp://127.0.0.1")
        slice_i = dict(zip([p.wire_name for p in part.shards[i]], part.split(full)[i], strict=True))

        def handle(msg: Message, i: int = i, port: int = push_port, t: dict = slice_i) -> Message:
            if msg.type == wire.HELLO:
                return wire.hello_reply(0, wire.HelloReply(port, incarnation=incarnations[i]))
            return wire.weights_reply(1, wire.PullReply(incarnations[i]), t)

        srv.serve(handle)
    counters: dict[str, float] = {}
    shards = ShardSet(
        ctx,
        [("127.0.0.1", s.port) for s in servers],
        part,
        sender="w0",
        timeout_s=10,
        server_timeout_s=10,
        counters=counters,
    )
    try:
        hellos = shards.hello_all("tiny")
        assert [h.reply.push_port for h in hellos] == [s.push_port for s in shards.shards]
        assert all(s.push is not None for s in shards.shards)
        sent = [wire.HelloRequest.from_body(s.received[0].body) for s in servers]
        assert [(h.shard, h.num_shards, h.partition) for h in sent] == [
            (0, 2, part.digest),
            (1, 2, part.digest),
        ]
        shards.pull_all()
        assert shards.versions == [1, 1]
        for got, want in zip(shards.join(), full, strict=True):
            np.testing.assert_array_equal(got, want)

        grads = [np.ones((8, 3), np.float32), np.ones(3, np.float32)]
        sizes = shards.push(5, grads, [1, 1], wire.PushBody(loss=0.1, steps=1))
        assert sizes is not None and all(n > 0 for n in sizes)
        for i, sock in enumerate(pulls):
            assert sock.poll(10_000, zmq.POLLIN)
            msg = wire.decode(sock.recv_multipart(copy=False))
            assert (msg.type, msg.sender, msg.seq, msg.base_version) == (wire.PUSH, "w0", 5, 1)
            assert list(msg.tensors) == shards.wire_names[i]
        assert not shards.restarted_since_push()
        incarnations[1] = "b"  # shard 1 restarts
        shards.pull_all()
        assert shards.restarted_since_push()
    finally:
        shards.close()
        for srv in servers:
            srv.close()
        for sock in pulls:
            sock.close(linger=0)
