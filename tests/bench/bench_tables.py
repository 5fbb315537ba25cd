"""Tables section: what a shard of a big embedding table holds in memory, and how long it starts.

The model is ``sparse_model:rows_10m_x64``: a 10,000,000 x 64 float32 table (2.56 GB) and a
small dense head (the smoke plan: ``rows_1m_x64``, 1,000,000 x 64). Servers run
``--optimizer adagrad``: one accumulator per variable, so a shard's slots are as many bytes as
its slice. Each round, on emulated hosts (shard ``i`` on core ``i mod cores``, ``bench_util``):

1. 2 shards of the table started at the same time, with nothing else running: each one's
   peak resident set (``VmHWM``) once it is ready, and the seconds from its process's start to
   its ready file (``--ready-file``: written once the sockets are bound, i.e. when it serves);
2. 4 shards started at the same time, each one's VmHWM once ready, and beside them the
   TensorFlow process baseline: a ``downpour server`` of ``sparse_model:rows_20k`` (a 1.3 MB
   table) started the same way, its VmHWM once ready (a process's own peak does not depend on
   what else runs beside it).

Each set is stopped before the next starts. The slice's bytes are the shard's ``shard_bytes``
(status document).

Keys (``tables``):

* ``shard_rss_ratio_2``, ``shard_rss_ratio_4``: the largest over shards and rounds of
  (shard VmHWM - baseline) / (slice bytes + slot bytes) at 2 and 4 shards (target <= 1.5);
* ``shard_start_s``: seconds from process start to ready of a shard of the table started with
  the other of 2 (the slower of the two; the median over rounds);
* per round and shard: ``detail``; the baseline of each round: ``baseline_mib``.

* ``reshard_s_per_gb``: seconds per GB of state (weights and slots) to restore a checkpoint of
  the table written by 2 shards onto 3 (``reshard_figures``), and ``reshard_s`` the seconds.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench_sparse import rows_label
from bench_util import (
    Procs,
    host_cpus,
    log,
    median,
    meminfo_mib,
    section_main,
    server_ready,
    start_server,
)
from bench_util import status_endpoint as endpoint_of

from downpour.net.client import fetch_status
from downpour.runtime.metrics import peak_rss_mib

OPTIMIZER = {"optimizer": "adagrad", "lr": 0.05}
ADAGRAD_SLOTS = 1  # accumulators per variable: a shard's slots are 1 x its slice
BASELINE_MODEL = "sparse_model:rows_20k"
MODELS = {1_000_000: "sparse_model:rows_1m_x64", 10_000_000: "sparse_model:rows_10m_x64"}
DIM = 64
SHARD_COUNTS = (2, 4)
RESHARD = (2, 3)  # a checkpoint of 2 shards restored onto 3
CHECKPOINT_TIMEOUT_S = 300.0  # a stopping shard writes its slice and slots
START_TIMEOUT_S = 600.0  # import, the table declared, a slice filled, on a loaded machine
TARGET_RATIO = 1.5
# More than each set needs, in MiB of MemAvailable (a TensorFlow process is under 1 GiB): the
# section says it skipped rather than push the machine into swap or the OOM killer.
TF_PROCESS_MIB = 1024


@dataclass(frozen=True)
class TablesPlan:
    """The table and how many rounds of one bench plan."""

    rows: int
    rounds: int


PLANS = {  # ``make bench QUICK=1`` skips the section; quick is for running it alone
    "smoke": TablesPlan(1_000_000, 1),
    "quick": TablesPlan(10_000_000, 1),
    "full": TablesPlan(10_000_000, 2),
}


@dataclass
class Started:
    """A server being started: its process, ready file and wall-clock start."""

    proc: Any
    ready: Path
    t0: float


def start(procs: Procs, name: str, model: str, *args: int, core: int, **more: Any) -> Started:
    """Start a server (``--shard I --num-shards N`` when ``args`` is (I, N); ``more``
    settings by name) on emulated host ``core``, without waiting for it."""
    settings: dict[str, Any] = {"model": model, **OPTIMIZER, **more}
    if args:
        settings |= {"shard": args[0], "num_shards": args[1]}
    t0 = time.time()  # the ready file's mtime is on the same (wall) clock
    proc, pending = start_server(procs, name, wait=False, settings=settings, cpus=host_cpus(core))
    return Started(proc, Path(pending["ready_file"]), t0)


def ready_figures(procs: Procs, s: Started) -> dict[str, Any]:
    """Once ``s`` is ready: its VmHWM (MiB), seconds from start to ready, status document."""
    info = server_ready(procs, s.proc, s.ready, START_TIMEOUT_S)
    peak = peak_rss_mib(s.proc.pid)
    if peak is None:
        raise RuntimeError(f"tables: no VmHWM for server pid {s.proc.pid}")
    return {
        "vmhwm_mib": peak,
        "start_s": s.ready.stat().st_mtime - s.t0,
        "doc": fetch_status(endpoint_of(info), timeout_s=30.0),
    }


def shard_set(
    procs: Procs, rows: int, n: int, with_baseline: bool
) -> tuple[list[dict[str, Any]], float | None]:
    """``n`` shards of the ``rows`` table started at the same time: per shard its VmHWM,
    slice and slot bytes and seconds to ready. ``with_baseline``: the baseline server (a
    1.3 MB model, the same options) starts beside them, and its VmHWM at ready is returned
    too (a process's own peak does not depend on what else runs; its start is not timed)."""
    started = [start(procs, f"tables-{n}-shard-{i}", MODELS[rows], i, n, core=i) for i in range(n)]
    if with_baseline:
        started.append(start(procs, "tables-baseline", BASELINE_MODEL, core=n))
    shards = []
    try:
        for i, s in enumerate(started[:n]):
            got = ready_figures(procs, s)
            slice_bytes = int(got["doc"]["shard_bytes"])
            shards.append({
                "shard": i,
                "vmhwm_mib": round(got["vmhwm_mib"], 1),
                "slice_bytes": slice_bytes,
                "slot_bytes": slice_bytes * ADAGRAD_SLOTS,
                "start_s": round(got["start_s"], 2),
            })  # fmt: skip
        baseline = ready_figures(procs, started[n])["vmhwm_mib"] if with_baseline else None
    finally:
        for s in started:  # all at once: each takes a second or two to shut TensorFlow down
            s.proc.terminate()
        for s in started:
            procs.stop(s.proc)
    return shards, baseline


def memory_needed_mib(rows: int) -> float:
    """What the larger set needs at once: 4 shards and the baseline, each a TensorFlow
    process, and between the shards the whole table and its slots."""
    return TF_PROCESS_MIB * (max(SHARD_COUNTS) + 1) + rows * DIM * 4 * (1 + ADAGRAD_SLOTS) / 2**20


def reshard_figures(procs: Procs, rows: int) -> dict[str, float]:
    """``reshard_s_per_gb``: 2 shards of the ``rows`` table with a ``--state-dir`` each,
    stopped (each writes its final checkpoint: its slice and its Adagrad slots), then 3
    shards started at once with ``--restore-from`` those two directories; the slowest new
    shard's ``restore_s`` (status: finding, reading, checking and assigning its rows of the
    weights and slots) over the GB of the whole state (the table's weights and slots). The
    checkpoints are removed afterwards."""
    root = procs.logdir / "tables-reshard"
    shutil.rmtree(root, ignore_errors=True)
    old = [root / f"shard-{i}" for i in range(RESHARD[0])]
    writers = [
        start(procs, f"tables-ckpt-{i}", MODELS[rows], i, RESHARD[0], core=i, state_dir=str(d))
        for i, d in enumerate(old)
    ]
    try:
        for w in writers:
            server_ready(procs, w.proc, w.ready, START_TIMEOUT_S)
        for w in writers:  # SIGTERM (once: a second one kills): the final checkpoint, exit 0
            w.proc.terminate()
        codes = [w.proc.wait(timeout=CHECKPOINT_TIMEOUT_S) for w in writers]
        if codes != [0] * len(writers):
            raise RuntimeError(f"tables: the checkpointing shards exited with {codes}")
        restore_from = ",".join(str(d) for d in old)
        new = [
            start(procs, f"tables-restore-{i}", MODELS[rows], i, RESHARD[1], core=i,
                  state_dir=str(root / f"new-{i}"), restore_from=restore_from)
            for i in range(RESHARD[1])
        ]  # fmt: skip
        try:
            docs = [ready_figures(procs, s)["doc"] for s in new]
        finally:
            for s in new:  # killed: their own final checkpoints are not what is measured
                s.proc.kill()
            for s in new:
                procs.stop(s.proc)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    seconds = max(float(d["restore_s"]) for d in docs)
    state_gb = rows * DIM * 4 * (1 + ADAGRAD_SLOTS) / 1e9
    log(f"tables: {RESHARD[0]} -> {RESHARD[1]} shards: {seconds:.1f} s for {state_gb:.2f} GB")
    return {"reshard_s_per_gb": seconds / state_gb, "reshard_s": seconds}


def run(plan_name: str, procs: Procs) -> dict[str, Any]:
    """The ``tables`` keys (see the module) under the bench plan ``plan_name``."""
    plan = PLANS[plan_name]
    need, have = memory_needed_mib(plan.rows), meminfo_mib("MemAvailable")
    if have < need:
        reason = f"{have:.0f} MiB available, the {plan.rows:,}-row table's 4 shards need {need:.0f}"
        log(f"tables: skipped: {reason}")
        return {"skipped": reason}
    baselines: list[float] = []
    rounds: list[dict[str, list[dict[str, Any]]]] = []
    for r in range(plan.rounds):
        log(f"tables: round {r + 1}/{plan.rounds}: {plan.rows:,} x {DIM} table, 2 shards at once")
        two, _ = shard_set(procs, plan.rows, 2, with_baseline=False)  # timed: nothing beside
        log("tables: 4 shards and the baseline server at once")
        four, baseline = shard_set(procs, plan.rows, 4, with_baseline=True)
        assert baseline is not None
        baselines.append(baseline)
        for s in two + four:
            s["ratio"] = (s["vmhwm_mib"] - baseline) * 2**20 / (s["slice_bytes"] + s["slot_bytes"])
        rounds.append({"2": two, "4": four})
    result: dict[str, Any] = {
        f"shard_rss_ratio_{n}": max(s["ratio"] for sets in rounds for s in sets[str(n)])
        for n in SHARD_COUNTS
    }
    result["shard_start_s"] = median([max(s["start_s"] for s in sets["2"]) for sets in rounds])
    result |= reshard_figures(procs, plan.rows)
    return result | {
        "rows": plan.rows,
        "dim": DIM,
        "optimizer": OPTIMIZER["optimizer"],
        "baseline_mib": baselines,
        "detail": rounds,
    }


def targets(t: dict[str, Any]) -> list[tuple[str, float, str, float]]:
    """The issue's targets of this section: (name, value, op, bound) rows for ``bench.targets``
    (none when the section was skipped)."""
    if "skipped" in t:
        return []
    return [
        (f"tables shard_rss_ratio_{n}", t[f"shard_rss_ratio_{n}"], "<=", TARGET_RATIO)
        for n in SHARD_COUNTS
    ]


def table_rows(t: dict[str, Any]) -> list[str]:
    """This section's lines of the bench's Markdown table."""
    if "skipped" in t:
        return [f"| tables | skipped | {t['skipped']} |"]
    table = f"{rows_label(t['rows'])} x {t['dim']} table, {t['optimizer']}"
    last = t["detail"][-1]
    out = [
        f"| tables | TF process baseline (VmHWM at ready of a server of a 1.3 MB model) | "
        f"{', '.join(f'{b:.0f}' for b in t['baseline_mib'])} MiB |"
    ]
    for n in SHARD_COUNTS:
        shards = last[str(n)]
        each = ", ".join(f"{s['vmhwm_mib']:.0f}" for s in shards)
        held = shards[0]["slice_bytes"] + shards[0]["slot_bytes"]
        out.append(
            f"| tables | {table}, {n} shards started at once: VmHWM per shard {each} MiB (last "
            f"round), slice + slots {held / 2**20:.0f} MiB each; **(VmHWM - baseline) / "
            f"(slice + slots)**, the largest | **{t[f'shard_rss_ratio_{n}']:.2f}** |"
        )
    out.append(
        f"| tables | {table}, seconds from process start to ready, 2 shards at once (the "
        f"slower) | {t['shard_start_s']:.1f} s |"
    )
    out.append(
        f"| tables | {table}: a checkpoint of 2 shards restored onto 3 (the slowest new shard's "
        f"restore), seconds per GB of weights and slots | {t['reshard_s_per_gb']:.2f} s/GB "
        f"({t['reshard_s']:.1f} s) |"
    )
    return out


if __name__ == "__main__":  # [smoke|quick|full]: this section alone, as JSON
    section_main("tables", run)
