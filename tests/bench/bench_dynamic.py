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
  peak while building, index rehashes included) and the table's own ``stats()``;
  ``bytes_per_live_row_ratio``: the ratio at the largest count measured;
* ``steps_per_s_by_live_rows``: one worker's steps/s against one shard whose table holds
  ``n`` live rows (``dynamic_steps``: a checkpoint of ``n`` rows written as the server writes
  it, restored by a real server, the worker's ids drawn uniformly over the live ones; steps/s
  from the server's status after a warm-up), on ``dynamic_model``'s ``DYNAMIC_DIM``-wide table
  (16: 20M rows and their slots are 2.56 GB);
* ``flatness``: steps/s at the largest count measured over steps/s at the smallest
  (target >= 0.8), with admission and fallback rows on (``dynamic_model``: every touch
  counted in the admission sketch on each apply);
* ``bytes_per_live_id``: per row width (``WIDTHS``: 1, 16, 64, Adagrad), a table filled by
  ``apply`` to ``plan.id_rows`` live ids, once in a budget of exactly that many rows (the
  store and the index sized for it, the admission sketch on: the bounded case) and once
  unbounded (grown by inserts); from its ``stats()``, per live id: ``total`` bytes, the
  ``row_and_slots`` payload, ``index_and_metadata`` (the index's buckets, each row's id,
  version and count, the Bloom filter of evicted ids: target <= 32), the admission
  ``sketch`` and the ``reserved`` slots not yet in use, reported apart.

A count the machine's available memory cannot hold is skipped, logged and listed under
``skipped_sizes`` with the reason. ``python tests/bench/bench_dynamic.py [smoke|quick|full]``
runs the section alone.
"""

from __future__ import annotations

import gc
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from bench_sparse import rows_label
from bench_util import Procs, log, median, meminfo_mib, section_main
from dynamic_model import DIM as DYNAMIC_DIM
from dynamic_model import fresh_ids
from dynamic_steps import ROW_BYTES, StepsPlan, steps_at

DIM = 64
OPTIMIZER = "adagrad"
SLOTS = 1  # Adagrad's accumulator: a row's slots are as many bytes as the row
BATCH = 65_536  # fresh ids per apply
TARGET_RATIO = 1.5
TARGET_FLATNESS = 0.8
WIDTHS = (1, 16, 64)  # row widths of bytes_per_live_id
TARGET_ID_BYTES = 32  # index and metadata per live id, at most
CHILD_TIMEOUT_S = 1200.0  # 5M rows created by apply on a loaded 2-core machine
CHILD_MIB = 1024  # a process with the server's imports, beside its table


@dataclass(frozen=True)
class DynamicPlan:
    """The sizes of one bench plan: rows per insert round, rounds, live-row counts of the
    memory measurement, and the steps/s measurement's plan."""

    insert_rows: int
    rounds: int
    live_rows: tuple[int, ...]
    steps: StepsPlan
    id_rows: int = 1_000_000


PLANS = {
    "smoke": DynamicPlan(
        200_000, 2, (1_000_000,), StepsPlan((100_000, 400_000), 3, 1, 1.0, 3), 100_000
    ),
    "quick": DynamicPlan(
        500_000,
        3,
        (1_000_000, 5_000_000),
        StepsPlan((1_000_000, 5_000_000), 6, 2, 1.5, 8),
        500_000,
    ),
    "full": DynamicPlan(
        1_000_000,
        5,
        (1_000_000, 5_000_000),
        StepsPlan((1_000_000, 5_000_000, 20_000_000), 20, 3, 4.0, 20),
    ),
}


def fill(table: Any, rows: int, start: int = 0, lookups: int = 1) -> float:
    """Create ``rows`` fresh ids in ``table`` by ``apply`` in batches of ``BATCH``, each id
    pushed with ``lookups`` lookups (enough for the table's ``admit_after``); seconds."""
    grads = np.full((BATCH, table.dim), 1e-3, np.float32)
    counts = np.full(BATCH, lookups, np.int64)
    took = 0.0
    for step, lo in enumerate(range(start, start + rows, BATCH)):
        ids = fresh_ids(lo, min(lo + BATCH, start + rows))
        t = time.perf_counter()
        table.apply(ids, grads[: ids.size], 0.05, version=step, lookups=counts[: ids.size])
        took += time.perf_counter() - t
    return took


def insert_rows_per_s(rows: int, rounds: int) -> dict[str, Any]:
    """New rows per second into an empty table (see the module): the median and each round."""
    from downpour.server.tables.table import DynamicTable

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


def id_bytes(width: int, rows: int, bounded: bool) -> dict[str, float]:
    """Bytes per live id of a ``width``-wide Adagrad table filled to ``rows`` ids (see the
    module), by part."""
    from downpour.server.tables.table import DynamicTable
    from downpour.tables.policy import TablePolicy

    policy = TablePolicy(rows if bounded else None, admission="always")
    table = DynamicTable("ids", width, optimizer=OPTIMIZER, policy=policy)
    fill(table, rows)
    s = table.stats()
    live = s["live_rows"]
    if live != rows:
        raise RuntimeError(f"dynamic: {live} live ids after {rows} fresh ones")
    out = {
        "total": s["bytes"] / live,
        "row_and_slots": (s["bytes_rows"] + s["bytes_slots"]) / live,
        "index_and_metadata": (s["bytes_index"] + s["bytes_meta"]) / live,
        "sketch": s["bytes_sketch"] / live,
        "reserved": s["bytes_reserved"] / live,
        "fallback": s["bytes_fallback"] / live,
    }
    del table
    gc.collect()
    return {k: round(v, 2) for k, v in out.items()}


def bytes_per_live_id(rows: int) -> dict[str, Any]:
    """``bytes_per_live_id``: per width, bounded and unbounded (see the module)."""
    out: dict[str, Any] = {}
    for width in WIDTHS:
        for bounded in (True, False):
            got = id_bytes(width, rows, bounded)
            out[f"{width}/{'budget' if bounded else 'unbounded'}"] = got
            log(f"dynamic: {rows:,} ids x {width} ({'budget' if bounded else 'unbounded'}): "
                f"{got['total']:.1f} bytes per id, {got['index_and_metadata']:.1f} of index and "
                f"metadata, {got['sketch']:.1f} of sketch")  # fmt: skip
    return {"bytes_per_live_id": out, "id_rows": rows}


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(f"{key}:"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {key}")


def child_main(rows: int) -> None:
    """In the measuring process: the resident set once imported and once ``rows`` live rows
    are in a table, as one JSON line on stdout."""
    from downpour.server.tables.table import DynamicTable

    fill(DynamicTable("warm", DIM, optimizer=OPTIMIZER), BATCH)  # code paths, not memory
    gc.collect()
    base = _status_kib("VmRSS")
    table = DynamicTable("bench", DIM, optimizer=OPTIMIZER)
    fill(table, rows)
    gc.collect()
    out = {"rows": rows, "base_kib": base, "rss_kib": _status_kib("VmRSS")}
    out |= {"hwm_kib": _status_kib("VmHWM"), "stats": table.stats()}
    print(json.dumps(out))


def rss_ratio(procs: Procs, rows: int) -> dict[str, Any]:
    """``child_main`` of ``rows`` in its own process; the ratios of its growth to raw bytes."""
    args = [str(Path(__file__).resolve()), "child", str(rows)]
    got = procs.run_json(args, f"dynamic-memory-{rows}", timeout_s=CHILD_TIMEOUT_S)
    if got["stats"]["live_rows"] != rows:
        raise RuntimeError(f"dynamic: the process held {got['stats']['live_rows']} rows")
    raw = rows * DIM * 4 * (1 + SLOTS)
    got["ratio"] = (got["rss_kib"] - got["base_kib"]) * 1024 / raw
    got["hwm_ratio"] = (got["hwm_kib"] - got["base_kib"]) * 1024 / raw
    log(f"dynamic: {rows:,} live rows: RSS +{(got['rss_kib'] - got['base_kib']) / 1024:.0f} "
        f"MiB for {raw / 2**20:.0f} MiB raw, ratio {got['ratio']:.3f}")  # fmt: skip
    return got


def fits(rows: int, row_bytes: int, copies: int, what: str, skipped: dict[str, str]) -> bool:
    """Whether a process with ``copies`` x ``rows`` x ``row_bytes`` beside ``CHILD_MIB`` fits
    in the available memory; if not, the reason goes to ``skipped`` under ``what``, logged."""
    need = CHILD_MIB + copies * rows * row_bytes / 2**20
    have = meminfo_mib("MemAvailable")
    if have >= need:
        return True
    skipped[what] = f"{have:.0f} MiB available, {need:.0f} needed"
    log(f"dynamic: {what} skipped: {skipped[what]}")
    return False


def memory(plan: DynamicPlan, procs: Procs, skipped: dict[str, str]) -> dict[str, Any]:
    """The ``bytes_per_live_row_ratio`` keys and their ``rss_detail``."""
    out: dict[str, Any] = {}
    detail = {}
    for rows in plan.live_rows:
        # rehash and batch peaks: twice the rows and slots
        if fits(rows, DIM * 4 * (1 + SLOTS), 2, f"memory at {rows_label(rows)} rows", skipped):
            detail[str(rows)] = rss_ratio(procs, rows)
            out[f"bytes_per_live_row_ratio_{rows_key(rows)}"] = detail[str(rows)]["ratio"]
    if detail:
        out["bytes_per_live_row_ratio"] = detail[max(detail, key=int)]["ratio"]
        out["bytes_per_live_row_ratio_rows"] = max(int(r) for r in detail)
    return out | {"rss_detail": detail}


def steps(plan: DynamicPlan, procs: Procs, skipped: dict[str, str]) -> dict[str, Any]:
    """``steps_per_s_by_live_rows`` and ``flatness`` (largest over smallest count measured)."""
    detail = {}
    for rows in plan.steps.rows:
        # the builder's table and its exported copy; the server's restore alike
        if fits(rows, ROW_BYTES, 3, f"steps/s at {rows_label(rows)} rows", skipped):
            detail[str(rows)] = steps_at(plan.steps, procs, rows)
    rate = {r: d["steps_per_s"] for r, d in detail.items()}
    out: dict[str, Any] = {"steps_per_s_by_live_rows": rate, "steps_detail": detail}
    if len(rate) >= 2:
        smallest, largest = min(rate, key=int), max(rate, key=int)
        out["flatness"] = rate[largest] / rate[smallest]
        out["flatness_rows"] = [int(smallest), int(largest)]
    return out


def run(plan_name: str, procs: Procs) -> dict[str, Any]:
    """The ``dynamic`` keys (see the module) under the bench plan ``plan_name``; a live-row
    count the machine's available memory cannot hold is skipped, saying so."""
    plan = PLANS[plan_name]
    log(f"dynamic: {plan.rounds} rounds of {plan.insert_rows:,} new rows, {DIM} wide")
    result: dict[str, Any] = insert_rows_per_s(plan.insert_rows, plan.rounds)
    result |= bytes_per_live_id(plan.id_rows)
    skipped: dict[str, str] = {}
    result |= memory(plan, procs, skipped)
    result |= steps(plan, procs, skipped)
    return result | {
        "dim": DIM,
        "steps_dim": DYNAMIC_DIM,
        "optimizer": OPTIMIZER,
        "skipped_sizes": skipped,
    }


def rows_key(rows: int) -> str:
    """``1m``, ``5m``, ``500k``: a live-row count as a key suffix."""
    return f"{rows // 1_000_000}m" if rows % 1_000_000 == 0 else f"{rows // 1000}k"


def targets(t: dict[str, Any]) -> list[tuple[str, float, str, float]]:
    """The issue's targets of this section: (name, value, op, bound) rows for ``bench.targets``
    (a figure not measured, every size skipped, has no row)."""
    out = [
        (f"dynamic bytes_per_live_row_ratio at {rows_label(int(r))} rows", d["ratio"], "<=",
         TARGET_RATIO)
        for r, d in t.get("rss_detail", {}).items()
    ]  # fmt: skip
    if "flatness" in t:
        small, large = (rows_label(r) for r in t["flatness_rows"])
        out.append((f"dynamic flatness {large} / {small} live rows", t["flatness"], ">=",
                    TARGET_FLATNESS))  # fmt: skip
    for key, d in t.get("bytes_per_live_id", {}).items():
        out.append((f"dynamic index + metadata bytes per live id, {key}",
                    d["index_and_metadata"], "<=", TARGET_ID_BYTES))  # fmt: skip
    return out


def table_rows(t: dict[str, Any]) -> list[str]:
    """This section's lines of the bench's Markdown table."""
    out = [
        f"| dynamic | new ids created per second on one shard ({t['dim']} wide, "
        f"{t['optimizer']}; rounds {' / '.join(f'{x:,}' for x in t['insert_rounds'])}) | "
        f"{t['insert_rows_per_s']:,.0f} rows/s |"
    ]
    for key, d in t.get("bytes_per_live_id", {}).items():
        width, kind = key.split("/")
        out.append(
            f"| dynamic | {rows_label(t['id_rows'])} ids x {width} ({kind}): bytes per live id "
            f"{d['total']:.1f} = row and slots {d['row_and_slots']:.1f} + **index and metadata "
            f"{d['index_and_metadata']:.1f}** + sketch {d['sketch']:.1f} + reserved "
            f"{d['reserved']:.1f} + fallback {d['fallback']:.1f} | "
            f"**{d['index_and_metadata']:.1f}** B |"
        )
    for r, d in t.get("rss_detail", {}).items():
        out.append(
            f"| dynamic | {rows_label(int(r))} live rows x {t['dim']}: **resident memory growth "
            f"/ raw row + slot bytes** (peak {d['hwm_ratio']:.2f}) | **{d['ratio']:.2f}** |"
        )
    for r, rate in t["steps_per_s_by_live_rows"].items():
        d = t["steps_detail"][r]
        out.append(
            f"| dynamic, pinned | 1 worker, server restored with {rows_label(int(r))} live rows "
            f"x {t['steps_dim']} ({d['rows_per_step']:.0f} rows pulled a step, drawn uniformly "
            f"over them) | {rate:.2f} steps/s |"
        )
    if "flatness" in t:
        small, large = (rows_label(r) for r in t["flatness_rows"])
        out.append(
            f"| dynamic, pinned | **steps/s at {large} / at {small} live rows** | "
            f"**{t['flatness']:.2f}** |"
        )
    out += [f"| dynamic | {what} | skipped: {why} |" for what, why in t["skipped_sizes"].items()]
    return out


if __name__ == "__main__":  # [smoke|quick|full]: this section alone, as JSON
    if sys.argv[1:2] == ["child"]:  # the memory-measuring process
        child_main(int(sys.argv[2]))
    else:
        section_main("dynamic", run)
