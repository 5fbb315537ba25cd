"""A bad network between worker and server, made by the project's own relay on loopback:
added delay and random connection resets. Training must progress, nothing may be applied
twice, and no worker may be declared gone. In-process (fast tier) and with processes (slow
tier, and the long variant)."""

from __future__ import annotations

import pytest
from conftest import summary, wait_until
from inproc import Services, WorkerThread, make_worker
from relay import Faults, Relay

from downpour.cli.status import fetch_status


def _run(services: Services, steps: int, resets: int) -> None:
    server = services.server(missing_after_s=5.0, gone_after_s=20.0)
    faults = Faults(delay_s=0.1, reset_after_bytes=(2_000, 60_000), max_resets=resets)
    with (
        Relay(("127.0.0.1", server.info["port"]), faults=faults, seed=1) as rep,
        Relay(("127.0.0.1", server.info["push_port"]), faults=faults, seed=2) as push,
    ):
        if services.cluster is not None:
            w = services.cluster.worker(
                rep.port,
                "--steps", str(steps), "--push-endpoint", f"127.0.0.1:{push.port}",
                "--request-timeout", "2", "--server-timeout", "60", "--heartbeat", "0.5",
            )  # fmt: skip
            finished = lambda: w.proc.poll() is not None  # noqa: E731
        else:
            t = WorkerThread(
                make_worker(
                    rep.port,
                    steps=steps,
                    push_endpoint=("127.0.0.1", push.port),
                    request_timeout_s=2.0,
                    server_timeout_s=60.0,
                    heartbeat_s=0.5,
                )
            )
            finished = t.finished
        states: set[str] = set()

        def done() -> bool:
            doc = fetch_status(server.status)
            states.update(x["state"] for x in doc["workers"].values())
            return finished()

        wait_until(done, 300, "the worker to finish through the faulty relay")
        if services.cluster is not None:
            assert w.wait(timeout=10) == 0, w.log_text()
            s = summary(w)
        else:
            s = t.result()
        assert rep.stats["resets"] + push.stats["resets"] > 0  # the faults did happen
        # the last push carries the highest seq: once the server has it, nothing is in flight
        # (unless that push itself died in a reset, which the bounded wait tolerates)
        try:
            wait_until(
                lambda: fetch_status(server.status)["workers"]["w"]["last_seq"] == s["last_seq"],
                15,
                "the last push",
            )
        except AssertionError:
            assert push.stats["resets"] > 0
        doc = fetch_status(server.status)
    wrec = doc["workers"]["w"]
    assert "gone" not in states  # never falsely declared gone
    assert doc["rejected"].get("duplicate", 0) == 0  # nothing applied twice
    assert wrec["applied"] <= s["pushes"]
    assert wrec["applied"] >= s["pushes"] // 2  # training progressed despite the faults
    # accounting: a push is applied, rejected, or lost in a connection the relay reset
    lost = s["pushes"] - wrec["applied"] - wrec["rejected"]
    assert lost >= 0, (s, wrec)
    assert lost == 0 or push.stats["resets"] > 0, (s, wrec, push.stats)


def test_delay_and_resets_through_a_relay(services: Services) -> None:
    _run(services, steps=25, resets=4)  # the long variant below: 400 steps, 60 resets


@pytest.mark.slow
@pytest.mark.parametrize("services", ["process"], indirect=True)
def test_delay_and_resets_through_a_relay_long(services: Services) -> None:
    _run(services, steps=400, resets=60)
