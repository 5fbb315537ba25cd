"""Unit tests of the observability pieces, without processes: the metrics catalogue, the
Prometheus collector, log formats and rate limiting, the cluster status view, the plots."""

from __future__ import annotations

import io
import json
import logging
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from downpour import wire
from downpour.cli.status import merge_workers, render, render_cluster
from downpour.runtime import logs, metrics
from downpour.runtime.metrics import STALENESS_BOUNDS, Histogram

BF16_NOTICE = "--compress bf16: gradients are rounded in NumPy at each push"


def _doc(model: str = "tiny", workers: dict[str, Any] | None = None) -> dict[str, Any]:
    """A status document as the server publishes it (the fields the consumers read)."""
    st = Histogram(STALENESS_BOUNDS)
    for s in (0, 1, 1, 2, 5, 200):
        st.observe(s)
    return {
        "service": "server",
        "protocol": 1,
        "model": model,
        "fingerprint": "f" * 32,
        "incarnation": "abc",
        "version": 6,
        "updates_applied": 6,
        "updates_per_s": 3.5,
        "uptime_s": 12.0,
        "apply_ms": 2.0,
        "loss": 0.5,
        "staleness": st.snapshot(),
        "rejected": {"shape": 2, "duplicate": 1},
        "rejected_total": 3,
        "auth_denied": {},
        "pushes_received": 9,
        "pulls": 4,
        "pulls_unchanged": 1,
        "hellos": 2,
        "bytes_in": 1000,
        "bytes_out": 2000,
        "status_requests": 5,
        "checkpoints": None,
        "eval": {"version": 5, "accuracy": 0.75, "time": 1.0, "seconds": 0.1, "count": 2},
        "workers": workers
        if workers is not None
        else {
            "w0": {
                "state": "alive",
                "last_seen_s": 0.1,
                "pushes": 4,
                "applied": 4,
                "rejected": 0,
                "steps": 4,
                "loss": 0.4,
                "staleness": 1,
                "reported": {"steps_per_s": 2.0, "compute_ms": 250.0, "loss": 0.4},
                "notices": [BF16_NOTICE],
            },
            "w1": {
                "state": "missing",
                "last_seen_s": 15.0,
                "pushes": 2,
                "applied": 2,
                "rejected": 3,
                "steps": 2,
                "loss": None,
                "staleness": None,
                "reported": {},
            },
        },
    }


# ------------------------------------------------------------------ metrics model


def test_worker_stats_cover_every_reported_figure() -> None:
    stats = metrics.new_worker_stats()
    assert set(stats) == {m.key for m in metrics.WORKER_REPORTED}
    for key in ("steps_per_s", "compute_ms", "push_ms", "pull_ms", "bytes_sent", "backpressure"):
        assert stats[key] == 0
    assert math.isnan(stats["loss"])  # unknown until the first step: not reported
    assert "loss" not in metrics.clean_reported(stats)


def test_rate_is_events_per_second_over_its_window() -> None:
    rate = metrics.Rate(10.0)
    assert rate.per_second(0.0) == 0.0
    rate.mark(0.0)
    rate.mark(0.1)
    assert rate.per_second(0.1) == pytest.approx(10.0)  # one interval of 0.1 s
    for i in range(1, 61):
        rate.mark(0.1 + 0.5 * i)  # 2/s for 30 s
    assert rate.per_second(30.1) == pytest.approx(2.0, rel=0.06)
    assert rate.per_second(30.1 + 11) == 0.0  # idle longer than the window


def test_clean_reported_keeps_only_finite_numbers() -> None:
    raw = {
        "ok": 1.5,
        "n": 3,
        "nan": float("nan"),
        "inf": float("inf"),
        "flag": True,
        "text": "x",
        "nested": {"a": 1},
        "k" * 65: 1,
        7: 1,
    }
    assert metrics.clean_reported(raw) == {"ok": 1.5, "n": 3}
    assert metrics.clean_reported(["not", "a", "dict"]) == {}
    many = {f"k{i}": i for i in range(500)}
    assert len(metrics.clean_reported(many)) == metrics.MAX_REPORTED


def test_notices_are_logged_once_and_the_first_few_kept(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from downpour.wire.bodies import MAX_NOTICES, NOTICE_CHARS

    log = logging.getLogger("downpour.worker.test")
    caplog.set_level("WARNING", logger="downpour.worker.test")
    notices = metrics.Notices()
    notices.warn(log, "row pulls off: %s", "no\n  extractor")
    notices.warn(log, "row pulls off: %s", "no extractor")  # the same sentence: once
    assert notices.items() == ("row pulls off: no extractor",)
    assert [r.getMessage() for r in caplog.records] == ["row pulls off: no extractor"]
    notices.warn(log, "x" * (NOTICE_CHARS + 50))
    assert notices.items()[1] == "x" * NOTICE_CHARS  # cut for the wire; logged whole
    assert caplog.records[-1].getMessage() == "x" * (NOTICE_CHARS + 50)
    for i in range(MAX_NOTICES + 3):
        notices.warn(log, "slow path %d", i)
    assert len(notices.items()) == MAX_NOTICES
    assert notices.items()[-1] == f"slow path {MAX_NOTICES - 3}"
    assert caplog.records[-1].getMessage() == f"slow path {MAX_NOTICES + 2}"  # still logged
    body = wire.PushBody(stats={"q": 1.0}, notices=notices.items())
    assert wire.PushBody.from_body(body.to_body()).notices == notices.items()


def test_catalogue_names_follow_prometheus_conventions() -> None:
    catalogue = [
        *metrics.SERVER_METRICS,
        *metrics.WORKER_METRICS,
        *metrics.WORKER_REPORTED,
        *metrics.EVAL_METRICS,
        metrics.HELDOUT_METRIC,
        metrics.WORKER_NOTICES,
        metrics.STALENESS,
        metrics.REJECTED,
        metrics.AUTH_DENIED,
        metrics.POLICY,
        *metrics.TABLE_METRICS,
        metrics.TABLE_PART_BYTES,
        metrics.TABLE_EVENTS,
    ]
    names = [m.name for m in catalogue]
    assert len(names) == len(set(names))
    for m in catalogue:
        assert m.name.startswith("downpour_") and m.name == m.name.lower()
        assert m.name.endswith("_total") == (m.kind == metrics.COUNTER), m.name
        if m.unit:
            assert m.unit in m.name, m.name
        assert not m.name.endswith("_ms"), "Prometheus wants base units (seconds)"


# ------------------------------------------------------------------ Prometheus


def test_collector_turns_a_status_document_into_metric_families() -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from downpour.server.observers.prometheus import render_text

    text = render_text(_doc)
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    assert fams["downpour_updates_applied"].samples[0].name == "downpour_updates_applied_total"
    assert fams["downpour_updates_applied"].samples[0].value == 6
    assert fams["downpour_apply_duration_seconds"].samples[0].value == pytest.approx(0.002)

    hist = {
        s.labels.get("le", s.name): s.value for s in fams["downpour_gradient_staleness"].samples
    }
    assert hist["0.0"] == 1 and hist["1.0"] == 3 and hist["2.0"] == 4 and hist["6.0"] == 5
    assert hist["128.0"] == 5 and hist["+Inf"] == 6
    assert hist["downpour_gradient_staleness_count"] == 6
    assert hist["downpour_gradient_staleness_sum"] == 209

    rejected = {s.labels["reason"]: s.value for s in fams["downpour_rejected_messages"].samples}
    assert rejected == {"shape": 2, "duplicate": 1}

    state = {
        (s.labels["worker"], s.labels["state"]): s.value
        for s in fams["downpour_worker_state"].samples
    }
    assert state[("w0", "alive")] == 1 and state[("w1", "missing")] == 1
    assert state[("w1", "alive")] == 0
    compute = fams["downpour_worker_compute_seconds"].samples
    assert [(s.labels["worker"], s.value) for s in compute] == [("w0", 0.25)]
    assert fams["downpour_heldout_accuracy"].samples[0].value == 0.75
    (score,) = fams["downpour_heldout_metric"].samples  # a result without "metric": accuracy
    assert score.labels == {"metric": "accuracy"} and score.value == 0.75
    notices = {s.labels["worker"]: s.value for s in fams["downpour_worker_notices"].samples}
    assert notices == {"w0": 1, "w1": 0}
    assert {s.labels["state"]: s.value for s in fams["downpour_workers"].samples} == {
        "alive": 1,
        "missing": 1,
        "gone": 0,
    }


def test_metrics_exporter_serves_http_on_loopback() -> None:
    import urllib.request

    from downpour.server.observers.prometheus import MetricsExporter

    exporter = MetricsExporter(_doc, "127.0.0.1", 0)
    try:
        url = f"http://127.0.0.1:{exporter.port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as resp:
            text = resp.read().decode()
        assert "downpour_updates_applied_total 6.0" in text
        assert "process_cpu_seconds_total" in text
    finally:
        exporter.close()


# ------------------------------------------------------------------ logs


@pytest.fixture
def captured() -> Any:
    """Route logging into a buffer with the services' set-up, then restore it."""
    root = logging.getLogger()
    saved = (root.handlers[:], root.level, dict(logs._context))
    logs._context.clear()  # an in-process service of an earlier test may have bound fields
    buf = io.StringIO()

    def setup(service: str, fmt: str) -> io.StringIO:
        logs.setup_logging(service, "INFO", fmt)
        root.handlers[0].stream = buf
        return buf

    yield setup
    root.handlers[:], level, ctx = saved
    root.setLevel(level)
    logs._context.clear()
    logs._context.update(ctx)


def test_json_log_lines_carry_service_worker_and_version(captured: Any) -> None:
    buf = captured("worker", "json")
    state = {"version": 3}
    logs.set_log_context(worker="w7", version=lambda: state["version"])
    log = logging.getLogger("downpour.worker")
    log.info("step %d", 1)
    state["version"] = 4
    log.warning("about %s", "w9", extra={"worker": "w9"})
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("failed")
    lines = [json.loads(line) for line in buf.getvalue().splitlines()]
    assert lines[0]["service"] == "worker" and lines[0]["message"] == "step 1"
    assert lines[0]["worker"] == "w7" and lines[0]["version"] == 3
    assert lines[1]["worker"] == "w9" and lines[1]["version"] == 4  # extra wins; version live
    assert lines[1]["level"] == "WARNING" and lines[1]["logger"] == "downpour.worker"
    assert "ValueError: boom" in lines[2]["exc"]


def test_text_log_lines_name_service_worker_and_version(captured: Any) -> None:
    buf = captured("server", "text")
    log = logging.getLogger("downpour.server")
    log.info("starting")
    logs.set_log_context(version=lambda: 12)
    log.info("worker %s joined", "w0", extra={"worker": "w0"})
    first, second = buf.getvalue().splitlines()
    assert first.endswith("INFO server: starting")
    assert second.endswith("INFO server worker=w0 version=12: worker w0 joined")
    with pytest.raises(ValueError, match="log format"):
        logs.setup_logging("server", "INFO", "xml")


def test_repeated_warnings_are_rate_limited_with_a_count(captured: Any) -> None:
    buf = captured("server", "json")
    now = [0.0]
    warn = logs.RateLimitedLog(logging.getLogger("downpour.server"), 10.0, clock=lambda: now[0])
    for i in range(50):
        warn.warning("shape", "rejected message from %s", f"w{i}")
    now[0] = 11.0
    warn.warning("shape", "rejected message from %s", "late")
    for _ in range(3):
        warn.warning("shape", "rejected message from %s", "tail")
    warn.warning("nbytes", "other")
    warn.flush()
    lines = [json.loads(line) for line in buf.getvalue().splitlines()]
    assert [d["message"] for d in lines] == [
        "rejected message from w0",
        "rejected message from late (+49 more since the last report)",
        "other",
        "rejected message from tail (+3 more since the last report; latest shown)",
    ]
    assert [d.get("suppressed") for d in lines] == [None, 49, None, 3]
    warn.flush()  # nothing left: nothing logged
    assert len(buf.getvalue().splitlines()) == 4


# ------------------------------------------------------------------ status view


def test_cluster_view_merges_the_workers_of_several_servers() -> None:
    a = _doc()
    b = _doc(
        workers={
            "w0": {
                "state": "gone",
                "last_seen_s": 70.0,
                "applied": 1,
                "rejected": 1,
                "steps": 9,
                "loss": 0.2,
                "staleness": 4,
                "reported": {"steps_per_s": 3.0},
                "notices": ["row pulls off", BF16_NOTICE],
            }
        }
    )
    merged = merge_workers({"a": a, "b": b})
    w0 = merged["w0"]
    assert w0["state"] == "gone" and w0["last_seen_s"] == 70.0  # the worst of the shards
    assert w0["steps"] == 9 and w0["staleness"] == 4 and w0["applied"] == 5
    assert w0["shards"] == 2 and w0["loss"] == pytest.approx(0.3)
    assert w0["reported"]["steps_per_s"] == 3.0
    assert w0["notices"] == [BF16_NOTICE, "row pulls off"]  # each once, over the shards
    assert merged["w1"]["shards"] == 1 and merged["w1"]["notices"] == []

    text = render_cluster({"tcp://a:1": a, "tcp://b:2": b, "tcp://c:3": {"error": "timeout"}})
    assert "cluster: 2/3 servers answering, model tiny" in text
    assert "updates applied 12" in text and "rejected 6" in text
    assert "tcp://c:3" in text and "unreachable: timeout" in text
    rows = {line.split()[0]: line.split() for line in text.splitlines()[-2:]}
    assert rows["w0"][1] == "gone" and rows["w0"][-1] == "2/2"
    assert rows["w1"][-1] == "1/2"
    warned = [line for line in text.splitlines() if line.startswith("WARNING: worker")]
    assert warned == [f"WARNING: worker w0: {BF16_NOTICE}", "WARNING: worker w0: row pulls off"]
    other = render_cluster({"a": a, "b": _doc(model="other")})
    assert "DIFFERENT MODELS" in other


def test_single_server_table_has_a_row_per_worker() -> None:
    text = render(_doc())
    assert "held-out accuracy 0.7500 at version 5" in text
    header, *rows = text.splitlines()[-3:]
    assert header.split()[:6] == ["worker", "state", "steps", "steps/s", "staleness", "loss"]
    assert rows[0].split()[:6] == ["w0", "alive", "4", "2", "1", "0.4"]
    assert rows[1].split()[:6] == ["w1", "missing", "2", "-", "-", "-"]
    assert f"WARNING: worker w0: {BF16_NOTICE}" in text.splitlines()
    assert "WARNING: worker w1" not in text
    assert "pull bounds" not in text  # no worker sent a bound
    bounds = {"reads": 40, "within": 31, "beyond": 9, "sampled": 16618, "dense_elements": 3274634}
    assert (
        "pull bounds: 31 pulls kept the held weights, 9 served; 16,618 of 3,274,634 dense "
        "weights sampled in 40 versions"
    ) in render(_doc() | {"pull_bounds": bounds}).splitlines()


# ------------------------------------------------------------------ plots


def test_plot_writes_the_three_pngs(tmp_path: Path) -> None:
    from matplotlib.image import imread

    from downpour.cli.plot import main as plot_main

    (tmp_path / "history.csv").write_text(
        "t,version,loss,staleness_mean,updates_per_s,accuracy,eval_version,eval_accuracy\n"
        "0.5,10,2.0,1.0,20,,,\n"
        "1.0,30,1.0,1.1,40,0.6,20,0.5\n"
        "1.5,60,0.5,1.2,60,,50,0.8\n"
        "2.0,90,0.2,1.2,60,0.9,80,0.9\n"
    )
    (tmp_path / "workers.csv").write_text(
        "t,worker,state,steps,steps_per_s,loss,staleness,applied\n"
        "0.5,w0,alive,5,10,2.0,1,5\n0.5,w1,alive,5,10,2.1,1,5\n"
        "1.0,w0,alive,15,20,1.0,1,15\n1.0,w1,alive,12,14,1.1,2,12\n"
        "2.0,w0,alive,45,30,0.2,1,45\n2.0,w1,alive,30,18,0.3,2,30\n"
    )
    (tmp_path / "status.json").write_text(json.dumps(_doc()))
    assert plot_main(str(tmp_path)) == 0
    for name in ("training.png", "staleness.png", "throughput.png"):
        image = imread(tmp_path / name)
        assert image.shape[0] >= 300 and image.shape[1] >= 600, name
        assert image.std() > 0.01, f"{name} is blank"
    assert plot_main(str(tmp_path / "missing")) == 2


def test_peak_rss_is_this_address_spaces_high_water_mark() -> None:
    """``peak_rss_mib`` is VmHWM: at least the resident set now, and it grows with a block
    this process touches."""
    from downpour.runtime.metrics import peak_rss_mib

    def rss_mib() -> float:
        with open("/proc/self/status") as f:
            line = next(x for x in f if x.startswith("VmRSS:"))
        return int(line.split()[1]) / 1024

    before = peak_rss_mib()
    assert before is not None and before >= rss_mib() > 0
    need_mib = before - rss_mib() + 64  # touched on top of what is resident: a new peak
    block = np.ones(int(need_mib * 2**20) // 8, np.float64)
    assert peak_rss_mib() > before and block.sum() > 0


def test_peak_rss_of_another_process_is_read_by_pid() -> None:
    """``peak_rss_mib(pid)`` reads that process's VmHWM (this one's, read by pid, lies between
    two reads of its own); a process that has exited has none."""
    import os
    import subprocess
    import sys

    from downpour.runtime.metrics import peak_rss_mib

    first = peak_rss_mib()
    by_pid = peak_rss_mib(os.getpid())
    assert first is not None and by_pid is not None and first <= by_pid <= peak_rss_mib()
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(timeout=60)
    assert peak_rss_mib(child.pid) is None
