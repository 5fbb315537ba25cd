"""A job that completes (``--job-workers``): workers say they finished, servers end the job
with a final checkpoint and exit 0 (3 when it fails), the chief scores and exports.

In-process servers and workers on real sockets (``inproc``); the process version of the
whole job is ``test_job_processes.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import wait_until
from inproc import InprocServer, WorkerThread, make_worker

from downpour import wire
from downpour.checkpoints.store import CheckpointStore
from downpour.cli.job.chief import run_chief
from downpour.cli.job.evaluator import run_evaluator
from downpour.net.client import ShardClient, fetch_status
from downpour.net.transport import make_context
from downpour.server.job import DONE, EXIT_FAILED, FAILED, RUNNING, JobTracker
from downpour.server.registry import WorkerRegistry

WAIT_S = 120.0


@dataclass(frozen=True)
class TFConfig:
    """The contract's ``downpour.config.tf_config.TFConfig``, as far as the chief reads it."""

    cluster: dict[str, list[str]]
    task_type: str
    task_index: int


# ------------------------------------------------------------------ wire


def test_finished_heartbeat_and_ack_are_optional_fields() -> None:
    hb = wire.HeartbeatRequest({"loss": 1.0}, finished=7)
    assert wire.HeartbeatRequest.from_body(hb.to_body()).finished == 7
    assert wire.HeartbeatRequest.from_body({"stats": {}}).finished is None  # an older worker
    with pytest.raises(wire.ProtocolError, match="finished"):
        wire.HeartbeatRequest.from_body({"finished": -1})
    assert wire.StatusRequest.from_body({}).ack is None  # a plain read
    assert wire.StatusRequest.from_body({"ack": "done"}).ack == "done"
    with pytest.raises(wire.ProtocolError, match="ack"):
        wire.StatusRequest.from_body({"ack": "exit"})


# ------------------------------------------------------------------ the tracker


def _registry(*workers: str, now: float = 0.0) -> WorkerRegistry:
    reg = WorkerRegistry(missing_after_s=1.0, gone_after_s=2.0)
    for w in workers:
        reg.admit(w, now)
    return reg


def test_a_worker_restarted_under_its_id_counts_once() -> None:
    reg = _registry("a", "b")
    job = JobTracker(workers=2, timeout_s=10.0, grace_s=1.0)
    job.note_finished("a", 0, reg, 0.0)
    job.note_finished("a", 0, reg, 1.0)  # restarted after finishing, finished again
    assert job.verdict(reg, 1.0) is None
    assert (job.finished, job.repeats) == ({"a": 0}, 1)
    job.note_finished("b", 0, reg, 2.0)
    assert job.verdict(reg, 2.0) == (DONE, "2 of 2 workers finished")


def test_done_waits_for_the_last_push_then_at_most_the_grace() -> None:
    reg = _registry("a")
    reg.get("a").last_seq = 4  # type: ignore[union-attr]
    job = JobTracker(workers=1, timeout_s=10.0, grace_s=1.0)
    job.note_finished("a", 5, reg, 0.0)  # push 5 is still on its way
    assert job.verdict(reg, 0.5) is None
    reg.get("a").last_seq = 5  # type: ignore[union-attr]
    assert job.verdict(reg, 0.6) == (DONE, "1 of 1 workers finished")
    reg.get("a").last_seq = 4  # type: ignore[union-attr]
    state, reason = job.verdict(reg, 1.5)  # type: ignore[misc]
    assert state == DONE and "never arrived" in reason


def test_unknown_worker_is_not_counted() -> None:
    reg = _registry()
    job = JobTracker(workers=1)
    job.note_finished("stranger", 3, reg, 0.0)
    assert (job.finished, job.unknown, job.verdict(reg, 0.0)) == ({}, 1, None)


def test_the_rest_gone_for_the_timeout_fails_the_job() -> None:
    reg = _registry("a", "b")
    job = JobTracker(workers=2, timeout_s=5.0)
    job.note_finished("a", 0, reg, 1.0)
    assert job.verdict(reg, 3.0) is None  # b is gone (silent 3 s) but not for 5 s after a
    assert job.verdict(reg, 5.9) is None
    state, reason = job.verdict(reg, 6.0)  # type: ignore[misc]
    assert state == FAILED and "1 of 2 workers finished" in reason
    job.end(state, reason, 10, 6.0)
    assert job.exit_code() == EXIT_FAILED and job.verdict(reg, 7.0) is None
    assert JobTracker(workers=1).state == RUNNING


# ------------------------------------------------------------------ servers and workers


def _start(tmp: Path, shards: int = 1, **config: object) -> list[InprocServer]:
    return [
        InprocServer(
            "tiny_models:tiny",
            model_ref="tiny_models:tiny",
            num_shards=shards,
            shard=i,
            state_dir=str(tmp / f"shard-{i}"),
            **config,
        )
        for i in range(shards)
    ]


def _workers(servers: list[InprocServer], n: int, steps: int = 12) -> list[WorkerThread]:
    ports = [s.port for s in servers]
    return [WorkerThread(make_worker(ports, worker_id=f"w{i}", steps=steps)) for i in range(n)]


def test_two_workers_finish_server_checkpoints_and_exits_0(tmp_path: Path) -> None:
    (server,) = _start(tmp_path, job_workers=2, linger_after_done_s=300.0)
    try:
        summaries = [t.result(WAIT_S) for t in _workers([server], 2)]
        doc = wait_until(
            lambda: (d := fetch_status(server.status))["job"]["state"] == DONE and d,
            WAIT_S,
            "the job to be done",
        )
        assert doc["job"]["finished"] == ["w0", "w1"]
        version = doc["job"]["version"]
        assert version == doc["version"] == sum(s["pushes"] for s in summaries)
        latest = CheckpointStore(tmp_path / "shard-0").latest()  # on disk before "done"
        assert latest is not None and latest.version == version
        assert latest.meta["finished"] == {"w0": 12, "w1": 12}
        fetch_status(server.status, ack="done")  # the chief's acknowledgement ends the linger
        assert server.wait(WAIT_S) == 0
    finally:
        server.stop()


def test_a_worker_that_never_finishes_fails_the_job(tmp_path: Path) -> None:
    (server,) = _start(
        tmp_path,
        job_workers=2,
        job_timeout_s=1.0,
        missing_after_s=0.2,
        gone_after_s=0.5,
        linger_after_done_s=0.0,
    )
    ctx = make_context()
    quitter = ShardClient(ctx, server.rep, sender="quitter", timeout_s=10.0)
    try:  # says hello, then is never heard from again
        quitter.hello(wire.HelloRequest(fingerprint=server.server.state.fingerprint))
        _workers([server], 1, steps=4)[0].result(WAIT_S)
        assert server.wait(WAIT_S) == EXIT_FAILED
        job = server.server.snapshot()["job"]
        assert job["state"] == FAILED and "--job-timeout" in job["reason"]
        assert job["finished"] == ["w0"]
        latest = CheckpointStore(tmp_path / "shard-0").latest()
        assert latest is not None and latest.version == job["version"] == 4
    finally:
        quitter.close()
        ctx.term()
        server.stop()


def test_the_chief_waits_scores_exports_and_the_servers_exit_0(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    servers = _start(tmp_path, shards=2, job_workers=2, linger_after_done_s=300.0)
    tf = TFConfig(
        {"ps": [f"127.0.0.1:{s.port}" for s in servers], "worker": ["w0:1", "w1:1"]},
        "chief",
        0,
    )
    job = ["--model", "tiny_models:tiny", "--poll-secs", "0.1"]
    job += ["--status-endpoints", ",".join(s.status for s in servers)]
    try:
        workers = _workers(servers, 2)
        assert run_evaluator(tf, [*job, "--eval-every-secs", "0.2"]) == 0  # until the end
        assert run_chief(tf, [*job, "--state-dir", str(tmp_path)]) == 0
        assert [s.wait(WAIT_S) for s in servers] == [0, 0]  # acknowledged: no linger
        for w in workers:
            w.result(WAIT_S)
        out = capsys.readouterr().out
        assert "held-out accuracy: " in out
        version = max(s.server.state.version for s in servers)
        exported = tmp_path / "export" / str(version)
        assert (exported / "saved_model.pb").is_file(), out
    finally:
        for s in servers:
            s.stop()


def test_the_evaluator_ends_when_a_server_has_gone_after_the_job_ended(tmp_path: Path) -> None:
    """The servers exit once the chief acknowledges the end, which can come between two of
    the evaluator's reads: a server that stops answering after one reported ``done`` has
    ended with the job, and the evaluator exits 0 (not 3 after --wait-servers)."""
    servers = _start(tmp_path, shards=2, job_workers=2, linger_after_done_s=300.0)
    tf = TFConfig({"ps": [f"127.0.0.1:{s.port}" for s in servers], "worker": ["w0:1"]},
                  "evaluator", 0)  # fmt: skip
    try:
        for w in _workers(servers, 2):
            w.result(WAIT_S)
        for s in servers:
            wait_until(lambda s=s: fetch_status(s.status)["job"]["state"] == DONE, WAIT_S, "done")
        fetch_status(servers[1].status, ack="done")  # shard 1 acknowledged: it exits
        assert servers[1].wait(WAIT_S) == 0
        argv = ["--model", "tiny_models:tiny", "--poll-secs", "0.05", "--wait-servers", "60"]
        argv += ["--status-endpoints", ",".join(s.status for s in servers)]
        assert run_evaluator(tf, [*argv, "--eval-every-secs", "600"]) == 0
    finally:
        for s in servers:
            s.stop()


@pytest.mark.parametrize(("recorded", "code"), [("done", 0), ("failed", 3), (None, 3)])
def test_the_evaluator_ends_on_the_chiefs_record_when_no_server_answers(
    tmp_path: Path, recorded: str | None, code: int
) -> None:
    """An evaluator that starts (or looks) after the servers have exited reads the chief's
    job-end record in the state root: done -> 0, failed -> 3; without one the silence is a
    failure (3)."""
    from downpour.checkpoints.dirs import write_job_end

    if recorded is not None:
        write_job_end(tmp_path, recorded, 12, None)
    (gone,) = _start(tmp_path / "gone")
    endpoint, status = gone.port, gone.status
    gone.stop()  # nothing answers there any more
    tf = TFConfig({"ps": [f"127.0.0.1:{endpoint}"], "worker": ["w0:1"]}, "evaluator", 0)
    argv = ["--model", "tiny_models:tiny", "--poll-secs", "0.05", "--wait-servers", "0.5"]
    argv += ["--status-endpoints", status, "--state-dir", str(tmp_path)]
    assert run_evaluator(tf, argv) == code


def test_a_job_end_record_counts_when_fresh_or_when_the_servers_are_silent(
    tmp_path: Path,
) -> None:
    """An old record (an earlier run of a job with the same state root) does not end an
    evaluator whose servers still answer."""
    from types import SimpleNamespace

    from downpour.checkpoints.dirs import read_job_end, write_job_end
    from downpour.cli.job.evaluator import _recorded_end

    args = SimpleNamespace(state_dir=str(tmp_path))
    watch = SimpleNamespace(statuses=["a"], heard={"a": 10.0}, started=5.0)  # "a" answered
    assert _recorded_end(args, watch, since=0.0) is None  # no record
    write_job_end(tmp_path, "done", 7, "/x/7")
    assert read_job_end(tmp_path)["version"] == 7
    written = read_job_end(tmp_path)["written_at"]
    assert _recorded_end(args, watch, since=written - 1) == "done"  # written after we started
    assert _recorded_end(args, watch, since=written + 1) is None  # an old record, servers up
    silent = SimpleNamespace(statuses=["a"], heard={}, started=5.0)
    assert _recorded_end(args, silent, since=written + 1) == "done"
    assert _recorded_end(SimpleNamespace(state_dir=None), silent, since=0.0) is None


def test_the_chief_exports_a_series_of_versions_whose_deltas_give_the_final_model(
    tmp_path: Path,
) -> None:
    """--export-every on the chief of a two-shard job with a dynamic table: versions from the
    shards' checkpoints while the job runs, the final checkpoints last, each delta applied in
    order to the first gives the last."""
    from test_serving_dir import _apply_in_order, _same_export

    from downpour.serving import versions

    model = "tiny_models:dynamic_dict"
    servers = [
        InprocServer(model, model_ref=model, num_shards=2, shard=i, optimizer="adagrad",
                     learning_rate=0.5, state_dir=str(tmp_path / f"shard-{i}"), job_workers=2,
                     linger_after_done_s=300.0, checkpoint_every=10, checkpoint_secs=0.0)
        for i in range(2)
    ]  # fmt: skip
    tf = TFConfig({"ps": [f"127.0.0.1:{s.port}" for s in servers], "worker": ["w0:1"]}, "chief", 0)
    job = ["--model", model, "--poll-secs", "0.05", "--state-dir", str(tmp_path)]
    job += ["--status-endpoints", ",".join(s.status for s in servers)]
    try:
        ports = [s.port for s in servers]
        workers = [WorkerThread(make_worker(ports, model, worker_id=f"w{i}", steps=40,
                                            n_fetch=1)) for i in range(2)]  # fmt: skip
        assert run_chief(tf, [*job, "--export-every", "10", "--export-keep", "50"]) == 0
        assert [s.wait(WAIT_S) for s in servers] == [0, 0]
        for w in workers:
            w.result(WAIT_S)
        base = tmp_path / "export"
        held = versions.versions(base)
        final = max(s.server.state.version for s in servers)
        assert held[-1] == final and len(held) >= 2, held
        assert versions.deltas(base) == list(zip(held, held[1:], strict=False))
        reached, applied = _apply_in_order(base, tmp_path)
        assert reached == final
        _same_export(applied, base / str(final))
    finally:
        for s in servers:
            s.stop()
