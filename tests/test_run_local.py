"""``downpour run-local`` end to end on a tiny model: the run directory has every file the
plots need, and the plots."""

from __future__ import annotations

import csv
import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, env

pytestmark = pytest.mark.slow  # slow tier: `downpour run-local` starts every service process


def test_run_local_writes_history_status_tensorboard_and_plots(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "downpour",
            "run-local",
            "--model",
            "tiny_models:tiny",
            "--workers",
            "2",
            "--steps",
            "150",
            "--server-eval-every",
            "50",
            "--no-progress",
            "--run-dir",
            str(run_dir),
        ],
        capture_output=True,
        text=True,
        env=env(),
        cwd=ROOT,
        timeout=240,
    )
    assert out.returncode == 0, out.stdout + out.stderr + (run_dir / "server.log").read_text()
    lines = out.stdout.splitlines()
    assert lines[-1].startswith("held-out accuracy: ")
    assert float(lines[-1].removeprefix("held-out accuracy: ")) > 0.9
    metrics_line = next(line for line in lines if line.startswith("metrics: http://127.0.0.1:"))
    assert metrics_line.endswith("/metrics")

    status = json.loads((run_dir / "status.json").read_text())
    assert status["updates_applied"] == 300 and set(status["workers"]) == {"worker-0", "worker-1"}
    assert status["eval"]["version"] >= 50  # the server evaluated during the run

    with open(run_dir / "history.csv", newline="") as f:
        history = list(csv.DictReader(f))
    assert {"eval_version", "eval_accuracy"} <= set(history[0])
    assert any(r["eval_accuracy"] for r in history)
    with open(run_dir / "workers.csv", newline="") as f:
        workers = list(csv.DictReader(f))
    assert {r["worker"] for r in workers} == {"worker-0", "worker-1"}
    assert any(float(r["steps_per_s"] or 0) > 0 for r in workers)

    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    for name in ("training.png", "staleness.png", "throughput.png"):
        assert (run_dir / name).stat().st_size > 10_000, name
        assert f"plot: {run_dir / name}" in lines


def test_run_local_with_two_shards_reaches_the_one_shard_bar(tmp_path: Path) -> None:
    """``--shards 2`` (``make run-local SHARDS=2``): two shard processes, the workers list
    both, and the evaluator scores the joined weights. The workers' options pass through:
    bf16 both ways here, which must not cost the bar."""
    run_dir = tmp_path / "run"
    out = subprocess.run(
        [
            sys.executable, "-m", "downpour", "run-local", "--model", "tiny_models:tiny",
            "--workers", "2", "--shards", "2", "--steps", "150", "--no-progress",
            "--compress", "bf16", "--pull-compress", "bf16",
            "--run-dir", str(run_dir),
        ],
        capture_output=True, text=True, env=env(), cwd=ROOT, timeout=240,
    )  # fmt: skip
    logs = "".join(p.read_text() for p in run_dir.glob("server-*.log"))
    assert out.returncode == 0, out.stdout + out.stderr + logs
    lines = out.stdout.splitlines()
    assert "shard 0/2: version 300, 300 updates" in out.stdout
    assert "shard 1/2: version 300, 300 updates" in out.stdout
    accuracy = float(lines[-1].removeprefix("held-out accuracy: "))
    assert accuracy > 0.9  # the bar tiny reaches with one server in the same 300 updates
    assert (run_dir / "server-0.json").exists() and (run_dir / "server-1.json").exists()
    doc = json.loads((run_dir / "status.json").read_text())  # shard 0's status at the end
    assert doc["pulls_bf16"] > 100  # the workers' pulls came in bfloat16
    for w in ("worker-0", "worker-1"):
        reported = doc["workers"][w]["reported"]
        # bf16 pushes: half the payload; with tiny's small tensors the headers are the rest
        assert reported["bytes_sent"] < 0.7 * reported["bytes_raw"], reported


def test_run_local_with_data_dispatch_runs_its_epochs_through_the_server(tmp_path: Path) -> None:
    """``--data-dispatch server``: the server dispatches, both workers take splits, and the
    run ends when the server has counted the epochs asked for, each split acknowledged
    once per epoch."""
    run_dir = tmp_path / "run"
    out = subprocess.run(
        [
            sys.executable, "-m", "downpour", "run-local", "--model", "tiny_models:tiny",
            "--workers", "2", "--epochs", "4", "--data-dispatch", "server",
            "--split-size", "64", "--no-progress", "--run-dir", str(run_dir),
        ],
        capture_output=True, text=True, env=env(), cwd=ROOT, timeout=480,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr + (run_dir / "server.log").read_text()
    doc = json.loads((run_dir / "status.json").read_text())
    d = doc["dispatch"]
    splits = -(-960 // 64)  # tiny's 960 training examples in splits of 64
    assert (d["universe"], d["splits_total"]) == ("960 elements / 64", splits)
    assert (d["epochs_done"], d["max_epochs"], d["finished"]) == (4, 4, True)
    assert (d["acked"], d["handed_out"], d["released"]) == (4 * splits, 4 * splits, 0)
    assert doc["updates_applied"] == 4 * 30  # 30 batches of 32 an epoch, between the workers
    assert all(w["steps"] > 0 for w in doc["workers"].values())  # both took splits
    assert f"dispatch: 4 epoch(s) done of 4, {4 * splits} splits acknowledged" in out.stdout
    assert float(out.stdout.splitlines()[-1].removeprefix("held-out accuracy: ")) > 0.8


def test_run_local_refuses_a_fraction_of_an_epoch_with_data_dispatch(tmp_path: Path) -> None:
    out = subprocess.run(
        [
            sys.executable, "-m", "downpour", "run-local", "--model", "tiny_models:tiny",
            "--epochs", "1.5", "--data-dispatch", "server", "--run-dir", str(tmp_path / "run"),
        ],
        capture_output=True, text=True, env=env(), cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2 and "counts whole epochs: --epochs 1.5" in out.stderr
    assert not (tmp_path / "run").exists()  # refused before anything started


def test_run_local_checkpoints_into_state_dir_and_its_export_scores_what_it_printed(
    tmp_path: Path,
) -> None:
    """``--state-dir``: the server's last checkpoint is where run-local says, and the
    ``downpour export`` command it prints turns it into a model that scores on the held-out set
    exactly what run-local printed last. The workers' ``--row-cache-rows`` and the server's
    optimizer pass through: a 100,000-row table kept as a cache of 150 rows, rows evicted."""
    run_dir, state = tmp_path / "run", tmp_path / "state"
    out = subprocess.run(
        [
            sys.executable, "-m", "downpour", "run-local", "--model", "tiny_models:big_embedding",
            "--workers", "1", "--steps", "40", "--row-cache-rows", "150",
            "--optimizer", "adagrad", "--lr", "0.5", "--state-dir", str(state),
            "--no-progress", "--run-dir", str(run_dir),
        ],
        capture_output=True, text=True, env=env(), cwd=ROOT, timeout=360,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr + (run_dir / "server.log").read_text()
    lines = out.stdout.splitlines()
    worker = next(line for line in lines if line.startswith("worker-0: 40 steps"))
    assert "row cache of 150 rows" in worker
    assert int(worker.rsplit(": ", 1)[1].removesuffix(" evictions")) > 0
    assert lines[-1].startswith("held-out accuracy: ")
    checkpoint = next(line for line in lines if line.startswith("checkpoint: "))
    assert checkpoint == f"checkpoint: {state / 'ckpt-000000000040.npz'} (version 40)"
    command = shlex.split(next(line for line in lines if line.startswith("export: "))[8:])
    assert command[:2] == ["downpour", "export"] and f"--state-dir={state}" in command
    exported = subprocess.run(
        [sys.executable, "-m", "downpour", *command[1:]],
        capture_output=True, text=True, env=env(), cwd=ROOT, timeout=240,
    )  # fmt: skip
    assert exported.returncode == 0, exported.stdout + exported.stderr
    assert exported.stdout.splitlines()[-1] == lines[-1]  # the same held-out score
    assert (run_dir / "model" / "saved_model.pb").is_file()
