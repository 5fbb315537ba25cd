"""Staleness policies in a server (``downpour server --policy``), in-process (fast tier) and as
a real process (slow tier), through the ``services`` fixture.

Each test starts one server with SGD (so a step is exactly ``lr * scale * gradient``) and
first drives it with hand-made pushes from a probe on the gradient socket, whose staleness
the test chooses, checking the policy's arithmetic in the weights and its counters in the
status document; then real workers train the tiny model under the same policy and
the held-out accuracy of the pulled weights must be well above chance (0.25).
"""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from conftest import ROOT, env, pull_weights, wait_until
from inproc import Services, WorkerThread, make_worker, serving, settle

from downpour import wire
from downpour.cli.status import fetch_status
from downpour.net.client import ShardClient, Weights
from downpour.net.transport import PushSocket, make_context

LR = 0.1
SGD = {"optimizer": "sgd", "learning_rate": LR}


def held_out_accuracy(arrays: list[np.ndarray]) -> float:
    """The tiny MLP (dense relu, dense) on the held-out blobs, in NumPy."""
    from tiny_models import blobs

    data = blobs()
    h = np.maximum(data.x_test @ arrays[0] + arrays[1], 0.0)
    logits = h @ arrays[2] + arrays[3]
    return float(np.mean(np.argmax(logits, axis=1) == data.y_test))


class Probe:
    """Hand-made pushes and pulls: chosen senders, base versions and gradient values."""

    def __init__(self, server: Any) -> None:
        self.server = server
        self.ctx = make_context()
        self.clients: dict[str, ShardClient] = {}  # one per sender: a pull speaks as one
        weights = self.pull("probe")
        self.names = list(weights.tensors)
        self.shapes = [np.shape(a) for a in weights.tensors.values()]
        endpoint = f"tcp://127.0.0.1:{server.info['push_port']}"
        self.push_sock = PushSocket(self.ctx, endpoint, hwm=1000, timeout_s=1.0)
        self.seqs: dict[str, int] = {}
        self.sent = 0

    def push(self, sender: str, base_version: int, value: float) -> None:
        """One gradient list filled with ``value``, computed (it says) from ``base_version``."""
        self.seqs[sender] = self.seqs.get(sender, 0) + 1
        shapes = zip(self.names, self.shapes, strict=True)
        tensors = {n: np.full(s, value, np.float32) for n, s in shapes}
        msg = wire.push_message(sender, self.seqs[sender], base_version, wire.PushBody(), tensors)
        self.push_sock.send(wire.encode(msg), deadline_s=30)
        self.sent += 1

    def settled(self) -> dict[str, Any]:
        """The status once the server has taken every push this probe sent (each sender's
        last sequence number accepted)."""

        def done() -> dict[str, Any] | None:
            doc = fetch_status(self.server.status)
            workers = doc["workers"]
            for sender, seq in self.seqs.items():
                if sender not in workers or workers[sender]["last_seq"] < seq:
                    return None
            return doc

        return wait_until(done, 30, f"the server to take the probe's {self.sent} pushes")

    def pull(self, sender: str) -> Weights:
        """A pull as ``sender`` (its reply tells it about dropped stale gradients)."""
        if sender not in self.clients:
            self.clients[sender] = ShardClient(
                self.ctx, self.server.rep, sender=sender, timeout_s=10
            )
        return self.clients[sender].pull()

    def close(self) -> None:
        for client in self.clients.values():
            client.close()
        self.push_sock.close()
        self.ctx.term()


@pytest.fixture
def probe_of() -> Iterator[Any]:
    probes: list[Probe] = []

    def make(server: Any) -> Probe:
        probes.append(Probe(server))
        return probes[-1]

    yield make
    for p in probes:
        p.close()


def fresh(probe: Probe, n: int, sender: str = "z") -> None:
    """``n`` zero gradients computed from the current version: SGD moves nothing, version += n."""
    for _ in range(n):
        probe.push(sender, fetch_status(probe.server.status)["version"], 0.0)
        probe.settled()


def train(services: Services, server: Any, workers: int, steps: int, **config: Any) -> list[Any]:
    """``workers`` real workers train ``steps`` steps each; their summaries, once the server
    has taken their last pushes."""
    sums = services.train(server.info["port"], workers, steps=steps, **config)
    settle(server.status, sums)
    return sums


def test_apply_step_scales_the_learning_rate_and_is_traced_once() -> None:
    """The state's lr input: an SGD step is ``lr * lr_scale * g``, Adam's first step
    ``lr * lr_scale * sign(g)`` (scaling the gradient would not change it); one trace."""
    from tiny_models import tiny

    from downpour.server.state import ParameterState

    sgd = ParameterState(tiny(), "sgd", 0.01)
    for scale in (1.0, 0.25, 1.0, 0.125):
        before = sgd.weights()[1]
        sgd.apply([np.full(np.shape(a), 0.5, np.float32) for a in before], lr_scale=scale)
        np.testing.assert_allclose(before[0] - sgd.weights()[1][0], 0.01 * scale * 0.5, rtol=1e-4)
    assert sgd.apply_traces == 1

    adam = ParameterState(tiny(), "adam", 0.01)
    before = adam.weights()[1]
    adam.apply([np.full(np.shape(a), 0.5, np.float32) for a in before], lr_scale=0.25)
    np.testing.assert_allclose(before[0] - adam.weights()[1][0], 0.01 * 0.25, rtol=1e-4)
    assert adam.apply_traces == 1


def test_async_applies_every_gradient_at_full_rate(services: Services, probe_of: Any) -> None:
    server = services.server(policy="async", **SGD)
    probe = probe_of(server)
    fresh(probe, 4)
    w0 = pull_weights(server.rep)[1]
    probe.push("a", 0, 0.5)  # staleness 4, applied as it is
    doc = probe.settled()
    w1 = pull_weights(server.rep)[1]
    np.testing.assert_allclose(w0[0] - w1[0], LR * 0.5, rtol=1e-5)
    assert doc["version"] == 5 and doc["staleness"]["max"] == 4
    assert doc["policy"]["policy"] == "async"
    assert doc["policy"]["counters"]["updates"] == doc["policy"]["counters"]["applied"] == 5

    sums = train(services, server, 2, 40)
    doc = fetch_status(server.status)
    assert doc["version"] == 5 + 80  # every push applied
    assert doc["policy"]["counters"]["offered"] == 85
    assert all(doc["workers"][s["worker"]]["applied"] == 40 for s in sums)
    assert all(doc["workers"][s["worker"]]["dropped"] == 0 for s in sums)
    assert doc["apply_traces"] == 1 and doc["rejected_total"] == 0
    assert held_out_accuracy(pull_weights(server.rep)[1]) > 0.8


def test_staleness_aware_divides_the_learning_rate_by_staleness(
    services: Services, probe_of: Any
) -> None:
    server = services.server(policy="staleness-aware", **SGD)
    probe = probe_of(server)
    fresh(probe, 4)
    w0 = pull_weights(server.rep)[1]
    probe.push("a", 0, 0.5)  # staleness 4: lr / 4
    probe.settled()
    w1 = pull_weights(server.rep)[1]
    np.testing.assert_allclose(w0[0] - w1[0], LR * 0.5 / 4, rtol=1e-5)
    probe.push("a", 4, 0.5)  # staleness 1: lr / max(1, 1) = lr
    doc = probe.settled()
    w2 = pull_weights(server.rep)[1]
    np.testing.assert_allclose(w1[0] - w2[0], LR * 0.5, rtol=1e-5)
    assert doc["policy"]["counters"]["scaled"] == 1 and doc["version"] == 6

    train(services, server, 2, 40)
    doc = fetch_status(server.status)
    c = doc["policy"]["counters"]
    assert doc["version"] == c["updates"] == c["applied"] == 6 + 80
    # every update with staleness >= 2 (and no other) had its rate divided
    buckets = dict((str(b), n) for b, n in doc["staleness"]["buckets"])
    assert c["scaled"] == doc["staleness"]["count"] - buckets["0"] - buckets["1"]
    assert doc["apply_traces"] == 1
    assert held_out_accuracy(pull_weights(server.rep)[1]) > 0.8


def test_bounded_drops_stale_gradients_and_tells_the_worker(
    services: Services, probe_of: Any
) -> None:
    server = services.server(policy="bounded:0", **SGD)  # only gradients from current weights
    probe = probe_of(server)
    fresh(probe, 1)
    w0 = pull_weights(server.rep)[1]
    probe.push("a", 0, 0.5)  # staleness 1 > 0: dropped, weights untouched
    doc = probe.settled()
    np.testing.assert_array_equal(pull_weights(server.rep)[1][0], w0[0])
    assert doc["version"] == 1 and doc["rejected_total"] == 0  # a drop is not an error
    assert doc["policy"]["counters"]["dropped_stale"] == 1
    assert doc["workers"]["a"]["dropped"] == 1 and doc["workers"]["a"]["last_seq"] == 1
    assert probe.pull("a").reply.dropped_stale == 1  # told once, at its next pull
    assert probe.pull("a").reply.dropped_stale == 0
    probe.push("a", 1, 0.5)  # staleness 0: applied
    doc = probe.settled()
    assert doc["version"] == 2 and doc["workers"]["a"]["applied"] == 1
    np.testing.assert_allclose(w0[0] - pull_weights(server.rep)[1][0], LR * 0.5, rtol=1e-5)

    # two real workers: some of their gradients are a version old, and dropped
    sums = train(services, server, 2, 60)
    doc = fetch_status(server.status)
    c = doc["policy"]["counters"]
    dropped = sum(doc["workers"][s["worker"]]["dropped"] for s in sums)
    assert c["offered"] == 3 + 120 and c["dropped_stale"] == 1 + dropped and dropped > 0
    assert doc["version"] == c["updates"] == 2 + 120 - dropped
    assert doc["staleness"]["max"] == 0  # nothing older than the current weights applied
    told = sum(s["dropped_stale"] for s in sums)
    assert 0 < told <= dropped  # drops after a worker's last pull are never told
    assert sum(s["stale_refreshes"] for s in sums) > 0
    assert held_out_accuracy(pull_weights(server.rep)[1]) > 0.8


def test_sync_averages_k_fresh_gradients_and_discards_late_ones(
    services: Services, probe_of: Any
) -> None:
    server = services.server(policy="sync:2/3", **SGD)
    probe = probe_of(server)
    w0 = pull_weights(server.rep)[1]
    probe.push("a", 0, 0.2)  # held
    probe.push("a", 0, 0.2)  # the same worker again in this round: dropped
    doc = probe.settled()
    assert doc["version"] == 0 and doc["policy"]["pending"] == 1
    probe.push("b", 0, 0.6)  # the second: the round applies the mean, 0.4
    probe.push("c", 0, 5.0)  # computed from version 0, now 1: late
    doc = probe.settled()
    w1 = pull_weights(server.rep)[1]
    np.testing.assert_allclose(w0[0] - w1[0], LR * 0.4, rtol=1e-5)
    c = doc["policy"]["counters"]
    assert doc["version"] == c["updates"] == 1 and c["applied"] == 2
    assert c["duplicate"] == 1 and c["late"] == 1 and c["aggregated"] == 2
    workers = doc["workers"]
    assert (workers["a"]["held"], workers["a"]["applied"], workers["a"]["dropped"]) == (1, 1, 1)
    assert (workers["b"]["applied"], workers["c"]["dropped"]) == (1, 1)
    assert probe.pull("c").reply.dropped_stale == 1  # a late gradient is told, like a stale one
    assert probe.pull("c").reply.dropped_stale == 0

    # Real workers. Whether a third one's gradients come late depends on how the processes'
    # start-ups overlap (a pair can finish before the third starts), so only what holds for
    # every interleaving is asserted: the accounting, and fresh-only updates.
    sums = train(services, server, 3, 40, sync_wait_s=8.0)  # covers start-up skew
    doc = fetch_status(server.status)
    c = doc["policy"]["counters"]
    assert c["offered"] == 4 + 120
    assert doc["version"] == c["updates"] and c["applied"] == 2 * c["updates"]  # 1 per 2
    assert c["aggregated"] == c["applied"] + c["discarded"] + doc["policy"]["pending"]
    assert c["offered"] == c["aggregated"] + c["late"] + c["duplicate"]
    assert doc["version"] > 10
    assert doc["staleness"]["max"] == 0  # only gradients from the current weights applied
    # late ones are told at the next pull (none after a worker's last); the probe's was told
    assert sum(s["dropped_stale"] for s in sums) <= c["late"] - 1
    assert held_out_accuracy(pull_weights(server.rep)[1]) > 0.8

    # a partial round is applied when the server stops
    for _ in range(2):  # a worker's gradient may be pending: then this completes its round
        probe.push("a", fetch_status(server.status)["version"], 0.0)
        if probe.settled()["policy"]["pending"] == 1:
            break
    doc = probe.settled()
    assert doc["policy"]["pending"] == 1, doc["policy"]
    log = services.stop(server)
    assert "applying a partial sync:2/3 round of 1 gradients" in log, doc["policy"]


class GatedStep:
    """A worker's step function that computes only when the test grants a step: a worker as
    slow as the test wants, deterministically. Everything else goes to the real one."""

    def __init__(self, step: Any) -> None:
        self._step = step
        self.grants = threading.Semaphore(0)

    def __call__(self, x: Any, y: Any) -> Any:
        assert self.grants.acquire(timeout=120), "the test granted no step for 120 s"
        return self._step(x, y)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._step, name)


def follow_the_slow_worker(
    status: str,
    k: int,
    gate: GatedStep,
    section: Callable[[dict[str, Any]], dict[str, Any]] = lambda doc: doc["policy"],
) -> Callable[[], dict[str, int]]:
    """The SSP bound as the status socket shows it (``section``: where the policy's
    ``clocks`` are): wait until worker "fast" is held K + 1 pushes ahead of the gated worker
    "slow", then grant the slow one 3 steps, the fast one following each to K + 1 ahead and
    never further (checked at every look). Returns the clocks reader."""

    def clocks() -> dict[str, int]:
        c = section(fetch_status(status))["clocks"]
        if "fast" in c and "slow" in c:
            assert c["fast"] - c["slow"] <= k + 1, c  # the SSP bound, at every look
        return c

    def fast_at(lead: int) -> bool:
        c = clocks()
        return "slow" in c and c.get("fast", 0) - c["slow"] == lead

    wait_until(lambda: fast_at(k + 1), 60, "the fast worker to be held K + 1 ahead")
    for _ in range(3):  # the slow worker steps; the fast one follows, and no further
        before = clocks()["slow"]
        gate.grants.release()
        wait_until(lambda b=before: clocks()["slow"] == b + 1, 60, "a slow step")
        wait_until(lambda: fast_at(k + 1), 60, "the fast worker to follow")
    return clocks


def test_ssp_holds_the_fast_worker_within_k_of_the_slowest_until_it_goes_missing() -> None:
    """ssp:2, two workers, one computing a step only when the test grants it: the fast one's
    clock never gets more than K + 1 pushes ahead of the slow one's (status: the policy's
    clocks), it follows the slow one step by step, and it is released when the slow one
    stops and the registry calls it missing. Every gradient is applied; none is dropped."""
    k = 2
    with serving(policy=f"ssp:{k}", missing_after_s=1.0, gone_after_s=30.0, **SGD) as server:
        endless = {"steps": 100_000, "heartbeat_s": 0.3}
        slow_worker = make_worker(server.port, worker_id="slow", **endless)
        gate = GatedStep(slow_worker.step_fn)
        slow_worker.step_fn = gate  # type: ignore[assignment]
        slow = WorkerThread(slow_worker)
        fast = WorkerThread(make_worker(server.port, worker_id="fast", **endless))
        try:
            clocks = follow_the_slow_worker(server.status, k, gate)
            doc = fetch_status(server.status)
            assert doc["policy"]["counters"]["held_pulls"] > 0
            assert doc["policy"]["counters"]["dropped_stale"] == 0

            slow.worker.stop()  # the slow worker goes away: silent, then missing
            gate.grants.release()
            slow.result(60)
            held_at = clocks()["fast"]
            wait_until(
                lambda: clocks().get("fast", 0) > held_at + 10 and "slow" not in clocks(),
                60,
                "the fast worker to be released once the slow one is missing",
            )
            assert fetch_status(server.status)["workers"]["slow"]["state"] == "missing"
        finally:
            slow.worker.stop()
            gate.grants.release()
            fast.worker.stop()
        s = fast.result(60)
        assert s["ssp_waits"] > 0
        doc = fetch_status(server.status)
        c = doc["policy"]["counters"]
        assert doc["rejected_total"] == 0 and c["applied"] == c["offered"] == doc["version"]


def test_bad_policy_is_refused_at_start() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "downpour", "server", "--policy", "bounded:-1"],
        capture_output=True,
        text=True,
        env=env(),
        cwd=ROOT,
        timeout=60,
    )
    assert out.returncode == 2
    assert "bounded:K needs K >= 0" in out.stderr
