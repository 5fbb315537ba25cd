"""Slow tier: real processes, real sockets on 127.0.0.1: a server and workers train together.

The same behaviours in-process, for the fast tier: tests/test_inproc_training.py."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

import pytest
import zmq
from conftest import ROOT, Cluster, env, summary, wait_until

from downpour.cli.status import fetch_status

pytestmark = pytest.mark.slow


def test_server_and_two_workers_train_the_default_model(cluster: Cluster) -> None:
    from downpour.serving.scoring import Evaluator

    server = cluster.server(model="downpour.models:deep_mnist", early=True)
    workers = [
        cluster.worker(
            server.port,
            "--steps",
            "80",
            model="downpour.models:deep_mnist",
            worker_id=f"w{i}",
        )
        for i in range(2)
    ]
    evaluator = Evaluator("downpour.models:deep_mnist", None)  # loads TF while the workers train
    for w in workers:
        assert w.wait(timeout=300) == 0, w.log_text()
    sums = [summary(w) for w in workers]
    assert [s["steps"] for s in sums] == [80, 80] and all(s["pushes"] == 80 for s in sums)

    doc = fetch_status(server.status)
    assert doc["version"] == doc["updates_applied"] == 160  # every push applied, none lost
    assert set(doc["workers"]) == {"w0", "w1"}
    for w in doc["workers"].values():
        assert w["applied"] == 80 and w["state"] == "alive" and w["staleness"] is not None
    assert doc["staleness"]["count"] == 160
    assert doc["staleness"]["max"] >= 1  # two asynchronous workers: some updates are stale
    assert doc["apply_traces"] == 1
    assert doc["rejected_total"] == 0
    if "MALLOC_ARENA_MAX" not in os.environ:  # the server capped its arenas before any thread
        heap = doc["malloc"]["heap"]
        assert doc["malloc"]["arena_limit"] == 2 and doc["malloc"]["limit_source"] == "downpour"
        assert heap is not None and 1 <= heap["arenas"] <= 2 and heap["free"] <= heap["system"]
    assert 0 < doc["rss_mib"] <= doc["peak_rss_mib"]

    version, acc = evaluator.score("127.0.0.1", server.info["port"])
    assert version == 160
    # 160 asynchronous updates from scratch reach 0.88-0.90 (80 updates spread 0.34-0.76 over
    # staleness interleavings); chance is 0.1
    assert acc > 0.7, f"held-out accuracy {acc} is not well above chance (0.1)"

    out = subprocess.run(
        [sys.executable, "-m", "downpour", "status", "--json", server.status],
        capture_output=True,
        env=env(),
        cwd=ROOT,
        timeout=60,
        check=True,
    )
    cli = json.loads(out.stdout)
    for key in (
        "version",
        "updates_applied",
        "updates_per_s",
        "rejected",
        "workers",
        "staleness",
        "loss",
        "bytes_in",
        "bytes_out",
    ):
        assert key in cli
    assert set(cli["staleness"]) >= {"mean", "max", "buckets"}
    assert cli["bytes_in"] >= 80 * 13_000_000  # 80 gradient lists of 13.1 MB came in


def test_worker_with_another_model_is_refused(cluster: Cluster) -> None:
    server = cluster.server(model="tiny_models:tiny", early=True)
    w = cluster.worker(server.port, "--steps", "5", model="tiny_models:tiny_other")
    assert w.wait(timeout=120) == 3
    log = w.log_text()
    assert "fingerprint" in log and "--model" in log
    doc = fetch_status(server.status)
    assert doc["rejected"].get("fingerprint") == 1
    assert doc["version"] == 0 and doc["workers"] == {}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_worker_started_before_the_server_connects_when_it_comes_up(cluster: Cluster) -> None:
    port = _free_port()
    w = cluster.worker(port, "--steps", "20", "--request-timeout", "1", "--server-timeout", "120")
    with pytest.raises(subprocess.TimeoutExpired):
        w.wait(timeout=8)  # no server yet: the worker keeps trying instead of failing or hanging
    server = cluster.server(port=port)
    assert w.wait(timeout=120) == 0, w.log_text()
    assert summary(w)["steps"] == 20
    assert fetch_status(server.status)["version"] == 20


def test_worker_gives_up_when_the_server_never_answers(cluster: Cluster) -> None:
    # a REP socket that reads requests and never replies: the worst kind of server
    ctx = zmq.Context()
    rep = ctx.socket(zmq.ROUTER)
    port = rep.bind_to_random_port("tcp://127.0.0.1")
    try:
        w = cluster.worker(port, "--steps", "5", "--request-timeout", "1", "--server-timeout", "4")
        assert w.wait(timeout=90) == 3
        assert "did not answer" in w.log_text()
    finally:
        rep.close(0)
        ctx.term()


def test_sigterm_stops_server_and_worker_cleanly(cluster: Cluster) -> None:
    server = cluster.server(early=True)
    w = cluster.worker(server.port, "--steps", "100000")
    wait_until(lambda: fetch_status(server.status)["version"] > 3, 120, "the worker to push")
    w.proc.send_signal(signal.SIGTERM)
    assert w.wait(timeout=60) == 0
    s = summary(w)
    assert s["stopped_early"] and s["steps"] > 3
    server.proc.send_signal(signal.SIGTERM)
    assert server.wait(timeout=60) == 0
    assert "stopped at version" in server.log_text()
