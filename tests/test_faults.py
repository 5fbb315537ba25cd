"""Faults with real processes and real signals: nothing hangs, nothing is lost, nothing bad
is applied. The process scenarios are in the slow tier; their in-process counterparts for the
fast tier are in tests/test_inproc_faults.py."""

from __future__ import annotations

import os
import signal
import socket
from pathlib import Path

import numpy as np
import pytest
from conftest import Cluster, Service, free_ports, summary, wait_until

from downpour.checkpoints.store import CheckpointStore
from downpour.cli.status import fetch_status
from downpour.server.checkpointing.capture import capture
from downpour.server.checkpointing.restore import restore
from downpour.server.state import ParameterState
from downpour.spec import load_spec

# ---------------------------------------------------------------- checkpoints, in-process


def _grads(state: ParameterState, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.normal(size=s).astype(d) for s, d in zip(state.shapes, state.dtypes, strict=True)]


def test_restored_weights_and_slots_are_bitwise_equal(tmp_path: Path) -> None:
    spec = load_spec("tiny_models:tiny")
    state = ParameterState(spec, "adam", 0.01)
    for i in range(5):
        state.apply(_grads(state, i))
    saved = capture(state)
    store = CheckpointStore(tmp_path, keep=2)
    store.write(state.version, saved, {"fingerprint": state.fingerprint, "workers": {"w": 7}})

    fresh = ParameterState(spec, "adam", 0.01, seed=99)  # different initial weights
    ckpt = store.latest()
    assert ckpt is not None and ckpt.meta["workers"] == {"w": 7}
    restore(fresh, ckpt)
    assert fresh.version == 5
    again = capture(fresh)
    slots = [k for k in saved if k.startswith("optimizer/") and "learning_rate" not in k]
    assert len(slots) >= 2 * len(state.variables)  # Adam: momentum and velocity per variable
    for key in saved:
        if "learning_rate" not in key:
            assert again[key].dtype == saved[key].dtype
            assert again[key].tobytes() == saved[key].tobytes(), key
    # and training goes on identically from the restored state
    g = _grads(state, 42)
    state.apply(g)
    fresh.apply(g)
    for a, b in zip(state.variables, fresh.variables, strict=True):
        assert a.numpy().tobytes() == b.numpy().tobytes()


def test_store_keeps_k_skips_damaged_and_cleans_leftovers(tmp_path: Path) -> None:
    state = ParameterState(load_spec("tiny_models:tiny"), "sgd", 0.1)
    store = CheckpointStore(tmp_path, keep=2)
    meta = {"fingerprint": state.fingerprint}
    for v in (1, 2, 3):
        store.write(v, capture(state), meta)
    assert [v for v, _ in store.list()] == [2, 3]
    (tmp_path / "ckpt-000000000004.npz.tmp-1234").write_bytes(b"partial")
    (tmp_path / "ckpt-000000000003.npz").write_bytes(b"damaged")  # the newest is broken
    assert store.latest().version == 2  # falls back to the previous one
    assert [p.name for p in store.clean_leftovers()] == ["ckpt-000000000004.npz.tmp-1234"]


# ---------------------------------------------------------------- processes


def _status(server: Service) -> dict:
    return fetch_status(server.status, timeout_s=10)


def _applied_at_least(server: Service, n: int) -> bool:
    return _status(server)["version"] >= n


@pytest.mark.slow
def test_sigterm_applies_what_was_received_and_checkpoints(
    cluster: Cluster, tmp_path: Path
) -> None:
    state_dir = tmp_path / "state"
    args = ("--state-dir", str(state_dir), "--checkpoint-every", "0", "--checkpoint-secs", "0")
    server = cluster.server(*args, early=True)
    workers = [cluster.worker(server.port, "--steps", "25", worker_id=f"w{i}") for i in range(2)]
    for w in workers:
        assert w.wait(timeout=120) == 0, w.log_text()
    pushed = sum(summary(w)["pushes"] for w in workers)
    server.proc.send_signal(signal.SIGTERM)
    assert server.wait(timeout=60) == 0
    store = CheckpointStore(state_dir)
    assert [v for v, _ in store.list()] == [pushed]  # the final checkpoint holds every update
    ckpt = store.latest()
    assert ckpt.meta["workers"] == {"w0": 25, "w1": 25}

    again = cluster.server(*args)
    doc = _status(again)
    assert doc["version"] == doc["restored_from"] == pushed
    # a restarted worker resumes its sequence where the server's checkpoint left it
    w = cluster.worker(again.info["port"], "--steps", "5", worker_id="w0")
    assert w.wait(timeout=120) == 0, w.log_text()
    doc = _status(again)
    assert doc["version"] == pushed + 5 and doc["rejected_total"] == 0
    assert doc["workers"]["w0"]["last_seq"] == 30


@pytest.mark.slow
def test_sigkill_while_writing_a_checkpoint_keeps_the_previous_one(
    cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state_dir = tmp_path / "state"
    monkeypatch.setenv("DOWNPOUR_TEST_CHECKPOINT_DELAY_S", "2")
    args = (
        "--state-dir",
        str(state_dir),
        "--checkpoint-every",
        "10",
        "--checkpoint-secs",
        "0",
        "--keep-checkpoints",
        "2",
    )
    server = cluster.server(*args, early=True)
    cluster.worker(server.port, "--steps", "100000", worker_id="w0")
    store = CheckpointStore(state_dir)
    wait_until(lambda: len(store.list()) >= 1, 120, "a first complete checkpoint")
    complete = {v for v, _ in store.list()}

    def writing() -> bool:
        tmp = [p for p in state_dir.iterdir() if ".tmp-" in p.name]
        return bool(tmp) and int(tmp[0].name[5:17]) not in complete

    wait_until(writing, 120, "the next checkpoint write to be under way")
    server.proc.kill()
    server.wait(timeout=30)
    leftovers = [p for p in state_dir.iterdir() if ".tmp-" in p.name]
    assert leftovers  # the kill did land mid-write

    monkeypatch.delenv("DOWNPOUR_TEST_CHECKPOINT_DELAY_S")
    newest = max(v for v, _ in store.list())
    again = cluster.server(*args)
    doc = _status(again)
    assert doc["restored_from"] == newest  # the previous checkpoint still loads
    assert not [p for p in state_dir.iterdir() if ".tmp-" in p.name]  # leftovers cleaned
    assert len(store.list()) <= 2


@pytest.mark.slow
def test_killed_worker_shows_missing_others_unaffected_and_it_rejoins(cluster: Cluster) -> None:
    server = cluster.server(
        "--missing-after", "1", "--gone-after", "30", model="tiny_models:wide", early=True
    )
    port = server.port
    wargs = ("--steps", "100000", "--heartbeat", "0.3")
    victim = cluster.worker(port, *wargs, model="tiny_models:wide", worker_id="victim")
    cluster.worker(port, *wargs, model="tiny_models:wide", worker_id="honest")

    def both_applied(n: int) -> bool:
        ws = _status(server)["workers"]
        return all(ws.get(w, {}).get("applied", 0) >= n for w in ("victim", "honest"))

    wait_until(lambda: both_applied(5), 120, "both workers to train")
    victim.proc.kill()  # SIGKILL, most likely in the middle of an 8.5 MB push
    victim.wait(timeout=30)
    doc = wait_until(
        lambda: (d := _status(server))["workers"]["victim"]["state"] == "missing" and d,
        3 * 1.0 + 2,
        "the killed worker to show as missing",
    )
    assert doc["workers"]["honest"]["state"] == "alive"
    applied_honest = doc["workers"]["honest"]["applied"]
    wait_until(
        lambda: _status(server)["workers"]["honest"]["applied"] > applied_honest + 5,
        60,
        "the honest worker to keep training",
    )

    before = _status(server)["workers"]["victim"]["applied"]
    cluster.worker(port, *wargs, model="tiny_models:wide", worker_id="victim")
    wait_until(
        lambda: _status(server)["workers"]["victim"]["applied"] > before + 3,
        120,
        "the restarted worker to rejoin and train",
    )
    doc = _status(server)
    assert doc["workers"]["victim"]["state"] == "alive"
    # a partial message is never applied: nothing was cut or rejected, every update is whole
    assert doc["rejected_total"] == 0
    assert doc["version"] == sum(w["applied"] for w in doc["workers"].values())


@pytest.mark.slow
def test_server_killed_and_restarted_workers_reconnect_and_continue(
    cluster: Cluster, tmp_path: Path
) -> None:
    port, push_port, status_port = free_ports(3)
    args = (
        "--state-dir",
        str(tmp_path / "state"),
        "--checkpoint-every",
        "5",
        "--checkpoint-secs",
        "0",
        "--port",
        str(port),
        "--push-port",
        str(push_port),
        "--status-port",
        str(status_port),
    )
    server = cluster.server(*args)
    # Workers train until told to stop, so the kill always lands mid-training however fast
    # the steps run; the restarted server must then receive pushes from both of them.
    wargs = ("--steps", "100000", "--request-timeout", "1", "--server-timeout", "90")
    workers = [cluster.worker(port, *wargs, worker_id=f"w{i}") for i in range(2)]
    wait_until(lambda: _applied_at_least(server, 20), 120, "training under way")
    server.proc.kill()
    server.wait(timeout=30)
    for w in workers:
        assert w.proc.poll() is None  # no worker crashed with its server

    again = cluster.server(*args)
    restored = _status(again)["restored_from"]
    assert restored is not None and restored >= 15

    def both_pushed_again() -> bool:
        ws = _status(again)["workers"]
        return all(ws.get(w, {}).get("applied", 0) >= 5 for w in ("w0", "w1"))

    wait_until(both_pushed_again, 180, "both workers to reconnect and train")
    for w in workers:
        w.proc.send_signal(signal.SIGTERM)
    for w in workers:
        assert w.wait(timeout=60) == 0, w.log_text()
    doc = _status(again)
    assert doc["version"] >= restored + 10  # training continued from the restored version
    steps = [summary(w)["steps"] for w in workers]
    assert min(steps) >= 5 and sum(steps) >= doc["version"]  # every update came from a step


@pytest.mark.slow
def test_server_killed_and_restarted_on_another_push_port_workers_follow(
    cluster: Cluster, tmp_path: Path
) -> None:
    """--push-port 0, SIGKILL, restart from the checkpoint on the same REQ port: the new
    gradient port differs, and every worker sees the new incarnation in a reply, says hello
    again, and has its gradients applied by the new server; the workers then stop cleanly."""
    args = ("--state-dir", str(tmp_path / "state"), "--checkpoint-every", "5")
    args += ("--checkpoint-secs", "0")
    server = cluster.server(*args)  # --push-port 0 and --status-port 0 (Cluster.server)
    port, old_push = server.info["port"], server.info["push_port"]
    wargs = ("--steps", "1000000", "--request-timeout", "1", "--server-timeout", "120")
    workers = [cluster.worker(port, *wargs, worker_id=f"w{i}") for i in range(2)]

    def every_worker_applied(srv: Service, n: int) -> bool:
        per_worker = _status(srv)["workers"]
        return all(per_worker.get(f"w{i}", {}).get("applied", 0) >= n for i in range(2))

    # every worker greeted the first server: a slow starter would greet the new one only once
    wait_until(lambda: every_worker_applied(server, 5), 180, "every worker training")
    server.proc.kill()
    server.wait(timeout=30)
    held = socket.socket()  # the old gradient port: taken, never read, so it cannot come back
    held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    held.bind(("127.0.0.1", old_push))
    held.listen(1)
    try:
        again = cluster.server(*args, port=port)
        assert again.info["push_port"] != old_push
        restored = _status(again)["restored_from"]
        assert restored is not None and restored >= 5

        for w in workers:
            assert w.proc.poll() is None, w.log_text()  # no worker gave up on its server
        wait_until(
            lambda: every_worker_applied(again, 10),
            120,
            "the restarted server to apply gradients from every worker",
        )
    finally:
        held.close()
    for w in workers:
        w.proc.send_signal(signal.SIGTERM)
    for w in workers:
        assert w.wait(timeout=60) == 0, w.log_text()
    assert all(summary(w)["rehellos"] >= 1 for w in workers)


@pytest.mark.slow
def test_sync_round_dies_with_its_server_and_workers_push_again_at_once(
    cluster: Cluster, tmp_path: Path
) -> None:
    """sync:2/2, server killed -9 and restarted from a checkpoint some versions back: the
    workers, waiting for a version the old server would have made, see the new incarnation
    and compute from the restored weights at once. Waiting out --sync-wait (300 s here)
    would overrun the bound below; no wait may time out."""
    port, push_port, status_port = free_ports(3)
    args = ("--policy", "sync:2/2", "--state-dir", str(tmp_path / "state"))
    args += ("--checkpoint-every", "10", "--checkpoint-secs", "0")
    args += ("--port", str(port), "--push-port", str(push_port), "--status-port", str(status_port))
    server = cluster.server(*args)
    # the workers train until told to stop, so the kill always lands mid-training
    wargs = ("--steps", "100000", "--request-timeout", "1", "--server-timeout", "90")
    wargs += ("--sync-wait", "300")
    workers = [cluster.worker(port, *wargs, worker_id=f"w{i}") for i in range(2)]
    wait_until(lambda: _applied_at_least(server, 14), 120, "sync rounds under way")
    server.proc.kill()
    server.wait(timeout=30)

    again = cluster.server(*args)
    restored = _status(again)["restored_from"]
    assert restored is not None and restored >= 10
    wait_until(
        lambda: _applied_at_least(again, restored + 100), 120, "the restarted server's rounds"
    )
    for w in workers:
        w.proc.send_signal(signal.SIGTERM)
    for w in workers:
        assert w.wait(timeout=60) == 0, w.log_text()
    sums = [summary(w) for w in workers]
    assert [s["sync_wait_timeouts"] for s in sums] == [0, 0]
    doc = _status(again)
    assert doc["version"] >= restored + 100  # the restarted server's rounds went on
    assert doc["staleness"]["max"] == 0  # sync: only gradients from the current weights


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.mark.slow
def test_stopped_server_gives_backpressure_then_training_resumes(cluster: Cluster) -> None:
    server = cluster.server(model="tiny_models:wide", early=True)
    w = cluster.worker(
        server.port,
        "--steps",
        "100000",
        "--push-timeout",
        "0.5",
        "--request-timeout",
        "2",
        "--server-timeout",
        "60",
        "--n-fetch",
        "1000",
        model="tiny_models:wide",
        worker_id="w0",
    )
    wait_until(lambda: _applied_at_least(server, 5), 120, "training under way")
    rss_before = _rss_mb(w.proc.pid)
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        wait_until(lambda: "push blocked" in w.log_text(), 60, "the worker to report back-pressure")
        rss_blocked = _rss_mb(w.proc.pid)
        assert w.proc.poll() is None
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
    assert rss_blocked < rss_before + 200, (rss_before, rss_blocked)  # queue bounded by the HWM
    version = _status(server)["version"]
    wait_until(lambda: _applied_at_least(server, version + 10), 120, "training to resume")
    wait_until(
        lambda: _status(server)["workers"]["w0"]["reported"].get("backpressure", 0) > 0,
        60,
        "the worker's back-pressure count to reach the server with its later pushes",
    )
