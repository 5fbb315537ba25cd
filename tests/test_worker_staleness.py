"""The staleness histogram per worker: a few pushes of known staleness over real sockets to a
server in this process; the status document, ``downpour status`` and the Prometheus
histogram ``downpour_worker_staleness{worker,le}`` carry the right counts."""

from __future__ import annotations

import urllib.request

import numpy as np
import zmq
from conftest import pull_weights, wait_until
from inproc import serving
from prometheus_client.parser import text_string_to_metric_families

from downpour import wire
from downpour.cli.status import render
from downpour.net.client import fetch_status
from downpour.wire import Message

NAMES = ["hidden/kernel", "hidden/bias", "logits/kernel", "logits/bias"]


def test_status_and_prometheus_carry_each_workers_staleness_histogram() -> None:
    with serving(optimizer="sgd", metrics_port=0) as server:
        _, w = pull_weights(server.rep)
        zeros = {n: np.zeros_like(a) for n, a in zip(NAMES, w, strict=True)}
        # (worker, seq, base_version), sent in order on one socket and applied one by one
        # (async), so each push's staleness is the number of updates before it minus its base
        pushes = [("a", 1, 0), ("a", 2, 0), ("a", 3, 0), ("b", 1, 3), ("a", 4, 0), ("a", 5, 5)]
        staleness = {"a": [0, 1, 2, 4, 0], "b": [0]}  # (version at apply) - base_version
        ctx = zmq.Context()
        sock = ctx.socket(zmq.PUSH)
        sock.connect(server.push)
        try:
            for sender, seq, base in pushes:
                msg = Message(wire.PUSH, sender, seq=seq, base_version=base, tensors=zeros)
                sock.send_multipart(wire.encode(msg))
            doc = wait_until(
                lambda: (d := fetch_status(server.status))["version"] == len(pushes) and d,
                30,
                "every push applied",
            )
        finally:
            sock.close(0)
            ctx.term()
        port = server.info["metrics_port"]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            text = resp.read().decode()

    # the status document: per-bucket counts over the fixed bounds, sum, p50/p99
    a = doc["workers"]["a"]["staleness_histogram"]
    counts = dict((str(b), c) for b, c in a["buckets"])
    assert counts == {
        "0": 2, "1": 1, "2": 1, "4": 1, "8": 0, "16": 0, "32": 0, "64": 0, "+Inf": 0,
    }  # fmt: skip
    assert a["count"] == 5 and a["sum"] == sum(staleness["a"])
    assert a["p50"] == 1 and a["p99"] == 4
    assert doc["workers"]["b"]["staleness_histogram"]["count"] == 1
    assert doc["workers"]["a"]["staleness"] == 0  # the last value stays as it was

    # downpour status shows the quantiles
    row = next(line for line in render(doc).splitlines() if line.startswith("a "))
    assert row.split()[-1] == "1/4"

    # Prometheus: one histogram, cumulative buckets per worker, _sum and _count
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    hist = fams["downpour_worker_staleness"]
    assert hist.type == "histogram"
    samples: dict[tuple[str, str, str], float] = {
        (s.name, s.labels["worker"], s.labels.get("le", "")): s.value for s in hist.samples
    }
    le = ["0.0", "1.0", "2.0", "4.0", "8.0", "16.0", "32.0", "64.0", "+Inf"]
    bucket_a = [samples[("downpour_worker_staleness_bucket", "a", x)] for x in le]
    assert bucket_a == [2, 3, 4, 5, 5, 5, 5, 5, 5]
    assert samples[("downpour_worker_staleness_count", "a", "")] == 5
    assert samples[("downpour_worker_staleness_sum", "a", "")] == sum(staleness["a"])
    assert samples[("downpour_worker_staleness_count", "b", "")] == 1
    assert {s.labels["worker"] for s in hist.samples} == {"a", "b"}
    assert fams["downpour_worker_staleness_last"].type == "gauge"
