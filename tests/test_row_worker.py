"""Row pulls, the worker's side: the id extractor, the staleness bound of the row cache,
training end to end with row pulls, and a table split over two shards (ids routed to the
shard holding them, the result equal to one shard's). In-process servers on real sockets."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import free_ports, wait_until
from inproc import InprocServer, WorkerThread, make_worker, serving, train

from downpour import wire
from downpour.cli.status import fetch_status
from downpour.model.build import build_model
from downpour.model.partition import make_partition
from downpour.net.cluster import ShardSet, partition_of, pull_full
from downpour.net.transport import make_context
from downpour.runtime.metrics import Notices
from downpour.spec import load_spec
from downpour.worker.rows.plan import Lookahead, RowPlan
from downpour.worker.service import WorkerError

BIG = "tiny_models:big_embedding"
TABLE = "embed/embeddings"


def plan_for(model_ref: str, staleness: int, num_shards: int = 1) -> RowPlan:
    model = build_model(load_spec(model_ref))
    variables = model.trainable_variables
    part = make_partition(
        [v.path for v in variables],
        [tuple(v.shape) for v in variables],
        [str(v.dtype) for v in variables],
        num_shards,
        "fp",
    )
    return RowPlan(model, part, [0], tf.TensorSpec((None, 6), tf.int32), staleness)


def test_the_extractor_finds_the_unique_ids_a_batch_gathers() -> None:
    plan = plan_for("tiny_models:embedding", 0)
    x = np.array([[5, 9, 5, 1, 1, 1], [9, 4999, 0, 0, 0, 0]], np.int32)
    (ids,) = plan.batch_ids(x)
    assert sorted(ids.tolist()) == [0, 1, 5, 9, 4999] and len(ids) == 5  # unique


def test_a_row_older_than_k_versions_is_pulled_again_and_a_fresh_one_is_not() -> None:
    plan = plan_for("tiny_models:embedding", staleness=2)
    table = plan.tables[0]
    table.fetched[[10, 11, 12, 13]] = [10, 11, 13, -1]  # fetched at those versions, 13 never
    ids = [np.array([10, 11, 12, 13], np.int64)]
    # the shard is at version 13: 10 is 3 versions old (> K = 2), 11 is 2 (fresh)
    assert plan.wanted(ids, [13])[0][TABLE].tolist() == [10, 13]
    # a look-ahead pull asks for what will be stale one version on: 11 too
    assert plan.wanted(ids, [13], ahead=1)[0][TABLE].tolist() == [10, 11, 13]
    assert plan.wanted(ids, [12])[0][TABLE].tolist() == [13]  # one version earlier: 10 fresh
    fresh = plan.wanted([np.array([12], np.int64)], [14])
    assert list(fresh[0]) == [TABLE] and fresh[0][TABLE].size == 0  # named, nothing asked
    assert RowPlan.count(fresh) == 0


def test_a_restarted_shard_s_rows_count_as_never_fetched() -> None:
    """Versions start again with a server's new incarnation: its rows are pulled again and
    a reply may overwrite them, whatever version they were fetched at before."""
    plan = plan_for(BIG, staleness=5, num_shards=2)
    plan.tables[0].fetched[:] = 40
    plan.forget(1)
    assert (plan.tables[0].fetched[:50_000] == 40).all()
    assert (plan.tables[0].fetched[50_000:] == -1).all()
    wanted = plan.wanted([np.array([1, 60_000], np.int64)], [40, 3])
    assert RowPlan.count(wanted) == 1 and wanted[1][f"{TABLE}[50000:100000]"].tolist() == [10_000]


def test_a_split_tables_ids_are_routed_to_their_shard_rebased() -> None:
    plan = plan_for(BIG, staleness=0, num_shards=2)
    ids = [np.array([3, 49_999, 50_000, 75_049], np.int64)]
    per_shard = plan.wanted(ids, [0, 0])
    assert per_shard[0][f"{TABLE}[0:50000]"].tolist() == [3, 49_999]
    assert per_shard[1][f"{TABLE}[50000:100000]"].tolist() == [0, 25_049]
    # a fixed table's ids go as int32: half the bytes of a request's id frame
    assert all(ids.dtype == np.int32 for shard in per_shard for ids in shard.values())


def test_lookahead_shows_the_coming_batches_and_keeps_each_ones_split_end() -> None:
    stream = Lookahead(iter([(i, -i, i == 2) for i in range(5)]))
    assert stream.features(1, 3) == [1, 2]  # read ahead, nothing taken
    assert stream.next() == (0, 0, False) and stream.next() == (1, -1, False)
    assert stream.features(1, 4) == [1, 2, 3]  # the current batch, then the ones ahead
    assert stream.next() == (2, -2, True)
    assert stream.features(4, 9) == [4]  # the end of the input
    assert [stream.next(), stream.next(), stream.next()] == [(3, -3, False), (4, -4, False), None]


def _figures(s: dict[str, Any]) -> dict[str, Any]:
    keys = ("held_out", "steps", "bytes_pulled", "rows_pulled", "row_hits", "row_misses")
    return {k: s[k] for k in keys}


def test_training_with_row_pulls_reaches_the_dense_bar_and_pulls_rows_only() -> None:
    with serving(BIG, optimizer="adagrad", learning_rate=0.5) as server:
        rows = train(server.port, BIG, steps=60, worker_id="rows")
        dense = train(server.port, BIG, steps=60, worker_id="dense", row_pulls="off")
    print("row pulls:", _figures(rows), "dense pulls:", _figures(dense))
    assert rows["row_pulls"] == [TABLE] and dense["row_pulls"] is None
    assert rows["held_out"] > 0.9 and dense["held_out"] > 0.9
    table = 100_000 * 16 * 4
    # one whole load, then rows: a batch of 20 x 6 ids touches at most 120 rows a step
    assert table < rows["bytes_pulled"] < table + 60 * 120 * (64 + 8) + 60 * 1024
    # every pull that brought a new version carried the whole table; how many of the 60
    # came back unchanged (the push not applied yet) depends on the timing
    whole = dense["pulls"] - dense["pulls_unchanged"]
    assert dense["bytes_pulled"] >= whole * table and whole > 40
    assert 0 < rows["rows_pulled"] <= 60 * 120 and rows["row_misses"] > 0


@pytest.mark.parametrize("staleness", [0, 10**6])
def test_the_staleness_bound_decides_which_rows_are_pulled(staleness: int) -> None:
    with serving(BIG, optimizer="sgd", learning_rate=0.5) as server:
        s = train(server.port, BIG, steps=30, row_staleness=staleness, n_fetch=1)
    if staleness:  # every row was fetched by the first load and never gets K versions old
        assert s["rows_pulled"] == 0 and s["row_misses"] == 0 and s["row_hits"] > 0
    else:  # the version moves every step: each batch's rows are pulled at the current one
        assert s["rows_pulled"] > 0 and s["row_misses"] > 0.9 * (s["row_hits"] + s["row_misses"])


def _push_same_gradients(endpoints: list[tuple[str, int]], steps: int) -> None:
    """The same seeded sparse gradients pushed to one server or to every shard."""
    spec = load_spec(BIG)
    variables = build_model(spec).trainable_variables
    ctx = make_context()
    shards = ShardSet(ctx, endpoints, partition_of(variables, len(endpoints)), sender="g")
    try:
        shards.hello_all(spec.name)
        rng = np.random.default_rng(11)
        for seq in range(1, steps + 1):
            ids = rng.integers(0, 100_000, 40)
            grads = [
                wire.Sparse(ids, rng.standard_normal((40, 16)).astype(np.float32), (100_000, 16)),
                rng.standard_normal((16, 4)).astype(np.float32),
                rng.standard_normal(4).astype(np.float32),
            ]
            shards.push(seq, grads, [seq - 1] * len(endpoints), wire.PushBody())
    finally:
        shards.close(push_linger_s=30.0)  # queued gradients leave before the sockets close
        ctx.term()


def _rows(endpoints: list[tuple[str, int]], ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    variables = build_model(load_spec(BIG)).trainable_variables
    ctx = make_context()
    shards = ShardSet(ctx, endpoints, partition_of(variables, len(endpoints)), sender="r")
    try:
        got_ids, rows, _ = shards.pull_rows(0, ids)
        return got_ids, rows
    finally:
        shards.close()
        ctx.term()


def test_a_table_split_over_two_shards_serves_the_rows_one_shard_does() -> None:
    """The same gradients pushed to one server and to two shards: row pulls routed over the
    shards reassemble exactly the one server's rows (sync:1/1 applies each in turn)."""
    steps = 12
    cfg = {"optimizer": "adagrad", "learning_rate": 0.5, "policy": "sync:1/1"}
    with (
        serving(BIG, **cfg) as one,
        serving(BIG, shard=0, num_shards=2, **cfg) as s0,
        serving(BIG, shard=1, num_shards=2, **cfg) as s1,
    ):
        single = [("127.0.0.1", one.port)]
        pair = [("127.0.0.1", s0.port), ("127.0.0.1", s1.port)]
        _push_same_gradients(single, steps)
        _push_same_gradients(pair, steps)
        _applied([one, s0, s1], steps)
        ids = np.array([7, 49_999, 50_000, 99_999, 7, 60_123, 123], np.int64)
        a_ids, a_rows = _rows(single, ids)
        b_ids, b_rows = _rows(pair, ids)
    np.testing.assert_array_equal(a_ids, np.unique(ids))
    np.testing.assert_array_equal(b_ids, a_ids)
    np.testing.assert_array_equal(b_rows, a_rows)  # bit for bit: the same row-wise arithmetic


def _applied(servers: list[Any], version: int) -> None:
    for s in servers:
        wait_until(lambda s=s: fetch_status(s.status)["version"] == version, 30, "the applies")


def test_a_worker_on_a_split_table_trains_as_on_one_shard() -> None:
    """One worker, sync:1/1 (each gradient from the weights after the previous one), row
    pulls on: two shards end with the same weights as one server."""
    cfg = {"optimizer": "adagrad", "learning_rate": 0.5, "policy": "sync:1/1"}
    variables = build_model(load_spec(BIG)).trainable_variables
    with serving(BIG, **cfg) as one:
        a = train(one.port, BIG, steps=20, worker_id="one")
        _applied([one], 20)
        _, whole = pull_full([one.rep], variables)
    with (
        serving(BIG, shard=0, num_shards=2, **cfg) as s0,
        serving(BIG, shard=1, num_shards=2, **cfg) as s1,
    ):
        b = train([s0.port, s1.port], BIG, steps=20, worker_id="two")
        _applied([s0, s1], 20)
        _, joined = pull_full([s0.rep, s1.rep], variables)
    assert a["row_pulls"] == b["row_pulls"] == [TABLE]
    assert a["rows_pulled"] > 0 and b["rows_pulled"] > 0
    for x, y in zip(whole, joined, strict=True):
        np.testing.assert_array_equal(x, y)  # the same arithmetic on the same rows


class _Subclassed(keras.Model):
    """An embedding model written as a subclass: no graph of layers to extract ids from."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = keras.layers.Embedding(100, 4)
        self.out = keras.layers.Dense(2)

    def call(self, x):  # noqa: ANN001, ANN201
        return self.out(keras.ops.mean(self.embed(x), axis=1))


def test_a_model_without_a_layer_graph_falls_back_to_whole_pulls(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model = _Subclassed()
    model(np.zeros((1, 3), np.int32))
    variables = model.trainable_variables
    part = make_partition(
        [v.path for v in variables],
        [tuple(v.shape) for v in variables],
        [str(v.dtype) for v in variables],
        1,
        "fp",
    )
    offered = [[variables[0].path]]
    spec = tf.TensorSpec((None, 3), tf.int32)
    notices = Notices()  # what the worker's pushes report to the servers' status
    with caplog.at_level("INFO", logger="downpour.worker"):
        plan = RowPlan.build(model, part, offered, spec, 0, notices=notices)
    assert plan is None
    assert "row pulls off" in caplog.text and "pulled whole" in caplog.text
    (off,) = notices.items()
    assert off.startswith("row pulls off") and "tables are pulled whole" in off
    assert RowPlan.build(model, part, [[]], spec, 0, notices=notices) is None  # not served
    assert notices.items()[1] == (
        f"tables {variables[0].path} are pulled whole: the servers do not serve them by row "
        "(their log and `downpour status` say why)"
    )


def test_a_row_pulling_worker_carries_on_through_a_server_restart(tmp_path: Path) -> None:
    """The server goes away and comes back from its checkpoint (a new incarnation, an older
    version): the worker forgets the versions its rows were fetched at, pulls them again and
    trains on."""
    port, push_port, status_port = free_ports(3)
    config = {
        "port": port,
        "push_port": push_port,
        "status_port": status_port,
        "optimizer": "adagrad",
        "learning_rate": 0.5,
        "state_dir": str(tmp_path / "state"),
        "checkpoint_every": 5,
        "checkpoint_secs": 0.0,
    }
    worker = make_worker(
        port, BIG, worker_id="w", steps=100_000, request_timeout_s=1.0, row_staleness=3
    )
    thread = WorkerThread(worker)
    try:
        first = InprocServer(BIG, **config)
        try:
            wait_until(lambda: fetch_status(first.status)["version"] >= 14, 60, "training")
        finally:
            first.stop()
        before = worker.stats["rows_pulled"]
        with serving(BIG, **config) as again:
            restored = fetch_status(again.status)["restored_from"]
            assert restored is not None
            wait_until(
                lambda: fetch_status(again.status)["version"] > restored + 20, 60, "training on"
            )
            doc = fetch_status(again.status)
            assert doc["rejected_total"] == 0
            assert worker.stats["rows_pulled"] > before
    finally:
        worker.stop()
    with contextlib.suppress(WorkerError):
        thread.result()
    assert thread.error is None or "stopped while waiting" in str(thread.error), thread.error
