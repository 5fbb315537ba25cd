"""A shaped link: a worker and a server on two hosts joined by a 1 Gbit/s link.

Each host is a Linux network namespace (``tests/netns.py``) whose one veth link is shaped
with ``tc qdisc ... tbf rate 1gbit``, so pushes (worker -> server) and pulls (server ->
worker) each get 1 Gbit/s. The worker runs on core 0, the server on core 1. Steps/s for:

* dense: float32 pushes and pulls;
* bf16: ``--compress bf16 --pull-compress bf16`` (half the bytes both ways);
* topk: ``--compress topk:0.01`` (1 % of each gradient's entries pushed; pulls dense).

Here bandwidth, not CPU, is the limit: this is where compression is meant to pay. The
section skips, with its reason, where namespaces or tbf cannot be had (not root, no ``ip``).

The status socket lives inside the server's namespace, so the windows are timed by this
file run as a script there (``bench_link.py sample ...``), which prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # tests/netns.py

from bench_util import host_cpus, service_args  # noqa: E402

RATE = "1gbit"
BURST = "512kb"  # > one GSO segment (64 KiB): tbf needs the largest packet to fit
LATENCY = "50ms"  # queue bound: 50 ms at the rate (6 MB) before tbf drops
MIN_WINDOW_STEPS = 3  # a window on a slow machine lasts until the worker made this many steps
VARIANTS: dict[str, dict[str, Any]] = {  # the workers' settings, by name
    "dense": {"pull_compress": "none"},  # float32 both ways, whatever the worker's default
    "bf16": {"compress": "bf16", "pull_compress": "bf16"},
    "topk": {"compress": "topk:0.01"},
}


def shape(ns: str, dev: str) -> str | None:
    """Shape ``dev`` in namespace ``ns`` to ``RATE`` with tbf; None, or why it failed."""
    cmd = ["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf"]
    cmd += ["rate", RATE, "burst", BURST, "latency", LATENCY]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    return None if done.returncode == 0 else f"tc tbf failed: {done.stderr.strip()}"


def sample(endpoint: str, worker: str, warmup_steps: int, windows: int, window_s: float) -> None:
    """Print the worker's steps/s over ``windows`` windows after ``warmup_steps`` (bounded)."""
    from downpour.net.client import fetch_status

    def steps(doc: dict[str, Any]) -> int:
        return int(doc.get("workers", {}).get(worker, {}).get("steps") or 0)

    deadline = time.monotonic() + 240.0
    doc = fetch_status(endpoint, timeout_s=10.0)
    while steps(doc) < warmup_steps:
        if time.monotonic() > deadline:
            raise RuntimeError(f"worker not warmed up after 240 s ({steps(doc)} steps)")
        time.sleep(0.2)  # polling the status socket for a bounded time
        doc = fetch_status(endpoint, timeout_s=10.0)
    rates = []
    last = doc
    for _ in range(windows):  # each window lasts window_s and holds MIN_WINDOW_STEPS steps
        end = time.monotonic() + window_s
        deadline = end + 240.0
        while True:
            time.sleep(0.1)  # polling the status socket for a bounded time
            doc = fetch_status(endpoint, timeout_s=10.0)
            done = time.monotonic() >= end and steps(doc) - steps(last) >= MIN_WINDOW_STEPS
            if done or time.monotonic() > deadline:
                break
        rates.append((steps(doc) - steps(last)) / max(doc["uptime_s"] - last["uptime_s"], 1e-9))
        last = doc
    staleness = doc.get("staleness", {}).get("mean")
    print(json.dumps({"windows": rates, "staleness_mean": staleness}), flush=True)


def available() -> str | None:
    """None if the section can run here, else why not."""
    import shutil

    import netns

    reason = netns.available()
    if reason is None and shutil.which("tc") is None:
        reason = "tc (iproute2) is not installed"
    return reason


def one_worker(
    plan: Any,
    procs: Any,
    srv: Any,
    wrk: Any,
    port: int,
    status: str,
    name: str,
    settings: dict[str, Any],
) -> dict[str, Any]:
    """Steps/s windows of one worker (more ``settings`` by name) in ``wrk`` against the server."""
    args = service_args(
        "worker", server=f"{srv.addr}:{port}", id=f"link-{name}", steps=1000000, log_every=0,
        log_level="WARNING", **settings,
    )  # fmt: skip
    worker, _ = procs.start(args, f"link-{name}", cpus=host_cpus(0), prefix=wrk.exec_args())
    try:
        sampler, sampled = procs.start(
            [
                str(HERE / "bench_link.py"),
                *("sample", "--endpoint", status, "--worker", f"link-{name}"),
                *("--warmup-steps", str(plan.e2e_warmup_steps)),
                *("--windows", str(plan.e2e_windows), "--window-s", str(plan.link_window_s)),
            ],
            f"link-sample-{name}",
            prefix=srv.exec_args(),
        )
        try:
            code = sampler.wait(timeout=400)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"link {name}: sampler did not finish in 400 s") from None
        if code != 0:
            tail = procs.log_tail(sampler) + "\n" + procs.log_tail(worker)
            raise RuntimeError(f"link {name}: sampler exited with {code}:\n{tail}")
        return json.loads(sampled.read_text().strip().splitlines()[-1])
    finally:
        procs.stop(worker)


def run(plan: Any, procs: Any) -> dict[str, Any]:
    """``{dense,bf16,topk}_steps_per_s`` over the shaped link, or ``{"skipped": reason}``."""
    import netns
    from bench_util import log, median, start_server

    reason = available()
    if reason is not None:
        log(f"link: skipped ({reason})")
        return {"skipped": reason}
    out: dict[str, Any] = {"rate": RATE, "burst": BURST, "latency": LATENCY}
    with netns.Network(net=91) as net:
        srv, wrk = net.add("server"), net.add("worker")
        for host in (srv, wrk):
            reason = shape(host.ns, host.dev)
            if reason is not None:
                log(f"link: skipped ({reason})")
                return {"skipped": reason}
        port = 5570  # inside the server's namespace: nothing else listens there
        server, info = start_server(
            procs,
            "link-server",
            port=port,
            settings={"insecure": True},  # plaintext, as the loopback runs (namespaces are private)
            cpus=host_cpus(1),
            host=srv.addr,
            prefix=srv.exec_args(),
        )
        status = f"tcp://{srv.addr}:{info['status_port']}"
        try:
            for name, settings in VARIANTS.items():  # one worker after another, one server
                log(f"link: {name}, worker {wrk.addr} (core 0) -> server {srv.addr} (core 1)")
                got = one_worker(plan, procs, srv, wrk, port, status, name, settings)
                out[f"{name}_steps_per_s"] = median(got["windows"])
                out[f"{name}_windows"] = got["windows"]
                out[f"{name}_staleness_mean"] = got["staleness_mean"]
        finally:
            procs.stop(server)
    out["bf16_vs_dense"] = out["bf16_steps_per_s"] / out["dense_steps_per_s"]
    out["topk_vs_dense"] = out["topk_steps_per_s"] / out["dense_steps_per_s"]
    return out


def main() -> None:
    """Command line: ``sample`` (run inside the server's namespace by ``run``)."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("mode", choices=["sample"])
    p.add_argument("--endpoint", required=True)
    p.add_argument("--worker", required=True)
    p.add_argument("--warmup-steps", type=int, default=5)
    p.add_argument("--windows", type=int, default=3)
    p.add_argument("--window-s", type=float, default=2.0)
    args = p.parse_args()
    sample(args.endpoint, args.worker, args.warmup_steps, args.windows, args.window_s)


if __name__ == "__main__":
    main()
