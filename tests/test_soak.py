"""Soak: a server with checkpoints and 4 workers train Deep MNIST on MNIST-5k for about ten
minutes under faults (``make soak``; slow tier, so ``make test-all`` runs it too).

Faults, from one seeded schedule (``tests/soak.py``; ``SOAK_SEED``): a random worker SIGKILLed
about every 20 s and restarted under the same id; the server SIGKILLed about every 2 minutes
and restarted on the same ports from its newest checkpoint (written every 5 s); two relays,
one before the REP port and one before the gradient port, resetting every connection about
every 20 s, and each connection once it has carried a random 0.1-1 GB (30 such per relay).

At the end:

- Open fds and RSS of the server are measured in its last incarnation, which serves at least
  the last 3 minutes: after its warm-up (60 s after it serves) and at the end of the fault
  phase, each time while all 4 workers train (so both counts see the same 4 connected
  workers), as the least of 20 samples over 10 s (a checkpoint being written or a 13 MB
  message being received comes and goes within that; a leak stays). A server SIGKILLed
  every 2 minutes is a new process each time, so only one incarnation can be compared with
  itself. The warm-up is the baseline because TensorFlow's
  allocator, the first traces and the first checkpoints grow RSS in the first minute, then
  it levels off; a leak grows with the work done and shows as growth past 10 %. It levels
  off that soon because the server caps malloc's arenas at 2 (``downpour.memory.malloc``): with
  glibc's own 16 here, every arena a thread takes keeps a few freed 13 MB receive buffers,
  and RSS climbs for thousands of updates (7-10 % past the warm-up in the soak). The
  figures carry the status document's ``malloc`` section at both measurements. Only growth
  fails: fewer fds or less RSS at the end is not a leak.
- The push accounting holds for the last incarnation, per worker and server-wide
  (``soak.accounting``): received = refused + accepted, accepted = applied + dropped + held.
- The held-out accuracy of the final checkpoint (``downpour export``) is at least 0.95.
  Before it is taken, the relays stop resetting and the server's own held-out evaluation
  (every ``EVAL_EVERY`` updates) must reach 0.95 within ``SETTLE_UPDATES`` updates after the
  faults. From scratch, 4 workers reach 0.93 only after about 500 updates (0.60 at 253, 0.93
  at 509, fault-free), so this cannot hide a lost state; every restart is also checked to
  resume from a checkpoint.

Why the wait: the held-out accuracy sometimes dips during the faults and recovers by the next
evaluation or two (one dip per run or none; e.g. 0.97 -> 0.78 -> 0.97 with SGD right after a
server restart and a worker's re-join; with Adam at 1e-3 once 0.97 -> 0.53 -> 0.78 in a
fault-free stretch past 3,400 updates). Fault-free 4-worker runs of 2,000-3,200 updates
showed no dip. The cause is not found yet; the evaluations are in the figures
(``held_out``), so a run shows whether and when it dipped. The server applies plain SGD
(``--optimizer sgd --lr 0.05``): Adam's dips were deeper and slower to recover.

``SOAK_SECONDS`` sets the fault phase (default 480: with start-up, restarts and the final
export about ten minutes in all); ``SOAK_FIGURES`` names a JSON file for the figures, which
are also printed (``pytest -s``) and written to the test's tmp dir.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import soak
from conftest import ROOT, Cluster, Service, env, free_ports, summary, wait_until
from relay import Faults, Relay

from downpour.cli.status import fetch_status

SECONDS = float(os.environ.get("SOAK_SECONDS", str(soak.FULL_S)))
SEED = int(os.environ.get("SOAK_SEED", "20"))
MODEL = "downpour.models:deep_mnist"
WORKERS = 4
GROWTH = 1.10  # fds and RSS at the end: at most 10 % above the warm-up level
ACCURACY = 0.95
EVAL_EVERY = 100  # the server's held-out evaluation, in updates
SETTLE_UPDATES = 400  # after the faults, the evaluation reaches ACCURACY within this many


class Soak:
    """The running soak: the server (restarted), the workers (restarted), the relays, and
    what was counted along the way."""

    def __init__(self, cluster: Cluster, tmp: Path) -> None:
        self.cluster = cluster
        self.state_dir = tmp / "state"
        port, push_port, status_port = free_ports(3)
        self.server_args = (
            "--state-dir", str(self.state_dir), "--checkpoint-every", "0",
            "--checkpoint-secs", "5", "--keep-checkpoints", "2", "--eval-every", str(EVAL_EVERY),
            "--port", str(port), "--push-port", str(push_port), "--status-port", str(status_port),
        )  # fmt: skip
        size = (100 << 20, 1 << 30)  # a connection is reset after 0.1-1 GB (8-80 messages)
        self.relays = [
            Relay(("127.0.0.1", p), faults=Faults(reset_after_bytes=size, max_resets=30), seed=i,
                  max_connections=1_000_000)
            for i, p in enumerate((port, push_port))
        ]  # fmt: skip
        for r in self.relays:
            r.start()
        self.server = self.start_server()
        self.workers = [self.start_worker(i) for i in range(WORKERS)]
        self.held_out: dict[int, float] = {}  # version -> the server's held-out accuracy
        self.joined: list[float | None] = [None] * WORKERS  # when each process said hello
        self.incarnations: list[dict[str, Any]] = [self.new_incarnation()]
        self.kills = {"worker": 0, "server": 0}
        self.worker_kills_merged = 0  # kills that fell due while no worker had trained yet
        self.resets_on_schedule = 0

    def start_server(self) -> Service:
        args = (*self.server_args, "--optimizer", "sgd", "--lr", "0.05")
        return self.cluster.server(*args, model=MODEL, ready_timeout=300)

    def start_worker(self, i: int) -> Service:
        args = (
            "--steps", "1000000", "--num-workers", str(WORKERS), "--worker-index", str(i),
            "--push-endpoint", f"127.0.0.1:{self.relays[1].port}",
            "--request-timeout", "4", "--server-timeout", "300",
        )  # fmt: skip
        return self.cluster.worker(self.relays[0].port, *args, model=MODEL, worker_id=f"w{i}")

    def status(self) -> dict[str, Any]:
        return fetch_status(self.server.status, timeout_s=15)

    def new_incarnation(self) -> dict[str, Any]:
        doc = self.status()
        return {
            "pid": self.server.proc.pid,
            "restored_from": doc["restored_from"],
            "started": time.monotonic(),
            "last_version": doc["version"],
            "samples": [],
        }

    def poll(self) -> dict[str, Any]:
        """The status now; notes the version, and fails if a worker exited on its own."""
        for i, w in enumerate(self.workers):
            assert w.proc.poll() is None, f"w{i} exited by itself:\n{w.log_text()[-3000:]}"
            if self.joined[i] is None and "joined server" in w.log_text():
                self.joined[i] = time.monotonic()
        doc = self.status()
        self.incarnations[-1]["last_version"] = doc["version"]
        if (ev := doc.get("eval")) is not None:
            self.held_out[ev["version"]] = ev[ev["metric"]]
        return doc

    def fire(self, event: soak.Event, plan: soak.Plan) -> bool:
        """Fire ``event``; False when it has to wait (a worker kill while none has trained)."""
        if event.kind == "worker":
            now = time.monotonic()
            i = plan.pick_worker([None if j is None else now - j for j in self.joined])
            if i is None:
                return False
            self.workers[i].proc.kill()
            self.workers[i].wait(timeout=30)
            self.workers[i] = self.start_worker(i)
            self.joined[i] = None
        elif event.kind == "server":
            self.poll()
            self.server.proc.kill()
            self.server.wait(timeout=30)
            self.server = self.start_server()
            self.incarnations.append(self.new_incarnation())
        else:
            self.resets_on_schedule += self.relays[event.target].reset_all()
            return True
        self.kills[event.kind] += 1
        return True

    def all_training(self, timeout: float = 240) -> dict[str, Any]:
        """Wait until every worker has had 2 more updates applied: all 4 are connected and
        training (a restarted one has imported TensorFlow and joined). Returns the status."""
        base = {w: r["applied"] for w, r in self.poll()["workers"].items()}

        def moved() -> dict[str, Any] | None:
            doc = self.poll()
            ws = doc["workers"]
            ok = all(ws.get(f"w{i}", {}).get("applied", 0) >= base.get(f"w{i}", 0) + 2
                     for i in range(WORKERS))  # fmt: skip
            return doc if ok else None

        return wait_until(moved, timeout, "all 4 workers to train")

    def measure(self, what: str) -> dict[str, Any]:
        """The server's fds and RSS while all 4 workers train: their level, the least of 20
        samples over 10 s (the server's own transients, a checkpoint being written or a
        message being received, come and go within that), and the most."""
        self.all_training()
        pid, fds, rss = self.server.proc.pid, [], []
        for _ in range(20):
            fds.append(soak.open_fds(pid))
            rss.append(soak.rss_mb(pid))
            time.sleep(0.5)  # sampling interval
        doc = self.all_training()  # and all 4 still train after the window
        return {
            "what": what, "fds": min(fds), "fds_max": max(fds),
            "rss_mb": round(min(rss), 1), "rss_mb_max": round(max(rss), 1),
            "at_s": round(time.monotonic() - self.incarnations[-1]["started"], 1),
            "malloc": doc.get("malloc"),
        }  # fmt: skip

    def settle(self, updates: int, timeout: float = 300) -> dict[str, Any]:
        """Stop the relays' resets, then wait for a held-out evaluation of a version made
        since of at least ACCURACY, within ``updates`` updates (fails past them); the status
        then."""
        for r in self.relays:
            r.set_faults(max_resets=0)
        start = self.poll()["version"]

        def recovered() -> dict[str, Any] | None:
            doc = self.poll()
            after = {v: a for v, a in self.held_out.items() if v > start}
            if any(a >= ACCURACY for v, a in after.items() if v <= start + updates):
                return doc
            assert all(v <= start + updates for v in after), (
                f"no held-out accuracy >= {ACCURACY} within {updates} updates of version "
                f"{start}: {after}"
            )
            return None

        return wait_until(recovered, timeout, f"held-out accuracy {ACCURACY} after the faults")

    def stop_relays(self) -> None:
        for r in self.relays:
            r.stop()


def _run_faults(s: Soak, plan: soak.Plan, t0: float) -> dict[str, Any]:
    """Fire the plan's events as they fall due, poll the server between them, and measure the
    last incarnation after its warm-up (then sample its fds and RSS every 5 s). The phase
    ends after ``plan.seconds``, or once the last incarnation has served ``plan.quiet_s``,
    whichever is later. Returns the warm-up measurement."""
    events = list(plan.events)
    warm: dict[str, Any] | None = None
    next_sample = 0.0
    while True:
        now = time.monotonic() - t0
        last = s.incarnations[-1]
        served = time.monotonic() - last["started"]
        final = s.kills["server"] == plan.count("server")  # the last incarnation serves
        if now >= plan.seconds and final and served >= plan.quiet_s:
            break
        due = [e for e in events if e.at <= now]
        waiting = [e for e in due if e.kind == "worker"][:-1]  # due worker kills merge
        s.worker_kills_merged += len(waiting)
        for e in due:
            if e in waiting or s.fire(e, plan):
                events.remove(e)
        if final and warm is None and served >= plan.warm_s:
            warm = s.measure("warm-up")
        if warm is not None and now >= next_sample:
            pid = s.server.proc.pid
            fds, rss = soak.open_fds(pid), round(soak.rss_mb(pid))
            last["samples"].append({"t_s": round(now), "fds": fds, "rss_mb": rss})
            next_sample = now + 5
        s.poll()
        time.sleep(0.5)  # pacing between polls (each wait on a condition is wait_until)
    assert warm is not None, "the last incarnation never reached its warm-up"
    return warm


def _export_accuracy(state_dir: Path, out: Path) -> tuple[float, str]:
    """``downpour export`` of the newest checkpoint; its held-out accuracy and its output."""
    proc = subprocess.run(
        [sys.executable, "-m", "downpour", "export", "--state-dir", str(state_dir),
         "--model", MODEL, "--out", str(out)],
        cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = re.search(r"held-out accuracy: ([0-9.]+)", proc.stdout)
    assert m, proc.stdout
    return float(m.group(1)), proc.stdout


@pytest.mark.slow
@pytest.mark.soak
@pytest.mark.timeout(int(SECONDS) + 1200)
def test_soak_under_kills_restarts_and_resets(cluster: Cluster, tmp_path: Path) -> None:
    started = time.monotonic()
    plan = soak.plan(SECONDS, SEED, relays=2)
    s = Soak(cluster, tmp_path)
    try:
        s.all_training()
        warm = _run_faults(s, plan, time.monotonic())
        end = s.measure("end")
        doc_before = s.poll()
        settled = s.settle(SETTLE_UPDATES)
        for w in s.workers:
            w.proc.send_signal(signal.SIGTERM)
        for w in s.workers:
            assert w.wait(timeout=120) == 0, w.log_text()[-3000:]
        last_seqs = {f"w{i}": summary(w)["last_seq"] for i, w in enumerate(s.workers)}

        def last_pushes_in() -> dict[str, Any] | None:  # their last pushes, unless reset away
            d = s.status()
            return (
                d if all(d["workers"][w]["last_seq"] == q for w, q in last_seqs.items()) else None
            )

        try:
            doc = wait_until(last_pushes_in, 30, "the workers' last pushes")
        except AssertionError:
            assert s.relays[1].stats["resets"] > 0
            doc = s.status()
    finally:
        s.stop_relays()
    s.server.proc.send_signal(signal.SIGTERM)
    assert s.server.wait(timeout=120) == 0, s.server.log_text()[-3000:]
    accuracy, exported = _export_accuracy(s.state_dir, tmp_path / "soak.keras")

    acct = soak.accounting(doc)
    incarnations = [{k: v for k, v in inc.items() if k != "started"} for inc in s.incarnations]
    figures = {
        "seconds_faults": SECONDS,
        "seconds_total": round(time.monotonic() - started, 1),
        "seed": SEED,
        "model": MODEL,
        "workers": WORKERS,
        "warm_up": warm,
        "end": end,
        "kills": s.kills,
        "kills_planned": {k: plan.count(k) for k in ("worker", "server")},
        "worker_kills_merged": s.worker_kills_merged,
        "resets": {
            "scheduled": s.resets_on_schedule,
            "total": sum(r.stats["resets"] for r in s.relays),
            "relay_connections": sum(r.stats["connections"] for r in s.relays),
        },  # fmt: skip
        "incarnations": incarnations,
        "last_incarnation": {"version": doc["version"], **acct},
        "version_at_end_of_faults": doc_before["version"],
        "version_settled": settled["version"],
        "held_out": {str(v): a for v, a in sorted(s.held_out.items())},
        "accuracy": accuracy,
        "exported": exported.strip().splitlines()[-3:],
    }
    text = json.dumps(figures, indent=1)
    (tmp_path / "soak-figures.json").write_text(text)
    if out := os.environ.get("SOAK_FIGURES"):
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text)
    print(f"\nsoak figures:\n{text}")
    print(
        f"soak: {SECONDS:.0f} s of faults, {figures['seconds_total']:.0f} s in all; "
        f"server fds {warm['fds']} -> {end['fds']}, RSS {warm['rss_mb']} -> {end['rss_mb']} MiB; "
        f"kills {s.kills}; resets {figures['resets']['total']}; "
        f"accepted pushes (last incarnation) {acct['accepted']}; accuracy {accuracy:.4f}"
    )

    assert s.kills["server"] == plan.count("server")  # every planned server kill happened
    # every worker kill happened, or merged into the next (it fell due while the one before
    # waited for a worker that had trained), or the last one was still waiting at the end
    assert s.kills["worker"] > 0
    assert plan.count("worker") - s.kills["worker"] - s.worker_kills_merged in (0, 1)
    assert figures["resets"]["total"] > 0
    for inc in s.incarnations[1:]:  # every restart resumed from a checkpoint
        assert inc["restored_from"] is not None and inc["restored_from"] > 0, incarnations
    assert not acct["violations"], acct
    assert acct["accepted"] > 0 and acct["applied"] > 0
    assert end["fds"] <= warm["fds"] * GROWTH, (warm, end)
    assert end["rss_mb"] <= warm["rss_mb"] * GROWTH, (warm, end)
    assert accuracy >= ACCURACY, exported
