"""``make study`` in its smoke mode: a reduced grid runs and writes valid output files.

The smoke grid, per model: MNIST with 1 and 2 workers, ``sync``, ``ssp`` and ``lookahead``
for 2, ``none`` and ``bf16``, ``lookahead`` without compression only, 30 updates, a 70 %
target; the click model (``clicks``) with the same workers and policies, no compression, 60
updates, its target the one-process AUC on the 1-worker run's batches minus 0.005; the
click model with a dense tower (``clicks-tower``) likewise; the
hashed-id model (``clicks-hashed``) with the smoke kinds its dynamic tables allow (``ssp``
and the hybrid), 40 updates, its target likewise. It exercises the same code as the full
study: the real ParameterState (row-sparse applies for the click model, dynamic tables for
the hashed one), Policy (with look-ahead pulls), GradientStep, row caches and row pulls,
Compressor and wire path in the event simulation, the tables and the plots. Only the shape
of the result is checked, plus what holds by construction.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from conftest import run_script

pytestmark = pytest.mark.slow  # slow tier: a smoke run of the whole script

ROOT = Path(__file__).resolve().parents[1]
STUDY = ROOT / "tests" / "bench" / "study.py"


@pytest.mark.timeout(180)
def test_study_smoke_writes_results_table_and_plots(tmp_path: Path) -> None:
    done = run_script(STUDY, "--smoke", "--out", str(tmp_path), timeout_s=150, what="study --smoke")
    assert done.returncode == 0, done.stderr[-4000:]

    doc = json.loads((tmp_path / "study-results.json").read_text())
    assert doc["plan_name"] == "smoke" and doc["machine"]["cores"] >= 1
    assert all(part["plan"]["name"] == "smoke" for part in doc["models"].values())
    runs = doc["runs"]
    assert len(runs) == 20 and not any("error" in r for r in runs)
    assert {(r["model"], r["workers"], r["policy"], r["compress"]) for r in runs} == {
        ("mnist", 1, "async", "none"),
        ("mnist", 1, "async", "bf16"),
        ("mnist", 2, "sync:2/2", "none"),
        ("mnist", 2, "sync:2/2", "bf16"),
        ("mnist", 2, "ssp:2", "none"),
        ("mnist", 2, "ssp:2", "bf16"),
        ("mnist", 2, "lookahead", "none"),
        ("clicks", 1, "async", "none"),
        ("clicks", 2, "sync:2/2", "none"),
        ("clicks", 2, "ssp:2", "none"),
        ("clicks", 2, "lookahead", "none"),
        ("clicks", 2, "dense=sync:2/2,rows=async", "none"),
        ("clicks-tower", 1, "async", "none"),
        ("clicks-tower", 2, "sync:2/2", "none"),
        ("clicks-tower", 2, "ssp:2", "none"),
        ("clicks-tower", 2, "lookahead", "none"),
        ("clicks-tower", 2, "dense=sync:2/2,rows=async", "none"),
        ("clicks-hashed", 1, "async", "none"),
        ("clicks-hashed", 2, "ssp:2", "none"),
        ("clicks-hashed", 2, "dense=sync:2/2,rows=async", "none"),
    }
    models = {"mnist", "clicks", "clicks-tower", "clicks-hashed"}
    assert set(doc["models"]) == set(doc["summary"]) == models
    for model, updates in (("clicks", 60), ("clicks-tower", 60), ("clicks-hashed", 40)):
        part = doc["models"][model]
        reference = part["one_process"]
        assert 0.5 < reference["auc"] <= 1.0 and reference["updates"] == updates
        assert reference["optimizer"] == part["optimizer"] == "lazy_adam"
        assert part["plan"]["target"] == pytest.approx(reference["auc"] - 0.005, abs=1e-5)
        assert doc["summary"][model]["target"] == part["plan"]["target"]
    sizes = {m: doc["models"][m]["model"] for m in doc["models"]}
    assert not sizes["mnist"]["dynamic_tables"] and not sizes["clicks"]["dynamic_tables"]
    assert sizes["clicks-hashed"]["dynamic_tables"]  # its rows: no declared count
    assert sizes["clicks-hashed"]["parameters"] < sizes["clicks"]["parameters"]
    assert sizes["clicks-tower"]["parameters"] == sizes["clicks"]["parameters"] - 4 + 5_249
    hashed = [r for r in runs if r["model"] == "clicks-hashed"]
    for r in hashed:  # every gradient's batch pulled its rows from the dynamic tables
        assert r["rows_pulled"] >= r["gradients"] and r["row_bytes_pulled"] > 0
    # one worker through the wire computes what one process does: the same batches, the
    # same rows, the same server optimizer, so the same held-out AUC after as many updates
    one = next(r for r in hashed if r["workers"] == 1)
    assert one["updates"] == 40
    assert one["final_accuracy"] == pytest.approx(
        doc["models"]["clicks-hashed"]["one_process"]["auc"], abs=1e-5
    )
    for r in runs:
        assert r["curve"][0][0] == 0 and r["curve"][-1][0] == r["updates"] > 0
        assert all(0.0 <= p[3] <= 1.0 for p in r["curve"])
        c = r["policy_counters"]
        assert c["updates"] == r["updates"]
        # every gradient computed was offered, but the last one of each other worker of an
        # asynchronous policy (ssp, lookahead) may be in flight when the run stops
        in_flight = 0 if r["policy"].startswith("sync") else r["workers"] - 1
        assert c["offered"] <= r["gradients"] <= c["offered"] + in_flight
        if r["policy"].startswith("sync"):
            assert c["applied"] == 2 * c["updates"] and r["staleness_max"] == 0
        if r["policy"].startswith("ssp"):  # every gradient applied: the bound is kept by waiting
            assert c["applied"] == c["updates"] == c["offered"] and c["dropped_stale"] == 0
        if r["policy"].startswith("dense="):  # hybrid: rows at once, dense in rounds of 2
            assert c["rows_applied"] == c["offered"] == c["dense_offered"]
            assert c["dense_applied"] == 2 * c["dense_updates"] > 0
            assert c["updates"] == c["rows_updates"] + c["dense_updates"]
        if r["policy"] == "lookahead":  # pulls were served extrapolated once tau was measured
            assert c["applied"] == c["updates"] and c["extrapolated"] > 0
        expected = 2.0 if r["compress"] == "bf16" else 1.0  # only MNIST runs bf16
        assert r["bytes_ratio"] == pytest.approx(expected, abs=0.02)
    # the speed-up columns, on every row: 1 worker's simulated time over the row's (same
    # model and compression), and the gradients computed to the target over 1 worker's
    base = {(r["model"], r["compress"]): r for r in runs if r["workers"] == 1}
    for r in runs:
        keys = ("model", "workers", "policy", "compress", "sim_seconds_to_target", "speedup")
        assert all(k in r for k in (*keys, "gradients_vs_1w")), r["policy"]
        b = base[(r["model"], r["compress"])]
        if not r["reached"]:
            assert r["speedup"] is None and r["gradients_vs_1w"] is None
            continue
        assert math.isfinite(r["sim_seconds_to_target"]) and r["sim_seconds_to_target"] > 0
        assert math.isfinite(r["speedup"]) and math.isfinite(r["gradients_vs_1w"])
        assert r["speedup"] == pytest.approx(
            b["sim_seconds_to_target"] / r["sim_seconds_to_target"], rel=2e-3
        )
        assert r["gradients_vs_1w"] == pytest.approx(
            r["gradients_to_target"] / b["gradients_to_target"], rel=2e-3
        )
        if r["workers"] == 1:
            assert r["speedup"] == r["gradients_vs_1w"] == 1.0
    assert all("target_met" in summary for summary in doc["summary"].values())
    # one worker: staleness is always 0, so every policy is this same run
    assert all(r["staleness_max"] == 0 for r in runs if r["workers"] == 1)
    assert doc["summary"]["mnist"]["bf16_bytes_ratio"] == pytest.approx(2.0, abs=0.02)

    table = (tmp_path / "study.md").read_text()
    n = len(models)  # a section per model; MNIST's 1-worker rows: one per compression
    assert table.count("| workers | policy | compress | updates to target |") == n
    assert table.count("| sim. s | speed-up | gradients x 1w |") == n
    assert table.count("Wall-clock speed-up, no compression") == n
    assert table.count("\n| 1 | any (all identical) |") == n + 1
    assert table.count("\n## ") == n and "simulated seconds to AUC " in table
    assert len(doc["pngs"]) == 2 * n
    for png in doc["pngs"]:
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
