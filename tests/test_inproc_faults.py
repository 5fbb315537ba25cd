"""Fast tier: faults in-process, real sockets and real checkpoints on disk.

The in-process counterparts of tests/test_faults.py's process scenarios (which stay in the
slow tier, with real signals): a stop applies what was received and checkpoints, a restart
restores and workers resume their sequences; a silent worker shows missing and rejoins; a
server that goes away and comes back on the same ports is found again, also mid sync round,
and one that comes back on another push port is greeted again and gets the gradients;
a push socket nobody reads gives counted back-pressure, not a crash or a hang.
"""

from __future__ import annotations

import contextlib
import socket
from pathlib import Path

import pytest
import zmq
from conftest import free_ports, wait_until
from inproc import InprocServer, WorkerThread, make_worker, serving, settle, train

from downpour.checkpoints.store import CheckpointStore
from downpour.cli.status import fetch_status
from downpour.worker.service import WorkerError

FINAL_ONLY = {"checkpoint_every": 0, "checkpoint_secs": 0.0}


def test_stop_applies_what_was_received_checkpoints_and_a_restart_restores(
    tmp_path: Path,
) -> None:
    state_dir = str(tmp_path / "state")
    with serving(state_dir=state_dir, **FINAL_ONLY) as server:
        assert fetch_status(server.status)["restore_s"] is None  # nothing to restore
        threads = [
            WorkerThread(make_worker(server.port, worker_id=f"w{i}", steps=25)) for i in (0, 1)
        ]
        sums = [t.result() for t in threads]
        settle(server.status, sums)
    pushed = sum(s["pushes"] for s in sums)
    store = CheckpointStore(state_dir)
    assert [v for v, _ in store.list()] == [pushed]  # the final checkpoint holds every update
    assert store.latest().meta["workers"] == {"w0": 25, "w1": 25}

    with serving(state_dir=state_dir, **FINAL_ONLY) as again:
        doc = fetch_status(again.status)
        assert doc["version"] == doc["restored_from"] == pushed
        assert doc["restore_s"] > 0  # how long reading and assigning it took
        # a restarted worker resumes its sequence where the server's checkpoint left it
        s = train(again.port, worker_id="w0", steps=5)
        settle(again.status, [s])
        doc = fetch_status(again.status)
        assert doc["version"] == pushed + 5 and doc["rejected_total"] == 0
        assert doc["workers"]["w0"]["last_seq"] == 30


def test_a_silent_worker_shows_missing_the_other_trains_and_it_rejoins() -> None:
    with serving(missing_after_s=1.0, gone_after_s=30.0) as server:
        endless = {"steps": 100_000, "heartbeat_s": 0.3}
        victim = WorkerThread(make_worker(server.port, worker_id="victim", **endless))
        honest = WorkerThread(make_worker(server.port, worker_id="honest", **endless))
        try:

            def applied(wid: str) -> int:
                return fetch_status(server.status)["workers"].get(wid, {}).get("applied", 0)

            wait_until(lambda: min(applied("victim"), applied("honest")) >= 5, 60, "training")
            victim.worker.stop()
            victim.result()
            doc = wait_until(
                lambda: (
                    (d := fetch_status(server.status))["workers"]["victim"]["state"] == "missing"
                    and d
                ),
                30,
                "the silent worker to show as missing",
            )
            assert doc["workers"]["honest"]["state"] == "alive"
            honest_before = doc["workers"]["honest"]["applied"]
            wait_until(lambda: applied("honest") > honest_before + 5, 60, "the other to train")

            before = applied("victim")
            again = WorkerThread(make_worker(server.port, worker_id="victim", **endless))
            try:
                wait_until(lambda: applied("victim") > before + 3, 60, "the worker to rejoin")
            finally:
                again.worker.stop()
                again.result()
            doc = fetch_status(server.status)
            assert doc["workers"]["victim"]["state"] == "alive"
            assert doc["rejected_total"] == 0
        finally:
            honest.worker.stop()
            honest.result()


@pytest.mark.parametrize("policy", ["async", "sync:2/2"])
def test_server_gone_and_back_on_its_ports_workers_reconnect_and_continue(
    tmp_path: Path, policy: str
) -> None:
    port, push_port, status_port = free_ports(3)
    config = {
        "port": port,
        "push_port": push_port,
        "status_port": status_port,
        "policy": policy,
        "state_dir": str(tmp_path / "state"),
        "checkpoint_every": 5,
        "checkpoint_secs": 0.0,
    }
    wcfg = {"steps": 100_000, "request_timeout_s": 1.0, "server_timeout_s": 60.0}
    first = InprocServer(**config)
    threads: list[WorkerThread] = []
    try:
        threads = [
            WorkerThread(make_worker(port, worker_id=f"w{i}", sync_wait_s=60, **wcfg))
            for i in (0, 1)
        ]
        wait_until(lambda: fetch_status(first.status)["version"] >= 14, 60, "training")
    finally:
        first.stop()  # the workers' server goes away mid-training
    try:
        assert all(t.error is None for t in threads)  # no worker failed with its server
        with serving(**config) as again:
            restored = fetch_status(again.status)["restored_from"]
            assert restored is not None and restored >= 10

            def both_back() -> dict | bool:
                """Both workers have reconnected and had gradients applied, and the version
                moved on: one worker alone can move it while the other is still backing off."""
                d = fetch_status(again.status)
                back = all(d["workers"].get(w, {}).get("applied", 0) > 0 for w in ("w0", "w1"))
                return back and d["version"] > restored + 20 and d

            doc = wait_until(both_back, 60, "both workers to train on from the restored version")
            assert {"w0", "w1"} <= set(doc["workers"])
            if policy.startswith("sync"):
                assert doc["staleness"]["max"] == 0  # sync: only gradients from current weights
    finally:
        for t in threads:
            t.worker.stop()
    for t in threads:  # stopped mid-request is the worker's clear error for a stop, not a fault
        with contextlib.suppress(WorkerError):
            t.result()
        assert t.error is None or "stopped while waiting" in str(t.error), t.error
    # no wait for the next sync version timed out: the new server was seen at once
    assert [t.worker.stats["sync_wait_timeouts"] for t in threads] == [0, 0]


def _hold_port(port: int) -> socket.socket:
    """Take ``port`` on 127.0.0.1 (listening, never accepting, never answering): no server
    started meanwhile can bind it, and whoever connects there is never read."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past the old server's TIME_WAIT
    s.bind(("127.0.0.1", port))
    s.listen(1)
    return s


def test_server_restarted_on_another_push_port_workers_say_hello_again(tmp_path: Path) -> None:
    """The server stops and comes back from its checkpoint on the same REQ port but another
    push port: each worker sees the new incarnation in a reply, says hello again, pushes to
    the new port, and the new server applies gradients from every worker."""
    config = {"state_dir": str(tmp_path / "state"), "checkpoint_every": 5, "checkpoint_secs": 0.0}
    wcfg = {"steps": 100_000, "request_timeout_s": 1.0, "server_timeout_s": 60.0}
    first = InprocServer(**config)
    port, old_push = first.port, first.server.push_port
    threads: list[WorkerThread] = []
    try:
        threads = [WorkerThread(make_worker(port, worker_id=f"w{i}", **wcfg)) for i in (0, 1)]
        wait_until(lambda: fetch_status(first.status)["version"] >= 10, 60, "training")
    finally:
        first.stop()
    held = _hold_port(old_push)  # the old gradient port stays dead
    try:
        with serving(port=port, **config) as again:
            assert again.server.push_port != old_push
            restored = fetch_status(again.status)["restored_from"]
            assert restored is not None and restored >= 5

            def applied(wid: str) -> int:
                return fetch_status(again.status)["workers"].get(wid, {}).get("applied", 0)

            wait_until(
                lambda: min(applied("w0"), applied("w1")) >= 5,
                60,
                "the new server to apply gradients from both workers",
            )
            for t in threads:
                t.worker.stop()
            sums = [t.result(60) for t in threads]
    finally:
        held.close()
        for t in threads:
            t.worker.stop()
    assert all(s["rehellos"] >= 1 for s in sums), sums
    assert all(s["stopped_early"] for s in sums)


def test_a_push_socket_nobody_reads_gives_counted_backpressure() -> None:
    ctx = zmq.Context()
    sink = ctx.socket(zmq.PULL)  # takes connections, never reads: a stalled server
    sink.setsockopt(zmq.RCVHWM, 1)
    sink.setsockopt(zmq.RCVBUF, 4096)
    sink_port = sink.bind_to_random_port("tcp://127.0.0.1")
    try:
        with serving("tiny_models:wide") as server:
            worker = WorkerThread(
                make_worker(
                    server.port,
                    "tiny_models:wide",
                    steps=100_000,
                    push_endpoint=("127.0.0.1", sink_port),
                    push_timeout_s=0.5,
                    push_linger_s=0.0,
                )
            )
            wait_until(lambda: worker.worker.stats["backpressure"] > 0, 60, "back-pressure")
            assert worker.error is None  # blocked, counted, still running
            worker.worker.stop()
            s = worker.result()
            assert s["backpressure"] > 0 and s["stopped_early"]
            assert s["dropped"] >= 1  # the gradient it could not send when told to stop
            assert fetch_status(server.status)["version"] == 0  # nothing reached the server
    finally:
        sink.close(0)
        ctx.term()
