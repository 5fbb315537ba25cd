"""``make bench`` in its quickest mode runs and writes the JSON document the issue specifies.

Only the shape of the result is checked: every required figure is present, finite and
positive. No timing target is asserted; this machine is shared and noisy, and targets are
what the bench itself reports.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
from conftest import run_script

pytestmark = pytest.mark.slow  # slow tier: a smoke run of the whole script

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "tests" / "bench" / "bench.py"

# The keys every full run reports (the smoke plan checks they are all there).
REQUIRED = {
    "wire": ["memcpy_ms", "push_decode_ms", "ratio_to_memcpy"],
    "seed_gradients": ["per_variable_ms", "one_pass_ms", "speedup"],
    "server": [
        "bare_apply_per_s",
        "server_apply_per_s",
        "ratio",
        "apply_ms",
        "apply_floor_ms",
        "pull_p50_ms",
        "pull_p99_ms",
        # the server on its own core, flooded from another
        "pinned_ratio",
        "pinned_overhead_memcpys",
        "pinned_floor_ms_per_apply",
        "pinned_floor_memcpys",
        # --pull-bound: one sample read after an apply
        "pull_bound_sample_ms",
    ],
    "end_to_end": [
        "local_steps_per_s",
        "downpour_1w_steps_per_s",
        "downpour_2w_steps_per_s",
        "tf_pss_1w_steps_per_s",
        "ratio_1w_vs_local",
        "ratio_1w_vs_tf_pss",
    ],
    # emulated hosts: worker side on core 0, server side on core 1
    "end_to_end.pinned": [
        "local_steps_per_s",
        "grad_only_steps_per_s",
        "downpour_1w_steps_per_s",
        "tf_pss_1w_steps_per_s",
        "ratio_1w_vs_local",
        "ratio_1w_vs_tf_pss",
        "ratio_to_limit",
        "overhead_vs_tf_pss",
        # the floor: the least worker against a server, the same cores
        "floor_steps_per_s",
        "floor_ratio_to_limit",
        "floor_overhead_vs_tf_pss",
    ],
    # the fetch schedule: the pinned downpour set-up with --n-fetch 4 beside --n-fetch 1
    "n_fetch_4": [
        "steps_per_s",
        "staleness_mean",
        "n_fetch_1_steps_per_s",
        "n_fetch_1_staleness_mean",
        "ratio_vs_n_fetch_1",
    ],
    # the TFRecord input pipeline against in-memory arrays, same model and step
    "input": ["memory_steps_per_s", "tfrecord_steps_per_s", "tfrecord_vs_memory"],
    "goodput": ["push_ratio_to_raw", "pull_ratio_to_raw", "pushpull_ratio_to_raw"],
    "link_1gbit": ["dense_steps_per_s", "bf16_steps_per_s", "topk_steps_per_s"],
    # row pulls of an embedding table against whole-table pulls, by table size
    "sparse": ["pull_bytes_ratio", "flatness"],
    # shards of a big table started at once: peak RSS per byte held, seconds to ready; a
    # checkpoint of 2 shards restored onto 3, seconds per GB of state
    "tables": ["shard_rss_ratio_2", "shard_rss_ratio_4", "shard_start_s", "reshard_s_per_gb"],
    # one shard's dynamic table: ids created per second, memory per live row over its raw
    # bytes, and a worker's steps/s against a server restored with N live rows, by N
    "dynamic": ["insert_rows_per_s", "bytes_per_live_row_ratio", "flatness"],
}


def figures(doc: dict, path: str) -> dict:
    """The sub-document at a dotted path of the result."""
    for part in path.split("."):
        doc = doc[part]
    return doc


@pytest.mark.timeout(660)
def test_bench_smoke_writes_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "bench-results.json"
    done = run_script(BENCH, "--smoke", "--out", str(out), timeout_s=600, what="bench --smoke")
    assert done.returncode == 0, f"bench failed:\n{done.stderr[-4000:]}"
    doc = json.loads(out.read_text())
    assert isinstance(doc["date"], str) and doc["date"]
    machine = doc["machine"]
    assert machine["cpu"] and machine["cores"] >= 1 and machine["memory_gib"] > 0
    assert machine["tensorflow"]
    # the CPU every figure was measured on: its model, and the flags a memcpy's speed rides on
    assert machine["cpu_model"] == machine["cpu"] and machine["cpu_model"] != "unknown"
    assert isinstance(machine["memcpy_flags"], list)
    assert set(machine["memcpy_flags"]) <= {"sse4_2", "avx2", "avx512f", "avx512bw", "erms", "fsrm"}
    for section in ("wire", "seed_gradients", "server", "end_to_end.pinned", "goodput", "sparse"):
        assert figures(doc, section)["cpu_model"] == machine["cpu_model"], section
    assert doc["server"]["pinned_cpu_model"] == machine["cpu_model"]  # beside the pinned figures
    assert {t["cpu_model"] for t in doc["targets"]} == {machine["cpu_model"]}
    assert "| machine | CPU model" in done.stdout and machine["cpu_model"] in done.stdout
    link_skipped = doc["link_1gbit"].get("skipped")
    for section, keys in REQUIRED.items():
        if section == "link_1gbit" and link_skipped:
            assert f"| link 1 Gbit/s | skipped | {link_skipped} |" in done.stdout  # says why
            continue
        for key in keys:
            value = figures(doc, section)[key]
            assert isinstance(value, int | float), f"{section}.{key} = {value!r}"
            assert math.isfinite(value) and value > 0, f"{section}.{key} = {value!r}"
    pulls = doc["wire"]["bf16_pulls"]  # bench's own check (rc 0 above) found them finite
    assert pulls["reps"] >= 1 and "| wire | bf16 pull, server:" in done.stdout
    assert doc["wire"]["bf16_pushes"]["reps"] >= 1 and "| wire | bf16 push, worker:" in done.stdout
    assert doc["seed_gradients"]["traces_one_pass"] == 1
    assert set(doc["seed_gradients"]["traces_per_variable"]) == {1}
    assert doc["input"]["traces"] == 1  # both feeds ran the one compiled step
    for section, key in (
        ("sparse", "steps_per_s_by_rows"),
        ("dynamic", "steps_per_s_by_live_rows"),
    ):
        by_rows = doc[section][key]
        assert len(by_rows) >= 2, by_rows  # a smallest and a largest table
        for rows, rate in by_rows.items():
            assert isinstance(rate, int | float) and math.isfinite(rate) and rate > 0, (rows, rate)
    dynamic = doc["dynamic"]
    assert not dynamic["skipped_sizes"], dynamic["skipped_sizes"]  # the smoke sizes are small
    for rows, d in dynamic["steps_detail"].items():  # a table of that many rows, rows pulled
        assert d["build"]["rows"] == int(rows) and d["rows_per_step"] > 0, (rows, d)
    # a row pull carries the batch's rows, a whole pull the table: fewer bytes a step
    assert doc["sparse"]["pull_bytes_ratio"] > 1.0
    assert "| wire |" in done.stdout  # the table was printed
    for target in (
        "pinned ratio_to_limit",
        "server pinned_overhead_memcpys",
        "goodput push",
        "sparse pull_bytes_ratio",
        "sparse flatness",
        "tables shard_rss_ratio_2",
        "tables shard_rss_ratio_4",
        "dynamic bytes_per_live_row_ratio at 1M rows",
        "dynamic flatness 400k / 100k live rows",
    ):
        assert f"| {target}" in done.stdout  # each new target is judged in the table
    assert "| server, pinned | the floor under it" in done.stdout
    # the pinned server and its floor ran in turn, once per round; each figure is a median
    srv = doc["server"]
    rounds = srv["pinned_rounds_detail"]
    assert len(rounds) == 2  # the smoke plan's pinned_server_rounds
    for r in rounds:
        assert r["server_apply_per_s"] > 0 and r["floor_ms_per_apply"] > 0, r
        assert r["beyond_floor_memcpys"] == pytest.approx(
            r["overhead_memcpys"] - r["floor_memcpys"]
        )
    mid = {k: sum(r[k] for r in rounds) / 2 for k in ("server_apply_per_s", "floor_ms_per_apply")}
    assert srv["pinned_server_apply_per_s"] == pytest.approx(mid["server_apply_per_s"])
    assert srv["pinned_floor_ms_per_apply"] == pytest.approx(mid["floor_ms_per_apply"])
    assert srv["pinned_overhead_beyond_floor_memcpys"] == pytest.approx(
        srv["pinned_overhead_memcpys"] - srv["pinned_floor_memcpys"]
    )
    assert "| e2e, pinned | the floor under it: the least worker" in done.stdout
    pinned = doc["end_to_end"]["pinned"]
    floor = pinned["detail"]["floor"]
    assert floor and all(r["grad_traces"] == 1 and r["cpus"] == floor[0]["cpus"] for r in floor)
    # the least worker loaded new weights on most steps, as a worker does from a server its
    # pushes keep moving (a pull that overtakes the last push's apply comes back unchanged)
    assert all(2 * r["pulls_with_weights"] >= r["steps"] for r in floor), floor
    assert pinned["overhead_ms"]["floor"] == pytest.approx(
        1e3 * (1 / pinned["floor_steps_per_s"] - 1 / pinned["grad_only_steps_per_s"])
    )
    assert "| link 1 Gbit/s |" in done.stdout
    assert "--n-fetch 4 / 1" in done.stdout  # the fetch schedule's row
    sys.path.insert(0, str(BENCH.parent))
    try:
        import bench
        import bench_pinned
    finally:
        sys.path.remove(str(BENCH.parent))
    # the pinned downpour set-up with the previous worker defaults, beside today's
    new = pinned["defaults"]["previous"]
    assert new["worker_settings"] == bench_pinned.PREVIOUS_DEFAULTS
    assert pinned["defaults"]["current"]["ratio_to_limit"] == pinned["ratio_to_limit"]
    for key in ("downpour_1w_steps_per_s", "ratio_to_limit", "overhead_vs_tf_pss"):
        assert math.isfinite(new[key]) and new[key] > 0, (key, new[key])
    assert f"**previous defaults** ({new['flags']}" in done.stdout
    assert f"| pinned ratio_to_limit, previous defaults ({new['flags']}) |" in done.stdout
    assert "ratio_1w_vs_local, bf16" not in done.stdout  # the smoke plan skips those set-ups

    # the full plan's extra end-to-end set-ups (bf16 both ways) reach the table and targets
    e = doc["end_to_end"]
    e["downpour_1w_bf16_steps_per_s"] = e["downpour_1w_curve_bf16_steps_per_s"] = 1.0
    e["ratio_1w_bf16_vs_local"] = e["ratio_1w_bf16_vs_tf_pss"] = 1.0
    e["ratio_1w_curve_bf16_vs_plain"] = e["ratio_1w_curve_bf16_vs_bf16"] = 1.0
    names = [t["target"] for t in bench.targets(doc)]
    assert "ratio_1w_curve_vs_plain, bf16" in names and "ratio_1w_vs_local, bf16" in names
    assert "CURVE, bf16 pushes and pulls" in bench.table({**doc, "targets": bench.targets(doc)})
