"""Which byte-saving settings are free in convergence: the study's fetch grid.

``python tests/bench/study_fetch.py --out runs/study-fetch`` runs ``study.simulate`` (the
convergence study's event simulation, MNIST-5k study CNN, Adam 1e-3, target 96 %) for 1, 4
and 8 workers under ``async``, once per setting and simulation seed. A setting is a fetch
setting (``fetch_sim``: ``every``, ``n-fetch:2``, ``n-fetch:4``, ``bf16``, ``adaptive:B``)
with a push compression (``--push``: ``none``, ``bf16``, ... as ``--compress`` takes them;
named ``FETCH push:COMPRESS`` unless ``none``). Each run stops at the target or at the caps
(``--run-on``: at the caps, and the tail accuracies compare the settings at one budget).
Writes ``fetch-results.json`` (``runs``: every run's record with ``setting``, ``fetch``,
``compress``, ``seed``, ``bytes_pulled``, ``bytes_pulled_to_target``, ``pulls_skipped`` ...;
``settings``: per worker count and setting, updates, gradients and bytes pulled and pushed to
the target over the base's) and ``fetch.md`` (the table). ``--model`` runs another study
model (``MODEL_TEXT``); for ``clicks-hashed`` the bytes pulled to the target include the
rows' (``row_bytes_pulled``), which its workers pull by id.

The base is the first fetch setting with the first push compression (``every``, ``none`` by
default; ``--fetch bf16 --push none,bf16`` compares bf16 pushes with today's defaults). A
setting is compared with the base at the same worker count over the same seeds: the ratio of
the summed updates (gradients, bytes) to the target. It is marked free when that updates
ratio is <= 1.05 at every worker count and every one of its runs reached the target. The
seed-to-seed spread of the base itself is in the table: a difference under it is noise.
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
FREE_UPDATES = 1.05  # at most 5 % more updates to the target than the base


def setting_name(fetch: str, compress: str) -> str:
    """A setting's name: its fetch setting, and its push compression unless ``none``."""
    return fetch if compress == "none" else f"{fetch} push:{compress}"


def setting_of(run: dict[str, Any]) -> str:
    """The setting a run's record ran."""
    return setting_name(run["fetch"], run["compress"])


def jobs_for(args: argparse.Namespace, costs: dict[str, float]) -> list[study.Job]:
    """One run per worker count, setting and seed; the slowest (most workers) first."""
    out = [
        study.Job(
            w,
            args.policy,
            push,
            args.lr,
            not args.run_on,
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
        for push in args.push
        for seed in args.seeds
    ]
    return sorted(out, key=lambda j: -j.workers)


def _ratio(runs: list[dict[str, Any]], base: list[dict[str, Any]], key: str) -> float | None:
    if not runs or any(r[key] is None for r in runs + base) or not sum(r[key] for r in base):
        return None
    return round(sum(r[key] for r in runs) / sum(r[key] for r in base), 3)


def _pushed_to_target(run: dict[str, Any]) -> float | None:
    """Bytes pushed until the target: the run's bytes per gradient, times its gradients."""
    if run["gradients_to_target"] is None or not run["gradients"]:
        return None
    return run["gradients_to_target"] * run["bytes_sent"] / run["gradients"]


def _tail_points(pairs: list[tuple[dict[str, Any], dict[str, Any]]]) -> float | None:
    """The mean over ``pairs`` (a run, the base's run of its seed) of the tail accuracy (the
    last 5 evaluations) minus the base's, in points: a quality cost at the same budget when
    the runs went on to the caps (``--run-on``)."""
    if not pairs:
        return None
    diff = sum(r["tail_mean_accuracy"] - e["tail_mean_accuracy"] for r, e in pairs)
    return round(100 * diff / len(pairs), 3)


def compare(runs: list[dict[str, Any]], settings: list[str]) -> list[dict[str, Any]]:
    """Per worker count and setting: its runs against the base's (``settings[0]``) over the
    seeds both reached the target in (``*_vs_base``: ratios of the sums), and the counts."""
    ok = [dict(r, bytes_pushed_to_target=_pushed_to_target(r)) for r in runs if "error" not in r]
    out = []
    for w in sorted({r["workers"] for r in ok}):
        base = {r["seed"]: r for r in ok if r["workers"] == w and setting_of(r) == settings[0]}
        for setting in settings:
            mine = [r for r in ok if r["workers"] == w and setting_of(r) == setting]
            pairs = [(r, base[r["seed"]]) for r in mine if r["seed"] in base]
            both = [(r, b) for r, b in pairs if r["reached"] and b["reached"]]
            a, b = [p[0] for p in both], [p[1] for p in both]
            out.append(
                {
                    "workers": w,
                    "setting": setting,
                    "seeds": sorted(r["seed"] for r in mine),
                    "reached": sum(r["reached"] for r in mine),
                    "updates_to_target": [r["updates_to_target"] for r in mine],
                    "updates_vs_base": _ratio(a, b, "updates_to_target"),
                    "gradients_vs_base": _ratio(a, b, "gradients_to_target"),
                    "bytes_vs_base": _ratio(a, b, "bytes_pulled_to_target"),
                    "push_bytes_vs_base": _ratio(a, b, "bytes_pushed_to_target"),
                    "tail_points_vs_base": _tail_points(pairs),
                    "per_seed_updates_vs_base": [
                        round(r["updates_to_target"] / e["updates_to_target"], 3) for r, e in both
                    ],
                    "pulls_skipped": sum(r["pulls_skipped"] for r in mine),
                    "pull_requests": sum(r["pull_requests"] for r in mine),
                }
            )
    return out


def free_settings(rows: list[dict[str, Any]], workers: list[int]) -> dict[str, bool]:
    """Per setting: within ``FREE_UPDATES`` of the base at every worker count, every run
    reaching the target."""
    free: dict[str, bool] = {}
    for row in rows:
        ok = (
            row["reached"] == len(row["seeds"]) > 0
            and row["updates_vs_base"] is not None
            and row["updates_vs_base"] <= FREE_UPDATES
        )
        free[row["setting"]] = free.get(row["setting"], True) and ok
    for setting in free:
        have = {r["workers"] for r in rows if r["setting"] == setting}
        free[setting] = free[setting] and have >= set(workers)
    return free


def _cell(v: float | None) -> str:
    return "—" if v is None else f"{v:.2f}"


def markdown(doc: dict[str, Any]) -> str:
    """fetch.md: how it ran, the table, the seed spread of the base."""
    rows, ws, free = doc["settings"], doc["args"]["workers"], doc["free"]
    a, base, names = doc["args"], doc["base"], doc["setting_names"]
    pushes = a.get("push", ["none"]) != ["none"]

    def row(w: int, setting: str) -> dict[str, Any] | None:
        return next((r for r in rows if r["workers"] == w and r["setting"] == setting), None)

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
        f"Each cell: updates to the target x `{base}`'s at that worker count (sum over the "
        f"seeds both reached it) / bytes pulled to the target x `{base}`'s"
        + (" / bytes pushed to the target x its" if pushes else "")
        + f". Free: <= {FREE_UPDATES:.2f}x the updates at every worker count, every run "
        "reaching the target.",
        "",
        "| setting | "
        + " | ".join(
            f"{w} worker{'s' * (w > 1)}: updates / bytes" + (" pulled / pushed" if pushes else "")
            for w in ws
        )
        + " | free |",
        "|---|" + "---:|" * len(ws) + "---|",
    ]
    for setting in names:
        cells = []
        for w in ws:
            r = row(w, setting)
            if r is None:
                cells.append("—")
                continue
            miss = len(r["seeds"]) - r["reached"]
            note = f" ({miss} not reached)" if miss else ""
            pushed = f" / {_cell(r['push_bytes_vs_base'])}" if pushes else ""
            cells.append(
                f"{_cell(r['updates_vs_base'])} / {_cell(r['bytes_vs_base'])}{pushed}{note}"
            )
        verdict = "yes" if free[setting] else "no"
        lines.append(f"| {setting} | " + " | ".join(cells) + f" | {verdict} |")
    lines += ["", "Updates to the target per seed (the noise):", ""]
    lines += ["| setting | " + " | ".join(f"{w}w" for w in ws) + " |", "|---|" + "---:|" * len(ws)]
    for setting in names:
        cells = []
        for w in ws:
            r = row(w, setting)
            got = r["updates_to_target"] if r else []
            cells.append(", ".join("—" if u is None else str(u) for u in got))
        lines.append(f"| {setting} | " + " | ".join(cells) + " |")
    if a.get("run_on"):
        lines += [
            "",
            f"Runs went on to the caps after the target (--run-on): the tail accuracy (mean of "
            f"the last 5 evaluations) minus `{base}`'s, in points, mean over the seeds:",
            "",
            "| setting | " + " | ".join(f"{w}w" for w in ws) + " |",
            "|---|" + "---:|" * len(ws),
        ]
        for setting in names:
            cells = []
            for w in ws:
                r = row(w, setting)
                v = r["tail_points_vs_base"] if r else None
                cells.append("—" if v is None else f"{v:+.2f}")
            lines.append(f"| {setting} | " + " | ".join(cells) + " |")
    skipped = [r for r in rows if r["pulls_skipped"]]
    if skipped:
        lines += ["", 'Adaptive pulls answered "unchanged" (skipped / requests, all seeds):', ""]
        lines += [
            f"- {r['setting']} at {r['workers']}w: {r['pulls_skipped']} / {r['pull_requests']}"
            for r in skipped
        ]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="runs/study-fetch", help="output directory")
    p.add_argument("--workers", default="1,4,8", help="worker counts")
    p.add_argument(
        "--fetch", default=",".join(FETCHES), help="fetch settings (the first is the base's)"
    )
    p.add_argument(
        "--push",
        default="none",
        help="push compressions, each with every fetch setting (the first is the base's)",
    )
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
        "--run-on",
        action="store_true",
        help="runs go on to the caps after the target, so that their tail accuracy compares "
        "the settings at the same budget",
    )
    p.add_argument(
        "--costs",
        metavar="GRAD_MS,APPLY_MS",
        help="costs of one gradient and one apply instead of measuring them now",
    )
    args = p.parse_args(argv)
    args.workers = [int(w) for w in args.workers.split(",")]
    args.fetch = args.fetch.split(",")
    args.push = args.push.split(",")
    args.seeds = [int(s) for s in args.seeds.split(",")]
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the grid; write fetch-results.json and fetch.md into --out."""
    args = parse_args(argv)
    from fetch_sim import parse_fetch

    from downpour.worker.compress import parse_compression

    for f in args.fetch:
        parse_fetch(f)  # a typo fails now, not in every run
    for c in args.push:
        parse_compression(c)
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
    runs = [r if "error" in r else dict(r, setting=setting_of(r)) for r in runs]
    names = [setting_name(f, c) for f in args.fetch for c in args.push]
    rows = compare(runs, names)
    doc: dict[str, Any] = {
        "study": "fetch settings",
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "command": "python tests/bench/study_fetch.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": host,
        "args": {k: v for k, v in vars(args).items() if k != "out"},
        "costs": costs,
        "base": names[0],
        "setting_names": names,
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
