"""Shared fixtures: start real server and worker processes on loopback, clean up after."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from downpour.config.settings import to_argv
from downpour.server.settings import SERVER_OPTIONS
from downpour.worker.settings import WORKER_OPTIONS

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


def env() -> dict[str, str]:
    """Environment for spawned services: the tests dir importable (tiny_models)."""
    path = os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])
    return dict(os.environ, PYTHONPATH=path, PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="2")


@dataclass
class Service:
    """A started process, its log, and (for servers) its bound ports.

    A server started with ``early=True`` is not waited for: ``port`` is known at once (chosen
    before the start), and the first use of ``info`` (``rep``, ``status`` ...) waits for it."""

    proc: subprocess.Popen
    log: Path
    known: dict[str, Any]
    pending: Callable[[], dict[str, Any]] | None = None

    @property
    def info(self) -> dict[str, Any]:
        """The server's ready file (its ports, shard, partition); waits the first time."""
        if self.pending is not None:
            self.known, self.pending = self.pending(), None
        return self.known

    @info.setter
    def info(self, value: dict[str, Any]) -> None:
        self.known, self.pending = value, None

    @property
    def port(self) -> int:
        """The REP port, without waiting for an ``early`` server to be ready."""
        return int(self.known["port"]) if "port" in self.known else int(self.info["port"])

    @property
    def rep(self) -> str:
        return f"tcp://{self.info.get('host', '127.0.0.1')}:{self.info['port']}"

    @property
    def status(self) -> str:
        return f"tcp://{self.info.get('host', '127.0.0.1')}:{self.info['status_port']}"

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait(self, timeout: float) -> int:
        """Exit code, waiting at most ``timeout`` seconds (raises on timeout)."""
        return self.proc.wait(timeout=timeout)


class Cluster:
    """Starts services for one test and stops them all at teardown."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[subprocess.Popen] = []
        self.n = 0

    def _spawn(
        self,
        args: list[str],
        name: str,
        stdout: int | None = None,
        prefix: list[str] | None = None,
    ) -> tuple[subprocess.Popen, Path]:
        self.n += 1
        log = self.tmp / f"{self.n:02d}-{name}.log"
        with open(log, "wb") as err:
            proc = subprocess.Popen(
                [*(prefix or []), sys.executable, "-m", "downpour", *args],
                stdout=stdout if stdout is not None else subprocess.DEVNULL,
                stderr=err,
                env=env(),
                cwd=ROOT,
            )
        self.procs.append(proc)
        return proc, log

    def server(
        self,
        *args: str,
        model: str = "tiny_models:tiny",
        port: int = 0,
        wait: bool = True,
        prefix: list[str] | None = None,
        early: bool = False,
        ready_timeout: float = 120.0,
    ) -> Service:
        """Start ``downpour server`` on free ports; wait until it serves.

        ``prefix`` runs it elsewhere, e.g. ``ip netns exec NS`` (then pass --host and
        --insecure in ``args``). ``early``: return at once with the REP port chosen up front
        (``Service.port``), so that workers start (and import TensorFlow) while the server
        does; they retry until it answers. Only for workers with the default --server-timeout.
        ``ready_timeout``: how long it may take to serve (a restart on a loaded machine).
        """
        from downpour.cli.local import wait_ready

        if early and not port:
            port = free_ports(1)[0]
        ready = self.tmp / f"ready-{self.n + 1}.json"
        settings = {"model": model, "port": port, "push_port": 0, "status_port": 0}
        proc, log = self._spawn(
            ["server", *to_argv(SERVER_OPTIONS, settings | {"ready_file": str(ready)}), *args],
            "server",
            prefix=prefix,
        )
        if early:
            return Service(
                proc, log, {"port": port}, lambda: wait_ready(proc, ready, ready_timeout, log)
            )
        info = wait_ready(proc, ready, ready_timeout, log) if wait else {}
        return Service(proc, log, info)

    def worker(
        self,
        server_port: int | list[int],
        *args: str,
        model: str = "tiny_models:tiny",
        worker_id: str = "w",
        host: str = "127.0.0.1",
        prefix: list[str] | None = None,
    ) -> Service:
        """Start ``downpour worker`` against host:server_port, or every shard's port in shard
        order when given a list (``prefix`` as for server)."""
        ports = server_port if isinstance(server_port, list) else [server_port]
        settings = {"server": ",".join(f"{host}:{p}" for p in ports), "model": model}
        settings |= {"id": worker_id, "log_every": 0}
        proc, log = self._spawn(
            ["worker", *to_argv(WORKER_OPTIONS, settings), *args],
            f"worker-{worker_id}",
            stdout=subprocess.PIPE,
            prefix=prefix,
        )
        return Service(proc, log, {})

    def stop(self) -> None:
        """Kill what is still running. The test is over: a graceful stop would only spend
        about 1.4 s per test in TensorFlow's shutdown (tests of SIGTERM send it themselves)."""
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait()


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(autouse=True)
def _log_context() -> Iterator[None]:
    """Services run in this process bind the process-wide log context (worker, version):
    restore it after each test, so one test's services never name another test's log lines."""
    from downpour.runtime import logs

    saved = dict(logs._context)
    yield
    logs._context.clear()
    logs._context.update(saved)


@pytest.fixture(params=["inproc", pytest.param("process", marks=pytest.mark.slow)])
def services(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    """``inproc.Services``: the test runs in-process (fast tier) and with processes (slow)."""
    from inproc import Services

    s = Services(request.param, tmp_path)
    try:
        yield s
    finally:
        s.close()


def summary(worker: Service) -> dict[str, Any]:
    """The JSON summary line a finished worker printed on stdout."""
    assert worker.proc.stdout is not None
    for line in worker.proc.stdout.read().decode().splitlines():
        if line.startswith('{"summary"'):
            return json.loads(line)["summary"]
    raise AssertionError(f"no summary from worker; log:\n{worker.log_text()}")


def run_script(
    script: Path, *args: str, timeout_s: float, what: str
) -> subprocess.CompletedProcess[str]:
    """Run ``python script args`` in its own process group, so a timeout stops its children
    too (fails the test, with the script's stderr, if it does not finish in time)."""
    import signal

    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, str(script), *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            stdout, stderr = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
        pytest.fail(f"{what} did not finish in {timeout_s:.0f} s:\n{stderr[-4000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def free_ports(n: int) -> list[int]:
    """``n`` TCP ports free on 127.0.0.1 right now (for a server restarted on the same ports),
    chosen below the kernel's ephemeral range: a port from that range can be taken as the
    local port of any outgoing connection while its server is down, and its restart would
    then find it in use."""
    import random
    import socket

    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random()
    found: list[int] = []
    for _ in range(2000):  # bounded: the range below the ephemeral one is nearly all free
        port = rng.randrange(max(1024, low - 12000), low)
        if port in found:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        found.append(port)
        if len(found) == n:
            return found
    raise RuntimeError(f"no {n} free ports below {low} on 127.0.0.1")


def wait_until(predicate: Any, timeout: float, what: str = "condition") -> Any:
    """Poll ``predicate`` until it returns a truthy value; fail after ``timeout`` seconds.

    A bounded wait on an observable condition, never a guess at how long something takes.
    """
    import time

    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


def pull_weights(endpoint: str, encoding: str = "dense") -> tuple[int, list[Any]]:
    """(version, copies of every weight) straight from a server's REP socket, through the
    shard client (``encoding``: the weights' on the wire, e.g. ``"bf16"``)."""
    import numpy as np

    from downpour import wire
    from downpour.net.client import ShardClient
    from downpour.net.transport import make_context

    ctx = make_context()
    client = ShardClient(ctx, endpoint, sender="test-probe", timeout_s=10)
    try:
        weights = client.pull(wire.PullRequest(encoding=encoding))
        return weights.version, [np.array(a) for a in weights.tensors.values()]
    finally:
        client.close()
        ctx.term()


def isolated_json(code: str, arg: Any) -> Any:
    """Run ``code`` in an isolated interpreter (``python -I``, no ``DOWNPOUR_*`` settings)
    with ``json.dumps(arg)`` as its argument; what it prints, as JSON."""
    r = subprocess.run(
        [sys.executable, "-I", "-c", code, json.dumps(arg)],
        env={k: v for k, v in env().items() if not k.startswith("DOWNPOUR_")},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)
