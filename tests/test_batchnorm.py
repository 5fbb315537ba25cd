"""BatchNorm's moving statistics (non-trainable state no gradient updates): the server's
weights, with statistics recomputed for them, reach the accuracy the workers report."""

from __future__ import annotations

from pathlib import Path

from conftest import pull_weights, wait_until
from inproc import Services, settle

from downpour.cli.export import export
from downpour.cli.status import fetch_status
from downpour.model.build import build_model, evaluate, recalibrate_batchnorm
from downpour.spec import load_spec

MODEL = "tiny_models:batchnorm"


def test_server_weights_with_recalibrated_statistics_reach_the_workers_accuracy(
    services: Services, tmp_path: Path
) -> None:
    server = services.server(MODEL, state_dir=str(tmp_path / "state"), eval_every=100)
    sums = services.train(server.port, 2, MODEL, steps=150)
    settle(server.status, sums)
    reported = [s["held_out"] for s in sums]  # each with its own statistics

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

    # the server's own --eval-every recomputes them too (off the apply loop: waited for)
    wait_until(
        lambda: (ev := fetch_status(server.status)["eval"]) and ev["accuracy"] > 0.9,
        60,
        "a held-out evaluation by the server above 0.9",
    )

    services.stop(server)
    result = export([tmp_path / "state"], tmp_path / "bn.keras", MODEL)
    assert result.batchnorm_recalibrated == 1
    assert result.accuracy is not None and abs(result.accuracy - recalibrated) < 1e-6
