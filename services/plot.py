"""``downpour plot RUN_DIR``: PNG plots of a run's history (matplotlib, Agg backend)."""

from __future__ import annotations

import csv
from pathlib import Path


def _floats(rows: list[dict[str, str]], key: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for r in rows:
        v = r.get(key)
        if v not in (None, "", "None"):
            xs.append(float(r["t"]))
            ys.append(float(v))
    return xs, ys


def plot_run(run_dir: str | Path) -> list[Path]:
    """Write ``training.png`` (loss and held-out accuracy over time); return the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    with open(run_dir / "history.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    fig, (ax_loss, ax_acc) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    ax_loss.plot(*_floats(rows, "loss"), color="tab:blue")
    ax_loss.set_ylabel("training loss (server EWMA)")
    ax_loss.set_yscale("log")
    ax_loss.grid(True, alpha=0.3)
    ax_acc.plot(*_floats(rows, "accuracy"), marker="o", color="tab:green")
    ax_acc.set_ylabel("held-out accuracy")
    ax_acc.set_xlabel("seconds since the workers started")
    ax_acc.set_ylim(0, 1)
    ax_acc.grid(True, alpha=0.3)
    fig.suptitle(f"downpour run {run_dir.name}")
    fig.tight_layout()
    out = run_dir / "training.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return [out]
