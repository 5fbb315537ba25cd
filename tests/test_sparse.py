"""Row-sparse gradients (an Embedding's IndexedSlices): sent as rows, applied as rows."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import pull_weights
from inproc import Services, settle

from downpour.cli.status import fetch_status
from downpour.model.build import build_model, evaluate
from downpour.server.state import ParameterState
from downpour.spec import load_spec
from downpour.wire import Sparse


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam"])
def test_sparse_apply_touches_only_its_rows_and_equals_the_dense_apply(optimizer: str) -> None:
    spec = load_spec("tiny_models:embedding")
    sparse = ParameterState(spec, optimizer, 0.1, seed=3)
    dense = ParameterState(spec, optimizer, 0.1, seed=3, jit=False, sparse_apply=False)
    assert sparse.sparse == [True, False, False] and not sparse.jit
    before = sparse.weights()[1][0].copy()
    rng = np.random.default_rng(0)
    touched: set[int] = set()
    for rows in ([3, 7, 3], [7, 4000, 12, 12, 12], [1]):  # repeated rows, a different nnz each
        idx = np.array(rows, np.int64)
        g = Sparse(idx, rng.standard_normal((len(rows), 8)).astype(np.float32), (5000, 8))
        rest = [rng.standard_normal(s).astype(np.float32) for s in sparse.shapes[1:]]
        sparse.apply([g, *rest])
        dense_g = np.zeros((5000, 8), np.float32)
        np.add.at(dense_g, idx, g.values)
        dense.apply([dense_g, *rest])  # the reference: the same rows, densified
        touched |= set(rows)
    after = sparse.weights()[1][0]
    changed = set(np.flatnonzero((after != before).any(axis=1)).tolist())
    assert changed == touched
    for a, b in zip(sparse.weights()[1], [v.numpy() for v in dense.variables], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert sparse.apply_traces == 1  # one trace for every number of rows


def test_a_large_table_pushes_bytes_in_proportion_to_rows_touched(services: Services) -> None:
    model = "tiny_models:big_embedding"
    server = services.server(model, optimizer="adagrad", learning_rate=0.5)
    (s,) = services.train(server.port, 1, model, steps=60)
    settle(server.status, [s])
    doc = fetch_status(server.status)
    assert doc["version"] == 60 and doc["rejected_total"] == 0
    table = 100_000 * 16 * 4
    per_push = doc["workers"]["w0"]["reported"]["bytes_sent"] / s["pushes"]
    # 20 examples x 6 tokens: at most 120 rows of 64 bytes (+ their indices, the dense layer)
    assert per_push < 0.005 * table, f"{per_push:.0f} bytes per push for a {table} byte table"

    spec = load_spec(model)
    m = build_model(spec)
    _, arrays = pull_weights(server.rep)
    for v, a in zip(m.trainable_variables, arrays, strict=True):
        v.assign(a)
    data = spec.load_data(None)
    assert evaluate(spec, m, data.x_test, data.y_test) > 0.9


def test_two_workers_pull_rows_of_a_large_table_and_train(services: Services) -> None:
    """Row pulls on (the default) with a staleness bound: each worker loads the table once,
    then pulls only the rows its batches gather, and both reach the held-out bar."""
    model = "tiny_models:big_embedding"
    server = services.server(model, optimizer="lazy_adam", learning_rate=0.05)
    sums = services.train(server.port, 2, model, steps=60, row_staleness=2)
    settle(server.status, sums)
    doc = fetch_status(server.status)
    assert doc["version"] == 120 and doc["rejected_total"] == 0
    assert doc["row_pulls"] >= 2 * 59 and doc["rows_served"] > 0
    table = 100_000 * 16 * 4
    for s in sums:
        assert s["row_pulls"] == ["embed/embeddings"] and s["held_out"] > 0.9
        assert s["rows_pulled"] <= 60 * 120 and s["row_misses"] > 0
        # one whole load; then rows (at most 120 a step, 72 bytes each) and the small layer
        assert table < s["bytes_pulled"] < table + 60 * (120 * 72 + 1024)
