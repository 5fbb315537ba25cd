"""ZeroMQ plumbing shared by both services: bounded requests, retries, pushes, binding.

Every blocking call here has a bound. A REQ socket whose reply does not arrive in time is
closed with LINGER 0 and recreated (the ZeroMQ guide's "Lazy Pirate"), because a plain REQ
socket waits forever when its server dies. ``retry_until`` repeats a request with capped,
jittered backoff until a deadline; ``PushSocket`` sends gradients with a send timeout at its
high-water mark and waits out back-pressure until a deadline, counting what happens.

Errors are named by how to recover: ``ServerUnavailable`` (retry later, or give up after a
deadline), ``Refused`` (fix the configuration; retrying cannot help), ``Stopped`` (the
caller asked to stop while waiting).
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import logging
import random
import socket
import struct
import threading
import time
from collections.abc import Callable, MutableMapping
from typing import Any, TypeVar

import zmq

from downpour import wire
from downpour.runtime.logs import RateLimitedLog
from downpour.wire import Message

log = logging.getLogger(__name__)
T = TypeVar("T")
Counters = MutableMapping[str, float]  # event counts a caller wants kept (e.g. worker stats)


class ServerUnavailable(Exception):
    """The server did not answer (or take a push) in time.

    Recovery: it is down, restarting or unreachable; retry later (a REQ socket has already
    been recreated), or give up with a clear error once a deadline has passed.
    """


class RequestTimeout(ServerUnavailable):
    """No reply to one request within its timeout after all retries (see ServerUnavailable)."""


class Stopped(Exception):
    """The caller's stop flag was set while waiting for the server.

    Recovery: none needed; the caller is shutting down.
    """


class RemoteError(Exception):
    """The server answered with an ERROR message. ``code`` is its reason (``wire.R_*``),
    ``endpoint`` the server's, when known.

    Recovery: the request was bad; resending it unchanged fails again.
    """

    def __init__(self, code: str, message: str, endpoint: str | None = None) -> None:
        super().__init__(f"server refused: {code}: {message}")
        self.code = code
        self.message = message
        self.endpoint = endpoint


class Refused(RemoteError):
    """The server refused this client (another model, partition or protocol version).

    Recovery: fix the configuration (--model, the shard list); retrying cannot help.
    """


_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address


def make_context(io_threads: int = 1) -> zmq.Context:
    """A fresh context; more I/O threads help when large payloads move both ways."""
    ctx = zmq.Context(io_threads=io_threads)
    ctx.setsockopt(zmq.LINGER, 0)
    return ctx


def bind(sock: zmq.Socket, host: str, port: int) -> int:
    """Bind ``tcp://host:port`` (port 0 picks a free one) and return the bound port."""
    if port == 0:
        return sock.bind_to_random_port(f"tcp://{host}")
    sock.bind(f"tcp://{host}:{port}")
    return port


def interface_addresses(name: str) -> list[str] | None:
    """The IP addresses of network interface ``name`` (``lo``, ``eth0``), or None when no
    interface has that name. ZeroMQ binds ``tcp://NAME:port`` to an interface's addresses,
    so a bind host may be one. Linux: IPv4 by the SIOCGIFADDR ioctl, IPv6 from
    /proc/net/if_inet6."""
    if name not in {n for _, n in socket.if_nameindex()}:
        return None
    addrs: list[str] = []
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("256s", name.encode()[:15])
        addrs.append(socket.inet_ntoa(fcntl.ioctl(s.fileno(), _SIOCGIFADDR, req)[20:24]))
    with contextlib.suppress(OSError), open("/proc/net/if_inet6") as f:
        for line in f:
            fields = line.split()
            if len(fields) == 6 and fields[5] == name:
                addrs.append(str(ipaddress.IPv6Address(bytes.fromhex(fields[0]))))
    return addrs


def is_loopback(host: str) -> bool:
    """True when every address ``host`` stands for is a loopback address (127.0.0.0/8, ::1).

    ``host`` may be an IP literal (IPv6 with or without brackets), an interface name (checked
    by its addresses) or a host name (resolved with getaddrinfo: every address it resolves to
    must be loopback). A name that resolves to nothing, ``*`` and ``0.0.0.0`` are not loopback.
    Matching by text would let ``127.0.0.1.example.com`` or ``localhost.example.com`` pass.
    """
    h = host.strip()
    if h.startswith("[") and h.endswith("]"):
        h = h[1:-1]
    if not h or h == "*":
        return False
    with contextlib.suppress(ValueError):
        return ipaddress.ip_address(h.split("%")[0]).is_loopback
    addrs = interface_addresses(h)
    if addrs is None:
        try:
            addrs = [info[4][0] for info in socket.getaddrinfo(h, None)]
        except (socket.gaierror, UnicodeError):
            return False
    return bool(addrs) and all(
        ipaddress.ip_address(str(a).split("%")[0]).is_loopback for a in addrs
    )


def tcp(host: str, port: int) -> str:
    """The endpoint string for host and port (IPv6 literals are bracketed)."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"tcp://{host}:{port}"


class ReqClient:
    """A REQ client that never hangs: each request has a timeout and bounded retries.

    Not thread-safe; use one per thread. ``configure`` is called on every new socket, so
    security options (CURVE) survive the recreate.
    """

    def __init__(
        self,
        ctx: zmq.Context,
        endpoint: str,
        timeout_s: float = 5.0,
        retries: int = 3,
        configure: Callable[[zmq.Socket], None] | None = None,
        max_msg_bytes: int = -1,
    ) -> None:
        self.ctx = ctx
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.retries = retries
        self.configure = configure
        self.max_msg_bytes = max_msg_bytes
        # The server's announced request limit (hello): a bigger request is refused here.
        self.max_request_bytes: int | None = None
        self.recreated = 0
        self.reply_bytes = 0  # the last reply's size as received, every frame
        self.sock = self._open()

    def _open(self) -> zmq.Socket:
        sock = self.ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_msg_bytes)
        if self.configure is not None:
            self.configure(sock)
        sock.connect(self.endpoint)
        return sock

    def _reset(self) -> None:
        self.sock.close(linger=0)
        self.recreated += 1
        self.sock = self._open()

    def request_frames(
        self, frames: list[Any], timeout_s: float | None = None, retries: int | None = None
    ) -> list[zmq.Frame]:
        """Send frames, return the reply frames; raise RequestTimeout when none comes.

        A request larger than the server's announced limit (``max_request_bytes``) is refused
        here (``Refused``, code ``oversize``) without being sent. A request that times out
        while over ``wire.REQUEST_DROP_FACTOR`` times the limit (before a hello told it:
        ``wire.REQUEST_MAX_BYTES``) says that the server dropped it for its size."""
        size = sum(memoryview(f).nbytes for f in frames)
        limit = self.max_request_bytes
        if limit is not None and size > limit:
            raise Refused(
                wire.R_OVERSIZE,
                f"the request is {size} bytes, larger than the server accepts ({limit} bytes)",
                self.endpoint,
            )
        timeout_ms = int(1000 * (self.timeout_s if timeout_s is None else timeout_s))
        attempts = 1 + (self.retries if retries is None else retries)
        for attempt in range(attempts):
            # A REQ socket whose connection failed its handshake (e.g. a CURVE server refused
            # our key) has no pipe to queue into, and a send would wait forever: bound it too.
            self.sock.setsockopt(zmq.SNDTIMEO, timeout_ms)
            try:
                self.sock.send_multipart(frames, copy=False)
            except zmq.Again:
                pass  # counts as no reply: recreate the socket and try again
            else:
                if self.sock.poll(timeout_ms, zmq.POLLIN):
                    reply = self.sock.recv_multipart(copy=False)
                    self.reply_bytes = sum(memoryview(f).nbytes for f in reply)
                    return reply
            log.debug("no reply from %s (attempt %d/%d)", self.endpoint, attempt + 1, attempts)
            self._reset()
        known = wire.REQUEST_MAX_BYTES if limit is None else limit
        why = (
            f": the request was {size} bytes, larger than the server accepts ({known} bytes), "
            "so it dropped the connection"
            if size > known * wire.REQUEST_DROP_FACTOR
            else ""
        )
        raise RequestTimeout(f"no reply from {self.endpoint} after {attempts} attempt(s){why}")

    def request(
        self,
        msg: Message,
        limits: wire.Limits = wire.DEFAULT_LIMITS,
        timeout_s: float | None = None,
        retries: int | None = None,
    ) -> Message:
        """Encode, send, decode the reply; ERROR replies raise RemoteError."""
        reply = wire.decode(self.request_frames(wire.encode(msg), timeout_s, retries), limits)
        if reply.type == wire.ERROR:
            err = wire.ErrorReply.from_body(reply.body)
            raise RemoteError(err.code, err.message, self.endpoint)
        return reply

    def close(self) -> None:
        """Close the socket without lingering."""
        self.sock.close(linger=0)


def backoff_delays(
    base_s: float = 0.1, cap_s: float = 5.0, seed: int | None = None
) -> Callable[[], float]:
    """Capped exponential backoff with full jitter; returns a function giving the next delay.

    Unbounded in calls: the exponent stops growing at the cap (``base_s * 2**n`` as a float
    overflows after about 1,000 doublings, which a long wait with a small base reaches)."""
    rng = random.Random(seed)
    state = {"d": base_s}

    def next_delay() -> float:
        d = min(cap_s, state["d"])
        state["d"] = d * 2
        return rng.uniform(d / 2, d)

    return next_delay


class Deadline:
    """A point in monotonic time; ``remaining()`` never goes below zero."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def remaining(self) -> float:
        """Seconds left, at least 0."""
        return max(0.0, self.end - time.monotonic())

    def expired(self) -> bool:
        """True once the deadline has passed."""
        return time.monotonic() >= self.end


def retry_until(
    call: Callable[[], T],
    deadline_s: float,
    *,
    what: str = "the server",
    stop: threading.Event | None = None,
    on_retry: Callable[[ServerUnavailable], None] | None = None,
    base_s: float = 0.1,
    cap_s: float = 2.0,
) -> T:
    """``call()`` repeated while it raises ServerUnavailable, with capped jittered backoff,
    until ``deadline_s`` seconds have passed (then ServerUnavailable naming ``what``) or
    ``stop`` is set (then Stopped). ``on_retry`` sees each failure before the pause."""
    deadline = Deadline(deadline_s)
    delay = backoff_delays(base_s, cap_s)
    while True:
        try:
            return call()
        except ServerUnavailable as exc:
            if stop is not None and stop.is_set():
                raise Stopped(f"stopped while waiting for {what}") from None
            if deadline.expired():
                raise ServerUnavailable(f"{what} did not answer for {deadline_s:.0f} s") from None
            if on_retry is not None:
                on_retry(exc)
            pause = min(delay(), deadline.remaining())
            if stop is not None:
                stop.wait(pause)
            else:
                time.sleep(pause)  # the backoff itself, not a synchronisation


class PushSocket:
    """A PUSH socket to one server's gradient port that never blocks for long.

    At the high-water mark (``hwm`` messages queued) a send waits ``timeout_s`` and fails;
    ``send`` counts that as ``backpressure`` and tries again until its deadline. Queued
    messages get ``linger_s`` to leave when the socket closes.
    """

    def __init__(
        self,
        ctx: zmq.Context,
        endpoint: str,
        *,
        hwm: int = 4,
        timeout_s: float = 1.0,
        configure: Callable[[zmq.Socket], None] | None = None,
        counters: Counters | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.counters: Counters = counters if counters is not None else {}
        self._warn = RateLimitedLog(log)
        self.sock = ctx.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, hwm)
        self.sock.setsockopt(zmq.SNDTIMEO, int(1000 * timeout_s))
        if configure is not None:
            configure(self.sock)
        self.sock.connect(endpoint)

    def _count(self, key: str) -> None:
        self.counters[key] = self.counters.get(key, 0) + 1

    def send(
        self,
        frames: list[Any],
        deadline_s: float,
        stop: threading.Event | None = None,
        abandon: Callable[[], bool] | None = None,
    ) -> bool:
        """Send one message, waiting out back-pressure for up to ``deadline_s``. False when
        ``stop`` was set, or ``abandon()`` turned true (e.g. the server restarted elsewhere),
        while blocked: the message is dropped and counted (``dropped``). ServerUnavailable
        when the server took nothing until the deadline."""
        deadline = Deadline(deadline_s)
        while True:
            try:
                self.sock.send_multipart(frames, copy=False)
                return True
            except zmq.Again:
                self._count("backpressure")
                self._warn.warning(
                    "backpressure", "push blocked at the high-water mark (server slow or away)"
                )
                if (stop is not None and stop.is_set()) or (abandon is not None and abandon()):
                    self._count("dropped")  # a planned stop, or nobody left to take it
                    return False
                if deadline.expired():
                    raise ServerUnavailable(
                        f"could not push gradients: server {self.endpoint} not taking them"
                    ) from None

    def close(self, linger_s: float = 0.0) -> None:
        """Close; queued messages get ``linger_s`` to leave (when the context terminates)."""
        self.sock.close(linger=int(1000 * linger_s))
