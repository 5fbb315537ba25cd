"""Across a real (virtual) network: a server and two workers in their own network namespaces,
joined by a bridge, with a rate limit on one link and a 10 s partition of another.

Skips, printing the reason, where namespaces cannot be made (not root, no iproute2).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import netns
import pytest
from conftest import ROOT, Cluster, Service, env, summary, wait_until

REASON = netns.available()
pytestmark = [  # slow tier: real processes in network namespaces
    pytest.mark.slow,
    pytest.mark.skipif(REASON is not None, reason=f"no network namespaces: {REASON}"),
]


@pytest.fixture
def network() -> Iterator[netns.Network]:
    with netns.Network() as net:
        yield net


def ns_status(host: netns.Host, server: Service) -> dict[str, Any]:
    """``downpour status --json`` run inside the server's namespace."""
    out = subprocess.run(
        [
            *host.exec_args(),
            sys.executable,
            "-m",
            "downpour",
            "status",
            "--json",
            "--timeout",
            "5",
            server.status,
        ],
        capture_output=True,
        env=env(),
        cwd=ROOT,
        timeout=60,
        check=True,
    )
    return json.loads(out.stdout)


def test_partition_and_rate_limit_across_namespaces(
    cluster: Cluster, network: netns.Network
) -> None:
    srv, h0, h1 = network.add("srv"), network.add("w0"), network.add("w1")
    h1.rate_limit("40mbit")  # w1's link is slow: its pushes queue, it must not be declared gone
    server = cluster.server(
        "--host",
        srv.addr,
        "--insecure",
        "--missing-after",
        "3",
        "--gone-after",
        "60",
        model="tiny_models:wide",
        prefix=srv.exec_args(),
    )
    wargs = (
        "--steps",
        "100000",
        "--request-timeout",
        "2",
        "--server-timeout",
        "120",
        "--heartbeat",
        "0.5",
    )
    w0, w1 = (
        cluster.worker(
            server.info["port"],
            *wargs,
            model="tiny_models:wide",
            worker_id=wid,
            host=srv.addr,
            prefix=h.exec_args(),
        )
        for wid, h in (("w0", h0), ("w1", h1))
    )

    def applied(doc: dict, wid: str) -> int:
        return doc["workers"].get(wid, {}).get("applied", 0)

    wait_until(
        lambda: all(applied(ns_status(srv, server), w) >= 3 for w in ("w0", "w1")),
        180,
        "both workers to train across the bridge",
    )
    h0.link(up=False)  # partition w0 for 10 s (over 3x --missing-after and 5x --request-timeout)
    cut = time.monotonic()
    try:
        doc = wait_until(
            lambda: (d := ns_status(srv, server))["workers"]["w0"]["state"] == "missing" and d,
            20,
            "w0 to show as missing",
        )
        before = applied(doc, "w1")
        wait_until(
            lambda: applied(ns_status(srv, server), "w1") > before,
            30,
            "w1 to keep training during the partition",
        )
        time.sleep(max(0.0, 10 - (time.monotonic() - cut)))  # the fault lasts 10 s (not a sync)
    finally:
        h0.link(up=True)
    seen = applied(ns_status(srv, server), "w0")
    doc = wait_until(
        lambda: (
            (d := ns_status(srv, server))["workers"]["w0"]["state"] == "alive"
            and applied(d, "w0") > seen + 2
            and d
        ),
        120,
        "w0 to come back and train again",
    )
    assert doc["workers"]["w1"]["state"] == "alive"
    assert all(w["state"] != "gone" for w in doc["workers"].values())
    assert doc["rejected"].get("duplicate", 0) == 0  # nothing was applied twice

    for w in (w0, w1):
        w.proc.terminate()
        assert w.wait(timeout=60) == 0, w.log_text()
    pushes = {s["worker"]: s["pushes"] for s in (summary(w0), summary(w1))}

    def accounted() -> dict | None:
        d = ns_status(srv, server)
        ws = d["workers"]
        return (
            d if all(ws[w]["applied"] + ws[w]["rejected"] == n for w, n in pushes.items()) else None
        )

    # accounting: everything each worker sent was applied or rejected; none is unexplained
    final = wait_until(accounted, 30, f"the server to account for every push {pushes}")
    assert final["version"] == sum(w["applied"] for w in final["workers"].values())
