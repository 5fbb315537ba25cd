"""The server's sockets: one ZeroMQ context, three bound sockets, CURVE + ZAP when keyed.

    rep          REP   hello, weight pulls, heartbeats        (port, ``--port``)
    grad_sock    PULL  gradient pushes from workers            (push_port, ``--push-port``)
    status_sock  REP   the status document, read-only          (status_port, ``--status-port``)

With keys, every socket is a CURVE server whose clients are checked by a ZAP handler against
the allow-lists (``downpour.net.security.Authenticator``), and a monitor on each socket counts
failed handshakes; all of it is in place before the first bind, so no plaintext peer ever
gets in. Each socket has a MAXMSGSIZE: a peer sending more than the model could need is cut
off before the server allocates it. The REP socket's is ``wire.REQUEST_DROP_FACTOR`` times
the request limit, so a request a little over the limit is still read, refused with a reason
and counted (``handle_request``).
"""

from __future__ import annotations

from typing import Any

import zmq

from downpour import wire
from downpour.net import security
from downpour.net.transport import bind, make_context

REQUEST_MAX_BYTES = wire.REQUEST_MAX_BYTES  # without row tables: requests carry no big tensors
STATUS_MAX_BYTES = 1 << 16


class ServerSockets:
    """The context and the three sockets, bound on ``host``; port 0 picks a free port (the
    bound ports are ``port``, ``push_port`` and ``status_port``).

    Raises ``security.SecurityError`` if the ZAP handler does not start (the server refuses
    to start) and ``zmq.ZMQError`` if a port is taken; either way nothing stays open.
    """

    def __init__(
        self,
        host: str,
        port: int,
        push_port: int,
        status_port: int,
        *,
        max_gradient_bytes: int,
        max_request_bytes: int = REQUEST_MAX_BYTES,
        io_threads: int = 2,
        keys: security.ServerKeys | None = None,
    ) -> None:
        self.ctx = make_context(io_threads)
        self.rep = self.ctx.socket(zmq.REP)
        self.grad_sock = self.ctx.socket(zmq.PULL)
        self.status_sock = self.ctx.socket(zmq.REP)
        for sock, max_bytes in (
            (self.rep, max_request_bytes * wire.REQUEST_DROP_FACTOR),
            (self.grad_sock, max_gradient_bytes),
            (self.status_sock, STATUS_MAX_BYTES),
        ):
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)
        self.auth: security.Authenticator | None = None
        try:
            if keys is not None:
                self._secure(keys)
            self.port = bind(self.rep, host, port)
            self.push_port = bind(self.grad_sock, host, push_port)
            self.status_port = bind(self.status_sock, host, status_port)
        except BaseException:
            if self.auth is not None:
                self.auth.stop()
            self.ctx.destroy(linger=0)  # also closes a ZAP socket a failed start left open
            raise

    def _secure(self, keys: security.ServerKeys) -> None:
        """CURVE + ZAP on every socket, and a handshake monitor on each."""
        auth = self.auth = security.Authenticator(self.ctx, keys)
        for sock, domain, label in (
            (self.rep, security.TRAINING_DOMAIN, "rep"),
            (self.grad_sock, security.TRAINING_DOMAIN, "push"),
            (self.status_sock, security.STATUS_DOMAIN, "status"),
        ):
            security.configure_curve_server(sock, keys, domain)
            auth.watch(sock, label)
        auth.start()  # raises SecurityError: the server refuses to start

    @property
    def authenticated(self) -> bool:
        """True under CURVE: every message comes with the name of its sender's key."""
        return self.auth is not None

    def peer_key(self, frames: list[Any]) -> str | None:
        """The name of the key a message came with (ZAP User-Id); None without CURVE."""
        return security.user_id(frames[0]) if self.auth is not None and frames else None

    def close(self) -> None:
        """Close the sockets, the ZAP handler and the context (idempotent)."""
        for sock in (self.rep, self.grad_sock, self.status_sock):
            sock.close(linger=0)
        if self.auth is not None:
            self.auth.stop()  # closes its sockets, or ctx.term() would wait for them
        if not self.ctx.closed:
            self.ctx.term()
