"""Which byte-saving pull settings are free in convergence: the study's fetch grid.

``python tests/bench/study_fetch.py --out runs/study-fetch`` runs ``study.simulate`` (the
convergence study's event simulation, MNIST-5k study CNN, Adam 1e-3, target 96 %) for 1, 4
and 8 workers under ``async``, once per fetch setting (``fetch_sim``: ``every``,
``n-fetch:2``, ``n-fetch:4``, ``bf16``, ``adaptive:B``) and simulation seed. Each run stops
at the target or at the caps. Writes ``fetch-results.json`` (``runs``: every run's record
with ``fetch``, ``seed``, ``bytes_pulled``, ``bytes_pulled_to_target``, ``pulls_skipped``
...; ``settings``: per worker count and setting, updates, gradients and bytes pulled to the
target over ``every``'s) and ``fetch.md`` (the table). ``--model`` runs another study model
(``MODEL_TEXT``); for ``clicks-hashed`` the bytes pulled to the target include the rows'
(``row_bytes_pulled``), which its workers pull by id.

A setting is compared with ``every`` at the same worker count over the same seeds: the
ratio of the summed updates (gradients, bytes) to the target. It is marked free when that
updates ratio is <= 1.05 at every worker count and every one of its runs reached the target.
The seed-to-seed spread of ``every`` itself is in the table: a difference under it is noise.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import study

FETCHES = ("every", "n-fetch:2", "n-fetch:4", "bf16", "adaptive:0.01", "adaptive:0.03")
MODEL_TEXT = {
    "mnist": "study CNN on MNIST-5k, Adam, batch 50",
    "clicks": "the fixed-id click model (downpour.examples.recsys), server lazy_adam, batch "
    "256; its simulated workers pull the whole model, where real ones pull rows",
    "clicks-tower": "the click model's tables under a dense tower (downpour.examples.recsys:"
    "tower), server lazy_adam, batch 256; its simulated workers pull the whole model",
    "clicks-hashed": "the hashed-id click model (downpour.examples.recsys_hashed), its tables "
    "in the server's dynamic tables, server lazy_adam, batch 256; each simulated worker has its "
    "own row caches and pulls its batches' rows by id with every pull, as real ones do",
}
FREE_UPDATES = 1.05  # at most 5 % more updates to the target than ``every``


def jobs_for(args: argparse.Namespace, costs: dict[str, float]) -> list[study.Job]:
    """One run per worker count, fetch setting and seed; the slowest (most workers) first."""
    out = [
        study.Job(
            w,
            args.policy,
            "none",
            args.lr,
            True,
            args.max_updates,
            args.max_gradients,
            args.target,
            args.eval_every,
            costs["apply_units"],
            costs["grad_s"],
            seed=seed,
            model=args.model,
            fetch=fetch,
        )
        for w in args.workers
        for fetch in args.fetch
        for seed in args.seeds
    ]
    return sorted(out, key=lambda j: -j.workers)


def _ratio(runs: list[dict[str, Any]], base: list[dict[str, Any]], key: str) -> float | None:
    if not runs or any(r[key] is None for r in runs + base) or not sum(r[key] for r in base):
        return None
    return round(sum(r[key] for r in runs) / sum(r[key] for r in base), 3)


def compare(runs: list[dict[str, Any]], fetches: list[str]) -> list[dict[str, Any]]:
    """Per worker count and fetch setting: its runs against ``every``'s over the seeds both
    reached the target in (``*_vs_every``: ratios of the sums), and the counts."""
    ok = [r for r in runs if "error" not in r]
    out = []
    for w in sorted({r["workers"] for r in ok}):
        every = {r["seed"]: r for r in ok if r["workers"] == w and r["fetch"] == "every"}
        for fetch in fetches:
            mine = [r for r in ok if r["workers"] == w and r["fetch"] == fetch]
            pairs = [(r, every[r["seed"]]) for r in mine if r["seed"] in every]
            both = [(r, b) for r, b in pairs if r["reached"] and b["reached"]]
            a, b = [p[0] for p in both], [p[1] for p in both]
            out.append(
                {
                    "workers": w,
                    "fetch": fetch,
                    "seeds": sorted(r["seed"] for r in mine),
                    "reached": sum(r["reached"] for r in mine),
                    "updates_to_target": [r["updates_to_target"] for r in mine],
                    "updates_vs_every": _ratio(a, b, "updates_to_target"),
                    "gradients_vs_every": _ratio(a, b, "gradients_to_target"),
                    "bytes_vs_every": _ratio(a, b, "bytes_pulled_to_target"),
                    "per_seed_updates_vs_every": [
                        round(r["updates_to_target"] / e["updates_to_target"], 3) for r, e in both
                    ],
                    "pulls_skipped": sum(r["pulls_skipped"] for r in mine),
                    "pull_requests": sum(r["pull_requests"] for r in mine),
                }
            )
    return out


def free_settings(rows: list[dict[str, Any]], workers: list[int]) -> dict[str, bool]:
    """Per fetch setting: within ``FREE_UPDATES`` of ``every`` at every worker count, every
    run reaching the target."""
    free: dict[str, bool] = {}
    for row in rows:
        ok = (
            row["reached"] == len(row["seeds"]) > 0
            and row["updates_vs_every"] is not None
            and row["updates_vs_every"] <= FREE_UPDATES
        )
        free[row["fetch"]] = free.get(row["fetch"], True) and ok
    for fetch in free:
        have = {r["workers"] for r in rows if r["fetch"] == fetch}
        free[fetch] = free[fetch] and have >= set(workers)
    return free


def _cell(v: float | None) -> str:
    return "—" if v is None else f"{v:.2f}"


def markdown(doc: dict[str, Any]) -> str:
    """fetch.md: how it ran, the table, the seed spread of ``every``."""
    rows, ws, free = doc["settings"], doc["args"]["workers"], doc["free"]
    a = doc["args"]
    lines = [
        f"# Fetch settings in the convergence study, {doc['date']}",
        "",
        f"Machine: {doc['machine']['summary']}. Model: {MODEL_TEXT[a.get('model', 'mnist')]}, "
        f"lr {a['lr']:g}, policy {a['policy']}, target {a['target']:.4g} held-out "
        f"{'accuracy' if a.get('model', 'mnist') == 'mnist' else 'AUC'} evaluated every "
        f'{a["eval_every"]} updates (the granularity of "updates to target"), caps '
        f"{a['max_updates']} updates / {a['max_gradients']} gradients. "
        f"Seeds {', '.join(map(str, a['seeds']))} (data order and worker speeds). Costs: "
        f"{doc['costs']['grad_ms']} ms per gradient, {doc['costs']['apply_ms']} ms per apply. "
        f"Command: `{doc['command']}` ({doc['total_seconds'] / 60:.1f} min).",
        "",
        "Each cell: updates to the target x `every`'s at that worker count (sum over the seeds "
        "both reached it) / bytes pulled to the target x `every`'s. Free: <= "
        f"{FREE_UPDATES:.2f}x the updates at every worker count, every run reaching the target.",
        "",
        "| fetch | "
        + " | ".join(f"{w} worker{'s' * (w > 1)}: updates / bytes" for w in ws)
        + " | free |",
        "|---|" + "---:|" * len(ws) + "---|",
    ]
    for fetch in a["fetch"]:
        cells = []
        for w in ws:
            r = next((r for r in rows if r["workers"] == w and r["fetch"] == fetch), None)
            if r is None:
                cells.append("—")
                continue
            miss = len(r["seeds"]) - r["reached"]
            note = f" ({miss} not reached)" if miss else ""
            cells.append(f"{_cell(r['updates_vs_every'])} / {_cell(r['bytes_vs_every'])}{note}")
        lines.append(f"| {fetch} | " + " | ".join(cells) + f" | {'yes' if free[fetch] else 'no'} |")
    lines += ["", "Updates to the target per seed (the noise):", ""]
    lines += ["| fetch | " + " | ".join(f"{w}w" for w in ws) + " |", "|---|" + "---:|" * len(ws)]
    for fetch in a["fetch"]:
        cells = []
        for w in ws:
            r = next((r for r in rows if r["workers"] == w and r["fetch"] == fetch), None)
            got = r["updates_to_target"] if r else []
            cells.append(", ".join("—" if u is None else str(u) for u in got))
        lines.append(f"| {fetch} | " + " | ".join(cells) + " |")
    skipped = [r for r in rows if r["pulls_skipped"]]
    if skipped:
        lines += ["", 'Adaptive pulls answered "unchanged" (skipped / requests, all seeds):', ""]
        lines += [
            f"- {r['fetch']} at {r['workers']}w: {r['pulls_skipped']} / {r['pull_requests']}"
            for r in skipped
        ]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="runs/study-fetch", help="output directory")
    p.add_argument("--workers", default="1,4,8", help="worker counts")
    p.add_argument("--fetch", default=",".join(FETCHES), help="fetch settings (every first)")
    p.add_argument("--seeds", default="0,1,2", help="simulation seeds")
    p.add_argument("--policy", default="async")
    p.add_argument(
        "--model",
        default="mnist",
        choices=tuple(MODEL_TEXT),
        help="the study model (clicks, clicks-tower, clicks-hashed: give --lr 0.01 and the "
        "study's --target AUC)",
    )
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--target", type=float, default=0.96)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--max-updates", type=int, default=1500, help="cap per run")
    p.add_argument("--max-gradients", type=int, default=3000, help="cap per run")
    p.add_argument("--jobs", type=int, default=2, help="runs at a time (1: in this process)")
    p.add_argument(
        "--costs",
        metavar="GRAD_MS,APPLY_MS",
        help="costs of one gradient and one apply instead of measuring them now",
    )
    args = p.parse_args(argv)
    args.workers = [int(w) for w in args.workers.split(",")]
    args.fetch = args.fetch.split(",")
    args.seeds = [int(s) for s in args.seeds.split(",")]
    if args.fetch[0] != "every":
        p.error("--fetch must start with every (the settings are compared with it)")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the grid; write fetch-results.json and fetch.md into --out."""
    args = parse_args(argv)
    from fetch_sim import parse_fetch

    for f in args.fetch:
        parse_fetch(f)  # a typo fails now, not in every run
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    study._init_process()
    from bench_util import machine

    host = machine()
    if args.costs:
        grad_ms, apply_ms = (float(x) for x in args.costs.split(","))
        costs = {"grad_ms": grad_ms, "apply_ms": apply_ms, "apply_units": apply_ms / grad_ms}
        costs["grad_s"] = grad_ms / 1e3
    else:
        costs = study.measure_costs(model=args.model)
    jobs = jobs_for(args, costs)
    study.log(f"{len(jobs)} fetch runs, {args.jobs} at a time; costs {costs}")
    runs = study.run_grid(args.jobs, jobs)
    rows = compare(runs, args.fetch)
    doc: dict[str, Any] = {
        "study": "fetch settings",
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "command": "python tests/bench/study_fetch.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": host,
        "args": {k: v for k, v in vars(args).items() if k != "out"},
        "costs": costs,
        "settings": rows,
        "free": free_settings(rows, args.workers),
        "runs": runs,
    }
    doc["total_seconds"] = round(time.monotonic() - started, 1)
    (out / "fetch-results.json").write_text(json.dumps(doc, indent=1))
    (out / "fetch.md").write_text(markdown(doc))
    study.log(f"wrote {out}/fetch-results.json and fetch.md; free: {doc['free']}")
    return 1 if any("error" in r for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
