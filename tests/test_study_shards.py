"""The study's model shards (``study.py --shards S``): S server queues, one per shard.

The simulation keeps one state for the math and gives each shard its own queue with its own
apply time. What holds by construction, checked on the click model in a process of its own
(one TensorFlow thread, as the study runs): one shard with the single queue's apply time is
the single-queue run step for step; one worker waits for its slowest shard, so shards whose
slowest takes the single queue's time give the same curve and clock, and faster shards
shorten the clock by exactly the time saved per update.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # builds the click model and runs the simulation

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "tests" / "bench"

RUNS = r"""
import json, sys
from dataclasses import replace
sys.path.insert(0, sys.argv[1])
import study

study._init_process()
# target 2.0: never reached, so every run goes to its 20 updates; grad_s 1: seconds = clock
one = study.Job(1, "async", "none", 0.01, False, 20, 10**9, 2.0, 5, 0.4, 1.0, model="clicks")
two = replace(one, workers=2, policy="ssp:2", stop_at_target=True)
runs = {
    "one": one,
    "one_slowest_same": replace(one, shard_units=(0.25, 0.4)),
    "one_faster": replace(one, shard_units=(0.1, 0.2)),
    "two": two,
    "two_one_shard": replace(two, shard_units=(0.4,)),
    "two_shards": replace(two, shard_units=(0.2, 0.2)),
}
print(json.dumps({k: study.simulate(job) for k, job in runs.items()}))
"""


@pytest.mark.timeout(240)
def test_shard_queues_reduce_to_the_single_queue_and_a_worker_waits_for_the_slowest() -> None:
    done = subprocess.run(
        [sys.executable, "-c", RUNS, str(BENCH)],
        capture_output=True,
        text=True,
        timeout=200,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    r = json.loads(done.stdout.strip().splitlines()[-1])
    assert r["one"]["shards"] == 1 and r["one_faster"]["shards"] == 2
    assert r["one"]["updates"] == 20 and len(r["one"]["curve"]) == 5

    # one worker: the same weights and clock when the slowest shard takes the queue's time
    assert r["one_slowest_same"]["curve"] == r["one"]["curve"]
    # faster shards: the same weights, 0.2 gradient-times less per update
    for a, b in zip(r["one"]["curve"], r["one_faster"]["curve"], strict=True):
        assert a[0] == b[0] and a[1] == b[1] and a[3] == b[3]
        assert b[2] == pytest.approx(a[2] - 0.2 * a[0], abs=2e-3)

    # one shard with the single queue's apply time is the single-queue run
    same = r["two_one_shard"]
    assert same["curve"] == r["two"]["curve"] and same["updates"] == r["two"]["updates"]
    assert same["policy_counters"] == r["two"]["policy_counters"]
    # two workers, two shards at half the time each: the clock runs no slower per update
    two, sharded = r["two"]["curve"], r["two_shards"]["curve"]
    assert sharded[-1][0] == two[-1][0] == 20
    assert sharded[-1][2] < two[-1][2]
