"""A TCP relay for tests: sits between a client and a server on 127.0.0.1, forwards every byte,
optionally records them, and injects faults on demand.

    with Relay(("127.0.0.1", server_port), record=True) as relay:
        client.connect(relay.endpoint)            # tcp://127.0.0.1:<relay.port>
        ...
        assert needle not in relay.recorded("up")  # bytes client -> server

Faults (a ``Faults`` value, given at construction or swapped at run time with
``relay.set_faults(...)``; every pump reads the current value before each chunk):

- ``delay_s``: wait this long before forwarding each chunk (each direction).
- ``throttle_bps``: at most this many bytes per second per direction per connection.
- ``stall_after_bytes`` + ``stall_s``: once a connection has carried that many bytes it stops
  forwarding, both ways, for ``stall_s`` seconds (once per connection; the chunk that
  crosses the mark waits too). ``relay.stall(seconds)`` stalls every connection
  now, on demand.
- ``reset_after_bytes=(lo, hi)``: each connection is reset (TCP RST to both sides) once it has
  carried a number of bytes drawn uniformly from ``[lo, hi]``; ``max_resets`` bounds how many
  connections are reset in total, so a reconnecting client eventually gets through.
  ``relay.reset_all()`` resets every open connection now.
- ``budget_direction``: which bytes count toward the two byte budgets above: ``UP``, ``DOWN``
  or ``None`` (both). One direction makes the point of a fault exact and repeatable; with both,
  it depends on how the two directions interleave.

Random draws come from ``random.Random(f"{seed}:{connection index}")``: the same seed and the
same sequence of connections give the same faults, whatever the thread timing. Everything is
bounded: ``max_connections`` accepted connections (more are closed at once), ``max_record_bytes``
recorded per direction (the rest is counted in ``stats["record_dropped"]``), every blocking call
has a short timeout, and ``stop()`` joins every thread. Faults are waits on the stop event, so
``stop()`` is prompt even in a long stall.

Threads: one accepting, two per connection (one per direction). Chunks are at most
``chunk_size`` bytes; TCP decides where they split, so per-chunk faults (delay) depend on it,
byte-count faults (stall, reset) do not.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import socket
import struct
import threading
import time
from dataclasses import dataclass
from types import TracebackType
from typing import Any

UP = "up"  # client -> target
DOWN = "down"  # target -> client
_POLL_S = 0.05  # how often a blocked pump re-checks for stop / reset


@dataclass(frozen=True)
class Faults:
    """What to do to the traffic; the default is nothing (a transparent relay)."""

    delay_s: float = 0.0
    throttle_bps: float | None = None
    stall_after_bytes: int | None = None
    stall_s: float = 0.0
    reset_after_bytes: tuple[int, int] | None = None
    max_resets: int = 1_000
    budget_direction: str | None = None  # UP, DOWN, or None: both count toward byte budgets


class _Conn:
    """One relayed connection: the two sockets, its fault budget and its recording."""

    def __init__(self, index: int, client: socket.socket, target: socket.socket, rng: Any):
        self.index = index
        self.client = client
        self.target = target
        self.rng = rng
        self.reset_budget: int | None = None
        self.stalled = False  # stall_after_bytes fires once per connection
        self.stall_until = 0.0
        self.carried = {UP: 0, DOWN: 0}
        self.dead = threading.Event()  # set: both pumps stop forwarding
        self.reset = False
        self.pumps_left = 2
        self.lock = threading.Lock()


class Relay:
    """Forward ``127.0.0.1:<port>`` to ``target``; record and inject faults (see module doc)."""

    def __init__(
        self,
        target: tuple[str, int],
        *,
        record: bool = False,
        faults: Faults | None = None,
        seed: int = 0,
        chunk_size: int = 65536,
        max_connections: int = 64,
        max_record_bytes: int = 256 << 20,
        connect_timeout_s: float = 5.0,
    ) -> None:
        self.target = target
        self.record = record
        self.faults = faults or Faults()
        self.seed = seed
        self.chunk_size = chunk_size
        self.max_connections = max_connections
        self.max_record_bytes = max_record_bytes
        self.connect_timeout_s = connect_timeout_s
        self.stats: dict[str, int] = {
            "connections": 0,
            "refused": 0,
            "resets": 0,
            "stalls": 0,
            "bytes_up": 0,
            "bytes_down": 0,
            "record_dropped": 0,
        }
        self._records: dict[str, bytearray] = {UP: bytearray(), DOWN: bytearray()}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._stall_until = 0.0
        self._conns: list[_Conn] = []
        self._threads: list[threading.Thread] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(_POLL_S)
        self.port: int = self._listener.getsockname()[1]
        self._acceptor = threading.Thread(
            target=self._accept_loop, name="relay-accept", daemon=True
        )

    # ------------------------------------------------------------ public API

    @property
    def endpoint(self) -> str:
        """``tcp://127.0.0.1:<port>``, for ZeroMQ ``connect``."""
        return f"tcp://127.0.0.1:{self.port}"

    def start(self) -> Relay:
        """Start accepting; returns self."""
        self._acceptor.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Close every connection and the listener; join all threads (bounded)."""
        self._stop.set()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            c.dead.set()
        deadline = time.monotonic() + timeout_s
        for t in [self._acceptor, *self._threads]:
            if t.is_alive():
                t.join(max(0.0, deadline - time.monotonic()))
        self._listener.close()
        for c in conns:  # normally closed by their pumps already; closing twice is harmless
            _close(c.client, rst=False)
            _close(c.target, rst=False)

    def __enter__(self) -> Relay:
        return self.start()

    def __exit__(
        self,
        _exc_type: type[BaseException] | None,
        _exc: BaseException | None,
        _tb: TracebackType | None,
    ) -> None:
        self.stop()

    def set_faults(self, **changes: Any) -> Faults:
        """Change fault settings now (fields of ``Faults``); returns the new value."""
        self.faults = dataclasses.replace(self.faults, **changes)
        return self.faults

    def stall(self, seconds: float) -> None:
        """Stop forwarding on every connection for ``seconds``, starting now."""
        with self._lock:
            self._stall_until = max(self._stall_until, time.monotonic() + seconds)
            self.stats["stalls"] += 1

    def reset_all(self) -> int:
        """Reset (RST) every open connection now; returns how many."""
        with self._lock:
            conns = [c for c in self._conns if not c.dead.is_set()]
        for c in conns:
            self._kill(c, reset=True)
        with self._lock:
            self.stats["resets"] += len(conns)
        return len(conns)

    def recorded(self, direction: str | None = None) -> bytes:
        """Bytes recorded ``UP`` (client -> target), ``DOWN``, or both (up then down)."""
        with self._lock:
            if direction is None:
                return bytes(self._records[UP]) + bytes(self._records[DOWN])
            return bytes(self._records[direction])

    def open_connections(self) -> int:
        """Connections currently relayed."""
        with self._lock:
            return sum(not c.dead.is_set() for c in self._conns)

    # ------------------------------------------------------------ internals

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with self._lock:
                index = self.stats["connections"]
                full = index >= self.max_connections
                if full:
                    self.stats["refused"] += 1
                else:
                    self.stats["connections"] += 1
            if full:
                _close(client, rst=True)
                continue
            try:
                target = socket.create_connection(self.target, timeout=self.connect_timeout_s)
            except OSError:
                with self._lock:
                    self.stats["refused"] += 1
                _close(client, rst=True)
                continue
            for s in (client, target):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                s.settimeout(_POLL_S)
            conn = _Conn(index, client, target, random.Random(f"{self.seed}:{index}"))
            f = self.faults
            if f.reset_after_bytes is not None:
                lo, hi = f.reset_after_bytes
                conn.reset_budget = conn.rng.randint(lo, hi)
            with self._lock:
                self._conns.append(conn)
            for direction, src, dst in ((UP, client, target), (DOWN, target, client)):
                t = threading.Thread(
                    target=self._pump,
                    args=(conn, direction, src, dst),
                    name=f"relay-{index}-{direction}",
                    daemon=True,
                )
                self._threads.append(t)
                t.start()

    def _wait(self, seconds: float, conn: _Conn) -> bool:
        """Wait (a fault, not synchronisation); False if the relay or connection ended."""
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            if self._stop.wait(min(left, _POLL_S)) or conn.dead.is_set():
                return False
        return not conn.dead.is_set()

    def _pump(self, conn: _Conn, direction: str, src: socket.socket, dst: socket.socket) -> None:
        try:
            while not self._stop.is_set() and not conn.dead.is_set():
                try:
                    data = src.recv(self.chunk_size)
                except TimeoutError:
                    continue
                except OSError as exc:  # a peer's RST is passed on as an RST
                    self._kill(conn, reset=isinstance(exc, ConnectionResetError))
                    return
                if not data:  # orderly EOF: pass it on, keep the other direction going
                    with contextlib.suppress(OSError):
                        dst.shutdown(socket.SHUT_WR)
                    return
                if not self._forward(conn, direction, dst, data):
                    return
        finally:
            self._pump_done(conn)

    def _forward(self, conn: _Conn, direction: str, dst: socket.socket, data: bytes) -> bool:
        """Apply the faults to one chunk and send it; False once the connection is over."""
        f = self.faults
        stall_now = reset_now = False
        before = 0
        with conn.lock:
            conn.carried[direction] += len(data)
            if f.budget_direction in (None, direction):  # this chunk counts toward budgets
                n = conn.carried[direction] if f.budget_direction else sum(conn.carried.values())
                before = n - len(data)
                if f.stall_after_bytes is not None and not conn.stalled:
                    stall_now = conn.stalled = n >= f.stall_after_bytes
                    if stall_now:
                        conn.stall_until = time.monotonic() + f.stall_s
                reset_now = conn.reset_budget is not None and n >= conn.reset_budget
        if stall_now or reset_now:
            with self._lock:  # decide and count at once: never more than max_resets
                self.stats["stalls"] += stall_now
                reset_now = reset_now and self.stats["resets"] < f.max_resets
                self.stats["resets"] += reset_now
        stall = max(self._stall_until, conn.stall_until) - time.monotonic()
        if stall > 0 and not self._wait(stall, conn):
            return False
        if f.delay_s > 0 and not self._wait(f.delay_s, conn):
            return False
        if reset_now:  # forward up to the budget, then reset
            assert conn.reset_budget is not None
            data = data[: max(0, conn.reset_budget - before)]
        step = max(1, len(data))
        if f.throttle_bps:
            step = max(1, min(step, int(f.throttle_bps / 20)))
        for i in range(0, len(data), step):
            piece = data[i : i + step]
            self._count(direction, piece)  # before the send: records keep forwarding order
            if not self._send(conn, dst, piece):
                return False
            if f.throttle_bps and not self._wait(len(piece) / f.throttle_bps, conn):
                return False
        if reset_now:
            self._kill(conn, reset=True)
            return False
        return True

    def _send(self, conn: _Conn, dst: socket.socket, data: bytes) -> bool:
        view = memoryview(data)
        while view:
            if self._stop.is_set() or conn.dead.is_set():
                return False
            try:
                n = dst.send(view)
            except TimeoutError:
                continue
            except OSError:
                self._kill(conn, reset=False)
                return False
            view = view[n:]
        return True

    def _count(self, direction: str, data: bytes) -> None:
        with self._lock:
            self.stats["bytes_up" if direction == UP else "bytes_down"] += len(data)
            if not self.record:
                return
            rec = self._records[direction]
            room = self.max_record_bytes - len(rec)
            rec += data[: max(0, room)]
            self.stats["record_dropped"] += max(0, len(data) - max(0, room))

    def _kill(self, conn: _Conn, reset: bool) -> None:
        with conn.lock:
            if conn.dead.is_set():
                return
            conn.reset = reset
            conn.dead.set()

    def _pump_done(self, conn: _Conn) -> None:
        """The last pump of a connection closes both sockets (RST if it was reset)."""
        with conn.lock:
            conn.pumps_left -= 1
            last = conn.pumps_left == 0
        if last:  # the other pump has returned too (it sees ``dead`` within _POLL_S)
            conn.dead.set()
            _close(conn.client, rst=conn.reset)
            _close(conn.target, rst=conn.reset)


def _close(sock: socket.socket, rst: bool) -> None:
    """Close a socket; with ``rst``, abortively (SO_LINGER 0 sends RST instead of FIN)."""
    with contextlib.suppress(OSError):
        if rst:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
