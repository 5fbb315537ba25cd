"""Goodput: MB/s of pushes, pulls and push+pull through downpour's wire and sockets against
raw pyzmq multipart of the same bytes (see ``goodput.py``), for a 1 MB message and for the
Deep-MNIST gradient list (13.1 MB). The receiving side runs on core 1, the sending side on
core 0 (emulated hosts). Each ``*_ratio_to_raw`` is the worse of the two sizes.
"""

from __future__ import annotations

import json
import math
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench_util import Plan, Procs, host_cpus, log

HERE = Path(__file__).resolve().parent
SCRIPT = str(HERE / "goodput.py")
ONE_MB = [[1 << 18]]  # 262,144 float32: 1 MiB


def sizes_of(shapes: Sequence[Sequence[int]]) -> str:
    """``goodput.py --sizes``: 1 MB and the gradient list of these float32 shapes."""
    total = sum(math.prod(s) for s in shapes) * 4
    return json.dumps({"1MB": ONE_MB, f"{total / 1e6:.1f}MB": [list(s) for s in shapes]})


def start_receiver(procs: Procs, sizes: str) -> tuple[subprocess.Popen[bytes], dict[str, int]]:
    """``goodput.py serve`` on core 1 and, once it is listening, its ports."""
    ready = procs.logdir / f"ready-goodput-{len(procs.procs):02d}.json"
    server, _ = procs.start(
        [SCRIPT, "serve", "--sizes", sizes, "--ready-file", str(ready)],
        "goodput-serve",
        cpus=host_cpus(1),
    )
    deadline = time.monotonic() + 60.0
    while not ready.exists():
        if server.poll() is not None or time.monotonic() > deadline:
            procs.stop(server)
            raise RuntimeError(f"goodput server not ready:\n{procs.log_tail(server)}")
        time.sleep(0.05)  # polling a file for a bounded time
    return server, json.loads(ready.read_text())


def run(plan: Plan, procs: Procs, shapes: list[tuple[int, ...]]) -> dict[str, Any]:
    """The goodput section: every figure of ``goodput.py client``."""
    sizes = sizes_of(shapes)
    server, ports = start_receiver(procs, sizes)
    try:
        log(f"goodput: {plan.goodput_reps} rounds, sender on core 0, receiver on core 1")
        args = [SCRIPT, "client", "--sizes", sizes, "--rounds", str(plan.goodput_reps)]
        args += ["--push-port", str(ports["push_port"]), "--rep-port", str(ports["rep_port"])]
        client, out = procs.start(args, "goodput-client", cpus=host_cpus(0))
        try:
            code = client.wait(timeout=300)
        except subprocess.TimeoutExpired:
            raise RuntimeError("goodput client did not finish in 300 s") from None
        if code != 0:
            raise RuntimeError(f"goodput client exited with {code}:\n{procs.log_tail(client)}")
        return json.loads(out.read_text().strip().splitlines()[-1])
    finally:
        procs.stop(server)
