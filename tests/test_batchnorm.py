"""BatchNorm's moving statistics (non-trainable state no gradient updates): the server's
weights, with statistics recomputed for them, reach the accuracy the workers report."""

from __future__ import annotations

from pathlib import Path

from conftest import Cluster, pull_weights, summary

from downpour.cli.export import export
from downpour.cli.status import fetch_status
from downpour.models import build_model, evaluate, recalibrate_batchnorm
from downpour.spec import load_spec

MODEL = "tiny_models:batchnorm"


def test_server_weights_with_recalibrated_statistics_reach_the_workers_accuracy(
    cluster: Cluster, tmp_path: Path
) -> None:
    server = cluster.server(
        "--state-dir", str(tmp_path / "state"), "--eval-every", "100", model=MODEL, early=True
    )
    workers = [
        cluster.worker(server.port, "--steps", "150", model=MODEL, worker_id=f"w{i}")
        for i in range(2)
    ]
    for w in workers:
        assert w.wait(timeout=180) == 0, w.log_text()
    reported = [summary(w)["held_out"] for w in workers]  # each with its own statistics

    spec = load_spec(MODEL)
    data = spec.load_data(None)
    model = build_model(spec)
    version, arrays = pull_weights(server.rep)
    assert version == 300
    for v, a in zip(model.trainable_variables, arrays, strict=True):
        v.assign(a)
    stale = evaluate(spec, model, data.x_test, data.y_test)  # the statistics build() made
    assert recalibrate_batchnorm(model, data.x_train) == 1
    recalibrated = evaluate(spec, model, data.x_test, data.y_test)
    assert recalibrated >= max(reported) - 0.01, (recalibrated, reported)
    assert recalibrated > 0.95 and stale < recalibrated - 0.2, (stale, recalibrated)

    doc = fetch_status(server.status)  # the server's own --eval-every recomputes them too
    assert doc["eval"]["accuracy"] > 0.9, doc["eval"]

    server.proc.terminate()
    assert server.wait(timeout=60) == 0
    result = export([tmp_path / "state"], tmp_path / "bn.keras", MODEL)
    assert result.batchnorm_recalibrated == 1
    assert result.accuracy is not None and abs(result.accuracy - recalibrated) < 1e-6
