"""Single simulated study runs at one worker count, for tuning a policy outside the grid.

``python tests/bench/study_sweep.py --workers 8 --costs 44.71,1.51 --log runs/sweep.jsonl
momentum-aware@4e-4 dc-a:4 lookahead:0.5`` runs each ``POLICY[@LR]`` once with
``study.simulate`` (the same simulation as ``make study``; LR default 1e-3), prints one line
per run (updates and gradients to 96 %, final accuracy, speed-up over the 1-worker time
given by ``--base-seconds``) and appends each record (with its accuracy curve) to ``--log``;
``--table LOG`` prints such a log as a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import study


def table(log: Path) -> str:
    """A Markdown table of every record in a ``--log`` file, in the order they ran."""
    lines = [
        "| workers | policy | lr | seed | updates to 96 % | gradients to 96 % | gradients run | "
        "final acc | staleness mean | lookahead gap ratio |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for text in log.read_text().splitlines():
        r = json.loads(text)
        ok = r["reached"]
        if r.get("decay") is not None:  # runs of a prototype extrapolation, since removed
            r["policy"] += f" (prototype: EMA drift, decay {r['decay']:g})"
        lines.append(
            f"| {r['workers']} | {r['policy']} | {r['lr']:g} | {r.get('seed', 0)} | "
            f"{r['updates_to_target'] if ok else 'not reached'} | "
            f"{r['gradients_to_target'] if ok else '—'} | {r['gradients']} | "
            f"{r['final_accuracy']:.3f} | {r['staleness_mean']:.1f} | "
            f"{r.get('lookahead_gap_ratio') or '—'} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Run the given policies one after another in this process (or print ``--table``)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="*", metavar="POLICY[@LR]")
    p.add_argument("--table", type=Path, metavar="LOG", help="print a log's runs as Markdown")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--costs", default="44.71,1.51", metavar="GRAD_MS,APPLY_MS")
    p.add_argument("--max-updates", type=int, default=800)
    p.add_argument("--max-gradients", type=int, default=700)
    p.add_argument("--target", type=float, default=0.96)
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--base-seconds", type=float, default=14.2, help="1 worker's sim. seconds")
    p.add_argument("--base-gradients", type=int, default=300, help="1 worker's gradients")
    p.add_argument("--seeds", default="0", help="simulation seeds, e.g. 0,1,2 (0: the grid's)")
    p.add_argument("--log", type=Path, help="append every record (JSON lines) here")
    args = p.parse_args(argv)
    if args.table:
        print(table(args.table), end="")
        return 0
    grad_ms, apply_ms = (float(x) for x in args.costs.split(","))
    study._init_process()
    seeds = [int(x) for x in args.seeds.split(",")]
    for text, seed in [(t, s) for t in args.runs for s in seeds]:
        policy, _, lr = text.partition("@")
        job = study.Job(
            args.workers,
            policy,
            "none",
            float(lr or 1e-3),
            True,
            args.max_updates,
            args.max_gradients,
            args.target,
            args.eval_every,
            round(apply_ms / grad_ms, 2),
            grad_ms / 1e3,
            seed=seed,
        )
        r = study.simulate(job)
        r["date"] = time.strftime("%Y-%m-%d %H:%M:%S")
        r["seed"] = seed
        if r["reached"]:
            speed = args.base_seconds / r["sim_seconds_to_target"]
            grads = r["gradients_to_target"] / args.base_gradients
            got = (
                f"{r['updates_to_target']} updates, {r['gradients_to_target']} grads, "
                f"{r['sim_seconds_to_target']:.2f} s ({speed:.2f}x, {grads:.2f}x grads)"
            )
        else:
            got = "not reached"
        print(
            f"{job.workers}w {policy} lr={job.lr:g} seed {seed}: {got}; "
            f"final {r['final_accuracy']:.3f} best {r['best_accuracy']:.3f} "
            f"staleness {r['staleness_mean']:.1f} gap ratio {r['lookahead_gap_ratio']} "
            f"({r['run_seconds']} s)",
            flush=True,
        )
        if args.log:
            with args.log.open("a") as f:
                f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
