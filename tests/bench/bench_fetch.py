"""Row ``n_fetch_4``: the worker's fetch schedule at ``--n-fetch 4``, beside ``--n-fetch 1``.

The set-up of ``end_to_end.pinned``'s downpour row (a worker on core 0, its server on core 1,
the default model): that section has just measured it with ``--n-fetch 1``; this one runs it
again with ``--n-fetch 4``, same plan and windows, and reports steps/s and the mean
staleness the server measured (from the first push on) for both, with their ratio. With
``--n-fetch 4`` the worker pulls a quarter as often; its fetch schedule
(``downpour.worker.pull.schedule``) sends each pull so that it arrives just before the step that
installs it, so the weights are about as fresh as the round trip allows rather than four
steps old. The worker's own figures (how many steps ahead it requested, its pull round trip
and step time) come from its summary.
"""

from __future__ import annotations

from typing import Any

import bench_e2e
from bench_util import Plan, Procs, host_cpus, log, median


def run(plan: Plan, procs: Procs, pinned: dict[str, Any]) -> dict[str, Any]:
    """``--n-fetch 4`` pinned as ``pinned`` (the ``end_to_end.pinned`` result, n_fetch 1)
    measured its downpour row; both figures and their ratios."""
    worker, server = host_cpus(0), host_cpus(1)
    log(f"n_fetch 4: downpour, worker on core {worker}, server on core {server}")
    runs = [
        bench_e2e.downpour(
            plan,
            procs,
            1,
            server_cpus=server,
            worker_cpus=worker,
            worker_settings={"n_fetch": 4},
        )
        for _ in range(plan.pinned_rounds)
    ]
    rate = median([x["steps_per_s"] for x in runs])
    staleness = median([x["staleness_mean"] or 0.0 for x in runs])
    summaries = [s for x in runs for s in x["worker_summaries"] if s]

    def from_worker(key: str) -> float | None:
        values = [s[key] for s in summaries if s.get(key) is not None]
        return median(values) if values else None

    return {
        "steps_per_s": rate,
        "staleness_mean": staleness,
        "n_fetch_1_steps_per_s": pinned["downpour_1w_steps_per_s"],
        "n_fetch_1_staleness_mean": pinned["downpour_staleness_mean"],
        "ratio_vs_n_fetch_1": rate / pinned["downpour_1w_steps_per_s"],
        "ratio_vs_local": rate / pinned["local_steps_per_s"],
        # informative: what the worker's fetch schedule saw and chose
        "fetch_lead_steps": from_worker("fetch_lead_steps"),
        "pull_rtt_ms": from_worker("pull_rtt_ms"),
        "step_ms": from_worker("step_ms"),
        "pulls_per_step": median(
            [s["pulls"] / s["steps"] for s in summaries if s.get("steps")] or [0.0]
        ),
        "cpus": {"worker_host": worker, "server_host": server},
        "detail": runs,
    }
