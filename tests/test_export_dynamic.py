"""Serving exports of models with dynamic tables, and delta exports between them: the served
SavedModel loads without downpour and predicts what the Keras model holding the tables' rows
predicts (zeros for an unknown id); deltas applied in order give the newer full export."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

from downpour import cli
from downpour.checkpoints.store import CheckpointError, CheckpointStore
from downpour.checkpoints.tables import tables_from_checkpoints
from downpour.inputs.data import Dataset
from downpour.layers import DynamicEmbedding, string_ids
from downpour.model.build import build_model, fingerprint
from downpour.server.tables.table import DynamicTable
from downpour.serving.delta import apply_delta, read_delta, write_delta
from downpour.serving.saved_model import (
    ServingError,
    Table,
    as_table,
    dense_variables,
    dynamic_layers,
    hold_rows,
    read_export,
    reference_outputs,
    write_export,
)
from downpour.spec import ModelSpec, load_spec
from downpour.tables.policy import TablePolicy

DIM = 4
RNG = np.random.default_rng(0)
USERS = RNG.integers(-(2**62), 2**62, 30, dtype=np.int64)
ITEMS = np.array([f"item-{i}" for i in range(20)])


def _one_input() -> keras.Model:
    ids = keras.Input((3,), dtype="int64", name="ids")
    e = DynamicEmbedding(DIM, max_rows=64, name="users")(ids)
    out = keras.layers.Dense(1, activation="sigmoid", name="head")(keras.layers.Flatten()(e))
    return keras.Model(ids, out)


def _two_tower(as_dict: bool) -> keras.Model:
    user = keras.Input((), dtype="int64", name="user")
    item = keras.Input((), dtype="string", name="item")
    eu = DynamicEmbedding(DIM, max_rows=64, name="users")(user)
    ei = keras.layers.Dense(DIM, name="item_proj")(DynamicEmbedding(DIM, 64, name="items")(item))
    out = keras.layers.Activation("sigmoid")(keras.layers.Dot(axes=-1)([eu, ei]))
    return keras.Model({"user": user, "item": item} if as_dict else [user, item], out)


def _batch(kind: str, users: np.ndarray, items: np.ndarray) -> object:
    if kind == "one":
        return tf.constant(np.stack([users, users[::-1], users]).T)
    pair = [tf.constant(users), tf.constant(items)]
    return {"user": pair[0], "item": pair[1]} if kind == "dict" else pair


MODELS: dict[str, Callable[[], keras.Model]] = {
    "one": _one_input,
    "list": lambda: _two_tower(False),
    "dict": lambda: _two_tower(True),
}


def _ids(path: str) -> np.ndarray:
    return string_ids(tf.constant(ITEMS)).numpy() if path.startswith("items") else USERS


def _servers(model: keras.Model, fallback: int = 0) -> dict[str, DynamicTable]:
    """One server-side table per DynamicEmbedding, trained a little at version 1; with
    ``fallback`` rows, ids 15..19 are refused a row (admit_after 2) and train them."""
    tables = {}
    for path, layer in dynamic_layers(model).items():
        policy = TablePolicy(None, fallback_rows=fallback, admit_after=2 if fallback else 1)
        t = DynamicTable(layer.name, DIM, seed=layer.seed, policy=policy, rule=layer.rule)
        ids = _ids(path)[:20]
        seen = np.concatenate([ids[:15], ids]) if fallback else ids  # 0..14 twice
        t.apply(seen, RNG.normal(size=(seen.size, DIM)).astype(np.float32), 0.5, version=1)
        tables[path] = t
    return tables


def _states(servers: dict[str, DynamicTable]) -> dict[str, Table]:
    return {p: as_table(t.export_state()) for p, t in servers.items()}


def _fp(model: keras.Model) -> str:
    return fingerprint(model.trainable_variables)


def _hold(model: keras.Model, tables: dict[str, Table], unknown: dict[str, np.ndarray]) -> None:
    """The Keras model holding exactly the tables' rows, and zero rows for ``unknown`` ids."""
    for path, layer in dynamic_layers(model).items():
        t, extra = tables[path], unknown.get(path, np.empty(0, np.int64))
        rows = np.concatenate([t.rows, np.zeros((extra.size, DIM), np.float32)])
        hold_rows(layer, np.concatenate([t.ids, extra]), rows)


def _serve(path: Path, batch: object) -> np.ndarray:
    loaded = tf.saved_model.load(str(path))  # kept while serving: it owns the variables
    return np.asarray(loaded.serve(batch))


@pytest.mark.parametrize("kind", list(MODELS))
def test_served_model_predicts_what_the_keras_model_with_the_rows_does(
    kind: str, tmp_path: Path
) -> None:
    model = MODELS[kind]()
    tables = _states(_servers(model))
    write_export(model, tables, tmp_path / "m", [1], _fp(model))
    assert (tmp_path / "m" / "saved_model.pb").is_file()

    known = _batch(kind, USERS[:8], ITEMS[:8])
    _hold(model, tables, {})
    np.testing.assert_allclose(_serve(tmp_path / "m", known), model(known), rtol=1e-6, atol=1e-7)

    fresh_users = np.array([7, -7, 2**62 + 1, 0, 5, 6, 8, 9], np.int64)
    fresh_items = np.array([f"new-{i}" for i in range(8)])
    unknown = _batch(kind, fresh_users, fresh_items)
    item_ids = string_ids(tf.constant(fresh_items)).numpy()
    _hold(model, tables, {"users/embeddings": fresh_users, "items/embeddings": item_ids})
    got = _serve(tmp_path / "m", unknown)
    np.testing.assert_allclose(got, model(unknown), rtol=1e-6, atol=1e-7)
    if kind != "one":  # a dot of zero rows: exactly the sigmoid of 0
        np.testing.assert_array_equal(got, np.full_like(got, 0.5))


LOADER = r"""
import json, sys
import numpy as np
import tensorflow as tf
loaded = tf.saved_model.load(sys.argv[1])
user = tf.constant(json.loads(sys.argv[2]), tf.int64)
item = tf.constant(json.loads(sys.argv[3]))
served = loaded.serve({"user": user, "item": item}).numpy()
signed = list(loaded.signatures["serving_default"](user=user, item=item).values())[0].numpy()
ours = sorted(m for m in sys.modules if m.split(".")[0] in ("downpour", "conftest"))
print(json.dumps({"serve": served.tolist(), "signature": signed.tolist(), "ours": ours}))
"""


@pytest.mark.parametrize("fallback", [0, 8])
def test_the_export_serves_in_a_process_that_never_imports_downpour(
    tmp_path: Path, fallback: int
) -> None:
    model = _two_tower(True)
    tables = _states(_servers(model, fallback))
    write_export(model, tables, tmp_path / "m", [1], _fp(model))
    users, items = np.append(USERS[:5], 12345), np.append(ITEMS[:5], "never seen")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    args = [str(tmp_path / "m"), json.dumps(users.tolist()), json.dumps(items.tolist())]
    proc = subprocess.run([sys.executable, "-I", "-c", LOADER, *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["ours"] == []
    want = _serve(tmp_path / "m", _batch("dict", users, items))
    np.testing.assert_array_equal(np.array(got["serve"], np.float32), want)
    np.testing.assert_array_equal(np.array(got["signature"], np.float32), want)
    if not fallback:
        assert want[-1, 0] == 0.5  # both ids unknown: zero rows
    else:  # unknown ids read their fallback rows, as the servers' gather gave them
        np.testing.assert_allclose(
            want, reference_outputs(model, tables, _batch("dict", users, items)), rtol=1e-6
        )


def test_an_unknown_id_reads_its_fallback_row_in_the_served_model(tmp_path: Path) -> None:
    """The served table answers what the servers' tables read: an own row, or the fallback
    row mix64(id) mod B that refused and unknown ids share."""
    model = _two_tower(True)
    servers = _servers(model, fallback=8)
    tables = _states(servers)
    for path, t in servers.items():
        refused = _ids(path)[15:20]
        assert (t.map.locate(refused) == -1).all() and tables[path].fallback.shape == (8, DIM)
        np.testing.assert_array_equal(tables[path].read(refused), t.gather(refused))
    write_export(model, tables, tmp_path / "m", [1], _fp(model))
    users = np.concatenate([USERS[:20], [7, -7, 2**62 + 1]])
    items = np.concatenate([ITEMS[:20], ["new-0", "new-1", "new-2"]])
    batch = _batch("dict", users, items)
    want = reference_outputs(model, tables, batch)
    np.testing.assert_allclose(_serve(tmp_path / "m", batch), want, rtol=1e-6, atol=1e-7)
    assert len({round(float(v), 6) for v in want[-3:, 0]}) > 1  # not one zero row for all


def _contents(path: Path) -> tuple[dict, dict, dict, list]:
    """(meta, ids by table, rows by table, dense values) of a full export."""
    meta, ids = read_export(path)
    loaded = tf.saved_model.load(str(path))
    rows = {p: loaded.rows[r["key"]].numpy() for p, r in meta["tables"].items()}
    return meta, ids, rows, [v.numpy() for v in loaded.dense]


def _assert_same_export(a: Path, b: Path) -> None:
    meta_a, ids_a, rows_a, dense_a = _contents(a)
    meta_b, ids_b, rows_b, dense_b = _contents(b)
    assert meta_a == meta_b
    for p in ids_a:
        np.testing.assert_array_equal(ids_a[p], ids_b[p])
        np.testing.assert_array_equal(rows_a[p], rows_b[p])
    assert len(dense_a) == len(dense_b) > 0
    for x, y in zip(dense_a, dense_b, strict=True):
        np.testing.assert_array_equal(x, y)


def _step(model: keras.Model, servers: dict[str, DynamicTable], version: int) -> None:
    """Train some rows (old and new ids) at ``version``, evict the idle ones, move the
    dense weights."""
    for path, t in servers.items():
        ids = np.concatenate([_ids(path)[version : version + 5], RNG.integers(0, 2**40, 3)])
        t.apply(ids, RNG.normal(size=(ids.size, DIM)).astype(np.float32), 0.1, version=version)
        t.evict_idle(version, 4)
    for v in dense_variables(model):
        v.assign(v.numpy() + 0.25)


def _dense(model: keras.Model) -> dict[str, np.ndarray]:
    return {v.path: v.numpy() for v in dense_variables(model)}


@pytest.mark.parametrize("fallback", [0, 8])
def test_deltas_applied_in_order_give_the_newer_full_export(tmp_path: Path, fallback: int) -> None:
    model = _two_tower(True)
    servers = _servers(model, fallback)
    fp = _fp(model)
    write_export(model, _states(servers), tmp_path / "v1", [1], fp)
    for old, new in ((1, 3), (3, 5)):  # a version between: rows trained then, not since
        for version in range(old + 1, new + 1):
            _step(model, servers, version)
        write_export(model, _states(servers), tmp_path / f"v{new}", [new], fp)
        meta = write_delta(tmp_path / f"v{old}", tmp_path / f"d{new}", _states(servers),
                           _dense(model), [new], fp)  # fmt: skip
        assert meta["from_version"] == [old] and meta["to_version"] == [new]
    _, arrays = read_delta(tmp_path / "d5")
    assert all(arrays[f"{k}/tombstones"].size for k in ("t0", "t1"))  # rows were evicted
    assert 0 < arrays["t1/ids"].size < len(servers["users/embeddings"])  # a delta, not a copy

    apply_delta(tmp_path / "v1", tmp_path / "d3", tmp_path / "a3")
    _assert_same_export(tmp_path / "a3", tmp_path / "v3")
    apply_delta(tmp_path / "a3", tmp_path / "d5", tmp_path / "a5")
    _assert_same_export(tmp_path / "a5", tmp_path / "v5")
    batch = _batch("dict", USERS[:10], ITEMS[:10])
    np.testing.assert_array_equal(_serve(tmp_path / "a5", batch), _serve(tmp_path / "v5", batch))

    with pytest.raises(ServingError, match="apply the deltas in order"):
        apply_delta(tmp_path / "v1", tmp_path / "d5", tmp_path / "bad")
    other = _one_input()
    with pytest.raises(ServingError, match="not of this one"):
        write_delta(tmp_path / "v1", tmp_path / "bad", _states(_servers(other)), _dense(other),
                    [2], _fp(other))  # fmt: skip
    assert not (tmp_path / "bad").exists()


def test_tables_are_joined_from_every_shards_checkpoint(tmp_path: Path) -> None:
    model = _one_input()
    (whole,) = _servers(model).values()
    state = whole.export_state()
    halves = [slice(0, 10), slice(10, None)]
    for shard, rows in enumerate(halves):
        arrays = {f"dynamic/users/embeddings/{f}": state[f][rows]
                  for f in ("ids", "rows", "versions", "counts")}  # fmt: skip
        CheckpointStore(tmp_path / f"s{shard}").write(1, arrays, {"shard": shard})
    ckpts = [CheckpointStore(tmp_path / f"s{i}").latest() for i in range(2)]
    joined = tables_from_checkpoints(ckpts)["users/embeddings"]
    for f in ("ids", "rows", "versions"):
        np.testing.assert_array_equal(joined[f], state[f])
    with pytest.raises(CheckpointError, match="held by two"):
        tables_from_checkpoints([ckpts[0], ckpts[0]])


def test_export_refuses_a_delta_from_that_is_not_an_export_of_this_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ref = "tiny_models:tiny"
    tiny = build_model(load_spec(ref))
    arrays = {f"model/{v.path}": v.numpy() for v in tiny.trainable_variables}
    doc = {"fingerprint": fingerprint(tiny.trainable_variables), "workers": {}}
    CheckpointStore(tmp_path / "state").write(3, arrays, doc)
    model = _two_tower(True)
    write_export(model, _states(_servers(model)), tmp_path / "other", [1], _fp(model))
    (tmp_path / "plain").mkdir()
    base = ["export", "--state-dir", str(tmp_path / "state"), "--model", ref]
    for old, says in (("plain", "is not a downpour export"), ("other", "is an export of model")):
        out = tmp_path / f"delta_{old}"
        assert cli.main([*base, "--out", str(out), "--delta-from", str(tmp_path / old)]) == 2
        assert says in capsys.readouterr().err
        assert not out.exists()


def recs_spec() -> ModelSpec:
    """The one-input model on ids of USERS, for ``downpour export --model``."""
    x = np.stack([RNG.choice(USERS[:25], 3) for _ in range(60)])
    y = RNG.integers(0, 2, 60)
    return ModelSpec(name="recs", build=_one_input, load_data=lambda _d: Dataset(x, y, x, y))


def test_downpour_export_serves_the_tables_of_the_checkpoints_and_writes_deltas(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = build_model(recs_spec())
    (server,) = _servers(model).values()
    state, ref = tmp_path / "state", "test_export_dynamic:recs_spec"
    base = ["export", "--state-dir", str(state), "--model", ref]
    for version in (1, 2):
        if version == 2:
            _step(model, {"users/embeddings": server}, version)
        arrays = {f"model/{v.path}": v.numpy() for v in dense_variables(model)}
        arrays |= {f"dynamic/users/embeddings/{f}": a for f, a in server.export_state().items()}
        doc = {"fingerprint": _fp(model), "workers": {}, "model": "recs"}
        CheckpointStore(state).write(version, arrays, doc)
        assert cli.main([*base, "--out", str(tmp_path / f"v{version}")]) == 0
        assert "reloaded: outputs match" in capsys.readouterr().out
    delta = ["--out", str(tmp_path / "d2"), "--delta-from", str(tmp_path / "v1")]
    assert cli.main([*base, *delta]) == 0
    assert "delta export directory" in capsys.readouterr().out
    apply_delta(tmp_path / "v1", tmp_path / "d2", tmp_path / "a2")
    _assert_same_export(tmp_path / "a2", tmp_path / "v2")
    batch = tf.constant(np.stack([USERS[:6], USERS[6:12], USERS[12:18]]).T)
    _hold(model, {"users/embeddings": as_table(server.export_state())}, {})
    np.testing.assert_allclose(_serve(tmp_path / "a2", batch), model(batch), rtol=1e-6)
