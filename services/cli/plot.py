"""``downpour plot RUN_DIR``: PNG plots of a run (matplotlib, Agg backend).

Reads what ``downpour run-local`` writes into a run directory and writes, next to it:

- ``training.png``  from ``history.csv``: training loss and the held-out metric over time (the
  metric is the ``eval_<name>`` column: ``accuracy`` by default, ``auc`` for an AUC model)
- ``staleness.png`` from ``status.json``: the histogram of gradient staleness over the run
- ``throughput.png`` from ``workers.csv`` (and ``history.csv``): steps/s per worker and the
  server's updates/s over time

A plot whose input file is missing is skipped (``plot_run`` returns the files it wrote).
"""

from __future__ import annotations

import csv
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any


def _floats(rows: list[dict[str, str]], key: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for r in rows:
        v = r.get(key)
        if v not in (None, "", "None"):
            xs.append(float(r["t"]))
            ys.append(float(v))
    return xs, ys


def _metric_name(rows: list[dict[str, str]]) -> str:
    """The held-out metric's name: the ``eval_<name>`` column beside ``eval_version``."""
    for key in rows[0] if rows else ():
        if key.startswith("eval_") and key != "eval_version":
            return key.removeprefix("eval_")
    return "accuracy"


def _read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_training(run_dir: Path, rows: list[dict[str, str]]) -> Path:
    """``training.png``: training loss (server EWMA) and the held-out metric over time."""
    plt = _pyplot()
    metric = _metric_name(rows)
    fig, (ax_loss, ax_acc) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    ax_loss.plot(*_floats(rows, "loss"), color="tab:blue")
    ax_loss.set_ylabel("training loss (server EWMA)")
    ax_loss.set_yscale("log")
    ax_loss.grid(True, alpha=0.3)
    seen: set[str] = set()  # each server evaluation once, where run-local first saw it
    evals = [
        r for r in rows if r.get("eval_version") not in seen and not seen.add(r["eval_version"])
    ]
    xs, ys = _floats(evals, f"eval_{metric}")
    if xs:
        ax_acc.plot(xs, ys, color="tab:olive", label="server --eval-every")
    ax_acc.plot(
        *_floats(rows, metric), marker="o", ls="-", color="tab:green", label="run-local pull"
    )
    if xs:
        ax_acc.legend(loc="lower right")
    ax_acc.set_ylabel(f"held-out {metric}")
    ax_acc.set_xlabel("seconds since the workers started")
    ax_acc.set_ylim(0, 1.02)  # a line at 1.0 stays visible
    ax_acc.grid(True, alpha=0.3)
    fig.suptitle(f"downpour run {run_dir.name}")
    fig.tight_layout()
    out = run_dir / "training.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def plot_staleness(run_dir: Path, doc: dict[str, Any]) -> Path:
    """``staleness.png``: how many updates were applied at each staleness (status buckets)."""
    plt = _pyplot()
    st = doc.get("staleness") or {}
    buckets = st.get("buckets") or []
    labels, counts, lower = [], [], None
    for bound, count in buckets:
        if bound == "+Inf":
            labels.append(f">{lower:g}" if lower is not None else "any")
        elif lower is None or bound - lower <= 1:
            labels.append(f"{bound:g}")
        else:
            labels.append(f"{lower + 1:g}-{bound:g}")
        counts.append(count)
        lower = bound if bound != "+Inf" else lower
    # drop the empty tail so the bars that matter are readable
    while len(counts) > 1 and counts[-1] == 0:
        labels.pop()
        counts.pop()
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar(range(len(counts)), counts, color="tab:orange")
    ax.set_xticks(range(len(counts)), labels)
    ax.set_xlabel("staleness (server version at apply - version the gradient was computed on)")
    ax.set_ylabel("updates applied")
    ax.grid(True, axis="y", alpha=0.3)
    ax.set_title(
        f"gradient staleness over {st.get('count', 0)} updates: mean {st.get('mean', 0):.2f}, "
        f"max {st.get('max', 0):g}"
    )
    fig.tight_layout()
    out = run_dir / "staleness.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def plot_throughput(
    run_dir: Path, worker_rows: list[dict[str, str]], history: list[dict[str, str]]
) -> Path:
    """``throughput.png``: each worker's steps/s and the server's updates/s over time."""
    plt = _pyplot()
    series: dict[str, list[dict[str, str]]] = defaultdict(list)
    for r in worker_rows:
        series[r["worker"]].append(r)
    fig, ax = plt.subplots(figsize=(8, 4))
    for wid, rows in sorted(series.items()):
        ax.plot(*_floats(rows, "steps_per_s"), label=f"{wid} steps/s")
    xs, ys = _floats(history, "updates_per_s")
    if xs:
        ax.plot(xs, ys, color="black", ls="--", label="server updates/s")
    ax.set_xlabel("seconds since the workers started")
    ax.set_ylabel("per second (10 s window)")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower right", fontsize="small")
    ax.set_title("throughput per worker")
    fig.tight_layout()
    out = run_dir / "throughput.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def plot_run(run_dir: str | Path) -> list[Path]:
    """Write every plot whose data is in ``run_dir``; return the paths written."""
    run_dir = Path(run_dir)
    history = _read_csv(run_dir / "history.csv") if (run_dir / "history.csv").exists() else []
    written = []
    if history:
        written.append(plot_training(run_dir, history))
    if (run_dir / "status.json").exists():
        written.append(plot_staleness(run_dir, json.loads((run_dir / "status.json").read_text())))
    if (run_dir / "workers.csv").exists():
        written.append(plot_throughput(run_dir, _read_csv(run_dir / "workers.csv"), history))
    return written


def main(run_dir: str) -> int:
    """``downpour plot RUN_DIR``: print the PNGs written; 2 if there was nothing to plot."""
    if not Path(run_dir).is_dir():
        print(f"downpour plot: {run_dir} is not a directory", file=sys.stderr)
        return 2
    written = plot_run(run_dir)
    if not written:
        print(
            f"downpour plot: nothing to plot in {run_dir} (history.csv, status.json, workers.csv)",
            file=sys.stderr,
        )
        return 2
    for png in written:
        print(f"plot: {png}")
    return 0
