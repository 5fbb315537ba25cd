"""Multi-valued features: a ``DynamicEmbedding`` over bags of ids (ragged, sparse, padded by
a pad id or a mask) pooled by a combiner, against NumPy and TensorFlow's own
``safe_embedding_lookup_sparse``; pads never rows; the ``bags`` model (a table shared by a
candidate item and a history) through a real server and worker; its serving export."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from inproc import serving, train
from tiny_models import TAG_PAD, bag_data, hashed

from downpour.layers import COMBINERS, DynamicEmbedding
from downpour.model.build import build_model, gathered_ids, id_extractor
from downpour.serving.saved_model import as_table, reference_outputs, write_export
from downpour.spec import load_spec

DIM = 3
BAGS = [[5, 6, 7], [8], [], [6, 6, 9, 5]]  # a repeated id, an empty bag
WEIGHTS = [[1.0, 2.0, 0.5], [3.0], [], [1.0, 1.0, 2.0, 0.25]]
PAD = -1


def _tensors(features: dict) -> dict:
    """The features as tensors (Keras takes no mix of arrays and ragged tensors)."""
    return {k: v if isinstance(v, tf.RaggedTensor) else tf.constant(v) for k, v in features.items()}


def _held_layer(combiner: str | None, pad_id: int | None = None) -> tuple[DynamicEmbedding, dict]:
    """A built layer holding known rows for every id of ``BAGS``; (layer, id -> row)."""
    layer = DynamicEmbedding(DIM, max_rows=32, combiner=combiner, pad_id=pad_id, name="bag")
    layer.build()
    ids = np.unique(np.concatenate([b for b in BAGS if b])).astype(np.int64)
    rows = np.random.default_rng(3).normal(size=(ids.size, DIM)).astype(np.float32)
    layer.hold(ids, rows)
    return layer, dict(zip(ids.tolist(), rows, strict=True))


def _reference(combiner: str | None, rows: dict, weighted: bool) -> list[np.ndarray]:
    """What each bag gives, in NumPy: rows per position, or pooled (zeros for an empty bag)."""
    out = []
    for bag, ws in zip(BAGS, WEIGHTS, strict=True):
        r = np.array([rows[i] for i in bag], np.float32).reshape(-1, DIM)
        w = np.array(ws if weighted else [1.0] * len(bag), np.float32)
        if combiner is None:
            out.append(r)
            continue
        total = (r * w[:, None]).sum(axis=0)
        denom = {"sum": 1.0, "mean": w.sum(), "sqrtn": np.sqrt((w**2).sum())}[combiner]
        out.append(total / denom if denom else np.zeros(DIM, np.float32))
    return out


def _inputs(form: str) -> tuple[object, object, object]:
    """(ids, weights, mask) of ``BAGS`` in ``form``."""
    width = max(len(b) for b in BAGS)
    if form == "ragged":
        return tf.ragged.constant(BAGS, tf.int64), tf.ragged.constant(WEIGHTS), None
    if form == "sparse":  # the ids at scattered columns, as a sparse feature has them
        where = [[i, 2 * j] for i, b in enumerate(BAGS) for j in range(len(b))]
        values = [v for b in BAGS for v in b]
        ws = [v for w in WEIGHTS for v in w]
        shape = [len(BAGS), 2 * width]
        return (tf.SparseTensor(where, tf.constant(values, tf.int64), shape),
                tf.SparseTensor(where, tf.constant(ws, tf.float32), shape), None)  # fmt: skip
    dense = np.full((len(BAGS), width), PAD, np.int64)
    w = np.zeros((len(BAGS), width), np.float32)
    for i, (b, ws) in enumerate(zip(BAGS, WEIGHTS, strict=True)):
        dense[i, : len(b)], w[i, : len(b)] = b, ws
    if form == "pad":
        return tf.constant(dense), tf.constant(w), None
    return (
        tf.constant(np.where(dense == PAD, 123, dense)),
        tf.constant(w),
        tf.constant(dense != PAD),
    )


# weights pool: without a combiner there is nothing to weigh
POOLINGS = [(c, w) for c in COMBINERS for w in (False, True)] + [(None, False)]


@pytest.mark.parametrize(("combiner", "weighted"), POOLINGS)
@pytest.mark.parametrize("form", ["ragged", "sparse", "pad", "mask"])
def test_each_form_and_combiner_matches_numpy(
    form: str, combiner: str | None, weighted: bool
) -> None:
    layer, rows = _held_layer(combiner, PAD if form == "pad" else None)
    ids, weights, mask = _inputs(form)
    got = layer(ids, weights=weights if weighted else None, mask=mask)
    want = _reference(combiner, rows, weighted)
    if combiner is not None:
        np.testing.assert_allclose(np.asarray(got), np.stack(want), rtol=1e-6, atol=1e-7)
    elif form == "ragged":
        for g, w in zip(got.to_list(), want, strict=True):
            np.testing.assert_allclose(np.array(g, np.float32).reshape(-1, DIM), w, rtol=1e-6)
    else:  # the rows at their positions, zeros at pads and masked or empty positions
        got = np.asarray(got)
        dense, _, m = _inputs(form)
        cols = (
            [[2 * j for j in range(len(b))] for b in BAGS]
            if form == "sparse"
            else [list(range(len(b))) for b in BAGS]
        )
        for i, w in enumerate(want):
            np.testing.assert_allclose(got[i, cols[i]], w, rtol=1e-6)
            others = [c for c in range(got.shape[1]) if c not in cols[i]]
            assert not got[i, others].any()


@pytest.mark.parametrize("combiner", COMBINERS)
def test_sparse_bags_pool_as_safe_embedding_lookup_sparse_does(combiner: str) -> None:
    layer, rows = _held_layer(combiner)
    ids, weights, _ = _inputs("sparse")
    table = np.zeros((10, DIM), np.float32)
    for i, r in rows.items():
        table[i] = r
    want = tf.nn.safe_embedding_lookup_sparse(
        tf.constant(table), ids, weights, combiner=combiner
    )  # ids are the table's row numbers here: held rows at the same ids
    np.testing.assert_allclose(layer(ids, weights=weights), want, rtol=1e-5, atol=1e-6)


def test_a_pad_is_never_a_row_never_counted_and_gets_no_gradient() -> None:
    layer = DynamicEmbedding(DIM, max_rows=16, combiner="sum", pad_id=0, admit_after=2, name="p")
    batch = tf.constant([[3, 0, 0], [0, 0, 0], [4, 3, 0]], tf.int64)
    for _ in range(3):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(layer(batch, training=True))
        (grad,) = tape.gradient(loss, [layer.embeddings.value])
    live = set(layer._map.live()[0].tolist())
    assert live == {3, 4} and 0 not in live
    assert layer._map.sketch.estimate(np.array([0]))[0] == 0  # never counted for admission
    assert set(grad.indices.numpy().tolist()) <= set(layer._map.locate(np.array([3, 4])).tolist())
    np.testing.assert_array_equal(np.asarray(layer(batch))[1], np.zeros(DIM))  # an empty bag


def test_the_id_extractor_reads_a_shared_tables_ids_from_every_feature_without_pads() -> None:
    spec = load_spec("tiny_models:bags")
    model = build_model(spec)
    layers = {x.name: x for x in model.layers if isinstance(x, DynamicEmbedding)}
    features, _ = bag_data(6, 9)
    extractor = id_extractor(model, [layers["items"], layers["tag"]])
    got = gathered_ids(extractor, _tensors(features))
    items, tags = (set(t.numpy().tolist()) for t in got)
    want_items = set(features["item"].tolist()) | set(features["history"].flat_values.numpy())
    assert items == want_items  # the candidate and every history item: one table
    assert TAG_PAD not in tags and tags == set(features["tags"][features["tags"] != TAG_PAD])


def test_the_bags_model_trains_through_a_server_and_its_pads_never_reach_it() -> None:
    """A server and a worker on real sockets: the worker pulls and pushes the real ids of
    every bag (the shared item table gets the candidates and the histories), the tag table
    never hears of the pad id, and the model learns its planted signal."""
    with serving("tiny_models:bags", optimizer="adagrad", learning_rate=0.1) as server:
        summary = train(server.port, "tiny_models:bags", steps=40, n_fetch=1)
        assert summary["steps"] == 40
        tables = server.server.state.tables
        tag = tables["tag/embeddings"]
        assert tag.map.locate(np.array([TAG_PAD]))[0] == -1
        assert tag.sketch.estimate(np.array([TAG_PAD]))[0] == 0
        features, _ = bag_data(800, 5)
        items = set(features["item"].tolist()) | set(features["history"].flat_values.numpy())
        assert set(tables["items/embeddings"].map.live()[0].tolist()) <= items
        assert len(tables["items/embeddings"]) > 40  # candidates and history items, one table


def test_a_multi_valued_export_answers_as_the_model_with_the_servers_rows(tmp_path: Path) -> None:
    """The server's tables exported: the served model pools the same bags (ragged history,
    padded tags, the shared item table) as the Keras model holding those rows."""
    spec = load_spec("tiny_models:bags")
    with serving(spec, optimizer="adagrad", learning_rate=0.1) as server:
        train(server.port, spec, steps=20, n_fetch=1)
        states = {p: as_table(t.export_state()) for p, t in server.server.state.tables.items()}
    model = build_model(spec)
    write_export(model, states, tmp_path / "m", [20], "fp")
    features, _ = bag_data(50, 11)
    features["user"][:3] = hashed(np.array([999, 998, 997]))  # ids the tables never saw
    batch = _tensors(features)
    want = reference_outputs(model, states, batch)
    loaded = tf.saved_model.load(str(tmp_path / "m"))
    got = np.asarray(loaded.serve(batch))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


BAG_LOADER = r"""
import json, sys
import numpy as np
import tensorflow as tf
loaded = tf.saved_model.load(sys.argv[1])
raw = json.loads(sys.argv[2])
batch = {
    "user": tf.constant(raw["user"], tf.int64),
    "item": tf.constant(raw["item"], tf.int64),
    "history": tf.ragged.constant(raw["history"], dtype=tf.int64, ragged_rank=1),
    "tags": tf.constant(raw["tags"], tf.int64),
}
served = loaded.serve(batch).numpy()
ours = sorted(m for m in sys.modules if m.split(".")[0] in ("downpour", "conftest"))
print(json.dumps({"serve": served.tolist(), "ours": ours}))
"""


def test_a_multi_valued_export_serves_in_a_process_that_never_imports_downpour(
    tmp_path: Path,
) -> None:
    """Ragged histories (empty ones among them) and padded tags, pooled by the served graph
    alone: the same outputs as in this process."""
    import json
    import os
    import subprocess
    import sys

    spec = load_spec("tiny_models:bags")
    with serving(spec, optimizer="adagrad", learning_rate=0.1) as server:
        train(server.port, spec, steps=10, n_fetch=1)
        states = {p: as_table(t.export_state()) for p, t in server.server.state.tables.items()}
    model = build_model(spec)
    write_export(model, states, tmp_path / "m", [10], "fp")
    features, _ = bag_data(12, 13)
    raw = {
        "user": features["user"].tolist(),
        "item": features["item"].tolist(),
        "history": features["history"].to_list(),
        "tags": features["tags"].tolist(),
    }
    assert any(not h for h in raw["history"])  # an empty bag among them
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    proc = subprocess.run([sys.executable, "-I", "-c", BAG_LOADER, str(tmp_path / "m"),
                           json.dumps(raw)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["ours"] == []
    loaded = tf.saved_model.load(str(tmp_path / "m"))
    want = np.asarray(loaded.serve(_tensors(features)))
    np.testing.assert_allclose(np.array(got["serve"], np.float32), want, rtol=1e-6, atol=1e-7)
