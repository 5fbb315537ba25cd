"""Fast tier: a server and workers train together in this process, on real loopback sockets.

The in-process counterparts of tests/test_integration.py's process scenarios (which stay in
the slow tier): every push applied and accounted, staleness measured, the status document
and ``downpour status --json``, a worker of another model refused, a worker that starts
before its server, a worker that gives up on a server that never answers, stop() paths.
"""

from __future__ import annotations

import json
import logging

import pytest
import zmq
from conftest import free_ports, wait_until
from inproc import WorkerThread, make_worker, serving, train

from downpour.cli import main as cli_main
from downpour.cli.status import fetch_status
from downpour.serving.scoring import Evaluator
from downpour.worker.service import WorkerError


def test_server_and_two_workers_train_and_every_push_is_accounted(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with serving() as server:
        workers = [
            WorkerThread(make_worker(server.port, worker_id=f"w{i}", steps=40)) for i in range(2)
        ]
        sums = [w.result() for w in workers]
        assert [s["steps"] for s in sums] == [40, 40] and all(s["pushes"] == 40 for s in sums)

        doc = wait_until(
            lambda: (d := fetch_status(server.status))["version"] == 80 and d, 30, "80 updates"
        )
        assert doc["updates_applied"] == 80  # every push applied, none lost
        assert set(doc["workers"]) == {"w0", "w1"}
        for w in doc["workers"].values():
            assert w["applied"] == 40 and w["state"] == "alive" and w["staleness"] is not None
        assert doc["staleness"]["count"] == 80
        assert doc["staleness"]["max"] >= 1  # prefetched weights: some updates are stale
        assert doc["apply_traces"] == 1
        assert doc["rejected_total"] == 0

        version, acc = Evaluator("tiny_models:tiny", None).score("127.0.0.1", server.port)
        assert version == 80
        assert acc > 0.5, f"held-out accuracy {acc} is not well above chance (0.25)"

        capsys.readouterr()
        assert cli_main(["status", "--json", server.status]) == 0
        cli = json.loads(capsys.readouterr().out)
        assert cli["version"] == 80 and set(cli["workers"]) == {"w0", "w1"}
        assert set(cli["staleness"]) >= {"mean", "max", "buckets"}
        # every push's payload arrived: the dense float32 gradients in bfloat16 (the
        # workers' default --compress bf16), half their bytes, plus the headers
        payload = server.server.state.payload_bytes
        assert cli["bytes_in"] >= 80 * payload // 2
        assert all(s["compress"] == "bf16" for s in sums)
        assert all(s["bytes_raw"] - s["bytes_sent"] == 40 * payload // 2 for s in sums)


def test_worker_with_another_model_is_refused() -> None:
    with serving() as server:
        with pytest.raises(WorkerError, match="fingerprint") as err:
            train(server.port, "tiny_models:tiny_other", steps=5)
        assert "--model" in str(err.value)
        doc = wait_until(
            lambda: (d := fetch_status(server.status))["rejected_total"] and d, 30, "a rejection"
        )
        assert doc["rejected"] == {"fingerprint": 1}
        assert doc["version"] == 0 and doc["workers"] == {}


def test_worker_started_before_the_server_connects_when_it_comes_up() -> None:
    (port,) = free_ports(1)
    worker = WorkerThread(make_worker(port, steps=20, request_timeout_s=1.0, server_timeout_s=60))
    # no server yet: the worker retries (its reconnect counter moves) instead of failing
    wait_until(lambda: worker.worker.stats["reconnects"] >= 1, 30, "the worker to retry")
    assert worker.error is None and worker.summary is None
    with serving(port=port) as server:
        assert worker.result()["steps"] == 20
        wait_until(lambda: fetch_status(server.status)["version"] == 20, 30, "20 updates")


def test_worker_gives_up_when_the_server_never_answers() -> None:
    ctx = zmq.Context()
    rep = ctx.socket(zmq.ROUTER)  # reads requests and never replies: the worst kind of server
    port = rep.bind_to_random_port("tcp://127.0.0.1")
    try:
        with pytest.raises(WorkerError, match="did not answer"):
            train(port, steps=5, request_timeout_s=1.0, server_timeout_s=4.0)
    finally:
        rep.close(0)
        ctx.term()


def test_stop_ends_a_worker_early_and_the_server_after_applying(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="downpour.server")
    with serving() as server:
        worker = WorkerThread(make_worker(server.port, steps=100_000))
        wait_until(lambda: fetch_status(server.status)["version"] > 3, 60, "the worker to push")
        worker.worker.stop()
        s = worker.result()
        assert s["stopped_early"] and s["steps"] > 3
        # close() ended the input generators mid-epoch (their tf.data iterators with them),
        # rather than leaving them to a cyclic garbage collection much later
        data = worker.worker.data  # the worker's TrainingBatches
        assert data._batches.gi_frame is None and data._input_stream.gi_frame is None
        wait_until(lambda: fetch_status(server.status)["version"] == s["pushes"], 30, "pushes")
    assert "stopped at version" in caplog.text  # the loop returned through its stop path
