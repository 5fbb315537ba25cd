"""ZeroMQ plumbing shared by both services: bounded requests, binding, socket options.

Every blocking call here has a bound. A REQ socket whose reply does not arrive in time is
closed with LINGER 0 and recreated (the ZeroMQ guide's "Lazy Pirate"), because a plain REQ
socket waits forever when its server dies.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from typing import Any

import zmq

from downpour import wire
from downpour.wire import Message

log = logging.getLogger(__name__)


class RequestTimeout(Exception):
    """No reply within the deadline after all retries.

    Recovery: the server is down or unreachable; callers retry later (the socket has already
    been recreated) or give up with a clear error.
    """


class RemoteError(Exception):
    """The server answered with an ERROR message. ``code`` is its reason.

    Recovery: depends on the code; "fingerprint" and "version" are permanent for this worker.
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"server refused: {code}: {message}")
        self.code = code
        self.message = message


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
        self.recreated = 0
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
        """Send frames, return the reply frames; raise RequestTimeout when none comes."""
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
                    return self.sock.recv_multipart(copy=False)
            log.debug("no reply from %s (attempt %d/%d)", self.endpoint, attempt + 1, attempts)
            self._reset()
        raise RequestTimeout(f"no reply from {self.endpoint} after {attempts} attempt(s)")

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
            raise RemoteError(str(reply.body.get("code")), str(reply.body.get("message")))
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
