"""Section 5, shards: the update capacity of 1 shard and of 2 shards, side by side.

Synthetic pushers, no model compute: gradients of the default model computed and encoded
once, flooded at real ``downpour server`` processes (bench_server.Flood, at most
``in_flight`` messages ahead of the applied version). One shard receives the whole gradient
list; each of two shards (``--shard I --num-shards 2``) receives its slice of it
(downpour.model.partition), from its own pusher thread. A full-model update needs both slices
applied, so the 2-shard capacity is the *slower* shard's applies/s.

Rounds alternate: a window on the single shard (the pair idle), then a window on the pair
(the single idle), so both see the same machine. On a 2-core machine two shards plus their
pushers share two cores: 2 is the largest shard count this machine can show honestly.

Each round then also runs each shard of the pair *alone* (the other idle): what a shard
would sustain on a machine of its own, as deployed; the pair's capacity on two such machines
is the slower of the two. That figure is reported beside, not instead of, the co-located one.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
from bench_server import Flood, rate_window, sample, wait_for
from bench_util import (
    Plan,
    Procs,
    cpu_seconds,
    log,
    median,
    server_ready,
    start_server,
    status_endpoint,
)

from downpour.model.partition import make_partition


def _window(
    endpoints: list[str], floods: list[Flood], window_s: float
) -> tuple[list[float], list[dict[str, Any]]]:
    """Applies/s of each server over one window (all floods running)."""
    if len(endpoints) == 1:
        rate, doc = rate_window(endpoints[0], floods[0], window_s)
        return [rate], [doc]
    first = [sample(ep, fl) for ep, fl in zip(endpoints, floods, strict=True)]
    end = time.monotonic() + window_s
    while time.monotonic() < end:  # keep every pusher informed during the window
        time.sleep(0.05)
        last = [sample(ep, fl) for ep, fl in zip(endpoints, floods, strict=True)]
    rates = [
        (b["version"] - a["version"]) / max(b["uptime_s"] - a["uptime_s"], 1e-9)
        for a, b in zip(first, last, strict=True)
    ]
    return rates, last


def run(
    plan: Plan,
    procs: Procs,
    names: list[str],
    grads: list[np.ndarray],
) -> dict[str, Any]:
    """Capacity of one shard and of two, alternating windows; medians and the ratio."""
    part = make_partition(names, [g.shape for g in grads], [g.dtype for g in grads], 2, "bench")
    slices = part.split(grads)
    wire_names = [[p.wire_name for p in parts] for parts in part.shards]
    # the three servers start side by side (each imports TensorFlow), then are waited for
    started = [start_server(procs, "shards-1of1", wait=False)] + [
        start_server(procs, f"shards-{i}of2", wait=False, settings={"shard": i, "num_shards": 2})
        for i in range(2)
    ]
    servers = [(p, server_ready(procs, p, Path(pending["ready_file"]))) for p, pending in started]
    (one_proc, one_info), pair = servers[0], servers[1:]
    if pair[0][1]["partition"] != pair[1][1]["partition"]:
        raise RuntimeError("the two shards computed different partitions")
    in_flight = 32  # the status the pushers pace on is published every 0.2 s
    setups = {
        "one": (
            [status_endpoint(one_info)],
            [Flood(one_info["push_port"], names, grads, in_flight)],
        ),
        "two": (
            [status_endpoint(info) for _, info in pair],
            [
                Flood(info["push_port"], wire_names[i], slices[i], in_flight)
                for i, (_, info) in enumerate(pair)
            ],
        ),
    }
    for i in range(2):  # each shard of the pair alone: the same endpoint and pusher
        setups[f"alone{i}"] = (setups["two"][0][i : i + 1], setups["two"][1][i : i + 1])
    pids = {"one": [one_proc.pid], "two": [p.pid for p, _ in pair]}
    pids.update({f"alone{i}": [pair[i][0].pid] for i in range(2)})
    rates: dict[str, list[float]] = {k: [] for k in setups}
    per_shard: list[list[float]] = []
    cpu = dict.fromkeys(setups, 0.0)
    wall = dict.fromkeys(setups, 0.0)
    for key in ("one", "two"):
        for fl in setups[key][1]:
            fl.start()
            fl.pause()
    try:
        for key in ("one", "two"):  # warm-up: the first applies compile
            eps, floods = setups[key]
            for fl in floods:
                fl.resume()
            for ep, fl in zip(eps, floods, strict=True):
                wait_for(ep, fl, 5, 120.0)
            end = time.monotonic() + plan.flood_warmup_s
            while time.monotonic() < end:
                for ep, fl in zip(eps, floods, strict=True):
                    sample(ep, fl)
                time.sleep(0.05)
            for ep, fl in zip(eps, floods, strict=True):
                fl.pause()
                wait_for(ep, fl, fl.sent, 60.0)
            log(f"shards: {key} warmed up")
        for r in range(plan.shard_rounds):
            for key, (eps, floods) in setups.items():
                for fl in floods:
                    fl.resume()
                for ep, fl in zip(eps, floods, strict=True):
                    wait_for(ep, fl, fl.applied + 4, 60.0)  # queues refilled
                c0 = sum(cpu_seconds(pid) for pid in pids[key])
                w0 = time.monotonic()
                window, docs = _window(eps, floods, plan.flood_window_s)
                wall[key] += time.monotonic() - w0
                cpu[key] += sum(cpu_seconds(pid) for pid in pids[key]) - c0
                rates[key].append(min(window))
                if key == "two":
                    per_shard.append(window)
                for ep, fl in zip(eps, floods, strict=True):
                    fl.pause()
                    wait_for(ep, fl, fl.sent, 60.0)  # drained: this setup idles now
                if any(d.get("rejected_total") for d in docs):
                    raise RuntimeError(f"{key}: server rejected flood messages")
            log(
                f"shards: round {r + 1}/{plan.shard_rounds}: 1 shard "
                f"{rates['one'][-1]:.1f}/s, 2 shards {rates['two'][-1]:.1f}/s "
                f"({', '.join(f'{x:.1f}' for x in per_shard[-1])}), each alone "
                f"{rates['alone0'][-1]:.1f}/s and {rates['alone1'][-1]:.1f}/s"
            )
    finally:
        for key in ("one", "two"):
            for fl in setups[key][1]:
                fl.stop()
        procs.stop(one_proc)
        for p, _ in pair:
            procs.stop(p)
    one, two = median(rates["one"]), median(rates["two"])
    alone = [median(rates["alone0"]), median(rates["alone1"])]
    return {
        "two_shards_each_alone_applies_per_s": min(alone),
        "ratio_each_alone_vs_one": min(alone) / one,
        "each_alone_per_shard_applies_per_s": alone,
        "one_shard_applies_per_s": one,
        "two_shards_applies_per_s": two,
        "ratio_two_vs_one": two / one,
        "two_shards_per_shard_applies_per_s": [median([w[i] for w in per_shard]) for i in range(2)],
        "one_shard_windows": rates["one"],
        "two_shards_windows": rates["two"],
        "shard_bytes": part.shard_bytes(),
        "server_cpu_cores_one": cpu["one"] / max(wall["one"], 1e-9),
        "server_cpu_cores_two": cpu["two"] / max(wall["two"], 1e-9),
        "in_flight": in_flight,
    }
