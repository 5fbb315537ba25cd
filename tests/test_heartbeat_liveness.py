"""Heartbeats alone keep a busy worker alive: a worker in a long local phase (large --n-push
and --n-fetch, a slow step) sends no push and no pull for longer than the server's
--missing-after, and stays ``alive`` only because its fetcher thread sends heartbeats. With
the heartbeat interval longer than that phase, the same worker shows as ``missing``.

Real sockets, a server and a worker in this process (``inproc``), a model whose step sleeps
inside ``tf.py_function`` (``slow_models``)."""

from __future__ import annotations

import time
from typing import Any

from conftest import wait_until
from inproc import WorkerThread, make_worker, serving

from downpour.net.client import fetch_status

MISSING_AFTER_S = 1.0
WINDOW_S = 4.0  # the quiet window watched: four times --missing-after
LONG = 10_000  # --n-push / --n-fetch: no push or pull after the first pull


def _counts(doc: dict[str, Any]) -> tuple[int, int, int, int]:
    w = doc["workers"]["w"]
    return doc["pushes_received"], doc["pulls"], w["pushes"], w["pulls"]


def _slow_worker(server: Any, heartbeat_s: float) -> WorkerThread:
    """A slow worker: hello, one pull (no prefetch), then a long local phase."""
    return WorkerThread(
        make_worker(server.port, "slow_models:slow", steps=LONG, n_push=LONG, n_fetch=LONG,
                    heartbeat_s=heartbeat_s, prefetch=False)
    )  # fmt: skip


def _worker(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["workers"].get("w", {})


def _stop(worker: WorkerThread) -> None:
    worker.worker.stop()
    worker.result(60)


def test_heartbeats_alone_keep_a_busy_worker_alive() -> None:
    with serving(missing_after_s=MISSING_AFTER_S, gone_after_s=60.0) as server:
        worker = _slow_worker(server, heartbeat_s=0.2)
        try:
            first = wait_until(  # a heartbeat has come: the worker is in its local phase
                lambda: _worker(d := fetch_status(server.status)).get("reported") and d,
                120,
                "the worker's first heartbeat",
            )
            start, states, doc = time.monotonic(), set(), first
            while time.monotonic() - start < WINDOW_S:  # watch the whole window
                doc = fetch_status(server.status)
                states.add(_worker(doc)["state"])
                time.sleep(0.1)  # the polling interval of this watch, not a synchronisation
            assert _counts(doc) == _counts(first)  # no push, no pull in the window ...
            assert states == {"alive"}  # ... and alive throughout: heartbeats only
            assert _worker(doc)["last_seen_s"] < MISSING_AFTER_S
        finally:
            _stop(worker)


def test_without_heartbeats_the_same_worker_goes_missing() -> None:
    with serving(missing_after_s=MISSING_AFTER_S, gone_after_s=60.0) as server:
        worker = _slow_worker(server, heartbeat_s=600.0)  # longer than the whole test
        try:
            doc = wait_until(
                lambda: _worker(d := fetch_status(server.status)).get("state") == "missing" and d,
                120,
                "the silent worker to show as missing",
            )
            w = _worker(doc)
            assert w["pushes"] == 0 and w["reported"] == {}  # no push and no heartbeat came
        finally:
            _stop(worker)
