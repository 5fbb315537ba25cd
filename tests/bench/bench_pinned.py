"""Emulated hosts: every process of a set-up on its own core, as on separate machines.

Host 0 (core 0) is the worker's machine, host 1 (core 1) the server's. Each process is
started under ``taskset`` with TensorFlow's thread pools sized to its one core
(``bench_util.pinned_env``), so a worker and a server no longer compete for the same cores.

``end_to_end.pinned``, measured side by side in one run:

* local: training alone on core 0, the faster of Keras Adam (one step per call) and the
  fused ``ResourceApplyAdam`` kernel with several steps per compiled call;
* grad_only: the worker's bare gradient step alone on core 0 (the limit of a worker that
  only computes gradients);
* downpour_1w: a downpour worker on core 0 and its server on core 1;
* tf_pss_1w: TF's ParameterServerStrategy, worker task on core 0, PS task (and the
  coordinator, which only dispatches) on core 1, at its best of Keras / fused Adam and 1 /
  10 steps per ``schedule``.

``overhead_vs_tf_pss`` is downpour's time per step beyond the gradient-only step over TF's:
when the computation dominates both approach the same limit, and the overheads show what the
step-rate ratio hides.

``end_to_end.pinned.defaults``: the downpour set-up once per set of worker defaults in
``default_sets`` in every round (``current``: the worker's own defaults; ``previous``: the
settings ``PREVIOUS_DEFAULTS`` names, the defaults before the last change), each with its
own ratios against the same local, gradient-only and TF PSS figures; the section's top-level
figures are the ``current`` set's.

``end_to_end.pinned.floor_*``: the floor under the worker's overhead, measured in the same
rounds: the least worker (``pinned.py least-worker``: bf16 pulls a step ahead, the gradient
step with its bf16 rounding, pushes, nothing else) on core 0 against a real server on core 1.

``server.pinned_*``: the server on core 1 flooded by pre-encoded pushes from core 0, against
the bare compiled apply and a memcpy of the gradient list measured on core 1 in the same run,
and against the floor under its overhead: the least server (receive, decode, stage, apply;
``pinned.py receive``) on core 1 fed the same pushes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import bench_e2e
from bench_util import (
    Plan,
    Procs,
    cpu_model,
    host_cpus,
    log,
    median,
    start_server,
    wait_ready,
)

HERE = Path(__file__).resolve().parent
FUSED_STEPS = 10  # steps per compiled call of fused local training, per TF PSS schedule
OVERHEAD_FLOOR = 1e-3  # an overhead below 0.1 % of the gradient step counts as that (noise)
# The worker settings (by name) measured beside the worker's defaults: the defaults before
# bf16 pushes became the default (float32 pushes, bf16 pulls), the one place to change them.
# None: measure the current defaults only.
PREVIOUS_DEFAULTS: dict[str, Any] | None = {"compress": "none"}


def default_sets() -> dict[str, dict[str, Any]]:
    """The sets of worker settings the pinned downpour set-up runs with, by name."""
    previous = {"previous": dict(PREVIOUS_DEFAULTS)} if PREVIOUS_DEFAULTS else {}
    return {"current": {}} | previous


def describe(settings: dict[str, Any]) -> str:
    """Worker settings as their command-line flags ("--n-fetch 4 --pull-compress bf16")."""
    flags = [f"--{k.replace('_', '-')} {v}" for k, v in settings.items()]
    return " ".join(flags) or "the worker's defaults"


def child(
    procs: Procs, mode: str, cpus: list[int], args: list[str], timeout_s: float = 600.0
) -> dict[str, Any]:
    """Run ``pinned.py mode args`` on ``cpus``; its JSON result (bounded wait)."""
    return procs.run_json([str(HERE / "pinned.py"), mode, *args], f"pinned-{mode}", timeout_s, cpus)


def overhead_ratio(downpour: float, tf_pss: float, grad_only: float) -> float:
    """Downpour's seconds per step beyond the gradient step over TF PSS's (rates in steps/s);
    each overhead is floored at ``OVERHEAD_FLOOR`` of the gradient step (noise can make a
    rate exceed the limit by a hair)."""
    limit = 1.0 / grad_only
    ours = max(1.0 / downpour - limit, OVERHEAD_FLOOR * limit)
    theirs = max(1.0 / tf_pss - limit, OVERHEAD_FLOOR * limit)
    return ours / theirs


def end_to_end(plan: Plan, procs: Procs) -> dict[str, Any]:
    """The pinned set-ups (local and gradient-only, downpour per set of defaults, the least
    worker, TF PSS), ``plan.pinned_rounds`` rounds in turn, and their ratios."""
    worker, server = host_cpus(0), host_cpus(1)
    k = FUSED_STEPS if plan.name != "smoke" else 2
    window = ["--warmup", str(plan.e2e_warmup_steps), "--windows", str(plan.e2e_windows)]
    window += ["--window-steps", str(plan.local_window_steps)]
    variants = f"keras:1,keras:{FUSED_STEPS},fused:1,fused:{FUSED_STEPS}"
    if plan.lean:  # the fused apply with several steps per schedule is TF's fastest here
        variants = f"fused:{FUSED_STEPS}"
    sets = default_sets()
    rounds: dict[str, list[dict[str, Any]]] = {"local": [], "pss": [], "floor": []}
    rounds |= {name: [] for name in sets}
    for r in range(plan.pinned_rounds):
        tag = f"pinned round {r + 1}/{plan.pinned_rounds}"
        log(f"{tag}: local training and the gradient step alone on core {worker}")
        rounds["local"].append(child(procs, "compute", worker, [*window, "--fused-k", str(k)]))
        for name, settings in sets.items():
            log(f"{tag}: downpour ({describe(settings)}), worker core {worker}, server {server}")
            rounds[name].append(
                bench_e2e.downpour(
                    plan, procs, 1, server_cpus=server, worker_cpus=worker,
                    worker_settings=settings,
                )
            )  # fmt: skip
        log(f"{tag}: the least worker on core {worker}, a server on core {server}")
        rounds["floor"].append(worker_floor(procs, window))
        log(f"{tag}: TF PSS, worker on core {worker}, PS and coordinator on core {server}")
        rounds["pss"].append(
            bench_e2e.tf_parameter_server(
                plan, procs, variants, cpus={"worker": worker, "ps": server, "chief": server}
            )
        )
    rate = {k: median([x["steps_per_s"] for x in rounds[k]]) for k in ("pss", "floor", *sets)}
    rate["local"] = median([x["local_steps_per_s"] for x in rounds["local"]])
    rate["grad"] = median([x["grad_only_steps_per_s"] for x in rounds["local"]])
    pss_variants = {
        name: median([x["variants"][name] for x in rounds["pss"]])
        for name in rounds["pss"][0]["variants"]
    }
    per_set = {
        name: {
            "worker_settings": settings,
            "flags": describe(settings),
            **downpour_figures(rate[name], rate, rounds[name]),
        }
        for name, settings in sets.items()
    }
    current = per_set["current"]
    floor_ms = 1e3 * (1 / rate["floor"] - 1 / rate["grad"])
    rounds["dp"] = rounds.pop("current")
    return {
        "local_steps_per_s": rate["local"],
        "grad_only_steps_per_s": rate["grad"],
        **{k: current[k] for k in SET_FIGURES},
        "tf_pss_1w_steps_per_s": rate["pss"],
        # informative: the components of the figures above
        "local_keras_adam_steps_per_s": median(
            [x["keras_adam_steps_per_s"] for x in rounds["local"]]
        ),
        "local_fused_steps_per_s": median([x["fused_steps_per_s"] for x in rounds["local"]]),
        "local_fused_steps_per_call": k,
        "compute_cpu_cores": median([x["cpu_cores"] for x in rounds["local"]]),
        "tf_pss_variants_steps_per_s": pss_variants,
        "tf_pss_best": max(pss_variants, key=pss_variants.__getitem__),
        "overhead_ms": {
            "downpour": current["overhead_ms"],
            "tf_pss": 1e3 * (1 / rate["pss"] - 1 / rate["grad"]),
            "floor": floor_ms,
        },
        # the floor: the least worker (bf16 both ways, see worker_floor) on core 0
        "floor_steps_per_s": rate["floor"],
        "floor_ratio_to_limit": rate["floor"] / rate["grad"],
        "floor_overhead_vs_tf_pss": overhead_ratio(rate["floor"], rate["pss"], rate["grad"]),
        "overhead_beyond_floor_ms": current["overhead_ms"] - floor_ms,
        "downpour_staleness_mean": current["staleness_mean"],
        "downpour_cpu_cores": current["cpu_cores"],
        "defaults": per_set,
        "cpus": {"worker_host": worker, "server_host": server},
        "cpu_model": cpu_model(),  # the pinned figures depend on it (docs/performance.md)
        "rounds": plan.pinned_rounds,
        "detail": rounds,
    }


SET_FIGURES = (  # a set of defaults' figures that the section also reports at its top level
    "downpour_1w_steps_per_s",
    "ratio_1w_vs_local",
    "ratio_1w_vs_tf_pss",
    "ratio_to_limit",
    "overhead_vs_tf_pss",
)


def downpour_figures(
    dp: float, rate: dict[str, float], runs: list[dict[str, Any]]
) -> dict[str, Any]:
    """One set of worker defaults' figures: its steps/s ``dp`` against the local, gradient-only
    and TF PSS rates of ``rate`` (the same for every set), and what its ``runs`` measured."""
    return {
        "downpour_1w_steps_per_s": dp,
        "ratio_1w_vs_local": dp / rate["local"],
        "ratio_1w_vs_tf_pss": dp / rate["pss"],
        "ratio_to_limit": dp / rate["grad"],
        "overhead_vs_tf_pss": overhead_ratio(dp, rate["pss"], rate["grad"]),
        "overhead_ms": 1e3 * (1 / dp - 1 / rate["grad"]),
        "staleness_mean": median([x["staleness_mean"] or 0.0 for x in runs]),
        "cpu_cores": {
            "server": median([x["server_cpu_cores"] for x in runs]),
            "worker": median([x["worker_cpu_cores"][0] for x in runs]),
        },
    }


def server(plan: Plan, procs: Procs) -> dict[str, Any]:
    """Server applies/s on core 1 flooded from core 0, against the bare apply on core 1.

    ``pinned_overhead_memcpys``: (time per apply in the server - the bare apply's time) over
    the memcpy of one gradient list, both measured on the server's core.
    ``pinned_floor_memcpys``: the part of it any TCP-fed TensorFlow server pays (the least
    server's time per apply, ``receive_floor``, beyond the bare apply), in the same unit;
    ``pinned_overhead_beyond_floor_memcpys``, the rest, is what downpour's server adds.
    The server and the least server run in turn, ``plan.pinned_server_rounds`` times, so a
    slow spell hits both alike; each figure is the median of its rounds, and the rounds are
    kept in ``pinned_rounds_detail`` (one round's server-minus-floor moves by more than
    downpour's share).
    """
    worker, core = host_cpus(0), host_cpus(1)
    log(f"server pinned: bare apply and memcpy on core {core}")
    bare = child(procs, "bare-apply", core, ["--reps", str(plan.apply_reps)])
    memcpy_ms = bare["apply_memcpy_ms"]

    def beyond_bare(ms: float) -> float:
        """Time per apply beyond the bare apply, in memcpys of the gradient list."""
        return (ms - bare["apply_ms"]) / memcpy_ms

    rounds = []
    for i in range(plan.pinned_server_rounds):
        log(f"server pinned: round {i + 1} of {plan.pinned_server_rounds}")
        flood = flood_server(plan, procs, bare)
        floor = receive_floor(plan, procs)
        server_ms = 1e3 / flood["applies_per_s"]
        rounds.append(
            {
                "server_apply_per_s": flood["applies_per_s"],
                "server_ms_per_apply": server_ms,
                "floor_ms_per_apply": floor["ms_per_apply"],
                "overhead_memcpys": beyond_bare(server_ms),
                "floor_memcpys": beyond_bare(floor["ms_per_apply"]),
                "beyond_floor_memcpys": (server_ms - floor["ms_per_apply"]) / memcpy_ms,
                "pusher_cpu_cores": flood["pusher_cpu_cores"],
                "server_reported_apply_ms": flood["server_reported_apply_ms"],
            }
        )

    def mid(key: str) -> float:
        return median([r[key] for r in rounds])

    applies_per_s = mid("server_apply_per_s")
    server_ms = 1e3 / applies_per_s
    overhead_ms = server_ms - bare["apply_ms"]
    overhead_memcpys = max(overhead_ms, 1e-6) / memcpy_ms
    # the least server's time per apply beyond the bare apply, in the same unit
    floor_memcpys = beyond_bare(mid("floor_ms_per_apply"))
    return {
        "pinned_ratio": applies_per_s / bare["bare_apply_per_s"],
        "pinned_overhead_memcpys": overhead_memcpys,
        "pinned_server_apply_per_s": applies_per_s,
        "pinned_bare_apply_per_s": bare["bare_apply_per_s"],
        "pinned_apply_ms": bare["apply_ms"],
        "pinned_server_ms_per_apply": server_ms,
        "pinned_overhead_ms": overhead_ms,
        "pinned_memcpy_ms": memcpy_ms,
        "pinned_pusher_cpu_cores": mid("pusher_cpu_cores"),
        "pinned_server_reported_apply_ms": mid("server_reported_apply_ms"),
        "pinned_cpus": {"server": core, "pushers": worker},
        # a memcpy's speed sets the unit of pinned_overhead_memcpys: the CPU it was measured on
        "pinned_cpu_model": cpu_model(),
        # the floor: the least server (receive, decode, stage, apply) on core 1, same pushes
        "pinned_floor_ms_per_apply": mid("floor_ms_per_apply"),
        "pinned_floor_memcpys": floor_memcpys,
        "pinned_overhead_beyond_floor_memcpys": overhead_memcpys - floor_memcpys,
        # each round's figures, server and floor in turn: the spread the medians hide
        "pinned_rounds_detail": rounds,
    }


def flood_server(plan: Plan, procs: Procs, bare: dict[str, Any]) -> dict[str, Any]:
    """A downpour server on core 1 flooded by pre-encoded pushes from core 0 (``pinned.py
    flood``), half a second of bare applies kept in flight: its applies/s as it reports
    them, over timed windows after a warm-up."""
    worker, core = host_cpus(0), host_cpus(1)
    proc, info = start_server(procs, "server-pinned", cpus=core)
    try:
        log(f"server pinned: server on core {core}, pushers on core {worker}")
        in_flight = max(16, int(0.5 * bare["bare_apply_per_s"]))
        return child(
            procs,
            "flood",
            worker,
            [
                *("--push-port", str(info["push_port"]), "--status-port", str(info["status_port"])),
                *("--in-flight", str(in_flight), "--warmup-s", str(plan.flood_warmup_s)),
                *("--windows", str(plan.flood_windows), "--window-s", str(plan.flood_window_s)),
            ],
        )
    finally:
        procs.stop(proc)


def worker_floor(procs: Procs, window: list[str]) -> dict[str, Any]:
    """``pinned.py least-worker`` on core 0 against a real server on core 1: steps/s of the
    least worker, one that pulls the weights in bf16 a step ahead, computes the gradient
    step with its bf16 rounding, pushes, and loads the pulled weights, nothing else. A worker
    that moves the worker defaults' bytes over TCP pays at least this; downpour's input
    pipeline, fetcher thread and bookkeeping are what it adds on top."""
    worker, core = host_cpus(0), host_cpus(1)
    proc, info = start_server(procs, "server-floor", cpus=core)
    try:
        return child(procs, "least-worker", worker, [*window, "--server-port", str(info["port"])])
    finally:
        procs.stop(proc)


def receive_floor(plan: Plan, procs: Procs) -> dict[str, Any]:
    """``pinned.py receive`` on core 1 fed by ``pinned.py send`` on core 0: ms per apply of
    the least server, one that receives a push (the kernel's TCP copy, libzmq), decodes it,
    stages it (the copy into the aligned buffers TensorFlow needs, with the NaN/Inf check)
    and applies it. A server that receives over TCP and applies with TensorFlow pays at
    least this; downpour's own loop, policy and bookkeeping are what it adds on top."""
    worker, core = host_cpus(0), host_cpus(1)
    per_window = max(5, int(60 * plan.flood_window_s))
    warmup = 5
    count = warmup + plan.flood_windows * per_window
    ready = procs.logdir / f"ready-{len(procs.procs):02d}-receive.json"
    log(f"server pinned: the receive floor, {count} pushes from core {worker} to core {core}")
    receiver, out = procs.start(
        [
            str(HERE / "pinned.py"),
            "receive",
            *("--ready-file", str(ready), "--warmup", str(warmup)),
            *("--windows", str(plan.flood_windows), "--window-msgs", str(per_window)),
        ],
        "pinned-receive",
        cpus=core,
    )
    try:
        port = wait_ready(receiver, ready, 180.0)["push_port"]
        child(procs, "send", worker, ["--push-port", str(port), "--count", str(count)])
        if receiver.wait(timeout=120.0) != 0:
            raise RuntimeError(f"pinned-receive failed:\n{procs.log_tail(receiver)}")
    finally:
        procs.stop(receiver)
    return json.loads(out.read_text().strip().splitlines()[-1])
