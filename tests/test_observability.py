"""Observability (127.0.0.1): status under abuse, Prometheus, TensorBoard, held-out
evaluation, JSON logs and the multi-server status view.

One module-scoped cluster serves every test here, in-process (fast tier: servers and workers
on threads of this process) and as real processes (slow tier): server A (tiny model, with
--metrics-port, --logdir, --eval-every and JSON logs) with workers w0 and w1, and server B
(another server of the same model, no workers: merging the workers of several shards is
unit-tested in test_metrics_logs.py). The workers train until the module ends. JSON log files
are written by service processes: that test runs with the processes only.
"""

from __future__ import annotations

import contextlib
import glob
import json
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import zmq
from conftest import ROOT, Cluster, Service, env, wait_until
from inproc import InprocServer, WorkerThread, make_worker

from downpour import wire
from downpour.cli.local import wait_ready
from downpour.cli.status import fetch_status
from downpour.net.client import ShardClient
from downpour.net.transport import make_context
from downpour.wire import Message

FOREVER = "1000000"  # steps: the workers train until the fixture stops them


@dataclass
class Obs:
    """The running cluster and where server A writes its observability output."""

    a: Any  # conftest.Service or inproc.InprocServer
    b: Any
    logdir: Path
    workers: dict[str, Any]


PROCESS = pytest.param("process", marks=pytest.mark.slow)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _server(cluster: Cluster, name: str, port: int, *args: str) -> tuple[Service, Path]:
    ready = cluster.tmp / f"ready-{name}.json"  # the last --ready-file wins
    return cluster.server(*args, "--ready-file", str(ready), port=port, wait=False), ready


@pytest.fixture(scope="module", params=["inproc", PROCESS])
def obs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Obs]:
    import tensorflow  # noqa: F401  (_events needs it: import it before the cluster loads the CPU)

    tmp = tmp_path_factory.mktemp("obs")
    if request.param == "inproc":
        yield from _inproc_obs(tmp)
        return
    cluster = Cluster(tmp)
    logdir = tmp / "tb"
    workers: dict[str, Service] = {}
    try:  # servers and workers start together (workers wait for their server): faster
        port_a = _free_port()  # known before A is up, so its workers can start with it
        a, ready_a = _server(
            cluster,
            "a",
            port_a,
            "--metrics-port",
            "0",
            "--logdir",
            str(logdir),
            "--summary-secs",
            "1",
            "--eval-every",
            "50",
            "--log-format",
            "json",
        )
        b, ready_b = _server(cluster, "b", 0)
        workers = {
            wid: cluster.worker(port, "--steps", FOREVER, "--log-format", "json", worker_id=wid)
            for wid, port in (("w0", port_a), ("w1", port_a))
        }
        a.info = wait_ready(a.proc, ready_a, 120.0, a.log)
        b.info = wait_ready(b.proc, ready_b, 120.0, b.log)
        wait_until(
            lambda: (
                (doc := fetch_status(a.status))["version"] > 20
                and set(doc["workers"]) == {"w0", "w1"}
            ),
            120,
            "workers w0 and w1 training",
        )
        yield Obs(a, b, logdir, workers)
    finally:
        for w in workers.values():  # workers first: a worker whose server is gone waits for
            w.proc.terminate()  # its pull to time out before it exits
        for w in workers.values():
            with contextlib.suppress(subprocess.TimeoutExpired):  # cluster.stop() kills it
                w.wait(timeout=30)
        cluster.stop()


def _inproc_obs(tmp: Path) -> Iterator[Obs]:
    """Obs with servers and workers on threads of this process."""
    logdir = tmp / "tb"
    servers: list[InprocServer] = []
    workers: dict[str, WorkerThread] = {}
    try:
        a = InprocServer(metrics_port=0, logdir=str(logdir), summary_interval_s=1.0, eval_every=50)
        servers.append(a)
        servers.append(InprocServer())
        workers = {
            wid: WorkerThread(make_worker(a.port, worker_id=wid, steps=int(FOREVER)))
            for wid in ("w0", "w1")
        }
        wait_until(
            lambda: (
                (doc := fetch_status(a.status))["version"] > 20
                and set(doc["workers"]) == {"w0", "w1"}
            ),
            60,
            "workers w0 and w1 training",
        )
        yield Obs(a, servers[1], logdir, workers)
    finally:
        for w in workers.values():
            w.worker.stop()
        for w in workers.values():
            w.result()
        for s in servers:
            s.stop()


def _version(endpoint: str) -> int:
    """The server's version, asked on its REP socket (not through the status socket)."""
    ctx = make_context()
    client = ShardClient(ctx, endpoint, sender="probe", timeout_s=10)
    try:
        # a version held that never matches: the reply carries the weights and the version
        return client.pull(wire.PullRequest(have=-2, incarnation="")).version
    finally:
        client.close()
        ctx.term()


def _time_for_updates(endpoint: str, n: int, timeout: float) -> float:
    """Seconds until the server applies ``n`` more updates (a bounded wait)."""
    t0, v0 = time.monotonic(), _version(endpoint)
    wait_until(lambda: _version(endpoint) >= v0 + n, timeout, f"{n} more updates")
    return time.monotonic() - t0


def test_status_flood_and_unread_replies_do_not_stop_training(obs: Obs) -> None:
    status_ep, rep_ep = obs.a.status, obs.a.rep
    request = wire.encode(Message(wire.STATUS, "abuser"))
    before = _time_for_updates(rep_ep, 200, 60)
    ctx = zmq.Context()
    stop = threading.Event()
    answered = [0]

    def flood() -> None:  # as many requests as the socket takes, for at most 60 s
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(status_ep)
        deadline = time.monotonic() + 60
        try:
            for _ in range(10_000_000):
                if stop.is_set() or time.monotonic() > deadline:
                    return
                try:
                    sock.send_multipart([b"", *request], zmq.NOBLOCK)
                    wait_ms = 0
                except zmq.Again:  # a thousand requests queued: wait for answers
                    wait_ms = 100
                while sock.poll(wait_ms, zmq.POLLIN):
                    wait_ms = 0
                    sock.recv_multipart()
                    answered[0] += 1
        finally:
            sock.close(0)

    status_before = fetch_status(status_ep)["status_requests"]
    silent = ctx.socket(zmq.REQ)  # asks once and never reads the reply
    hoarder = ctx.socket(zmq.DEALER)  # asks thousands of times and never reads a reply
    flooder = threading.Thread(target=flood, daemon=True)
    try:
        for s in (silent, hoarder):
            s.setsockopt(zmq.LINGER, 0)
            s.connect(status_ep)
        silent.send_multipart(request)
        for _ in range(5000):
            try:
                hoarder.send_multipart([b"", *request], zmq.NOBLOCK)
            except zmq.Again:
                break
        flooder.start()
        wait_until(lambda: answered[0] > 100, 30, "the flood to be answered")
        during = _time_for_updates(rep_ep, 200, 60)  # training goes on under the flood
        assert flooder.is_alive(), "the flood ended before training was measured under it"
        # the status socket still answers a well-behaved client in the middle of it all
        doc = fetch_status(status_ep, timeout_s=10)
        assert doc["status_requests"] - status_before > 100
        assert set(doc["workers"]) == {"w0", "w1"}
    finally:
        stop.set()
        flooder.join(timeout=10)
        silent.close(0)
        hoarder.close(0)
        ctx.term()
    print(
        f"\n200 updates: {before:.2f} s before the flood, {during:.2f} s during it "
        f"(ratio {during / before:.2f}); {answered[0]} flood requests answered"
    )


def _scrape(port: int) -> dict[str, Any]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        assert resp.status == 200
        text = resp.read().decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_metrics_endpoint_serves_prometheus_families(obs: Obs) -> None:
    wait_until(lambda: fetch_status(obs.a.status)["eval"], 60, "a held-out evaluation")
    families = _scrape(obs.a.info["metrics_port"])

    applied = families["downpour_updates_applied"]  # the parser strips a counter's _total
    assert applied.type == "counter"
    assert applied.samples[0].name == "downpour_updates_applied_total"
    assert applied.samples[0].value > 20

    hist = families["downpour_gradient_staleness"]
    assert hist.type == "histogram"
    buckets = [s for s in hist.samples if s.name.endswith("_bucket")]
    assert buckets[-1].labels["le"] == "+Inf"
    counts = [s.value for s in buckets]
    assert counts == sorted(counts), "histogram buckets must be cumulative"
    count = next(s.value for s in hist.samples if s.name.endswith("_count"))
    assert count == counts[-1] > 0

    rejected = families["downpour_rejected_messages"]
    assert rejected.type == "counter"
    assert all(set(s.labels) == {"reason"} for s in rejected.samples)

    for name in (
        "downpour_worker_updates_applied",
        "downpour_worker_steps_per_second",
        "downpour_worker_compute_seconds",
        "downpour_worker_push_seconds",
        "downpour_worker_pull_seconds",
        "downpour_worker_sent_bytes",
        "downpour_worker_backpressure_events",
        "downpour_worker_local_loss",
        "downpour_worker_staleness",
    ):
        assert {s.labels["worker"] for s in families[name].samples} == {"w0", "w1"}, name
    alive = {
        s.labels["worker"]
        for s in families["downpour_worker_state"].samples
        if s.labels["state"] == "alive" and s.value == 1
    }
    assert alive == {"w0", "w1"}
    compute = [s.value for s in families["downpour_worker_compute_seconds"].samples]
    assert all(0 < v < 10 for v in compute)  # seconds, converted from the reported ms

    acc = families["downpour_heldout_accuracy"].samples[0].value
    assert 0.0 <= acc <= 1.0
    assert families["downpour_heldout_evaluations"].samples[0].value >= 1


def test_server_evaluates_the_held_out_set_without_stalling(obs: Obs) -> None:
    first = wait_until(lambda: fetch_status(obs.a.status)["eval"], 60, "a held-out evaluation")
    assert set(first) >= {"version", "accuracy", "time", "seconds", "count", "every"}
    assert first["every"] == 50 and first["examples"] == 240  # tiny_models.blobs: 240 held out

    def later() -> dict[str, Any] | None:
        ev = fetch_status(obs.a.status)["eval"]
        return (
            ev if ev["version"] >= first["version"] + 100 and ev["count"] > first["count"] else None
        )

    ev = wait_until(later, 60, "evaluations of later versions")
    assert ev["time"] > first["time"]
    # separable blobs: a few hundred updates learn them well above chance (0.25)
    wait_until(
        lambda: fetch_status(obs.a.status)["eval"]["accuracy"] > 0.8, 60, "accuracy above 0.8"
    )
    assert fetch_status(obs.b.status)["eval"] is None  # off unless --eval-every


def _events(logdir: Path) -> dict[str, list[tuple[int, Any]]]:
    import tensorflow as tf

    found: dict[str, list[tuple[int, Any]]] = {}
    for path in sorted(glob.glob(str(logdir / "events.out.tfevents.*"))):
        for raw in tf.data.TFRecordDataset(path):
            event = tf.compat.v1.Event.FromString(raw.numpy())
            for v in event.summary.value:
                value = tf.make_ndarray(v.tensor)
                found.setdefault(v.tag, []).append((event.step, value))
                assert v.metadata.plugin_data.plugin_name in ("scalars", "histograms")
    return found


def test_tensorboard_event_files_hold_the_scalars(obs: Obs) -> None:
    want = {
        "training/loss",
        "training/updates_per_s",
        "staleness/mean",
        "staleness/histogram",
        "heldout/accuracy",
        "worker/w0/steps_per_s",
        "worker/w1/loss",
    }
    tags = wait_until(
        lambda: (
            (t := _events(obs.logdir)) and want <= set(t) and len(t["training/loss"]) >= 2 and t
        ),
        60,
        "TensorBoard scalars",
    )
    steps = [step for step, _ in tags["training/loss"]]
    assert steps == sorted(steps) and steps[-1] > steps[0]  # step = version: rises
    assert all(float(v) > 0 for _, v in tags["training/loss"])
    assert all(0.0 <= float(v) <= 1.0 for _, v in tags["heldout/accuracy"])
    _, hist = tags["staleness/histogram"][-1]
    assert hist.shape[1] == 3 and hist[:, 2].sum() > 0  # (left, right, count) rows


def _json_lines(log: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]


@pytest.mark.parametrize("obs", [PROCESS], indirect=True)
def test_json_logs_carry_service_worker_and_version(obs: Obs) -> None:
    server_lines = wait_until(
        lambda: (
            (lines := _json_lines(obs.a.log))
            and any("held-out" in d["message"] for d in lines)
            and lines
        ),
        60,
        "server JSON log lines",
    )
    for d in server_lines:
        assert d["service"] == "server" and {"time", "level", "logger", "message"} <= set(d)
    serving = next(i for i, d in enumerate(server_lines) if d["message"].startswith("serving"))
    assert all(isinstance(d.get("version"), int) for d in server_lines[serving:])
    joined = [d for d in server_lines if d["message"].endswith("joined")]
    assert {d["worker"] for d in joined} == {"w0", "w1"}

    worker_lines = [
        d for d in _json_lines(obs.workers["w0"].log) if d["logger"] == "downpour.worker"
    ]
    assert worker_lines, obs.workers["w0"].log_text()
    for d in worker_lines:
        assert d["service"] == "worker" and d["worker"] == "w0" and isinstance(d["version"], int)
    assert not obs.b.log_text().lstrip().startswith("{")  # server B logs text (the default)


def _status_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "downpour", "status", *args],
        capture_output=True,
        text=True,
        env=env(),
        cwd=ROOT,
        timeout=60,
    )


def test_status_shows_several_servers_as_one_cluster(obs: Obs) -> None:
    a, b = obs.a.status, obs.b.status
    out = _status_cli("--watch", "0.2", "--count", "2", a, b)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert text.count("cluster: 2/2 servers answering, model tiny") == 2  # two refreshes
    assert "DIFFERENT MODELS" not in text
    rows = [line.split() for line in text.splitlines()[-2:]]  # the last refresh's worker rows
    assert [r[0] for r in rows] == ["w0", "w1"]
    for r in rows:
        assert r[1] == "alive" and float(r[3]) > 0  # state, steps/s
        assert r[-1] == "1/2"  # known to one of the two servers

    one = _status_cli("--json", a)
    doc = json.loads(one.stdout)
    for key in ("version", "updates_applied", "updates_per_s", "staleness", "workers", "eval"):
        assert key in doc
    w0 = doc["workers"]["w0"]
    for key in ("state", "last_seen_s", "steps", "staleness", "loss", "reported"):
        assert key in w0
    for key in ("steps_per_s", "compute_ms", "push_ms", "pull_ms", "bytes_sent", "backpressure"):
        assert key in w0["reported"]
    assert "loss" in w0["reported"]

    both = json.loads(_status_cli("--json", a, b).stdout)
    assert set(both) == {a, b} and set(both[a]["workers"]) == {"w0", "w1"}
    assert both[b]["workers"] == {} and both[b]["model"] == "tiny"

    stream = _status_cli("--json", "--watch", "0.2", "--count", "2", a)
    docs = [json.loads(line) for line in stream.stdout.splitlines()]  # JSON Lines
    assert len(docs) == 2 and docs[1]["version"] >= docs[0]["version"]

    gone = _status_cli("--timeout", "0.5", a, "tcp://127.0.0.1:1")
    assert gone.returncode == 1 and "unreachable" in gone.stdout
