"""Sparse section: row pulls of a big embedding table against whole-table pulls, by table size.

The model is ``sparse_model``: an ``Embedding(rows, 16)`` gathering 8 Zipf-distributed ids per
example (batch 256) and a small dense head. For each table size a real ``downpour server``
(``--optimizer adagrad``: the table and its slot change on the touched rows only) runs on
core 1 and one ``downpour worker`` at a time on core 0 (emulated hosts, ``bench_util``):

* rows: the worker with ``--row-pulls auto`` (the default): each step pulls the rows its
  coming batch gathers, at the server's current version (``--row-staleness 0``), and the
  dense head whole;
* dense: the worker with ``--row-pulls off``: every pull carries the whole table.

Both pull every step (``--n-fetch 1``). Steps/s is read from the server's status socket over
timed windows after a warm-up; bytes per step is the growth of the worker's reported
``bytes_pulled`` over the same windows, per step (the first whole load is in the warm-up).

Keys (``sparse``):

* ``pull_bytes_ratio``: dense bytes per step over row-pull bytes per step at 1M rows (at the
  largest size with a dense measurement when the plan has no 1M table); per size in
  ``pull_bytes_ratio_by_rows``;
* ``steps_per_s_by_rows``: the row-pulling worker's steps/s at each size;
* ``flatness``: steps/s at the largest size over steps/s at the smallest.

A whole pull of the 4M table is 256 MB, so the dense side runs few steps, and only at the
sizes the plan names (``SparsePlan.dense_rows``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench_util import (
    Procs,
    free_port,
    host_cpus,
    log,
    median,
    section_main,
    server_ready,
    service_args,
    start_server,
)
from bench_util import status_endpoint as endpoint_of
from sparse_model import DIM

from downpour.net.client import fetch_status

OPTIMIZER = {"optimizer": "adagrad", "lr": 0.05}
MODELS = {
    20_000: "sparse_model:rows_20k",
    100_000: "sparse_model:rows_100k",
    1_000_000: "sparse_model:rows_1m",
    4_000_000: "sparse_model:rows_4m",
}
RATIO_ROWS = 1_000_000  # the size the pull_bytes_ratio target is set at
WARMUP_TIMEOUT_S = 240.0  # start-up, the first whole load and tracing, on a loaded machine
WINDOW_TIMEOUT_S = 240.0  # one window, however slow the steps


@dataclass(frozen=True)
class SparsePlan:
    """Table sizes and window lengths of one bench plan."""

    rows: tuple[int, ...]  # table sizes, each with a row-pulling worker
    dense_rows: tuple[int, ...]  # the sizes also measured with whole-table pulls
    warmup_steps: int
    windows: int
    window_s: float
    min_window_steps: int  # a window lasts until the worker made this many steps
    dense_warmup_steps: int
    dense_window_steps: int  # one window of this many steps with whole-table pulls


PLANS = {
    "smoke": SparsePlan((20_000, 100_000), (100_000,), 3, 1, 1.0, 3, 1, 2),
    "quick": SparsePlan((100_000, 1_000_000), (1_000_000,), 6, 2, 1.5, 8, 2, 3),
    "full": SparsePlan(
        (100_000, 1_000_000, 4_000_000), (100_000, 1_000_000, 4_000_000), 20, 3, 4.0, 20, 3, 6
    ),
}


def _record(doc: dict[str, Any], wid: str) -> tuple[int, float, float]:
    """(steps, bytes_pulled, rows_pulled) the worker ``wid`` last reported to the server."""
    w = doc.get("workers", {}).get(wid, {})
    reported = w.get("reported") or {}
    return (
        int(w.get("steps") or 0),
        float(reported.get("bytes_pulled") or 0.0),
        float(reported.get("rows_pulled") or 0.0),
    )


def _status(endpoint: str, proc: Any, procs: Procs, what: str) -> dict[str, Any]:
    if proc.poll() is not None:
        raise RuntimeError(f"{what}: worker exited with {proc.returncode}:\n{procs.log_tail(proc)}")
    return fetch_status(endpoint, timeout_s=30.0)


def measure(
    procs: Procs,
    endpoint: str,
    proc: Any,
    wid: str,
    warmup_steps: int,
    windows: int,
    window_s: float,
    min_steps: int,
    what: str = "sparse",
) -> dict[str, Any]:
    """Steps/s and pulled bytes and rows per step of worker ``wid`` over ``windows`` windows
    after ``warmup_steps`` steps; each window lasts ``window_s`` and ``min_steps`` steps.
    ``what``: the section, in error messages."""
    deadline = time.monotonic() + WARMUP_TIMEOUT_S
    doc = _status(endpoint, proc, procs, what)
    while _record(doc, wid)[0] < warmup_steps:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: {wid} not warmed up in {WARMUP_TIMEOUT_S:.0f} s")
        time.sleep(0.2)  # polling the status socket for a bounded time
        doc = _status(endpoint, proc, procs, what)
    rates, bytes_per_step, rows_per_step = [], [], []
    last = doc
    for _ in range(windows):
        end = time.monotonic() + window_s
        deadline = end + WINDOW_TIMEOUT_S
        while True:
            time.sleep(0.1)  # polling the status socket for a bounded time
            doc = _status(endpoint, proc, procs, what)
            steps = _record(doc, wid)[0] - _record(last, wid)[0]
            if time.monotonic() >= end and steps >= min_steps:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what}: {wid} made {steps} steps in a window")
        (s1, b1, r1), (s0, b0, r0) = _record(doc, wid), _record(last, wid)
        rates.append((s1 - s0) / max(doc["uptime_s"] - last["uptime_s"], 1e-9))
        bytes_per_step.append((b1 - b0) / (s1 - s0))
        rows_per_step.append((r1 - r0) / (s1 - s0))
        last = doc
    reported = doc.get("workers", {}).get(wid, {}).get("reported") or {}
    return {
        "steps_per_s": median(rates),
        "windows": rates,
        "bytes_per_step": median(bytes_per_step),
        "rows_per_step": median(rows_per_step),
        # where a step's time goes, as the worker and the server last reported it
        "worker_ms": {k: reported.get(f"{k}_ms") for k in ("compute", "pull", "push")},
        "server_apply_ms": doc.get("apply_ms"),
    }


def start_servers(procs: Procs, sizes: tuple[int, ...]) -> dict[int, tuple[Any, int, Path]]:
    """One server per table size, all on core 1 and started at once: a server idles until its
    worker comes, so the later sizes' start-up overlaps the first worker's. {rows: (process,
    REP port, ready file)}."""
    out = {}
    for rows in sizes:
        port = free_port()  # the worker starts before the server is ready and retries
        settings = {"model": MODELS[rows], **OPTIMIZER}
        proc, pending = start_server(
            procs, f"sparse-server-{rows}", port, wait=False, settings=settings, cpus=host_cpus(1)
        )
        out[rows] = (proc, port, Path(pending["ready_file"]))
    return out


def one_worker(procs: Procs, rows: int, port: int, mode: str) -> tuple[Any, str]:
    """Start a worker (``--row-pulls mode``) on core 0 against the ``rows`` table's server."""
    wid = f"sparse-{'rows' if mode == 'auto' else 'dense'}-{rows}"
    args = service_args(
        "worker", server=f"127.0.0.1:{port}", id=wid, model=MODELS[rows], row_pulls=mode,
        n_fetch=1, steps=1000000, request_timeout=120.0, log_every=0, log_level="WARNING",
    )  # fmt: skip
    proc, _ = procs.start(args, wid, cpus=host_cpus(0))
    return proc, wid


def measure_sizes(plan: SparsePlan, procs: Procs) -> dict[int, dict[str, Any]]:
    """Per table size, the row-pulling worker, then (if the plan says so) the dense one;
    one worker at a time, each size's server stopped once its workers are done."""
    servers = start_servers(procs, plan.rows)
    sizes: dict[int, dict[str, Any]] = {}
    first = True
    try:
        for rows, (server, port, ready) in servers.items():
            sizes[rows] = {}
            for name, mode in [("rows", "auto")] + [("dense", "off")] * (rows in plan.dense_rows):
                proc, wid = one_worker(procs, rows, port, mode)
                try:
                    if first:  # every server up before anything is timed
                        for other, _, other_ready in servers.values():
                            server_ready(procs, other, other_ready)
                        first = False
                    endpoint = endpoint_of(server_ready(procs, server, ready))
                    log(f"sparse: {rows:,} rows, {name} pulls (worker core 0, server core 1)")
                    if name == "rows":
                        sizes[rows][name] = measure(
                            procs, endpoint, proc, wid, plan.warmup_steps, plan.windows,
                            plan.window_s, plan.min_window_steps,
                        )  # fmt: skip
                    else:  # a whole table a step: one window of a few steps
                        sizes[rows][name] = measure(
                            procs, endpoint, proc, wid, plan.dense_warmup_steps, 1, 0.0,
                            plan.dense_window_steps,
                        )  # fmt: skip
                finally:
                    procs.stop(proc)
            procs.stop(server)
    finally:
        for server, _, _ in servers.values():
            procs.stop(server)
    return sizes


def run(plan_name: str, procs: Procs) -> dict[str, Any]:
    """The ``sparse`` keys (see the module) under the bench plan ``plan_name``."""
    plan = PLANS[plan_name]
    sizes = measure_sizes(plan, procs)
    rate = {str(r): s["rows"]["steps_per_s"] for r, s in sizes.items()}
    row_bytes = {str(r): s["rows"]["bytes_per_step"] for r, s in sizes.items()}
    dense_bytes = {str(r): s["dense"]["bytes_per_step"] for r, s in sizes.items() if "dense" in s}
    ratio = {r: dense_bytes[r] / row_bytes[r] for r in dense_bytes}
    at = str(RATIO_ROWS) if str(RATIO_ROWS) in ratio else max(ratio, key=int)
    smallest, largest = str(min(plan.rows)), str(max(plan.rows))
    return {
        "pull_bytes_ratio": ratio[at],
        "pull_bytes_ratio_rows": int(at),
        "pull_bytes_ratio_by_rows": ratio,
        "steps_per_s_by_rows": rate,
        "flatness": rate[largest] / rate[smallest],
        "flatness_rows": [int(smallest), int(largest)],
        "row_bytes_per_step_by_rows": row_bytes,
        "rows_per_step_by_rows": {str(r): s["rows"]["rows_per_step"] for r, s in sizes.items()},
        "dense_bytes_per_step_by_rows": dense_bytes,
        "dense_steps_per_s_by_rows": {
            str(r): s["dense"]["steps_per_s"] for r, s in sizes.items() if "dense" in s
        },
        "dim": DIM,
        "optimizer": OPTIMIZER["optimizer"],
        "detail": {str(r): s for r, s in sizes.items()},
    }


def targets(s: dict[str, Any]) -> list[tuple[str, float, str, float]]:
    """The issue's targets of this section: (name, value, op, bound) rows for ``bench.targets``."""
    return [
        (f"sparse pull_bytes_ratio at {rows_label(s['pull_bytes_ratio_rows'])} rows",
         s["pull_bytes_ratio"], ">=", 50.0),
        (f"sparse flatness {rows_label(s['flatness_rows'][1])} / "
         f"{rows_label(s['flatness_rows'][0])} rows", s["flatness"], ">=", 0.8),
    ]  # fmt: skip


def rows_label(n: int) -> str:
    """A table size as the section names it: 100k, 1M, 4M."""
    return f"{n // 1_000_000}M" if n % 1_000_000 == 0 else f"{n // 1_000}k"


def table_rows(s: dict[str, Any]) -> list[str]:
    """This section's lines of the bench's Markdown table."""
    out = []
    for rows, rate in s["steps_per_s_by_rows"].items():
        dense = ""
        if rows in s["pull_bytes_ratio_by_rows"]:
            dense = (
                f"; whole-table pulls {s['dense_steps_per_s_by_rows'][rows]:.2f} steps/s, "
                f"{s['dense_bytes_per_step_by_rows'][rows] / 1e6:.1f} MB a step: "
                f"**{s['pull_bytes_ratio_by_rows'][rows]:.0f}x** the bytes"
            )
        out.append(
            f"| sparse, pinned | {rows_label(int(rows))} x {s['dim']} table, row pulls "
            f"({s['rows_per_step_by_rows'][rows]:.0f} rows, "
            f"{s['row_bytes_per_step_by_rows'][rows] / 1e3:.0f} kB a step{dense}) | "
            f"{rate:.2f} steps/s |"
        )
    out.append(
        f"| sparse, pinned | **steps/s at {rows_label(s['flatness_rows'][1])} rows / at "
        f"{rows_label(s['flatness_rows'][0])} rows** | **{s['flatness']:.2f}** |"
    )
    return out


if __name__ == "__main__":  # [smoke|quick|full]: this section alone, as JSON
    section_main("sparse", run)
