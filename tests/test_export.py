"""``downpour export``: a server's checkpoint (in-process; in the slow tier a process's) out as
a .keras file and a SavedModel that plain TensorFlow loads (no downpour import) and that scores
exactly what the checkpoint does."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from inproc import Services, settle
from plain_tf import plain_tf_accuracy, save_eval_data

from downpour import cli
from downpour.checkpoints.store import CheckpointStore
from downpour.cli.export import ExportError, export
from downpour.model.build import build_model, evaluate, fingerprint
from downpour.spec import load_spec


def _checkpoint_accuracy(ref: str, state_dir: Path) -> tuple[float, int]:
    """(held-out accuracy, version) of the newest checkpoint, computed here from its arrays."""
    spec = load_spec(ref)
    model = build_model(spec, seed=123)  # other initial weights: all must come from the file
    ckpt = CheckpointStore(state_dir).latest()
    assert ckpt is not None
    for v in model.trainable_variables:
        v.assign(ckpt.arrays[f"model/{v.path}"])
    data = spec.load_data(None)
    return evaluate(spec, model, data.x_test, data.y_test), ckpt.version


def _synthetic_checkpoint(
    state_dir: Path, ref: str, version: int = 7, **meta: object
) -> dict[str, np.ndarray]:
    """A checkpoint of the model's initial weights (plus an optimizer entry to be ignored)."""
    model = build_model(load_spec(ref))
    arrays = {f"model/{v.path}": v.numpy() for v in model.trainable_variables}
    doc = {"fingerprint": fingerprint(model.trainable_variables), "workers": {}, **meta}
    CheckpointStore(state_dir).write(version, {**arrays, "optimizer/iteration": np.int64(3)}, doc)
    return arrays


def test_export_of_a_trained_server_loads_in_plain_tensorflow(
    services: Services, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = tmp_path / "state"
    server = services.server(
        state_dir=str(state), checkpoint_every=0, checkpoint_secs=0.0, learning_rate=0.01
    )
    settle(server.status, services.train(server.port, 1, steps=60))
    services.stop(server)  # SIGTERM for a process: the final checkpoint
    accuracy, version = _checkpoint_accuracy("tiny_models:tiny", state)
    assert version == 60 and accuracy >= 0.8  # chance is 0.25

    keras_out, saved_out = tmp_path / "tiny.keras", tmp_path / "tiny_saved"
    for out in (keras_out, saved_out):
        args = ["export", "--state-dir", str(state), "--out", str(out)]
        assert cli.main([*args, "--model", "tiny_models:tiny"]) == 0
        printed = capsys.readouterr().out
        assert f"held-out accuracy: {accuracy:.4f}" in printed and "version 60" in printed
    assert keras_out.is_file() and (saved_out / "saved_model.pb").is_file()

    spec = load_spec("tiny_models:tiny")
    data = spec.load_data(None)
    npz = save_eval_data(tmp_path / "heldout.npz", data.x_test, data.y_test)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    jobs = [
        {"path": str(keras_out), "format": "keras", "npz": str(npz)},
        {"path": str(saved_out), "format": "saved_model", "npz": str(npz)},
    ]
    got = plain_tf_accuracy(jobs, scratch)
    assert got["downpour_modules"] == []
    for job in jobs:
        assert abs(got["accuracy"][job["path"]] - accuracy) <= 1e-6, (got, accuracy)


def test_default_model_is_named_by_the_checkpoint_and_loads_without_custom_objects(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No --model: the checkpoint's "deep_mnist" resolves to the built-in Deep-MNIST CNN,
    whose .keras file plain Keras loads with no custom objects."""
    state = tmp_path / "state"
    _synthetic_checkpoint(state, "downpour.models:deep_mnist", model="deep_mnist")
    out = tmp_path / "mnist.keras"
    assert cli.main(["export", "--state-dir", str(state), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "model downpour.models:deep_mnist" in printed and "needs these classes" not in printed
    assert "non-trainable" not in printed  # Dropout's seed state is not worth a note

    spec = load_spec()
    data = spec.load_data(None)
    x, y = data.x_test[:300], data.y_test[:300]
    want = evaluate(spec, build_model(spec), x, y)  # the checkpoint holds the initial weights
    npz = save_eval_data(tmp_path / "mnist.npz", x, y)
    got = plain_tf_accuracy([{"path": str(out), "format": "keras", "npz": str(npz)}], tmp_path)
    assert got["downpour_modules"] == []
    assert abs(got["accuracy"][str(out)] - want) <= 1e-6


def test_refuses_a_checkpoint_of_another_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = tmp_path / "state"
    _synthetic_checkpoint(state, "tiny_models:tiny", model="tiny")
    out = tmp_path / "x.keras"
    args = ["export", "--state-dir", str(state), "--out", str(out)]
    # "tiny" does not resolve: the default model is tried, and its fingerprint differs
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert "written for model 'tiny'" in err and "downpour.models:deep_mnist" in err
    assert "--model" in err
    assert cli.main([*args, "--model", "tiny_models:tiny_other"]) == 2
    assert "tiny_models:tiny_other" in capsys.readouterr().err
    assert not out.exists()
    assert cli.main([*args, "--model", "tiny_models:tiny", "--no-verify"]) == 0
    assert cli.main([*args, "--model", "tiny_models:tiny"]) == 2  # never overwrites
    assert "exists" in capsys.readouterr().err


def test_a_custom_layer_needs_a_saved_model_and_non_trainables_are_noted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """tiny_models:counting has an unregistered layer class with a non-trainable variable."""
    state = tmp_path / "state"
    _synthetic_checkpoint(state, "tiny_models:counting", model="counting")
    args = ["export", "--state-dir", str(state), "--model", "tiny_models:counting"]
    assert cli.main([*args, "--out", str(tmp_path / "c.keras")]) == 2
    err = capsys.readouterr().err
    assert "does not load back: it needs the model's own classes" in err
    assert "['tiny_models.CountingLayer']" in err and "SavedModel" in err
    assert not (tmp_path / "c.keras").exists()  # the failed export removed what it wrote
    assert cli.main([*args, "--out", str(tmp_path / "c_saved")]) == 0
    printed = capsys.readouterr().out
    assert "outputs match" in printed and "non-trainable" in printed
    assert "['counter/calls']" in printed


def test_a_lambda_layer_keras_export_fails_cleanly_and_names_the_saved_model_form(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A .keras archive with a Lambda layer does not load back (Keras's safe mode): the export
    fails with exit 2, leaves nothing at --out, and names the SavedModel form, which works."""
    state = tmp_path / "state"
    _synthetic_checkpoint(state, "tiny_models:lambda_mlp", model="lambda_mlp")
    args = ["export", "--state-dir", str(state), "--model", "tiny_models:lambda_mlp"]
    out = tmp_path / "m.keras"
    assert cli.main([*args, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "does not load back" in err and "removed it" in err
    assert f"--out {tmp_path / 'm'}" in err and "SavedModel directory" in err
    assert not out.exists() and list(tmp_path.iterdir()) == [state]
    assert cli.main([*args, "--out", str(tmp_path / "m")]) == 0
    assert "outputs match" in capsys.readouterr().out


def test_refuses_a_missing_variable_and_an_empty_state_dir(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    with pytest.raises(ExportError, match="no checkpoint"):
        export([state], tmp_path / "a.keras", "tiny_models:tiny")
    with pytest.raises(ExportError, match="no such directory"):
        export([tmp_path / "nowhere"], tmp_path / "a.keras", "tiny_models:tiny")

    model = build_model(load_spec("tiny_models:tiny"))
    arrays = {f"model/{v.path}": v.numpy() for v in model.trainable_variables}
    del arrays["model/logits/bias"]
    meta = {"fingerprint": fingerprint(model.trainable_variables)}
    CheckpointStore(state).write(3, arrays, meta)
    with pytest.raises(ExportError, match=r"variable 'logits/bias' \(4,\) is in no checkpoint"):
        export([state], tmp_path / "a.keras", "tiny_models:tiny")


def test_a_sharded_servers_checkpoints_are_joined_from_one_state_dir_per_shard(
    tmp_path: Path,
) -> None:
    """Two shard states (hidden/kernel split by rows) checkpointed as a shard server does:
    export with both --state-dir gives the unsharded model's weights; one is not enough."""
    from downpour.server.checkpointing.capture import capture
    from downpour.server.state import ParameterState

    spec = load_spec("tiny_models:tiny")
    whole = ParameterState(spec, "sgd", 0.1, seed=5, jit=False)
    shards = [
        ParameterState(spec, "sgd", 0.1, seed=5, jit=False, shard=i, num_shards=2) for i in range(2)
    ]
    part = shards[0].partition
    assert "hidden/kernel[0:8]" in shards[0].names  # a row-split variable
    grads = [np.random.default_rng(1).normal(size=s).astype(np.float32) for s in whole.shapes]
    whole.apply(grads)
    for st, piece in zip(shards, part.split(grads), strict=True):
        st.apply(piece)
    dirs = [tmp_path / "shard0", tmp_path / "shard1"]
    for i, (st, d) in enumerate(zip(shards, dirs, strict=True)):
        meta = {"fingerprint": st.fingerprint, "model": spec.name, "shard": i,
                "num_shards": 2, "partition": part.digest}  # fmt: skip
        CheckpointStore(d).write(st.version, capture(st), meta)

    out = tmp_path / "sharded.keras"
    r = export(dirs, out, "tiny_models:tiny")
    assert [v for _, v in r.checkpoints] == [1, 1] and r.max_abs_diff == 0.0
    import keras

    loaded = keras.models.load_model(out)
    for v, want in zip(loaded.trainable_variables, whole.weights()[1], strict=True):
        np.testing.assert_allclose(v.numpy(), want, rtol=1e-6, err_msg=v.path)

    with pytest.raises(ExportError, match=r"missing \[1\].*--state-dir DIR per shard"):
        export(dirs[:1], tmp_path / "b.keras", "tiny_models:tiny")
    with pytest.raises(ExportError, match=r"shard\(s\) \[0\] given twice"):
        export([dirs[0], dirs[0]], tmp_path / "b.keras", "tiny_models:tiny")


def test_checkpoints_of_another_partition_are_refused(tmp_path: Path) -> None:
    model = build_model(load_spec("tiny_models:tiny"))
    arrays = {f"model/{v.path}": v.numpy() for v in model.trainable_variables}
    meta = {"fingerprint": fingerprint(model.trainable_variables), "partition": "0123abcd"}
    CheckpointStore(tmp_path / "s").write(1, arrays, meta)
    with pytest.raises(ExportError, match="written with partition 0123abcd"):
        export([tmp_path / "s"], tmp_path / "x.keras", "tiny_models:tiny")
    arrays["model/hidden/kernel[0:8]"] = arrays["model/hidden/kernel"][:8]
    CheckpointStore(tmp_path / "t").write(1, arrays, {"fingerprint": meta["fingerprint"]})
    with pytest.raises(ExportError, match=r"lacks: \['hidden/kernel\[0:8\]'\]"):
        export([tmp_path / "t"], tmp_path / "x.keras", "tiny_models:tiny")
