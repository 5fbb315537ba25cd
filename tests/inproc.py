"""Services in the test process: a server on a thread, workers on threads, real sockets.

The fast tier's way to exercise the services without a process start per scenario: the
``Server`` and ``Worker`` classes the CLI runs, bound to 127.0.0.1 on ports chosen by the OS,
with real ZeroMQ sockets, real TensorFlow and real checkpoints on disk. Only what needs a
process (signals, exit codes, the command line, a kill) is left to the slow tier.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

from downpour.server.service import Server, ServerConfig
from downpour.spec import ModelSpec, load_spec
from downpour.worker.service import Worker, WorkerConfig

JOIN_S = 60.0  # bound on a stopped service's thread finishing (drain, final checkpoint)


class InprocServer:
    """A ``Server`` whose ``run()`` loop turns on a daemon thread; ``stop()`` joins it."""

    def __init__(self, spec: ModelSpec | str = "tiny_models:tiny", **config: Any) -> None:
        self.spec = load_spec(spec) if isinstance(spec, str) else spec
        settings = {"port": 0, "push_port": 0, "status_port": 0, "publish_interval_s": 0.05}
        self.config = ServerConfig(**{**settings, **config})
        self.server = Server(self.spec, self.config)
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="inproc-server", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self.server.run()
        except BaseException as exc:  # handed to the test by stop()
            self.error = exc

    @property
    def rep(self) -> str:
        return f"tcp://127.0.0.1:{self.server.port}"

    @property
    def push(self) -> str:
        return f"tcp://127.0.0.1:{self.server.push_port}"

    @property
    def status(self) -> str:
        return f"tcp://127.0.0.1:{self.server.status_port}"

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def info(self) -> dict[str, Any]:
        """Where it listens, as a process server's ready file says (``conftest.Service.info``)."""
        return self.server.endpoints()

    def stop(self) -> None:
        """Stop the loop (it drains and writes its final checkpoint), join it, re-raise."""
        self.server.stop()
        self._thread.join(JOIN_S)
        assert not self._thread.is_alive(), f"server thread still running after {JOIN_S} s"
        if self.error is not None:
            raise self.error


@contextmanager
def serving(spec: ModelSpec | str = "tiny_models:tiny", **config: Any) -> Iterator[InprocServer]:
    """An ``InprocServer`` for the body of a ``with``; stopped (and its errors raised) after."""
    server = InprocServer(spec, **config)
    try:
        yield server
    finally:
        server.stop()


def worker_config(ports: int | list[int], **config: Any) -> WorkerConfig:
    """A worker's settings for in-process servers on 127.0.0.1 (one port per shard)."""
    ports = ports if isinstance(ports, list) else [ports]
    base = WorkerConfig(
        port=ports[0],
        servers=tuple(("127.0.0.1", p) for p in ports),
        worker_id="w",
        log_every=0,
        request_timeout_s=10.0,
        server_timeout_s=60.0,
    )
    return replace(base, **config)


def make_worker(
    ports: int | list[int], spec: ModelSpec | str = "tiny_models:tiny", **config: Any
) -> Worker:
    """A ``Worker`` (model built, sockets made, nothing sent yet)."""
    spec = load_spec(spec) if isinstance(spec, str) else spec
    return Worker(spec, worker_config(ports, **config), spec.load_data(None))


def train(
    ports: int | list[int], spec: ModelSpec | str = "tiny_models:tiny", **config: Any
) -> dict[str, Any]:
    """Run one worker to the end of its steps on this thread; its summary."""
    worker = make_worker(ports, spec, **config)
    try:
        return worker.run()
    finally:
        worker.close()


class WorkerThread:
    """A worker running on a thread, for several at once; ``result()`` joins it."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.summary: dict[str, Any] | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"worker-{worker.id}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self.summary = self.worker.run()
        except BaseException as exc:  # handed to the test by result()
            self.error = exc
        finally:
            self.worker.close()

    def result(self, timeout: float = 120.0) -> dict[str, Any]:
        """The summary, waiting at most ``timeout`` seconds; re-raises the worker's error."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            self.worker.stop()
            self._thread.join(JOIN_S)
            raise AssertionError(f"worker {self.worker.id} did not finish in {timeout} s")
        if self.error is not None:
            raise self.error
        assert self.summary is not None
        return self.summary
