"""Per-thread py-spy profiles of the bench's pinned set-ups: where a step's time goes.

    .venv/bin/python tests/bench/profile_pinned.py [--setup e2e|flood|goodput] [--seconds 20]
        [--perf]

``e2e``: the pinned end-to-end set-up of ``make bench`` (a downpour worker on core 0, its
server on core 1, Deep-MNIST, Adam); ``flood``: the server on core 1 under the bench's
pre-encoded pushers on core 0; ``goodput``: the goodput section's sender (core 0) and
receiver (core 1). After a warm-up, ``py-spy record --threads --idle
--nonblocking`` samples each downpour process for the same window (the sampler itself costs
a few percent of a core; it reads memory without stopping the process). For every thread
the summary prints its share of the window's samples by the innermost frame of downpour's
(or the library function it called into), so a thread that waits shows where, and the
steps/s of the window beside the unprofiled figure of ``make bench``.

With ``--perf`` the window is sampled by ``perf record -C`` on each emulated host's core
instead of py-spy (which is not pinned, and would take CPU from the cores measured): it sees
what py-spy cannot, native code and the kernel, by thread. Its
summary gives each thread's CPU by shared object (``[kernel.kallsyms]`` for the kernel,
``[JIT]`` for XLA's compiled code) as a share of the core and in milliseconds per update
or step of the window: libzmq's I/O thread in the kernel is the TCP copy. It needs
``perf`` (Debian: ``apt-get install linux-perf``) and ``kernel.perf_event_paranoid`` <= 0
or root.

The raw profiles (``py-spy`` raw format, one line per stack; ``perf-*.data``) stay in
``--out``.
"""

from __future__ import annotations

import argparse
import collections
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_util import (
    Procs,
    free_port,
    host_cpus,
    log,
    server_ready,
    service_args,
    start_server,
    status_endpoint,
)

from downpour.net.client import fetch_status

PY_SPY = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
PERF = shutil.which("perf")
PERF_MIN_SHARE = 0.5  # a thread, or its shared object, below this % of the core is not listed
FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")
OURS = ("worker/", "server/", "shared/", "cli/")  # py-spy names files from their package root


def perf_record(cores: dict[str, list[int]], seconds: float, out: Path) -> None:
    """``perf record`` on each emulated host's cores (name: CPUs) for the same ``seconds``,
    in ``out/perf-<name>.data``. Used instead of py-spy, which is not pinned: sampling two
    processes' threads it took over a third of a core the profile was meant to measure."""
    perfs = []
    for name, cpus in cores.items():
        args = [PERF or "perf", "record", "-C", ",".join(map(str, cpus)), "--quiet"]
        args += ["-o", str(out / f"perf-{name}.data"), "--", "sleep", str(int(seconds))]
        perfs.append(subprocess.Popen(args, stdout=subprocess.DEVNULL))
    for p in perfs:
        p.wait(timeout=seconds + 60)


def record(pids: dict[str, int], seconds: float, rate: int, out: Path) -> dict[str, list[str]]:
    """py-spy on each process of ``pids`` (name: pid) for the same ``seconds``, raw stacks
    per thread, idle ones included, in ``out/<name>.txt``; each one's ``summarise``."""
    spies = []
    for name, pid in pids.items():
        args = [PY_SPY, "record", "--pid", str(pid), "--threads", "--idle", "--nonblocking"]
        args += ["--rate", str(rate), "--duration", str(int(seconds)), "--format", "raw"]
        args += ["--output", str(out / f"{name}.txt")]
        spies.append(subprocess.Popen(args, stdout=subprocess.DEVNULL))
    for spy in spies:
        spy.wait(timeout=seconds + 60)
    return {name: summarise(out / f"{name}.txt") for name in pids}


def where(frames: list[str]) -> str:
    """The innermost frame of downpour's own code, with the call it was in (if any)."""
    parsed = [FRAME.match(f) for f in frames]
    for i in range(len(parsed) - 1, -1, -1):
        m = parsed[i]
        if m and m["file"].startswith(OURS):
            inner = parsed[i + 1] if i + 1 < len(parsed) else None
            callee = f" -> {inner['func']}" if inner else ""
            return f"{m['func']} ({m['file']}:{m['line']}){callee}"
    m = parsed[-1] if parsed else None
    return f"{m['func']} ({Path(m['file']).name})" if m else "?"


def summarise(raw: Path, top: int = 8) -> list[str]:
    """Per thread: its samples and the ``top`` places they were in."""
    threads: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        thread = frames[0]
        threads[thread][where(frames[1:])] += int(count)
    lines = []
    for thread, places in sorted(threads.items(), key=lambda kv: -sum(kv[1].values())):
        n = sum(places.values())
        lines.append(f"  {thread}: {n} samples")
        for place, k in places.most_common(top):
            lines.append(f"    {100 * k / n:5.1f} %  {place}")
    return lines


def perf_rows(report: str) -> tuple[float, dict[str, collections.Counter[str]]]:
    """``perf report --sort comm,dso -t ';'`` text of a ``cpu-clock`` recording: the busy
    seconds it sampled (its event count, in nanoseconds; an idle CPU is not sampled) and
    {thread name: {shared object: % of those samples}}, XLA's compiled code (``[JIT] tid
    N``) under one name."""
    busy = re.search(r"^# Event count \(approx\.\): (\d+)", report, re.M)
    if busy is None:
        raise ValueError("perf report without an event count")
    rows: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for line in report.splitlines():  # "33.32% ;python ;[JIT] tid 8480"
        fields = [f.strip() for f in line.split(";")]
        if len(fields) != 3 or not fields[0].endswith("%"):
            continue
        share, comm, dso = float(fields[0][:-1]), fields[1], fields[2]
        rows[comm]["[JIT] (XLA)" if dso.startswith("[JIT]") else dso] += share
    return int(busy[1]) / 1e9, rows


def perf_summary(data: Path, seconds: float, per: int, unit: str) -> list[str]:
    """CPU of one core's ``perf record`` by thread name and shared object: its share of the
    core over the window and milliseconds per ``unit`` (``per`` of them in the window)."""
    report = subprocess.run(
        [PERF or "perf", "report", "-i", str(data), "--stdio", "--sort", "comm,dso", "-t", ";"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return perf_lines(report, seconds, per, unit)


def perf_lines(report: str, seconds: float, per: int, unit: str) -> list[str]:
    """``perf_summary``'s lines from the text of ``perf report`` over ``seconds``: a row's
    share of the samples times the busy time is its CPU time."""
    busy_s, rows = perf_rows(report)
    lines = [f"  busy {100 * busy_s / seconds:.1f} % of the core, idle the rest"]
    for comm, by_dso in sorted(rows.items(), key=lambda kv: -sum(kv[1].values())):
        entries = [
            (comm, sum(by_dso.values()), "  "),
            *[(d, x, "    ") for d, x in by_dso.most_common()],
        ]
        for i, (name, share, indent) in enumerate(entries):
            core = share * busy_s / seconds  # % of the core over the window
            if core < PERF_MIN_SHARE:
                continue
            ms = 10 * share * busy_s / max(per, 1)  # share % of busy_s, in ms, per unit
            label = f"{name}:" if i == 0 else name
            lines.append(f"{indent}{label} {core:5.1f} % of the core, {ms:.2f} ms per {unit}")
    return lines


def steps_and_version(endpoint: Any, wid: str) -> tuple[int, int, float]:
    doc = fetch_status(endpoint, timeout_s=10.0)
    return int(doc["workers"].get(wid, {}).get("steps") or 0), int(doc["version"]), doc["uptime_s"]


def e2e(
    procs: Procs,
    out: Path,
    seconds: float,
    rate: int,
    worker: dict[str, str] | None = None,
    perf: bool = False,
) -> list[str]:
    """Worker on core 0, server on core 1 (``bench_e2e.downpour``'s pinned set-up);
    ``worker``: more worker settings by name (``{"compress": "bf16"}``); ``perf``: each
    core under ``perf record`` instead of py-spy."""
    worker_cpus, server_cpus = host_cpus(0), host_cpus(1)
    port, wid = free_port(), "profile-w0"
    server, pending = start_server(procs, "server", port=port, wait=False, cpus=server_cpus)
    args = service_args(
        "worker", server=f"127.0.0.1:{port}", id=wid, steps=1000000, log_every=0,
        log_level="WARNING", **(worker or {}),
    )  # fmt: skip
    proc, _ = procs.start(args, wid, cpus=worker_cpus)
    endpoint = status_endpoint(server_ready(procs, server, Path(pending["ready_file"])))
    deadline = time.monotonic() + 180.0
    while steps_and_version(endpoint, wid)[0] < 20:  # tracing and the first pulls done
        if time.monotonic() > deadline or proc.poll() is not None:
            raise RuntimeError(f"worker not warmed up:\n{procs.log_tail(proc)}")
        time.sleep(0.2)
    s0, v0, t0 = steps_and_version(endpoint, wid)
    if perf:
        perf_record({"worker-core": worker_cpus, "server-core": server_cpus}, seconds, out)
    else:
        profiles = record({"worker": proc.pid, "server": server.pid}, seconds, rate, out)
    s1, v1, t1 = steps_and_version(endpoint, wid)
    head = f"worker on core {worker_cpus}, server on core {server_cpus}: "
    head += f"{(s1 - s0) / (t1 - t0):.2f} steps/s, {(v1 - v0) / (t1 - t0):.2f} updates/s profiled"
    lines = [head]
    if not perf:
        lines += ["worker:", *profiles["worker"], "server:", *profiles["server"]]
    else:
        lines += [f"perf, worker's core {worker_cpus}:"]
        lines += perf_summary(out / "perf-worker-core.data", seconds, s1 - s0, "step")
        lines += [f"perf, server's core {server_cpus}:"]
        lines += perf_summary(out / "perf-server-core.data", seconds, v1 - v0, "update")
    return lines


def flood(
    procs: Procs, out: Path, seconds: float, rate: int, in_flight: int, perf: bool = False
) -> list[str]:
    """Server on core 1 under ``pinned.py flood``'s pre-encoded pushers on core 0, kept
    ``in_flight`` pushes ahead of its version; ``perf``: core 1 under ``perf record`` instead
    of py-spy."""
    core, pushers = host_cpus(1), host_cpus(0)
    server, info = start_server(procs, "server", cpus=core)
    args = [str(Path(__file__).with_name("pinned.py")), "flood"]
    args += ["--push-port", str(info["push_port"]), "--status-port", str(info["status_port"])]
    args += ["--in-flight", str(in_flight), "--warmup-s", "3", "--windows", "1"]
    args += ["--window-s", str(seconds + 10)]
    flooder, result = procs.start(args, "flood", cpus=pushers)
    endpoint, deadline = status_endpoint(info), time.monotonic() + 120.0
    while int(fetch_status(endpoint, timeout_s=10.0)["version"]) < 200:  # past its warm-up
        if time.monotonic() > deadline or flooder.poll() is not None:
            raise RuntimeError(f"no flood:\n{procs.log_tail(flooder)}")
        time.sleep(0.2)
    v0 = int(fetch_status(endpoint, timeout_s=10.0)["version"])
    if perf:
        perf_record({"server-core": core}, seconds, out)
    else:
        profiles = record({"server": server.pid}, seconds, rate, out)
    v1 = int(fetch_status(endpoint, timeout_s=10.0)["version"])
    flooder.wait(timeout=seconds + 120)
    head = f"server on core {core}, pushers on core {pushers}: {result.read_text().strip()[-300:]}"
    lines = [head]
    if not perf:
        lines += ["server:", *profiles["server"]]
    else:
        lines += [f"perf, server's core {core}:"]
        lines += perf_summary(out / "perf-server-core.data", seconds, v1 - v0, "update")
    return lines


def goodput(procs: Procs, out: Path, seconds: float, rate: int) -> list[str]:
    """``goodput.py``: its receiver on core 1, its sender on core 0, the 13.1 MB gradient list
    and 1 MB, pushes, pulls and both, through downpour's sockets and raw pyzmq in turn."""
    from bench_goodput import SCRIPT, sizes_of, start_receiver

    from downpour.model.build import build_model
    from downpour.spec import load_spec

    model = build_model(load_spec("downpour.models:deep_mnist"), seed=0)
    sizes = sizes_of([[int(d) for d in v.shape] for v in model.trainable_variables])
    server, ports = start_receiver(procs, sizes)
    args = [SCRIPT, "client", "--sizes", sizes, "--rounds", "1000"]
    args += ["--push-port", str(ports["push_port"]), "--rep-port", str(ports["rep_port"])]
    client, _ = procs.start(args, "client", cpus=host_cpus(0))
    profiles = record({"sender": client.pid, "receiver": server.pid}, seconds, rate, out)
    head = f"goodput: sender on core {host_cpus(0)}, receiver on core {host_cpus(1)}"
    return [head, "sender:", *profiles["sender"], "receiver:", *profiles["receiver"]]


def main(argv: list[str] | None = None) -> int:
    """Run one set-up under py-spy and print the per-thread summary."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--setup", choices=("e2e", "flood", "goodput"), default="e2e")
    p.add_argument("--seconds", type=float, default=20.0, help="profiled window")
    p.add_argument("--rate", type=int, default=100, help="samples per second")
    p.add_argument("--out", help="directory for the raw profiles (default: a new temp dir)")
    p.add_argument(
        "--worker",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a worker setting for the e2e set-up (compress=bf16); repeatable",
    )
    p.add_argument(
        "--in-flight",
        type=int,
        default=100,
        help="flood: pushes kept ahead of the server's version. make bench keeps half a second "
        "of bare applies ahead, about 100 where an apply takes 5 ms; fewer do not saturate the "
        "server (16 gave about half the applies/s of 100 on a 2-core AMD EPYC host)",
    )
    p.add_argument(
        "--perf",
        action="store_true",
        help="e2e and flood: perf record each emulated host's core instead of py-spy (native "
        "and kernel time by thread)",
    )
    args = p.parse_args(argv)
    worker = dict(kv.split("=", 1) for kv in args.worker)
    if not args.perf and not Path(PY_SPY).exists():
        print("py-spy is not installed: pip install py-spy", file=sys.stderr)
        return 2
    if args.perf and PERF is None:
        print("perf is not installed: apt-get install linux-perf", file=sys.stderr)
        return 2
    out = Path(args.out or tempfile.mkdtemp(prefix="downpour-profile-"))
    out.mkdir(parents=True, exist_ok=True)
    log(f"profiling the pinned {args.setup} set-up for {args.seconds:.0f} s; raw profiles in {out}")
    with Procs(out) as procs:
        if args.setup == "e2e":
            lines = e2e(procs, out, args.seconds, args.rate, worker, args.perf)
        elif args.setup == "flood":
            lines = flood(procs, out, args.seconds, args.rate, args.in_flight, args.perf)
        else:
            lines = goodput(procs, out, args.seconds, args.rate)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
