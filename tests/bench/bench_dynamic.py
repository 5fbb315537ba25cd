"""Dynamic section: one shard's dynamic table, how fast it creates rows and what a row costs.

Keys (``dynamic``):

* ``insert_rows_per_s``: new ids created per second on one shard: ``DynamicTable.apply`` of
  batches of ``BATCH`` fresh ids (each creates its row and Adagrad slot, then takes its
  update) into an empty ``DIM``-wide float32 table, ``plan.insert_rows`` in all; the median
  over ``plan.rounds`` rounds, each on a new table, in this process, after a warm-up batch;
* ``bytes_per_live_row_ratio_<n>`` for ``n`` live rows (1M, 5M): a separate process (the
  server's imports, TensorFlow included) measures its resident set (``VmRSS``) once
  imported, builds a table of ``n`` live rows by ``apply`` as a server does, and measures it
  again: the growth over ``n`` x the raw bytes of a row and its slot (``DIM`` x 4 x 2)
  (target <= 1.5). ``rss_detail`` holds each process's figures: its ``VmHWM`` growth too (the
  peak while building, index rehashes included) and the table's own ``stats()``.

``python tests/bench/bench_dynamic.py [smoke|quick|full]`` runs the section alone.
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from bench_util import Procs, child_env, log, median, meminfo_mib, section_main

DIM = 64
OPTIMIZER = "adagrad"
SLOTS = 1  # Adagrad's accumulator: a row's slots are as many bytes as the row
BATCH = 65_536  # fresh ids per apply
TARGET_RATIO = 1.5
CHILD_TIMEOUT_S = 1200.0  # 5M rows created by apply on a loaded 2-core machine
CHILD_MIB = 1024  # a process with the server's imports, beside its table


@dataclass(frozen=True)
class DynamicPlan:
    """The sizes of one bench plan: rows per insert round, rounds, live-row counts."""

    insert_rows: int
    rounds: int
    live_rows: tuple[int, ...]


PLANS = {
    "smoke": DynamicPlan(200_000, 2, (1_000_000,)),
    "quick": DynamicPlan(500_000, 3, (1_000_000, 5_000_000)),
    "full": DynamicPlan(1_000_000, 5, (1_000_000, 5_000_000)),
}


def fresh_ids(start: int, stop: int) -> np.ndarray:
    """Distinct int64 ids spread over all of int64 (``mix64`` of a range is a bijection)."""
    from downpour.initial import mix64

    return mix64(np.arange(start, stop, dtype=np.uint64)).view(np.int64)


def fill(table: Any, rows: int, start: int = 0) -> float:
    """Create ``rows`` fresh ids in ``table`` by ``apply`` in batches of ``BATCH``; seconds."""
    grads = np.full((BATCH, table.dim), 1e-3, np.float32)
    took = 0.0
    for step, lo in enumerate(range(start, start + rows, BATCH)):
        ids = fresh_ids(lo, min(lo + BATCH, start + rows))
        t = time.perf_counter()
        table.apply(ids, grads[: ids.size], 0.05, version=step)
        took += time.perf_counter() - t
    return took


def insert_rows_per_s(rows: int, rounds: int) -> dict[str, Any]:
    """New rows per second into an empty table (see the module): the median and each round."""
    from downpour.server.dynamic import DynamicTable

    fill(DynamicTable("warm", DIM, optimizer=OPTIMIZER), BATCH)  # code paths, not timed
    rates = []
    for r in range(rounds):
        table = DynamicTable("bench", DIM, optimizer=OPTIMIZER)
        rates.append(rows / fill(table, rows, start=r * rows))
        if len(table) != rows:
            raise RuntimeError(f"dynamic: {len(table)} live rows after {rows} fresh ids")
        del table
        gc.collect()
    return {"insert_rows_per_s": median(rates), "insert_rounds": [round(x) for x in rates]}


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(f"{key}:"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {key}")


def child_main(rows: int) -> None:
    """In the measuring process: the resident set once imported and once ``rows`` live rows
    are in a table, as one JSON line on stdout."""
    from downpour.server.dynamic import DynamicTable

    fill(DynamicTable("warm", DIM, optimizer=OPTIMIZER), BATCH)  # code paths, not memory
    gc.collect()
    base = _status_kib("VmRSS")
    table = DynamicTable("bench", DIM, optimizer=OPTIMIZER)
    fill(table, rows)
    gc.collect()
    out = {"rows": rows, "base_kib": base, "rss_kib": _status_kib("VmRSS")}
    out |= {"hwm_kib": _status_kib("VmHWM"), "stats": table.stats()}
    print(json.dumps(out))


def rss_ratio(rows: int) -> dict[str, Any]:
    """``child_main`` of ``rows`` in its own process; the ratios of its growth to raw bytes."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "child", str(rows)]
    done = subprocess.run(
        cmd, capture_output=True, text=True, env=child_env(), timeout=CHILD_TIMEOUT_S, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"dynamic: {rows:,}-row process exited {done.returncode}: "
                           f"{done.stderr[-2000:]}")  # fmt: skip
    got = json.loads(done.stdout.strip().splitlines()[-1])
    if got["stats"]["live_rows"] != rows:
        raise RuntimeError(f"dynamic: the process held {got['stats']['live_rows']} rows")
    raw = rows * DIM * 4 * (1 + SLOTS)
    got["ratio"] = (got["rss_kib"] - got["base_kib"]) * 1024 / raw
    got["hwm_ratio"] = (got["hwm_kib"] - got["base_kib"]) * 1024 / raw
    log(f"dynamic: {rows:,} live rows: RSS +{(got['rss_kib'] - got['base_kib']) / 1024:.0f} "
        f"MiB for {raw / 2**20:.0f} MiB raw, ratio {got['ratio']:.3f}")  # fmt: skip
    return got


def run(plan_name: str, procs: Procs) -> dict[str, Any]:
    """The ``dynamic`` keys (see the module) under the bench plan ``plan_name``; a live-row
    count the machine's available memory cannot hold is skipped, saying so."""
    del procs  # the measuring processes are short and waited for here
    plan = PLANS[plan_name]
    log(f"dynamic: {plan.rounds} rounds of {plan.insert_rows:,} new rows, {DIM} wide")
    result: dict[str, Any] = insert_rows_per_s(plan.insert_rows, plan.rounds)
    detail, skipped = {}, {}
    for rows in plan.live_rows:
        need = CHILD_MIB + 2 * rows * DIM * 4 * (1 + SLOTS) / 2**20  # rehash and batch peaks
        have = meminfo_mib("MemAvailable")
        if have < need:
            skipped[str(rows)] = f"{have:.0f} MiB available, {need:.0f} needed"
            log(f"dynamic: {rows:,} live rows skipped: {skipped[str(rows)]}")
            continue
        detail[str(rows)] = rss_ratio(rows)
        result[f"bytes_per_live_row_ratio_{rows_key(rows)}"] = detail[str(rows)]["ratio"]
    return (
        result
        | {"dim": DIM, "optimizer": OPTIMIZER, "rss_detail": detail}
        | ({"skipped": skipped} if skipped else {})
    )


def rows_key(rows: int) -> str:
    """``1m``, ``5m``, ``500k``: a live-row count as a key suffix."""
    return f"{rows // 1_000_000}m" if rows % 1_000_000 == 0 else f"{rows // 1000}k"


def targets(t: dict[str, Any]) -> list[tuple[str, float, str, float]]:
    """The issue's targets of this section: (name, value, op, bound) rows for ``bench.targets``."""
    return [
        (f"dynamic {k}", v, "<=", TARGET_RATIO)
        for k, v in t.items()
        if k.startswith("bytes_per_live_row_ratio_")
    ]


if __name__ == "__main__":  # [smoke|quick|full]: this section alone, as JSON
    if sys.argv[1:2] == ["child"]:
        child_main(int(sys.argv[2]))
    else:
        section_main("dynamic", run)
