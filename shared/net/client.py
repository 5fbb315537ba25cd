"""The shard client: how every caller speaks to one server (shard).

Layered as in ps-lite: ``downpour.wire`` builds and reads message bodies, ``downpour.net.transport``
owns sockets, deadlines, the Lazy-Pirate recreate and backoff, and a ``ShardClient`` turns
them into typed calls on one server: ``hello``, ``pull``, ``heartbeat``, ``status`` and,
for data dispatched by the server (shard 0 under ``--data-dispatch server``),
``next_split`` / ``ack_splits`` (pushes go over a ``transport.PushSocket``).
``downpour.net.cluster.ShardSet`` does the same for every shard of a partitioned model.

A ShardClient holds one REQ socket per endpoint and is not thread-safe: use one per thread.
With ``server_timeout_s`` > 0, ``hello`` and ``pull`` retry a server that does not answer
with capped, jittered backoff until that many seconds have passed (counting ``reconnects``),
then raise ``ServerUnavailable``; with 0 they try once. A server that refuses the client
raises ``Refused``; an ERROR reply to anything else raises ``RemoteError``.
"""

from __future__ import annotations

import logging
import secrets
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import zmq

from downpour import wire
from downpour.inputs.context import Split
from downpour.net import security
from downpour.net.transport import (
    Counters,
    Refused,
    RemoteError,
    ReqClient,
    ServerUnavailable,
    make_context,
    retry_until,
)
from downpour.wire import Message

log = logging.getLogger(__name__)

# This process's token, sent with hello and split requests: a server that sees a worker id
# speak from a new token knows the worker restarted and takes back the splits it held.
PROCESS_TOKEN = secrets.token_hex(8)


@dataclass(frozen=True)
class Hello:
    """A server's answer to hello: its weight ``version`` and the reply body."""

    version: int
    reply: wire.HelloReply


@dataclass(frozen=True)
class Weights:
    """A pull's answer: the server's ``version``, the reply body and the tensors (none when
    ``reply.unchanged``), in the server's variable order."""

    version: int
    reply: wire.PullReply
    tensors: dict[str, wire.WireTensor] = field(default_factory=dict)

    @property
    def unchanged(self) -> bool:
        """True when the sender's version was still current (no tensors came)."""
        return self.reply.unchanged

    def with_tensors(self, tensors: dict[str, Any]) -> Weights:
        """The same answer carrying other tensors (e.g. converted for the step function)."""
        return replace(self, tensors=tensors)


@dataclass(frozen=True)
class SplitGrant:
    """The dispatcher's answer to ``next_split``: ``kind`` "split" (read ``split`` of
    ``epoch``, then acknowledge it), "wait" (the epoch's last splits are in flight elsewhere:
    ask again after ``retry_s``) or "end" (the epoch bound is reached); the reply body too."""

    kind: str
    epoch: int
    split: Split | None
    retry_s: float
    reply: wire.SplitReply


class ShardClient:
    """Typed requests to one server: hello, pull, heartbeat (its REP socket) and status (its
    status socket). Either endpoint may be None when the caller uses only the other."""

    def __init__(
        self,
        ctx: zmq.Context,
        endpoint: str | None,
        *,
        sender: str,
        timeout_s: float = 10.0,
        server_timeout_s: float = 0.0,
        retries: int = 0,
        keys: security.ClientKeys | None = None,
        limits: wire.Limits = wire.DEFAULT_LIMITS,
        max_msg_bytes: int = -1,
        status_endpoint: str | None = None,
        counters: Counters | None = None,
        stop: threading.Event | None = None,
        on_reply: Callable[[], None] | None = None,
    ) -> None:
        self.ctx = ctx
        self.endpoint = endpoint
        self.status_endpoint = status_endpoint
        self.sender = sender
        self.timeout_s = timeout_s
        self.server_timeout_s = server_timeout_s
        self.retries = retries
        self.keys = keys
        self.limits = limits
        self.max_msg_bytes = max_msg_bytes
        self.counters: Counters = counters if counters is not None else {}
        self.stop = stop
        self.on_reply = on_reply
        self._req: ReqClient | None = None
        self._sent_universe: str | None = None  # digest of the universe the server has had
        self._split_seq = 0
        self._status: ReqClient | None = None

    # ------------------------------------------------------------ sockets

    def _client(self, endpoint: str | None, what: str) -> ReqClient:
        if endpoint is None:
            raise ValueError(f"this client has no {what} endpoint")
        return ReqClient(
            self.ctx,
            endpoint,
            timeout_s=self.timeout_s,
            retries=self.retries,
            configure=security.curve_client(self.keys),  # CURVE survives a recreate
            max_msg_bytes=self.max_msg_bytes,
        )

    @property
    def req(self) -> ReqClient:
        """The REQ client for the server's REP socket (opened on first use)."""
        if self._req is None:
            self._req = self._client(self.endpoint, "request")
        return self._req

    @property
    def recreated(self) -> int:
        """How often the REQ socket was recreated after a missing reply (Lazy Pirate)."""
        return self._req.recreated if self._req is not None else 0

    def close(self) -> None:
        """Close the sockets without lingering."""
        for c in (self._req, self._status):
            if c is not None:
                c.close()
        self._req = self._status = None

    # ------------------------------------------------------------ requests

    def request(self, msg: Message, *, patient: bool = True) -> Message:
        """Send ``msg`` to the REP socket and return the reply. ``patient``: retry until
        ``server_timeout_s`` (ServerUnavailable after); else one attempt. ERROR replies
        raise RemoteError."""

        def once() -> Message:
            reply = self.req.request(msg, self.limits)
            if self.on_reply is not None:
                self.on_reply()
            return reply

        if not patient or self.server_timeout_s <= 0:
            return once()
        return retry_until(
            once,
            self.server_timeout_s,
            what=f"server {self.endpoint}",
            stop=self.stop,
            on_retry=self._on_retry,
        )

    def _on_retry(self, exc: ServerUnavailable) -> None:
        self.counters["reconnects"] = self.counters.get("reconnects", 0) + 1
        log.warning("server %s not answering; retrying", self.endpoint)

    def hello(self, body: wire.HelloRequest) -> Hello:
        """Introduce the sender, stating that it decodes every encoding and row id dtype
        (``wire.ACCEPTS_ALL``) unless ``body.accepts`` says otherwise. Refused when the server
        will not take it (another model or partition), ServerUnavailable when it does not
        answer."""
        if body.process is None:
            body = replace(body, process=PROCESS_TOKEN)
        if body.accepts is None:
            body = replace(body, accepts=wire.ACCEPTS_ALL)
        try:
            reply = self.request(wire.hello_request(self.sender, body))
        except RemoteError as exc:
            raise Refused(exc.code, exc.message, self.endpoint) from None
        wire.expect(reply, wire.HELLO)
        hello = Hello(reply.base_version, wire.HelloReply.from_body(reply.body))
        if hello.reply.max_request_bytes is not None:  # bigger requests are refused here
            self.req.max_request_bytes = hello.reply.max_request_bytes
        return hello

    def pull(
        self,
        body: wire.PullRequest | None = None,
        rows: dict[str, Any] | None = None,
    ) -> Weights:
        """The server's weights (or "unchanged" when ``body.have`` is still current).
        ``rows``: a row request, the row ids wanted of each row-sparse table by wire name
        (the reply carries those rows as ``wire.Sparse``; see ``downpour.wire``). Counts the
        reply's size as received in ``counters["bytes_received"]``."""
        msg = wire.pull_request(self.sender, body, rows)
        reply = wire.expect(self.request(msg), wire.WEIGHTS)
        self.counters["bytes_received"] = self.counters.get("bytes_received", 0) + (
            self.req.reply_bytes
        )
        return Weights(reply.base_version, wire.PullReply.from_body(reply.body), reply.tensors)

    def heartbeat(
        self, stats: dict[str, float] | None = None, notices: tuple[str, ...] = ()
    ) -> tuple[int, wire.HeartbeatReply]:
        """One heartbeat attempt, no retry: (the server's version, its reply). ``stats`` and
        ``notices``: the sender's reported figures and slow paths (``metrics.Notices``)."""
        body = wire.HeartbeatRequest(stats, notices=notices or None)
        msg = wire.heartbeat_request(self.sender, body)
        reply = self.req.request(msg, self.limits, retries=0)
        if self.on_reply is not None:
            self.on_reply()
        wire.expect(reply, wire.HEARTBEAT)
        return reply.base_version, wire.HeartbeatReply.from_body(reply.body)

    def finished(
        self, last_seq: int, stats: dict[str, float] | None = None, notices: tuple[str, ...] = ()
    ) -> int:
        """Tell the server the sender has done its work, its last push being ``last_seq``
        (a heartbeat with ``finished``), retried until ``server_timeout_s`` like hello and
        pull: the job's end depends on every shard hearing it. The server's version."""
        body = wire.HeartbeatRequest(stats, finished=last_seq, notices=notices or None)
        reply = wire.expect(self.request(wire.heartbeat_request(self.sender, body)), wire.HEARTBEAT)
        return reply.base_version

    def next_split(
        self,
        universe: wire.DataUniverse,
        acks: tuple[tuple[int, ...], ...] = (),
        *,
        epochs: int | None = None,
        want: bool = True,
        process: str | None = None,
    ) -> SplitGrant:
        """Acknowledge the finished splits ``acks`` ((epoch, index, seq): seq is the push
        carrying the split's last gradients, see ``wire.SplitRequest``) and ask for the
        next one of ``universe`` (sent whole on this client's first call, then only its
        digest; ``epochs``: the bound to propose, 0 unbounded). Safe to retry: an ack
        repeated after a lost reply is ignored, and a worker at its in-flight limit gets
        its newest split again. Refused when the server serves other data or does not
        dispatch; ServerUnavailable when it does not answer."""
        digest = universe.digest()
        first = self._sent_universe != digest
        try:
            reply = self._split_request(universe, acks, epochs, want, process, whole=first)
        except RemoteError as exc:
            if exc.code == wire.R_UNIVERSE and not first:  # e.g. a server restarted afresh
                reply = self._split_request(universe, acks, epochs, want, process, whole=True)
            else:
                raise
        self._sent_universe = digest
        r = wire.SplitReply.from_body(wire.expect(reply, wire.SPLIT).body)
        split = None
        if r.grant == "split":
            assert r.index is not None
            if r.file is not None:
                split = Split(r.index, file=r.file, skip=r.skip)
            else:
                assert r.start is not None and r.stop is not None
                split = Split(r.index, start=r.start, stop=r.stop, skip=r.skip)
        return SplitGrant(r.grant, r.epoch, split, r.retry_ms / 1e3, r)

    def _split_request(
        self,
        universe: wire.DataUniverse,
        acks: tuple[tuple[int, ...], ...],
        epochs: int | None,
        want: bool,
        process: str | None,
        *,
        whole: bool,
    ) -> Message:
        body = wire.SplitRequest(
            digest=universe.digest(),
            acks=tuple(acks),
            want=want,
            universe=universe if whole else None,
            epochs=epochs if whole else None,
            process=process or PROCESS_TOKEN,
        )
        self._split_seq += 1
        try:
            return self.request(wire.split_request(self.sender, body, self._split_seq))
        except RemoteError as exc:
            if exc.code == wire.R_DISPATCH_OFF or (exc.code == wire.R_UNIVERSE and whole):
                raise Refused(exc.code, exc.message, self.endpoint) from None
            raise

    def ack_splits(
        self, universe: wire.DataUniverse, acks: tuple[tuple[int, ...], ...]
    ) -> wire.SplitReply:
        """Acknowledge finished splits without asking for another (e.g. before exiting)."""
        return self.next_split(universe, acks, want=False).reply

    def status(self, ack: str | None = None) -> dict[str, Any]:
        """The server's status document from its status socket (one attempt); ``ack``:
        acknowledge an ended job (``wire.StatusRequest``)."""
        if self._status is None:
            self._status = self._client(self.status_endpoint, "status")
        msg = wire.status_request(self.sender, wire.StatusRequest(ack))
        reply = self._status.request(msg, wire.STATUS_LIMITS)
        wire.expect(reply, wire.STATUS)
        return dict(wire.StatusReply.from_body(reply.body).doc)


def fetch_status(
    endpoint: str,
    timeout_s: float = 5.0,
    keys: security.ClientKeys | None = None,
    sender: str = "status-cli",
    ack: str | None = None,
) -> dict[str, Any]:
    """The status document of the server whose status socket is at ``endpoint``, with its
    own short-lived context (RequestTimeout when it does not answer within ``timeout_s``);
    ``ack``: acknowledge an ended job (``wire.StatusRequest``)."""
    ctx = make_context()
    client = ShardClient(
        ctx, None, sender=sender, timeout_s=timeout_s, keys=keys, status_endpoint=endpoint
    )
    try:
        return client.status(ack)
    finally:
        client.close()
        ctx.term()
