"""Bring your own model: the worked example (shared/examples/wine.py, a functional Keras model
on the wine data that mlxtend ships) trains through a real server and worker, scores well on
its held-out wines with the server's weights, and exports to a file plain TensorFlow loads."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import pull_weights
from inproc import Services, settle
from plain_tf import plain_tf_accuracy, save_eval_data

from downpour import cli
from downpour.model.build import build_model, evaluate
from downpour.spec import load_spec

WINE = "downpour.examples.wine:spec"


def test_wine_data_and_model_are_deterministic_and_fingerprint_only_dense_layers() -> None:
    spec = load_spec(WINE)
    data = spec.load_data(None)
    assert data.x_train.shape == (134, 13) and data.x_test.shape == (44, 13)
    assert data.x_train.dtype.name == "float32" and data.y_train.dtype.name == "int64"
    assert sorted(set(data.y_test.tolist())) == [0, 1, 2]  # every class is held out
    a, b = build_model(spec), build_model(spec)
    assert [v.path for v in a.variables] == [  # standardising adds no variables
        "hidden1/kernel", "hidden1/bias", "hidden2/kernel", "hidden2/bias",
        "logits/kernel", "logits/bias",
    ]  # fmt: skip
    for va, vb in zip(a.variables, b.variables, strict=True):
        assert va.numpy().tobytes() == vb.numpy().tobytes()
    with pytest.raises(ValueError, match="drop --data-dir"):
        spec.load_data("/some/dir")


def test_wine_trains_through_server_and_worker_and_exports(
    services: Services, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = tmp_path / "state"
    server = services.server(
        WINE, learning_rate=0.01, state_dir=str(state), checkpoint_every=0, checkpoint_secs=0.0
    )
    settle(
        server.status, services.train(server.port, 1, WINE, epochs=40)
    )  # 40 x 9 batches (134 = 8 x 16 + 6)
    version, weights = pull_weights(server.rep)
    assert version == 360

    spec = load_spec(WINE)
    model = build_model(spec, seed=1)
    for v, a in zip(model.trainable_variables, weights, strict=True):
        v.assign(a)
    data = spec.load_data(None)
    accuracy = evaluate(spec, model, data.x_test, data.y_test)
    assert accuracy >= 0.85, accuracy  # chance: about 0.36 (the largest class)

    services.stop(server)  # SIGTERM for a process: the final checkpoint, version 360
    out = tmp_path / "wine.keras"
    args = ["export", "--state-dir", str(state), "--out", str(out), "--model", WINE]
    assert cli.main(args) == 0
    assert f"held-out accuracy: {accuracy:.4f}" in capsys.readouterr().out

    npz = save_eval_data(tmp_path / "wine.npz", data.x_test, data.y_test)  # raw measurements
    got = plain_tf_accuracy([{"path": str(out), "format": "keras", "npz": str(npz)}], tmp_path)
    assert got["downpour_modules"] == []
    assert abs(got["accuracy"][str(out)] - accuracy) <= 1e-6
