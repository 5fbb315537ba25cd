"""Fast tier: DistBelief's ``n_fetch`` and ``n_push`` end to end, a server and one worker in
this process on real loopback sockets.

Each scenario counts the worker's pulls and pushes (its summary) against the server's
updates, and checks the staleness the server measured for them (the status document's
histogram). The model (``slow_models:paced``) takes a steady 50 ms a step, so a pull of its
weights takes a small fraction of a step and the worker's fetch schedule
(``downpour.worker.pull.schedule``) requests each pull one step before the weights are needed.

With one worker, the push computed at step ``s`` is applied at version ``s // n_push`` (the
pushes before it), and its staleness is that minus the version it was computed from.
"""

from __future__ import annotations

from typing import Any

import pytest
from conftest import wait_until
from inproc import serving, train

from downpour.cli.status import fetch_status

MODEL = "slow_models:paced"
STEPS = 40


def run(**config: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """One worker trains STEPS steps on a fresh server: its summary and, once every push is
    applied, the server's status document."""
    with serving(MODEL) as server:
        summary = train(server.port, MODEL, steps=STEPS, **config)
        doc = wait_until(
            lambda: (d := fetch_status(server.status))["version"] == summary["pushes"] and d,
            30,
            f"{summary['pushes']} updates",
        )
    return summary, doc


def counts(doc: dict[str, Any]) -> dict[int, int]:
    """The server's staleness histogram as {upper bound: pushes}, empty buckets left out."""
    return {b: c for b, c in doc["staleness"]["buckets"] if c and b != "+Inf"}


def test_n_fetch_4_pulls_every_4th_step_just_in_time() -> None:
    summary, doc = run(n_fetch=4)
    assert summary["steps"] == STEPS and summary["pushes"] == STEPS
    # the first pull, then one before each of steps 4, 8, ..., 36
    assert summary["pulls"] == 1 + (STEPS - 1) // 4
    # every pull but perhaps the first prefetch (sent before any push) brought new weights
    assert summary["pulls"] - summary["pulls_unchanged"] >= summary["pulls"] - 1
    assert doc["updates_applied"] == STEPS and doc["staleness"]["count"] == STEPS
    # the schedule sent each request fewer than 4 steps ahead (a pull is a small fraction of
    # a step here); requested right after the install, as a plain prefetch does, the weights
    # used from step f on would be those of step f-4: staleness 4..7, mean over 5
    assert summary["fetch_lead_steps"] is not None and 1 <= summary["fetch_lead_steps"] < 4
    assert summary["pull_rtt_ms"] is not None and summary["step_ms"] is not None
    assert doc["staleness"]["mean"] < 4 + 1
    # the weights installed before step f were requested before step f-1's push, so the
    # push of step f+j (j = 0..3) is at least j+1 versions stale: none at 0 but the first
    assert counts(doc).get(0) == 1
    assert doc["workers"]["w"]["staleness_histogram"]["count"] == STEPS


@pytest.mark.parametrize("n_fetch", [1, 4])
def test_n_push_4_pushes_every_4th_step_at_most_one_version_stale(n_fetch: int) -> None:
    summary, doc = run(n_push=4, n_fetch=n_fetch)
    assert summary["steps"] == STEPS
    assert summary["pushes"] == STEPS // 4  # one averaged gradient per 4 steps
    assert summary["pulls"] == 1 + (STEPS - 1) // n_fetch
    assert doc["updates_applied"] == STEPS // 4 and doc["staleness"]["count"] == STEPS // 4
    # each push's weights were pulled before the previous push left (prefetched), and after
    # the ones before it were applied: the first push 0 versions stale, the others 1
    assert counts(doc) == {0: 1, 1: STEPS // 4 - 1}
    assert doc["workers"]["w"]["applied"] == STEPS // 4
