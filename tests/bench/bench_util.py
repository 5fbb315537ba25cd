"""Shared pieces of the benchmark: run plans, timing, machine description, child processes.

Every wait here is bounded and every process started through ``Procs`` is stopped when its
``with`` block ends, whatever happened inside it.
"""

from __future__ import annotations

import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
_T0 = time.monotonic()


def log(msg: str) -> None:
    """A progress line on stderr with the seconds since the bench started."""
    print(f"[{time.monotonic() - _T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Plan:
    """How much to measure: repetitions per section and the length of timed windows.

    End to end, every set-up is measured ``e2e_rounds`` times in turn (local, 1 worker,
    2 workers, TF), so that a slow spell on a shared machine hits all of them alike.
    """

    name: str
    wire_reps: int
    seed_reps: int
    apply_reps: int
    flood_warmup_s: float
    flood_windows: int
    flood_window_s: float
    pulls: int
    e2e_warmup_steps: int
    e2e_windows: int
    e2e_window_s: float
    local_window_steps: int
    pss_warmup_steps: int
    pss_window_steps: int
    e2e_rounds: int
    e2e_bf16: bool = False  # also the --compress bf16 set-ups (full only: quick stays short)
    shard_rounds: int = 1  # rounds of the shards section
    pinned_rounds: int = 1  # rounds of the pinned end-to-end set-ups (emulated hosts)
    pinned_server_rounds: int = 1  # rounds of the pinned server and its floor, in turn
    goodput_reps: int = 3  # messages per goodput sample (x size-dependent factor)
    link_window_s: float = 2.0  # timed window of each shaped-link set-up
    # measure only the headline set-ups: not the e2e 2-worker, CURVE and unpinned TF PSS ones,
    # n_fetch_4, shards and the shaped link (each process start-up costs seconds of TF import)
    lean: bool = False


PLANS = {
    "smoke": Plan(
        "smoke",
        3,
        2,
        3,
        1.0,
        1,
        1.0,
        5,
        2,
        1,
        1.0,
        4,
        2,
        4,
        1,
        goodput_reps=1,
        link_window_s=1.0,
        pinned_server_rounds=2,
    ),
    # quick (under 3 minutes on 2 cores): one round, short windows, few steps; most of its time is
    # process start-up, so it measures the headline set-ups only (lean) and fewer TF PSS variants
    "quick": Plan(
        "quick", 30, 6, 12, 1.0, 2, 1.5, 30, 6, 3, 1.5, 15, 8, 15, 1, goodput_reps=2, lean=True
    ),
    "full": Plan(
        "full",
        200,
        30,
        100,
        3.0,
        5,
        4.0,
        300,
        10,
        4,
        4.0,
        50,
        20,
        50,
        3,
        True,
        5,
        pinned_rounds=2,
        pinned_server_rounds=3,
        goodput_reps=10,
        link_window_s=4.0,
    ),  # fmt: skip
}


def median(xs: list[float]) -> float:
    """The median of a non-empty list."""
    return float(statistics.median(xs))


def percentile(xs: list[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation, of a non-empty list."""
    s = sorted(xs)
    k = (len(s) - 1) * q / 100.0
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def time_ms(fn: Callable[[], Any], reps: int, warmup: int = 2) -> list[float]:
    """Wall-clock milliseconds of ``reps`` calls of ``fn`` after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(1e3 * (time.perf_counter() - t0))
    return out


MEMCPY_FLAGS = ("sse4_2", "avx2", "avx512f", "avx512bw", "erms", "fsrm")  # what memcpy uses


def cpu_info() -> tuple[str, set[str]]:
    """The CPU's model name and feature flags, from /proc/cpuinfo ("unknown" and none where
    it does not say): every figure in memcpys depends on them, the memcpy's speed first."""
    model, flags = "unknown", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and model == "unknown":
                    model = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    return model, flags


def cpu_model() -> str:
    """The CPU model name, stored beside figures that depend on it (``cpu_info``)."""
    return cpu_info()[0]


def machine() -> dict[str, Any]:
    """CPU model, its memcpy-relevant flags, cores, memory and software versions."""
    import numpy as np
    import tensorflow as tf
    import zmq

    cpu, flags = cpu_info()
    mem_gib = meminfo_mib("MemTotal") / 1024
    simd = [f for f in ("avx", "avx2", "fma", "avx512f") if f in flags]
    memcpy_flags = [f for f in MEMCPY_FLAGS if f in flags]
    hypervisor = "hypervisor" in flags
    return {
        "cpu": cpu,
        "cpu_model": cpu,
        "simd": simd,
        # rep movsb fast paths (erms, fsrm) and vector widths: what a memcpy's speed rides on
        "memcpy_flags": memcpy_flags,
        "virtualised": hypervisor,
        "cores": os.cpu_count(),
        "memory_gib": round(mem_gib, 1),
        "tensorflow": tf.__version__,
        "numpy": np.__version__,
        "pyzmq": zmq.__version__,
        "libzmq": zmq.zmq_version(),
        "python": platform.python_version(),
        "kernel": platform.release(),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "summary": f"{cpu} ({', '.join(memcpy_flags) or 'no memcpy flags'}), "
        f"{os.cpu_count()} cores, {mem_gib:.0f} GiB, TensorFlow {tf.__version__}",
    }


def meminfo_mib(key: str) -> float:
    """A /proc/meminfo figure in MiB (``MemTotal``, ``MemAvailable``); 0 where it does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(f"{key}:"):
                    return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        return 0.0
    return 0.0


def cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU seconds used so far by process ``pid`` (all threads; None: this one)."""
    if pid is None:
        return time.process_time()
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for TensorFlow's gRPC servers)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def child_env() -> dict[str, str]:
    """Environment for child processes: the bench's own modules (model plugins such as
    ``study:mnist_cnn``) importable, TensorFlow's chatter off; downpour is installed."""
    path = os.pathsep.join([str(ROOT / "tests" / "bench"), os.environ.get("PYTHONPATH", "")])
    return dict(os.environ, PYTHONPATH=path, PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="2")


def host_cpus(index: int) -> list[int]:
    """The cores of emulated host ``index`` (0, 1, ...): one core each, wrapping around the
    cores this process may use (on a 1-core machine every host shares the one core)."""
    cores = sorted(os.sched_getaffinity(0))
    return [cores[index % len(cores)]]


def pinned_env(cpus: Sequence[int]) -> dict[str, str]:
    """``child_env`` for a process pinned to ``cpus``: TensorFlow's intra-op pool as wide as
    the cores, one inter-op thread per core (what TensorFlow would pick on such a host)."""
    n = str(len(cpus))
    return dict(child_env(), TF_NUM_INTRAOP_THREADS=n, TF_NUM_INTEROP_THREADS=n, OMP_NUM_THREADS=n)


class Procs:
    """Starts child processes with their output in log files; stops them all on exit.

    Use as a context manager: leaving the block (normally or by an exception, Ctrl-C
    included) sends SIGTERM to every child still running, waits a bounded time, then kills.
    """

    def __init__(self, logdir: Path, stop_timeout_s: float = 20.0) -> None:
        self.logdir = logdir
        self.stop_timeout_s = stop_timeout_s
        self.procs: list[tuple[subprocess.Popen[bytes], Path]] = []

    def __enter__(self) -> Procs:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()

    def start(
        self,
        args: list[str],
        name: str,
        cpus: Sequence[int] | None = None,
        prefix: Sequence[str] = (),
    ) -> tuple[subprocess.Popen[bytes], Path]:
        """Start ``python args...`` in the repo root; stdout and stderr go to ``name``.log.

        ``cpus``: the child runs on those cores only, TensorFlow's thread pools sized to them
        (an emulated host, see ``pinned_env``). ``prefix``: a command the child runs under,
        e.g. ``ip netns exec NS``.
        """
        log = self.logdir / f"{len(self.procs):02d}-{name}.log"
        out = self.logdir / f"{len(self.procs):02d}-{name}.out"
        env = child_env() if cpus is None else pinned_env(cpus)
        pin = [] if cpus is None else ["taskset", "-c", ",".join(str(c) for c in cpus)]
        with open(log, "wb") as err, open(out, "wb") as stdout:
            proc = subprocess.Popen(
                [*prefix, *pin, sys.executable, *args], stdout=stdout, stderr=err, env=env, cwd=ROOT
            )
        self.procs.append((proc, log))
        return proc, out

    def stop(self, proc: subprocess.Popen[bytes], timeout_s: float | None = None) -> int:
        """SIGTERM, wait at most ``timeout_s``, then SIGKILL; returns the exit code."""
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout=timeout_s or self.stop_timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait(timeout=10)

    def stop_all(self) -> None:
        """Stop every child that is still running (terminate all first, then wait for each)."""
        for proc, _ in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc, _ in self.procs:
            self.stop(proc)

    def run_json(
        self,
        args: list[str],
        name: str,
        timeout_s: float = 600.0,
        cpus: Sequence[int] | None = None,
    ) -> dict[str, Any]:
        """Run ``python args...`` to its end (bounded wait) and return the JSON object on
        the last line of its stdout; RuntimeError with its log's tail if it fails."""
        proc, out = self.start(args, name, cpus=cpus)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.stop(proc)
            raise RuntimeError(f"{name} did not finish in {timeout_s:.0f} s") from None
        if code != 0:
            raise RuntimeError(f"{name} exited with {code}:\n{self.log_tail(proc)}")
        return json.loads(out.read_text().strip().splitlines()[-1])

    def log_tail(self, proc: subprocess.Popen[bytes], lines: int = 30) -> str:
        """The last lines of a child's stderr log, for error messages."""
        for p, log in self.procs:
            if p is proc:
                return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
        return ""


def wait_ready(proc: subprocess.Popen[bytes], ready_file: Path, timeout_s: float) -> dict[str, Any]:
    """The server's ready-file JSON; fails if the server exits or is not ready in time."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ready_file.exists():
            return json.loads(ready_file.read_text())
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} before it was ready")
        time.sleep(0.1)  # polling a file for a bounded time
    raise RuntimeError(f"server not ready after {timeout_s:.0f} s")


def start_server(
    procs: Procs,
    name: str,
    port: int = 0,
    wait: bool = True,
    settings: Mapping[str, Any] | None = None,
    cpus: Sequence[int] | None = None,
    host: str = "127.0.0.1",
    prefix: Sequence[str] = (),
) -> tuple[subprocess.Popen[bytes], dict[str, Any]]:
    """Start ``downpour server`` (Deep-MNIST, Adam 1e-3) on ``host``; wait for it if ``wait``.

    ``port`` 0 picks a free REP port; a fixed one lets workers start at the same time as the
    server (they retry until it answers). Push and status ports are always picked free.
    ``settings``: more server settings by name (``{"policy": "sync:2/2"}``). ``cpus`` and
    ``prefix`` as for ``Procs.start`` (an emulated host, a network namespace).
    """
    ready = procs.logdir / f"ready-{len(procs.procs):02d}-{name}.json"  # unique per start
    proc, _ = procs.start(
        service_args(
            "server",
            host=host,
            port=port,
            push_port=0,
            status_port=0,
            ready_file=str(ready),
            log_level="WARNING",
            **(settings or {}),
        ),
        name,
        cpus=cpus,
        prefix=prefix,
    )
    return proc, (server_ready(procs, proc, ready) if wait else {"ready_file": str(ready)})


def service_args(service: str, **settings: Any) -> list[str]:
    """``python -m downpour SERVICE`` with ``settings`` (by name) as ``Procs.start`` takes it:
    the flags come from the service's option declarations (``downpour.config.settings.to_argv``)."""
    from downpour.config.settings import to_argv
    from downpour.server.settings import SERVER_OPTIONS
    from downpour.worker.settings import WORKER_OPTIONS

    options = SERVER_OPTIONS if service == "server" else WORKER_OPTIONS
    return ["-m", "downpour", service, *to_argv(options, settings)]


def server_ready(
    procs: Procs, proc: subprocess.Popen[bytes], ready: Path, timeout_s: float = 180.0
) -> dict[str, Any]:
    """The ready-file info of a server started by ``start_server``; bounded wait."""
    try:
        return wait_ready(proc, ready, timeout_s)
    except RuntimeError as exc:
        raise RuntimeError(f"{exc}; server log:\n{procs.log_tail(proc)}") from None


def status_endpoint(info: dict[str, Any]) -> str:
    """The status socket of a server from its ready-file info."""
    return f"tcp://127.0.0.1:{info['status_port']}"


def section_main(name: str, run: Callable[[str, Procs], dict[str, Any]]) -> None:
    """``python tests/bench/bench_NAME.py [smoke|quick|full]``: the section ``name`` alone under
    that plan (default smoke), its JSON document on stdout; child logs in a fresh directory."""
    import tempfile

    plan_name = sys.argv[1] if len(sys.argv) > 1 else "smoke"
    with Procs(Path(tempfile.mkdtemp(prefix=f"downpour-bench-{name}-"))) as procs:
        print(json.dumps(run(plan_name, procs), indent=2))
