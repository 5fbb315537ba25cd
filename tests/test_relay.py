"""The test relay: forwards both ways, records, and injects delay, throttle, stall and resets."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import pytest
from conftest import wait_until
from relay import DOWN, UP, Faults, Relay


class EchoServer:
    """A TCP echo server on 127.0.0.1 (threads, bounded): the relay's target in these tests."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.05)
        self.port = self.listener.getsockname()[1]
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._accept, daemon=True)]
        self.threads[0].start()

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            t = threading.Thread(target=self._echo, args=(conn,), daemon=True)
            self.threads.append(t)
            t.start()

    def _echo(self, conn: socket.socket) -> None:
        conn.settimeout(0.05)
        with conn:
            while not self.stop.is_set():
                try:
                    data = conn.recv(65536)
                except TimeoutError:
                    continue
                except OSError:
                    return
                if not data:
                    return
                with contextlib.suppress(OSError):
                    conn.sendall(data)

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=2)
        self.listener.close()


@pytest.fixture
def echo() -> Iterator[EchoServer]:
    server = EchoServer()
    try:
        yield server
    finally:
        server.close()


def roundtrip(port: int, payload: bytes, timeout: float = 10.0) -> bytes:
    """Send payload through 127.0.0.1:port, read the same number of bytes back."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(payload)
        got = bytearray()
        while len(got) < len(payload):
            chunk = s.recv(65536)
            if not chunk:
                break
            got += chunk
        return bytes(got)


def test_forwards_both_ways_and_records_each_direction(echo: EchoServer) -> None:
    payload = bytes(range(256)) * 4096  # 1 MiB, several chunks
    with Relay(("127.0.0.1", echo.port), record=True) as relay:
        echoed = roundtrip(relay.port, payload) == payload  # a bool: no 1 MiB diff on failure
        assert echoed, "the payload did not come back intact"
        assert roundtrip(relay.port, b"second connection") == b"second connection"
        total = len(payload) + 17
        wait_until(
            lambda: relay.stats["bytes_up"] == relay.stats["bytes_down"] == total, 10, "counts"
        )
        for direction in (UP, DOWN):
            rec = relay.recorded(direction)
            same = rec == payload + b"second connection"  # a bool: no 1 MiB diff on failure
            assert same, f"{direction}: {len(rec)} bytes recorded, not the two payloads in order"
        assert relay.stats["connections"] == 2 and relay.stats["resets"] == 0
    assert relay.open_connections() == 0


def test_without_record_nothing_is_kept(echo: EchoServer) -> None:
    with Relay(("127.0.0.1", echo.port)) as relay:
        assert roundtrip(relay.port, b"x" * 1000) == b"x" * 1000
        assert relay.recorded() == b""


def test_delay_throttle_and_stall_slow_traffic_down(echo: EchoServer) -> None:
    # lower bounds only: a fault guarantees at least this much time, never at most
    with Relay(("127.0.0.1", echo.port), faults=Faults(delay_s=0.3)) as relay:
        t0 = time.monotonic()
        assert roundtrip(relay.port, b"ping") == b"ping"
        assert time.monotonic() - t0 >= 0.6  # one delayed chunk each way

        relay.set_faults(delay_s=0.0, throttle_bps=200_000)
        t0 = time.monotonic()
        assert roundtrip(relay.port, b"t" * 50_000) == b"t" * 50_000
        # 5 pieces of 10 kB up, 50 ms apart: the last leaves >= 0.2 s after the first
        assert time.monotonic() - t0 >= 0.19

        relay.set_faults(throttle_bps=None)
        relay.stall(0.5)
        t0 = time.monotonic()
        assert roundtrip(relay.port, b"after the stall") == b"after the stall"
        assert time.monotonic() - t0 >= 0.45


def test_stall_after_bytes_pauses_a_connection_once(echo: EchoServer) -> None:
    faults = Faults(stall_after_bytes=10, stall_s=0.5)
    with Relay(("127.0.0.1", echo.port), faults=faults) as relay:
        t0 = time.monotonic()
        assert roundtrip(relay.port, b"0123456789abc") == b"0123456789abc"
        assert time.monotonic() - t0 >= 0.45
        assert relay.stats["stalls"] >= 1


def test_reset_after_a_seeded_byte_budget_then_bounded(echo: EchoServer) -> None:
    faults = Faults(reset_after_bytes=(1000, 2000), max_resets=1, budget_direction=UP)
    with Relay(("127.0.0.1", echo.port), faults=faults, seed=42, record=True) as relay:
        with (
            socket.create_connection(("127.0.0.1", relay.port), timeout=10) as s,
            pytest.raises((ConnectionResetError, BrokenPipeError, EOFError)),
        ):
            for _ in range(100):  # bounded: 100 kB, far beyond the 2 kB budget
                s.sendall(b"r" * 1000)
                if not s.recv(65536):
                    raise EOFError
        assert relay.stats["resets"] == 1
        budget = len(relay.recorded(UP))
        assert 1000 <= budget <= 2000  # forwarded up to the drawn budget, not a byte more
        # max_resets reached: the next connection passes untouched
        assert roundtrip(relay.port, b"z" * 5000) == b"z" * 5000
        assert relay.stats["resets"] == 1

    # same seed, same connection order: the same budget
    with Relay(("127.0.0.1", echo.port), faults=faults, seed=42, record=True) as again:
        with (
            socket.create_connection(("127.0.0.1", again.port), timeout=10) as s,
            contextlib.suppress(ConnectionResetError, BrokenPipeError),
        ):
            for _ in range(100):
                s.sendall(b"r" * 1000)
                if not s.recv(65536):
                    break
        assert len(again.recorded(UP)) == budget


def test_reset_all_and_stop_close_every_connection(echo: EchoServer) -> None:
    relay = Relay(("127.0.0.1", echo.port)).start()
    try:
        s = socket.create_connection(("127.0.0.1", relay.port), timeout=10)
        assert roundtrip(relay.port, b"warm") == b"warm"
        s.sendall(b"hello")
        assert s.recv(100) == b"hello"
        wait_until(lambda: relay.open_connections() == 1, 10, "the warm-up connection to close")
        assert relay.reset_all() == 1
        with pytest.raises(ConnectionResetError):
            for _ in range(50):  # the RST arrives within the relay's poll period
                if not s.recv(100):
                    raise AssertionError("FIN instead of RST")
        s.close()
    finally:
        relay.stop()
    assert not any(t.is_alive() for t in relay._threads)
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", relay.port), timeout=2).close()
