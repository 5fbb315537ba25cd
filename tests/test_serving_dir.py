"""Serving exports kept current while training runs (``downpour.serving.versions``, the server's
``--export-every``): versions appear whole and atomically, the last K are kept, a reader polling
the directory never loads a partial one, and the deltas applied in order to the first full
export give the last."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tensorflow as tf
from conftest import wait_until
from inproc import serving, train

from downpour.cli.status import fetch_status
from downpour.config.settings import ConfigError
from downpour.model.build import build_model, fingerprint
from downpour.serving import versions
from downpour.serving.delta import apply_delta, read_delta
from downpour.serving.saved_model import Table, dense_variables, dynamic_layers, read_export
from downpour.spec import load_spec

TOKENS = np.arange(60, dtype=np.int32).reshape(10, 6)


def _weights(model: Any, scale: float) -> dict[str, np.ndarray]:
    """The model's trainable fixed variables, filled with values that depend on ``scale``."""
    return {
        v.path: np.full(v.shape, scale, np.dtype(str(v.dtype)))
        for v in dense_variables(model)
        if v.trainable
    }


def _export(base: Path, model: Any, version: int, keep: int = 5, **kw: Any) -> Any:
    return versions.export_versions(
        base, model, version, _weights(model, version / 10), {},
        fingerprint(model.trainable_variables), "embedding", keep=keep, **kw,
    )  # fmt: skip


def test_versions_are_renamed_into_place_and_the_last_k_kept(tmp_path: Path) -> None:
    model = build_model(load_spec("tiny_models:embedding"))
    for version in (3, 5, 8, 13):
        written = _export(tmp_path, model, version, keep=2)
        assert written.path == tmp_path / str(version)
    assert versions.versions(tmp_path) == [8, 13]
    assert versions.deltas(tmp_path) == [(8, 13)]  # the deltas from 3 and 5 went with them
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    with pytest.raises(ValueError, match="not above the newest, 13"):
        _export(tmp_path, model, 13)
    loaded = tf.saved_model.load(str(tmp_path / "13"))
    kernel = next(v for v in loaded.dense if tuple(v.shape) == (8, 4))
    np.testing.assert_array_equal(kernel.numpy(), np.full((8, 4), 1.3, np.float32))


def test_a_crash_mid_write_leaves_no_numeric_directory(tmp_path: Path) -> None:
    model = build_model(load_spec("tiny_models:embedding"))
    _export(tmp_path, model, 1)

    def half_then_crash(tmp: Path) -> None:
        (tmp / "variables").mkdir(parents=True)
        (tmp / "saved_model.pb").write_bytes(b"half")
        raise RuntimeError("killed mid-write")

    with pytest.raises(RuntimeError, match="killed mid-write"):
        versions.publish(tmp_path / "2", half_then_crash)
    assert versions.versions(tmp_path) == [1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1"]

    # a process killed mid-write leaves its .tmp- directory; the next start removes it
    (tmp_path / ".tmp-2-999" / "variables").mkdir(parents=True)
    (tmp_path / "deltas" / ".tmp-1-2-999").mkdir(parents=True)
    assert versions.versions(tmp_path) == [1]
    assert len(versions.clean_leftovers(tmp_path)) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1", "deltas"]


def test_a_failed_version_leaves_no_delta_to_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = build_model(load_spec("tiny_models:embedding"))
    _export(tmp_path, model, 1)

    def crash(*_a: Any, **_k: Any) -> None:
        raise OSError("disk full")

    monkeypatch.setattr("downpour.serving.saved_model.write_export", crash)
    with pytest.raises(OSError, match="disk full"):
        _export(tmp_path, model, 2)
    assert versions.versions(tmp_path) == [1] and versions.deltas(tmp_path) == []


def test_a_reader_polling_the_directory_loads_every_version_it_sees(tmp_path: Path) -> None:
    model = build_model(load_spec("tiny_models:embedding"))
    done, loaded, failures = threading.Event(), [], []

    def reader() -> None:
        seen = -1
        while True:
            finished = done.is_set()  # read before listing: the last listing sees everything
            held = versions.versions(tmp_path)
            if held and held[-1] > seen:
                seen = held[-1]
                try:
                    served = tf.saved_model.load(str(tmp_path / str(seen)))
                    out = served.serve(tf.constant(TOKENS)).numpy()
                    loaded.append((seen, float(out[0, 0])))
                except Exception as exc:  # noqa: BLE001 - every failure is the test's result
                    failures.append((seen, repr(exc)))
            if finished:
                return
            done.wait(0.005)  # pacing the poll, not waiting for anything

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for version in range(1, 7):
            _export(tmp_path, model, version, keep=10)
    finally:
        done.set()
        thread.join(120)
    assert not failures
    assert loaded and loaded[-1][0] == 6  # the newest version was loaded whole
    # each version's weights are its own: its output is that of the values written into it
    outputs = dict(loaded)
    for version, out in outputs.items():
        ref = _reference_output(model, version)
        assert out == pytest.approx(ref, rel=1e-5)


def _reference_output(model: Any, version: int) -> float:
    versions.assign_weights(model, _weights(model, version / 10))
    return float(np.asarray(model(TOKENS, training=False))[0, 0])


def _apply_in_order(base: Path, work: Path) -> tuple[int, Path]:
    """Apply every delta from the first version on, in order; (version reached, its dir)."""
    held = versions.versions(base)
    steps = dict(versions.deltas(base))
    at, path = held[0], base / str(held[0])
    while at in steps:
        out = work / f"applied-{steps[at]}"
        apply_delta(path, versions.delta_dir(base, at, steps[at]), out)
        at, path = steps[at], out
    return at, path


def _same_export(got: Path, want: Path) -> None:
    """Two full exports hold the same ids, rows and dense variables."""
    (meta_a, ids_a), (meta_b, ids_b) = read_export(got), read_export(want)
    assert meta_a["versions"] == meta_b["versions"]
    for path in meta_b["tables"]:
        np.testing.assert_array_equal(ids_a[path], ids_b[path])
    a, b = tf.saved_model.load(str(got)), tf.saved_model.load(str(want))
    for key in b.rows:
        np.testing.assert_array_equal(a.rows[key].numpy(), b.rows[key].numpy())
    for va, vb in zip(a.dense, b.dense, strict=True):
        np.testing.assert_array_equal(va.numpy(), vb.numpy())


@pytest.mark.parametrize(
    ("model", "table"),
    [("tiny_models:dynamic_tensor", "tables"), ("tiny_models:embedding", "fixed")],
)
def test_a_training_server_exports_versions_whose_deltas_give_the_last(
    tmp_path: Path, model: str, table: str
) -> None:
    spec = load_spec(model)
    base = tmp_path / "exports"
    config = {"export_dir": str(base), "export_every": 10, "export_keep": 50}
    with serving(spec, optimizer="adagrad", learning_rate=0.5, **config) as server:
        train(server.port, spec, steps=40, worker_id="w", n_fetch=1)
        doc = wait_until(lambda: (d := fetch_status(server.status))["version"] == 40 and d, 30,
                         "40 updates")  # fmt: skip
    held = versions.versions(base)
    assert held[-1] == 40 and len(held) >= 2  # the first due export, and the final one
    exports = server.server.exports
    assert exports is not None and exports.counts.written == len(held)
    assert exports.counts.failed == 0 and exports.counts.last_version == 40
    assert doc["exports"]["every"] == 10 and doc["exports"]["dir"] == str(base)
    assert versions.deltas(base) == list(zip(held, held[1:], strict=False))

    delta, _ = read_delta(versions.delta_dir(base, held[-2], held[-1]))
    if table == "fixed":  # the Embedding goes by changed row, not whole
        (record,) = delta["fixed"].values()
        assert 0 < record["changed"] < 5000
    else:
        (record,) = delta["tables"].values()
        assert record["changed"] > 0

    reached, applied = _apply_in_order(base, tmp_path)
    assert reached == 40
    _same_export(applied, base / "40")


def test_export_every_is_refused_on_a_shard_and_without_a_directory() -> None:
    from downpour.server.settings import ServerConfig, validate_server

    with pytest.raises(ConfigError, match="the job's chief exports"):
        validate_server(ServerConfig(export_dir="x", export_every=5, num_shards=2))
    with pytest.raises(ConfigError, match="go together"):
        validate_server(ServerConfig(export_every=5))


def test_a_dynamic_table_delta_drops_evicted_ids(tmp_path: Path) -> None:
    spec = load_spec("tiny_models:dynamic_tensor")
    model = build_model(spec)
    fp = fingerprint(model.trainable_variables)
    (path,) = dynamic_layers(model)
    weights = {v.path: v.numpy() for v in dense_variables(model) if v.trainable}
    rows = np.arange(24, dtype=np.float32).reshape(3, 8)

    def write(version: int, ids: list[int], table_rows: np.ndarray) -> None:
        table = Table(np.array(ids, np.int64), table_rows, np.full(len(ids), version, np.int64))
        versions.export_versions(tmp_path, model, version, weights, {path: table}, fp,
                                    spec.name)  # fmt: skip

    write(1, [7, -3, 2**40], rows)
    write(2, [7, 11], np.stack([rows[0] + 1, rows[1]]))  # -3 and 2**40 evicted, 11 new
    delta, arrays = read_delta(versions.delta_dir(tmp_path, 1, 2))
    key = delta["tables"][path]["key"]
    assert sorted(arrays[f"{key}/tombstones"].tolist()) == [-3, 2**40]
    assert sorted(arrays[f"{key}/ids"].tolist()) == [7, 11]
    reached, applied = _apply_in_order(tmp_path, tmp_path / "work")
    assert reached == 2
    _same_export(applied, tmp_path / "2")


def test_an_export_due_while_one_is_written_is_skipped_and_counted(tmp_path: Path) -> None:
    from concurrent.futures import Future

    from downpour.server.observers.exports import ServingExporter
    from downpour.server.state import ParameterState

    spec = load_spec("tiny_models:tiny")
    state = ParameterState(spec)
    exporter = ServingExporter(spec, str(tmp_path), 5, 3, state.fingerprint)
    try:
        exporter._running = Future()  # an export still being written
        state.version = 5
        exporter.after_loop_pass(state)
        assert exporter.counts.skipped == 1 and versions.versions(tmp_path) == []
        exporter._running = None
        state.version = 9  # the next is due 5 updates after the skipped one
        exporter.after_loop_pass(state)
        assert exporter._running is None
        state.version = 10
        exporter.after_loop_pass(state)
        exporter.final(state)  # waits for it; version 10 is exported already
        assert versions.versions(tmp_path) == [10]
        state.version = 12
        exporter.final(state)
    finally:
        exporter.close()
    assert versions.versions(tmp_path) == [10, 12]
    assert versions.deltas(tmp_path) == [(10, 12)]
    assert exporter.snapshot() | {"last_seconds": None} == {
        "written": 2, "skipped": 1, "failed": 0, "last_version": 12, "last_seconds": None,
        "last_delta": str(versions.delta_dir(tmp_path, 10, 12)), "every": 5, "keep": 3,
        "dir": str(tmp_path),
    }  # fmt: skip
