"""``make bench-curve``: what CURVE costs 1 worker end to end, over more rounds than the bench.

    .venv/bin/python tests/bench/curve_cost.py [--rounds 6] [--out curve-cost.json]

The full bench measures each end-to-end set-up in three rounds; on a 2-core machine the
CURVE-against-plaintext ratio moves by 0.1 from round to round, so this runs only the three
set-ups the CURVE cost target compares, ``rounds`` times in turn with the full plan's windows
(``bench_e2e.downpour``: the same processes, warm-up and status-socket windows):

- 1 worker + server in plaintext (the default: float32 both ways)
- the same under CURVE (keys generated for the run, every socket encrypted)
- the same under CURVE with ``--compress bf16 --pull-compress bf16`` (the lever the issue names)

Prints each round and the medians with their ratios to plaintext; writes them as JSON.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the sibling bench modules

import bench_e2e  # noqa: E402
from bench_util import PLANS, Procs, log, machine, median  # noqa: E402

FLOAT32_PULLS = {"pull_compress": "none"}  # float32 both ways, whatever the worker's default
SETUPS: dict[str, dict[str, Any]] = {
    "plaintext": {"worker_settings": FLOAT32_PULLS},
    "curve": {"curve": True, "worker_settings": FLOAT32_PULLS},
    "curve_bf16": {"curve": True, "bf16": True},
}


def run(rounds: int, logdir: Path) -> dict[str, Any]:
    """Every set-up ``rounds`` times in turn; per-round rates, medians and ratios."""
    plan = PLANS["full"]
    rates: dict[str, list[float]] = {k: [] for k in SETUPS}
    with Procs(logdir) as procs:
        for r in range(rounds):
            for name, kw in SETUPS.items():
                log(f"round {r + 1}/{rounds}: {name}")
                rates[name].append(bench_e2e.downpour(plan, procs, 1, **kw)["steps_per_s"])
            log(f"round {r + 1}: { ({k: round(v[-1], 2) for k, v in rates.items()}) }")
    med = {k: median(v) for k, v in rates.items()}
    per_round = {
        k: [c / p for c, p in zip(rates[k], rates["plaintext"], strict=True)]
        for k in ("curve", "curve_bf16")
    }
    return {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "rounds": rounds,
        "steps_per_s": rates,
        "median_steps_per_s": med,
        "ratio_curve_vs_plain": med["curve"] / med["plaintext"],
        "ratio_curve_bf16_vs_plain": med["curve_bf16"] / med["plaintext"],
        "ratio_per_round": per_round,
        "median_ratio_per_round": {k: median(v) for k, v in per_round.items()},
    }


def main(argv: list[str] | None = None) -> int:
    """Parse options, run, print, write the JSON."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=6, help="rounds of the three set-ups")
    p.add_argument("--out", default="curve-cost.json", help="where to write the JSON")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    result = run(args.rounds, Path(tempfile.mkdtemp(prefix="downpour-curve-")))
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    med, per = result["median_steps_per_s"], result["ratio_per_round"]
    print(f"\n1 worker + server, steps/s, {args.rounds} rounds ({result['date']})")
    for k, v in result["steps_per_s"].items():
        print(f"  {k:11s} median {med[k]:6.2f}   rounds {', '.join(f'{x:.2f}' for x in v)}")
    for k in ("curve", "curve_bf16"):
        ratio = result[f"ratio_{k}_vs_plain"]
        rounds = ", ".join(f"{x:.2f}" for x in per[k])
        print(f"  {k} / plaintext: {ratio:.3f} (per round {rounds})")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
