"""Sharded parameter servers: the same arithmetic as one server, training through real shard
processes, refusal of a worker that splits the model differently, and a shard killed and
restarted while the other keeps serving. The process scenarios are in the slow tier; their
in-process counterparts for the fast tier are in tests/test_inproc_shards.py."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, Cluster, Service, env, free_ports, pull_weights, summary, wait_until

from downpour.checkpoints.store import CheckpointStore
from downpour.cli.status import fetch_status
from downpour.model.build import build_model, evaluate
from downpour.net.cluster import partition_of, pull_full
from downpour.spec import load_spec


def test_sharded_apply_is_the_same_arithmetic_as_one_server() -> None:
    """Two shard states fed the split gradients end where one unsharded state ends."""
    from downpour.server.state import ParameterState

    spec = load_spec("tiny_models:tiny")
    whole = ParameterState(spec, "adam", 1e-2, seed=5)
    shards = [ParameterState(spec, "adam", 1e-2, seed=5, shard=i, num_shards=2) for i in range(2)]
    part = shards[0].partition
    assert part.digest == shards[1].partition.digest
    assert any(not p.whole for parts in part.shards for p in parts)  # a row-split variable
    rng = np.random.default_rng(1)
    for _ in range(4):
        grads = [rng.standard_normal(s).astype(np.float32) for s in whole.shapes]
        whole.apply(grads)
        for st, piece in zip(shards, part.split(grads), strict=True):
            st.apply(piece)
    joined = part.join([st.weights()[1] for st in shards], len(whole.names))
    for name, a, b in zip(whole.names, joined, whole.weights()[1], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7, err_msg=name)
    assert [st.version for st in shards] == [4, 4] and all(st.apply_traces == 1 for st in shards)


def start_shards(
    cluster: Cluster, n: int, *args: str, model: str = "tiny_models:tiny"
) -> list[Service]:
    """``n`` shard servers of one model, each on its own ports, starting side by side."""
    return [
        cluster.server("--shard", str(i), "--num-shards", str(n), *args, model=model, early=True)
        for i in range(n)
    ]


def held_out_accuracy(
    servers: list[Service], model: str = "tiny_models:tiny"
) -> tuple[list[int], float]:
    """(versions, held-out accuracy) of the whole model pulled from every shard."""
    spec = load_spec(model)
    keras_model = build_model(spec)
    versions, arrays = pull_full([s.rep for s in servers], keras_model.trainable_variables)
    for v, a in zip(keras_model.trainable_variables, arrays, strict=True):
        v.assign(a)
    data = spec.load_data(None)
    return versions, float(evaluate(spec, keras_model, data.x_test, data.y_test))


@pytest.mark.slow
def test_two_shards_two_workers_train_and_show_one_cluster(cluster: Cluster) -> None:
    servers = start_shards(cluster, 2)
    ports = [s.port for s in servers]
    assert servers[0].info["partition"] == servers[1].info["partition"]
    workers = [cluster.worker(ports, "--steps", "60", worker_id=f"w{i}") for i in range(2)]
    for w in workers:
        assert w.wait(timeout=180) == 0, w.log_text()
    sums = [summary(w) for w in workers]
    assert all(s["pushes"] == 60 and len(s["versions"]) == 2 for s in sums)

    docs = [fetch_status(s.status) for s in servers]
    for i, doc in enumerate(docs):
        assert (doc["shard"], doc["num_shards"]) == (i, 2)
        assert doc["version"] == 120 and doc["rejected_total"] == 0  # every slice applied
        assert doc["staleness"]["count"] == 120  # staleness is tracked per shard
        assert set(doc["workers"]) == {"w0", "w1"}
    assert docs[0]["shard_bytes"] + docs[1]["shard_bytes"] == sum(
        int(np.prod(v.shape)) * 4
        for v in build_model(load_spec("tiny_models:tiny")).trainable_variables
    )
    versions, acc = held_out_accuracy(servers)
    assert versions == [120, 120]
    assert acc > 0.9, f"held-out accuracy {acc} from the shards' joined weights"

    out = subprocess.run(
        [sys.executable, "-m", "downpour", "status", *(s.status for s in servers)],
        capture_output=True,
        text=True,
        env=env(),
        cwd=ROOT,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "shards: 2/2 present" in out.stdout and "versions 120..120" in out.stdout
    assert "0/2" in out.stdout and "1/2" in out.stdout


@pytest.mark.slow
def test_worker_with_another_partition_is_refused(cluster: Cluster) -> None:
    servers = start_shards(cluster, 2)
    ports = [s.port for s in servers]
    swapped = cluster.worker(ports[::-1], "--steps", "5", worker_id="swapped")
    only_one = cluster.worker(ports[:1], "--steps", "5", worker_id="one")
    for w in (swapped, only_one):
        assert w.wait(timeout=120) == 3, w.log_text()
        assert "refused this worker" in w.log_text() and "shard order" in w.log_text()
    doc = fetch_status(servers[1].status)
    assert doc["rejected"].get("partition", 0) >= 1 and doc["version"] == 0


@pytest.mark.slow
def test_show_partition_prints_the_table() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "downpour", "server", "--show-partition", "--num-shards", "2"],
        capture_output=True,
        text=True,
        env=env(),
        cwd=ROOT,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "fc1/kernel[0:1568]" in out.stdout and "fc1/kernel[1568:3136]" in out.stdout
    assert "shard 0:" in out.stdout and "shard 1:" in out.stdout


@pytest.mark.slow
def test_a_shard_killed_and_restarted_resumes_while_the_other_keeps_serving(
    cluster: Cluster, tmp_path: Path
) -> None:
    ports = [free_ports(3) for _ in range(2)]

    def shard_args(i: int) -> tuple[str, ...]:
        port, push_port, status_port = ports[i]
        return (
            "--shard", str(i), "--num-shards", "2",
            "--state-dir", str(tmp_path / f"state-{i}"),
            "--checkpoint-every", "10", "--checkpoint-secs", "0",
            "--port", str(port), "--push-port", str(push_port), "--status-port", str(status_port),
        )  # fmt: skip

    servers = [cluster.server(*shard_args(i)) for i in range(2)]
    # Workers train until told to stop, so the kill always lands mid-training however fast
    # the steps run.
    wargs = ("--steps", "100000", "--request-timeout", "1", "--server-timeout", "90")
    workers = [cluster.worker([p[0] for p in ports], *wargs, worker_id=f"w{i}") for i in range(2)]
    wait_until(
        lambda: all(fetch_status(s.status, timeout_s=10)["version"] >= 40 for s in servers),
        120,
        "training under way on both shards",
    )
    servers[1].proc.kill()
    servers[1].wait(timeout=30)
    # the surviving shard still answers status and weight pulls
    before = fetch_status(servers[0].status, timeout_s=10)
    assert before["shard"] == 0 and before["version"] >= 40  # (each shard applies in its own time)
    version0, _ = pull_weights(servers[0].rep)
    assert version0 >= before["version"]
    for w in workers:
        assert w.proc.poll() is None  # the workers wait for the dead shard; none crashed

    again = cluster.server(*shard_args(1))
    doc = fetch_status(again.status, timeout_s=10)
    restored = doc["restored_from"]
    assert restored is not None and restored >= 30 and doc["shard"] == 1
    wait_until(
        lambda: fetch_status(again.status, timeout_s=10)["version"] >= restored + 60,
        240,
        "the restarted shard to train on",
    )
    for w in workers:
        w.proc.send_signal(signal.SIGTERM)
    for w in workers:
        assert w.wait(timeout=60) == 0, w.log_text()
    steps = [summary(w)["steps"] for w in workers]
    after = [fetch_status(s.status, timeout_s=10) for s in (servers[0], again)]
    assert after[1]["version"] >= restored + 60  # the restarted shard trained on
    assert after[0]["version"] > before["version"]  # and so did the one that stayed
    assert sum(steps) >= after[0]["version"]  # each shard's update came from one step
    for i in range(2):  # each shard's checkpoints hold its own slice only
        ckpt = CheckpointStore(tmp_path / f"state-{i}", 3).latest()
        assert ckpt is not None and ckpt.meta["shard"] == i and ckpt.meta["num_shards"] == 2
        wire = {k.removeprefix("model/") for k in ckpt.arrays if k.startswith("model/")}
        assert wire == {p.wire_name for p in servers_partition().shards[i]}
    _, acc = held_out_accuracy([servers[0], again])
    assert acc > 0.85, f"held-out accuracy {acc} after a shard restart"


def servers_partition():  # noqa: ANN201
    """The partition of tiny_models:tiny over 2 shards, as the workers compute it."""
    return partition_of(build_model(load_spec("tiny_models:tiny")).trainable_variables, 2)


@pytest.mark.slow
def test_more_shards_than_the_model_can_fill_is_refused_at_start(cluster: Cluster) -> None:
    """tiny's 4 variables make at most 81 row pieces: 100 shards cannot all hold something."""
    server = cluster.server("--shard", "0", "--num-shards", "100", wait=False)
    assert server.proc.wait(timeout=120) == 2
    assert "empty" in server.log_text()
