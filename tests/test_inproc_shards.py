"""Fast tier: sharded servers in-process, two shard servers on real loopback sockets.

The in-process counterparts of tests/test_shards.py's process scenarios (which stay in the
slow tier): workers train on two shards and ``downpour status`` shows one cluster, a worker
that splits the model differently is refused, a shard that goes away and comes back on its
ports resumes from its checkpoint while the other keeps serving, and the start-up refusals.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import free_ports, pull_weights, wait_until
from inproc import InprocServer, WorkerThread, make_worker, serving, settle, train
from test_shards import held_out_accuracy, servers_partition

from downpour.checkpoints.store import CheckpointStore
from downpour.cli import main as cli_main
from downpour.cli.status import fetch_status
from downpour.model.build import build_model
from downpour.server.main import show_partition
from downpour.spec import load_spec
from downpour.worker.service import WorkerError


def test_two_shards_two_workers_train_and_show_one_cluster(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with serving(shard=0, num_shards=2) as s0, serving(shard=1, num_shards=2) as s1:
        servers = [s0, s1]
        assert s0.info["partition"] == s1.info["partition"]
        ports = [s.port for s in servers]
        threads = [WorkerThread(make_worker(ports, worker_id=f"w{i}", steps=60)) for i in (0, 1)]
        sums = [t.result() for t in threads]
        assert all(s["pushes"] == 60 and len(s["versions"]) == 2 for s in sums)
        for s in servers:
            settle(s.status, sums)

        docs = [fetch_status(s.status) for s in servers]
        for i, doc in enumerate(docs):
            assert (doc["shard"], doc["num_shards"]) == (i, 2)
            assert doc["version"] == 120 and doc["rejected_total"] == 0  # every slice applied
            assert doc["staleness"]["count"] == 120  # staleness is tracked per shard
            assert set(doc["workers"]) == {"w0", "w1"}
            assert doc["slot_bytes"] == 2 * doc["shard_bytes"]  # Adam: two slots per part
            assert doc["peak_rss_mib"] > 0
        whole = build_model(load_spec("tiny_models:tiny")).trainable_variables
        assert docs[0]["shard_bytes"] + docs[1]["shard_bytes"] == sum(
            int(np.prod(v.shape)) * 4 for v in whole
        )
        versions, acc = held_out_accuracy(servers)
        assert versions == [120, 120]
        assert acc > 0.9, f"held-out accuracy {acc} from the shards' joined weights"

        capsys.readouterr()
        assert cli_main(["status", *(s.status for s in servers)]) == 0
        out = capsys.readouterr().out
        assert "shards: 2/2 present" in out and "versions 120..120" in out
        assert "0/2" in out and "1/2" in out
        assert cli_main(["status", s0.status]) == 0
        out = capsys.readouterr().out
        mb = docs[0]["shard_bytes"] / 1e6, docs[0]["slot_bytes"] / 1e6
        assert f"holds {mb[0]:,.1f} MB of parameters, {mb[1]:,.1f} MB of optimizer slots" in out


def test_worker_with_another_partition_is_refused() -> None:
    with serving(shard=0, num_shards=2) as s0, serving(shard=1, num_shards=2) as s1:
        for ports, wid in (([s1.port, s0.port], "swapped"), ([s0.port], "one")):
            with pytest.raises(WorkerError, match="refused this worker") as err:
                train(ports, worker_id=wid, steps=5)
            assert "shard order" in str(err.value)
        doc = wait_until(
            lambda: (d := fetch_status(s1.status))["rejected_total"] and d, 30, "a refusal"
        )
        assert doc["rejected"].get("partition", 0) >= 1 and doc["version"] == 0


def test_a_shard_gone_and_back_resumes_while_the_other_keeps_serving(tmp_path: Path) -> None:
    ports = [free_ports(3) for _ in range(2)]

    def shard(i: int) -> InprocServer:
        port, push_port, status_port = ports[i]
        return InprocServer(
            shard=i,
            num_shards=2,
            state_dir=str(tmp_path / f"state-{i}"),
            checkpoint_every=10,
            checkpoint_secs=0.0,
            port=port,
            push_port=push_port,
            status_port=status_port,
        )

    servers = [shard(0), shard(1)]
    wcfg = {"steps": 150, "request_timeout_s": 1.0, "server_timeout_s": 60.0}
    try:
        threads = [
            WorkerThread(make_worker([p[0] for p in ports], worker_id=f"w{i}", **wcfg))
            for i in (0, 1)
        ]
        wait_until(
            lambda: all(fetch_status(s.status)["version"] >= 40 for s in servers),
            60,
            "training under way on both shards",
        )
        servers[1].stop()
        # the remaining shard still answers status and weight pulls
        before = fetch_status(servers[0].status)
        assert before["shard"] == 0 and before["version"] >= 40
        assert pull_weights(servers[0].rep)[0] >= before["version"]
        assert all(t.error is None for t in threads)  # the workers wait for the absent shard

        servers[1] = shard(1)
        doc = fetch_status(servers[1].status)
        restored = doc["restored_from"]
        assert restored is not None and restored >= 40 and doc["shard"] == 1
        sums = [t.result(180) for t in threads]
        assert all(s["steps"] == 150 for s in sums)
        for s in servers:
            settle(s.status, sums)
        after = [fetch_status(s.status) for s in servers]
        assert after[1]["version"] > restored  # the restarted shard trained on
        assert after[0]["version"] > before["version"]  # and so did the one that stayed
        _, acc = held_out_accuracy(servers)
        assert acc > 0.85, f"held-out accuracy {acc} after a shard restart"
    finally:
        for s in servers:
            s.stop()
    for i in range(2):  # each shard's checkpoints hold its own slice only
        ckpt = CheckpointStore(tmp_path / f"state-{i}", 3).latest()
        assert ckpt is not None and ckpt.meta["shard"] == i and ckpt.meta["num_shards"] == 2
        names = {k.removeprefix("model/") for k in ckpt.arrays if k.startswith("model/")}
        assert names == {p.wire_name for p in servers_partition().shards[i]}


def test_more_shards_than_the_model_can_fill_is_refused_at_start() -> None:
    """tiny's 4 variables make at most 81 row pieces: 100 shards cannot all hold something."""
    with pytest.raises(ValueError, match="empty"):
        InprocServer(shard=0, num_shards=100)


def test_show_partition_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert show_partition("downpour.models:deep_mnist", 2) == 0
    out = capsys.readouterr().out
    assert "fc1/kernel[0:1568]" in out and "fc1/kernel[1568:3136]" in out
    assert "shard 0:" in out and "shard 1:" in out
