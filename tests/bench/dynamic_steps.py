"""Worker steps/s against one shard whose dynamic table holds N live rows (the ``dynamic``
section's ``steps_per_s_by_live_rows``).

For each N, in real processes:

1. a building process declares the server's state of ``dynamic_model`` (``ParameterState``,
   the server's optimizer and learning rate), creates N rows in its table by ``apply`` of
   ``fresh_ids(0, N)`` (``bench_dynamic.fill``: as pushes of new ids create them), and writes
   it to a state dir with the server's own checkpoint code (``capture_state`` through
   ``CheckpointStore.write``);
2. a ``downpour server --model dynamic_model:live_N --state-dir DIR`` (one shard, core 1)
   restores it; its status must say ``live_rows == N`` before anything is timed;
3. one ``downpour worker`` (core 0, ``--n-fetch 1``, row pulls at the current version) trains
   on batches whose ids are drawn uniformly over the N live ids: every row it pulls and
   pushes exists, at random places in the table. Its steps/s is read from the server's
   status (the worker's step count as the server records it, over the server's uptime) over
   timed windows after a warm-up (``bench_sparse.measure``): start-up and tracing excluded.
   Afterwards the table must still hold exactly N rows (no id was new).

The server is then killed (its final checkpoint, the whole table again, is not needed) and the
state dir removed.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench_sparse import measure, rows_label
from bench_util import (
    Procs,
    host_cpus,
    log,
    server_ready,
    service_args,
    start_server,
)
from bench_util import status_endpoint as endpoint_of
from dynamic_model import ADMIT_AFTER, DIM, LAYER

from downpour.net.client import fetch_status

OPTIMIZER, LR = "adagrad", 0.05
TABLE = f"{LAYER}/embeddings"  # the table's variable path: its key in the status document
MODELS = {
    100_000: "dynamic_model:live_100k",
    400_000: "dynamic_model:live_400k",
    1_000_000: "dynamic_model:live_1m",
    5_000_000: "dynamic_model:live_5m",
    20_000_000: "dynamic_model:live_20m",
}
ROW_BYTES = DIM * 4 * 2 + 8 * 4  # a row, its Adagrad slot, its id, version, count, buckets
BUILD_TIMEOUT_S = 1800.0  # 20M rows created by apply and written, on a loaded 2-core machine
RESTORE_TIMEOUT_S = 900.0  # the server's start: imports, then the checkpoint's 20M rows


@dataclass(frozen=True)
class StepsPlan:
    """Live-row counts and the timed windows at each."""

    rows: tuple[int, ...]
    warmup_steps: int
    windows: int
    window_s: float
    min_window_steps: int


def build_main(rows: int, state_dir: str) -> None:
    """In the building process: the server's state of the bench model with ``rows`` live rows,
    written as the server writes a checkpoint (see the module); one JSON line on stdout."""
    from bench_dynamic import BATCH, fill

    from downpour.checkpoints.store import CheckpointStore
    from downpour.server.checkpointing.capture import capture_state
    from downpour.server.state import ParameterState
    from downpour.spec import load_spec

    spec = load_spec(MODELS[rows])
    state = ParameterState(spec, OPTIMIZER, LR)
    table = state.tables[TABLE]
    seconds = fill(table, rows, lookups=ADMIT_AFTER)  # each id admitted at its first push
    state.version = -(-rows // BATCH)  # one version per batch of new ids, as the applies were
    arrays, meta = capture_state(state)
    t = time.perf_counter()
    path = CheckpointStore(state_dir).write(
        state.version, arrays, meta | {"model": spec.name, "model_ref": MODELS[rows]}
    )
    took = time.perf_counter() - t
    done = {"rows": len(table), "fill_s": seconds, "write_s": took, "bytes": path.stat().st_size}
    print(json.dumps(done))


def build(procs: Procs, rows: int, state_dir: Path) -> dict[str, Any]:
    """``build_main`` in its own process (bounded wait); its JSON line."""
    script = str(Path(__file__).resolve())
    args = [script, "build", str(rows), str(state_dir)]
    got = procs.run_json(args, f"dynamic-build-{rows}", timeout_s=BUILD_TIMEOUT_S)
    if got["rows"] != rows:
        raise RuntimeError(f"dynamic: the builder's table held {got['rows']} rows, not {rows}")
    log(f"dynamic: {rows:,} live rows built in {got['fill_s']:.1f} s, checkpoint of "
        f"{got['bytes'] / 2**20:.0f} MiB written in {got['write_s']:.1f} s")  # fmt: skip
    return got


def _live_rows(endpoint: str) -> int:
    return int(fetch_status(endpoint, timeout_s=30.0)["dynamic_tables"][TABLE]["live_rows"])


def steps_at(plan: StepsPlan, procs: Procs, rows: int) -> dict[str, Any]:
    """Steps/s of one worker against a server restored with ``rows`` live rows (see the
    module), with the building and restoring figures."""
    state_dir = procs.logdir / f"dynamic-state-{rows}"
    built = build(procs, rows, state_dir)
    server = None
    try:
        settings = {
            "model": MODELS[rows], "optimizer": OPTIMIZER, "lr": LR, "state_dir": str(state_dir),
            "checkpoint_every": 0, "checkpoint_secs": 0,  # no checkpoint inside a timed window
        }  # fmt: skip
        t = time.monotonic()
        server, pending = start_server(
            procs, f"dynamic-server-{rows}", wait=False, settings=settings, cpus=host_cpus(1)
        )
        info = server_ready(procs, server, Path(pending["ready_file"]), RESTORE_TIMEOUT_S)
        start_s = time.monotonic() - t
        endpoint = endpoint_of(info)
        if (live := _live_rows(endpoint)) != rows:
            raise RuntimeError(f"dynamic: the server restored {live:,} live rows, not {rows:,}")
        wid = f"dynamic-{rows}"
        args = service_args(
            "worker", server=f"127.0.0.1:{info['port']}", id=wid, model=MODELS[rows], n_fetch=1,
            steps=1_000_000, request_timeout=120.0, log_every=0, log_level="WARNING",
        )  # fmt: skip
        worker, _ = procs.start(args, wid, cpus=host_cpus(0))
        log(f"dynamic: {rows_label(rows)} live rows, 1 worker (core 0), server (core 1)")
        try:
            got = measure(
                procs, endpoint, worker, wid, plan.warmup_steps, plan.windows, plan.window_s,
                plan.min_window_steps, what="dynamic",
            )  # fmt: skip
        finally:
            procs.stop(worker)
        if (live := _live_rows(endpoint)) != rows:
            raise RuntimeError(f"dynamic: {live:,} live rows after training, not {rows:,}")
    finally:
        if server is not None and server.poll() is None:
            server.kill()  # its final checkpoint (the whole table again) is not wanted
            server.wait(timeout=30)
        shutil.rmtree(state_dir, ignore_errors=True)
    log(f"dynamic: {rows_label(rows)} live rows: {got['steps_per_s']:.2f} steps/s")
    return got | {"build": built, "server_start_s": round(start_s, 1)}


if __name__ == "__main__":  # build ROWS DIR: the building process
    if sys.argv[1:2] != ["build"]:
        sys.exit("usage: dynamic_steps.py build ROWS STATE_DIR")
    build_main(int(sys.argv[2]), sys.argv[3])
