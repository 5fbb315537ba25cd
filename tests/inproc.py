"""Services in the test process: a server on a thread, workers on threads, real sockets.

The fast tier's way to exercise the services without a process start per scenario: the
``Server`` and ``Worker`` classes the CLI runs, bound to 127.0.0.1 on ports chosen by the OS,
with real ZeroMQ sockets, real TensorFlow and real checkpoints on disk. Only what needs a
process (signals, exit codes, the command line, a kill) is left to the slow tier.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

from downpour.config.settings import Option, to_argv
from downpour.server.service import Server
from downpour.server.settings import SERVER_OPTIONS, ServerConfig
from downpour.spec import ModelSpec, load_spec
from downpour.worker.service import Worker
from downpour.worker.settings import WORKER_OPTIONS, WorkerConfig

JOIN_S = 60.0  # bound on a stopped service's thread finishing (drain, final checkpoint)


class InprocServer:
    """A ``Server`` whose ``run()`` loop turns on a daemon thread; ``stop()`` joins it."""

    def __init__(self, spec: ModelSpec | str = "tiny_models:tiny", **config: Any) -> None:
        self.spec = load_spec(spec) if isinstance(spec, str) else spec
        settings = {"port": 0, "push_port": 0, "status_port": 0, "publish_interval_s": 0.05}
        self.config = ServerConfig(**{**settings, **config})
        self.server = Server(self.spec, self.config)
        self.error: BaseException | None = None
        self.returncode: int | None = None  # what run() returned, once it has
        self._thread = threading.Thread(target=self._run, name="inproc-server", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self.returncode = self.server.run()
        except BaseException as exc:  # handed to the test by stop()
            self.error = exc

    def wait(self, timeout: float = JOIN_S) -> int | None:
        """Wait for the loop to end on its own (a job's end); its return code, or None
        when it is still running after ``timeout`` seconds."""
        self._thread.join(timeout)
        return None if self._thread.is_alive() else self.returncode

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
        error, self.error = self.error, None  # raised once, by the first stop()
        if error is not None:
            raise error


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
    return Worker(spec, worker_config(ports, **config))


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

    def finished(self) -> bool:
        """True once run() has returned or raised."""
        return not self._thread.is_alive()

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


class LogCapture(logging.Handler):
    """Every record of the ``downpour`` loggers while attached, as text (a server's log)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []
        self.setFormatter(logging.Formatter("%(levelname)s %(name)s %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))

    def text(self) -> str:
        return "\n".join(self.lines)


def _flags(options: tuple[Option, ...], config: dict[str, Any]) -> list[str]:
    """``config`` (config attribute -> value, as the in-process services take it) as the
    service's flags, from its option declarations; a key no option has is a KeyError."""
    name_of = {o.field: o.name for o in options}
    return to_argv(options, {name_of[k]: v for k, v in config.items()})


class Services:
    """Servers and workers for a test that runs in both tiers: in this process (``inproc``,
    the fast tier) or as ``downpour`` processes (``process``, the slow tier), with the same
    settings (config attributes, as ``ServerConfig`` / ``WorkerConfig`` name them)."""

    def __init__(self, mode: str, tmp: Path) -> None:
        from conftest import Cluster

        self.mode = mode
        self.cluster = Cluster(tmp) if mode == "process" else None
        self.inproc: list[tuple[InprocServer, LogCapture]] = []
        self.workers: list[Any] = []  # the last train()'s worker processes (their logs)

    def server(
        self, model: str = "tiny_models:tiny", keys: Path | None = None, **config: Any
    ) -> Any:
        """A started server with ``rep``, ``status``, ``info`` and ``port`` (``keys``: the
        key directory of ``downpour server --keys``)."""
        if self.cluster is not None:
            flags = _flags(SERVER_OPTIONS, config) + (["--keys", str(keys)] if keys else [])
            return self.cluster.server(*flags, model=model)
        if keys is not None:
            from downpour.net.security import load_server_keys

            config["keys"] = load_server_keys(keys)
        capture = LogCapture()
        logger = logging.getLogger("downpour")
        logger.addHandler(capture)
        if logger.level == logging.NOTSET or logger.level > logging.INFO:
            logger.setLevel(logging.INFO)
        server = InprocServer(model, model_ref=model, **config)
        self.inproc.append((server, capture))
        return server

    def train(
        self,
        ports: int | list[int],
        workers: int = 1,
        model: str = "tiny_models:tiny",
        ids: list[str] | None = None,
        key: tuple[Path, Path] | None = None,
        **config: Any,
    ) -> list[dict[str, Any]]:
        """``workers`` workers (``ids``, default "w0", "w1", ...) train to the end at once;
        their summaries. ``key``: (client secret key file, server public key file)."""
        ids = ids or [f"w{i}" for i in range(workers)]
        if self.cluster is not None:
            from conftest import summary

            flags = _flags(WORKER_OPTIONS, config)
            if key is not None:
                flags += ["--key", str(key[0]), "--server-key", str(key[1])]
            procs = [  # --id last: ids may hold "/", which a log file name may not
                self.cluster.worker(
                    ports, *flags, "--id", i, model=model, worker_id=i.replace("/", "-")
                )
                for i in ids
            ]
            self.workers = procs
            for w in procs:
                assert w.wait(timeout=300) == 0, w.log_text()
            return [summary(w) for w in procs]
        if key is not None:
            from downpour.net.security import load_client_keys

            config["keys"] = load_client_keys(*key)
        threads = [WorkerThread(make_worker(ports, model, worker_id=i, **config)) for i in ids]
        return [t.result(300) for t in threads]

    def log(self, server: Any) -> str:
        """The server's log so far."""
        if self.cluster is not None:
            return server.log_text()
        return next(capture.text() for s, capture in self.inproc if s is server)

    def reload_keys(self, server: Any) -> None:
        """Make the server re-read its allow-lists, as SIGHUP does for a process."""
        if self.cluster is not None:
            import signal

            server.proc.send_signal(signal.SIGHUP)
        else:
            assert server.server.auth is not None
            server.server.auth.request_reload()

    def stop(self, server: Any) -> str:
        """Stop ``server`` as an operator would (SIGTERM for a process); its log."""
        if self.cluster is not None:
            server.proc.terminate()
            assert server.wait(timeout=60) == 0, server.log_text()
            return server.log_text()
        for s, capture in self.inproc:
            if s is server:
                s.stop()
                return capture.text()
        raise AssertionError("not a server of this test")

    def close(self) -> None:
        if self.cluster is not None:
            self.cluster.stop()
        logger = logging.getLogger("downpour")
        for s, capture in self.inproc:
            logger.removeHandler(capture)
            s.stop()


def settle(status: str, summaries: list[dict[str, Any]], timeout: float = 30.0) -> None:
    """Wait until the server at ``status`` has taken each finished worker's last push (its
    ``last_seq``): a worker's run ends when its pushes are sent, not when they are applied."""
    from conftest import wait_until

    from downpour.cli.status import fetch_status

    def taken() -> bool:
        workers = fetch_status(status)["workers"]
        return all(
            workers.get(s["worker"], {}).get("last_seq", 0) >= s["last_seq"] for s in summaries
        )

    wait_until(taken, timeout, "the server to take every worker's last push")
