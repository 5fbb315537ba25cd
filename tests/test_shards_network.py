"""Shards on several "machines": 2 shards and 2 workers in 4 network namespaces joined by a
bridge, every socket CURVE-encrypted and authenticated; one shard killed and restarted.

Skips, printing the reason, where namespaces cannot be made (not root, no iproute2).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import netns
import pytest
from conftest import ROOT, Cluster, Service, env, free_ports, summary, wait_until

from downpour.cli.export import export
from downpour.net import security

REASON = netns.available()
pytestmark = [  # slow tier: real processes in network namespaces
    pytest.mark.slow,
    pytest.mark.skipif(REASON is not None, reason=f"no network namespaces: {REASON}"),
]


@pytest.fixture
def network() -> Iterator[netns.Network]:
    with netns.Network(net=78) as net:
        yield net


def status_in(host: netns.Host, server: Service, keys: Path) -> dict[str, Any]:
    """``downpour status --json`` over CURVE with the reader key, run inside ``host``."""
    out = subprocess.run(
        [
            *host.exec_args(), sys.executable, "-m", "downpour", "status", "--json",
            "--timeout", "5", "--key", str(keys / "clients" / "status.key_secret"),
            "--server-key", str(keys / security.SERVER_PUBLIC), server.status,
        ],
        capture_output=True, env=env(), cwd=ROOT, timeout=60, check=True,
    )  # fmt: skip
    return json.loads(out.stdout)


def test_two_shards_two_workers_across_namespaces_with_curve_and_a_shard_restart(
    cluster: Cluster, network: netns.Network, tmp_path: Path
) -> None:
    keys = tmp_path / "keys"
    security.generate_keys(keys, ["w0", "w1"], ["status"])
    hosts = [network.add(n) for n in ("s0", "s1", "w0", "w1")]
    shard_hosts = hosts[:2]
    ports = [free_ports(3) for _ in range(2)]

    def start_shard(i: int) -> Service:
        port, push_port, status_port = ports[i]
        return cluster.server(
            "--host", shard_hosts[i].addr, "--keys", str(keys),
            "--shard", str(i), "--num-shards", "2",
            "--state-dir", str(tmp_path / f"state-{i}"),
            "--checkpoint-every", "20", "--checkpoint-secs", "0",
            "--port", str(port), "--push-port", str(push_port), "--status-port", str(status_port),
            prefix=shard_hosts[i].exec_args(),
        )  # fmt: skip

    shards = [start_shard(i) for i in range(2)]
    servers = ",".join(f"{h.addr}:{p[0]}" for h, p in zip(shard_hosts, ports, strict=True))
    workers = [
        cluster.worker(
            0,
            "--server",
            servers,
            "--steps",
            "100000",  # until SIGTERM: the kill always lands mid-training
            "--key",
            str(keys / "clients" / f"{wid}.key_secret"),
            "--server-key",
            str(keys / security.SERVER_PUBLIC),
            "--request-timeout",
            "2",
            "--server-timeout",
            "120",
            worker_id=wid,
            prefix=h.exec_args(),
        )  # fmt: skip
        for wid, h in (("w0", hosts[2]), ("w1", hosts[3]))
    ]
    wait_until(
        lambda: status_in(hosts[1], shards[1], keys)["version"] >= 60,
        180,
        "both workers to train both shards across the bridge",
    )
    shards[1].proc.kill()
    shards[1].wait(timeout=30)
    doc0 = status_in(hosts[0], shards[0], keys)  # the other shard keeps serving
    assert doc0["shard"] == 0 and doc0["auth"]["mechanism"] == "curve"
    for w in workers:
        assert w.proc.poll() is None  # waiting for the dead shard, within --server-timeout

    again = start_shard(1)
    doc1 = status_in(hosts[1], again, keys)
    assert doc1["restored_from"] is not None and doc1["restored_from"] >= 40
    wait_until(
        lambda: status_in(hosts[1], again, keys)["version"] >= doc1["restored_from"] + 60,
        240,
        "training to resume on the restarted shard",
    )
    for w in workers:
        w.proc.send_signal(signal.SIGTERM)
    for w in workers:
        assert w.wait(timeout=60) == 0, w.log_text()
    steps = [summary(w)["steps"] for w in workers]
    final = [status_in(h, s, keys) for h, s in zip(shard_hosts, (shards[0], again), strict=True)]
    assert final[1]["version"] >= doc1["restored_from"] + 60  # resumed on the restarted shard
    assert sum(steps) >= final[0]["version"]  # each of a shard's updates came from one step
    for d in final:
        assert {"w0", "w1"} <= set(d["workers"]) and d["rejected"].get("identity", 0) == 0
        assert d["partition"] == final[0]["partition"]

    for s in (shards[0], again):  # SIGTERM: each shard writes a final checkpoint of its slice
        s.proc.terminate()
        assert s.wait(timeout=60) == 0, s.log_text()
    result = export(
        [tmp_path / "state-0", tmp_path / "state-1"], tmp_path / "model.keras", "tiny_models:tiny"
    )
    assert result.accuracy is not None and result.accuracy > 0.9, result
