"""The worker's bounded row cache (``--row-cache-rows N``): a table of more rows than N kept
as N cached rows, trained against real in-process servers; the result equals a full
replica's, pushes carry global ids, rows are evicted, and batches that need more rows than
the cache holds are refused."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf
from conftest import wait_until
from inproc import make_worker, serving, train

from downpour import wire
from downpour.cli.status import fetch_status
from downpour.config.settings import ConfigError
from downpour.model.build import build_model
from downpour.model.partition import Part
from downpour.net.cluster import pull_full
from downpour.spec import load_spec
from downpour.worker.rows.cache import RowCache
from downpour.worker.service import WorkerError

BIG = "tiny_models:big_embedding"  # 100,000 x 16; a batch gathers <= 120 ids of 200 in use
TABLE = "embed/embeddings"
CACHE = 150  # fewer rows than the 200 ids the run gathers: rows are evicted and pulled again
SYNC = {"optimizer": "adagrad", "learning_rate": 0.5, "policy": "sync:1/1"}


def _cached(cache: RowCache, *ids: int) -> list[bool]:
    return (cache.slots(np.array(ids, np.int64)) >= 0).tolist()


def test_eviction_spares_the_current_batch_and_keeps_rows_for_coming_batches() -> None:
    cache = RowCache(rows=1000, dim=2, capacity=4)
    cache.begin_batch(np.array([1, 2], np.int64), now=0)
    cache.place(np.array([1, 2], np.int64), until=0, current=True)
    # a look-ahead pull for batches 1 and 2 brings rows 3 and 4: the cache is full
    cache.place(np.array([3, 4], np.int64), until=2, current=False)
    # more look-ahead rows find no slot: the current batch's rows and the coming batches'
    # are all kept, so row 5 is dropped (its batch's top-up pulls it)
    assert cache.place(np.array([5], np.int64), until=2, current=False).tolist() == [-1]
    assert cache.dropped == 1 and _cached(cache, 1, 2, 3, 4, 5) == [True] * 4 + [False]
    # batch 1 gathers 1 and 5: its top-up evicts row 2, which no batch from now on needs
    cache.begin_batch(np.array([1, 5], np.int64), now=1)
    cache.place(np.array([5], np.int64), until=1, current=True)
    assert _cached(cache, 1, 2, 3, 4, 5) == [True, False, True, True, True]
    # a batch's own rows may evict rows kept for coming batches, never its own
    cache.begin_batch(np.array([1, 5, 6, 7], np.int64), now=1)
    cache.place(np.array([6, 7], np.int64), until=1, current=True)
    assert _cached(cache, 1, 3, 4, 5, 6, 7) == [True, False, False, True, True, True]
    assert cache.evictions == 3
    with pytest.raises(WorkerError, match="more than --row-cache-rows 4"):
        cache.begin_batch(np.arange(5, dtype=np.int64), now=2)


def test_a_cache_fills_its_unused_slots_first_then_evicts_the_least_recently_used() -> None:
    """No row is evicted while a slot never held one; then the row used longest ago goes
    (of rows last used by the same batch, the one in the lower slot), never the current
    batch's, and a look-ahead place spares the rows a coming batch needs."""
    cache = RowCache(rows=1000, dim=2, capacity=6)
    for now, batch in enumerate(([1, 2], [3, 4], [5, 6])):
        ids = np.array(batch, np.int64)
        cache.begin_batch(ids, now=now)
        cache.place(ids, until=now, current=True)
    assert cache.evictions == 0 and sorted(cache.slots(np.arange(1, 7)).tolist()) == list(range(6))
    ids = np.array([1, 7, 8], np.int64)  # 1 is used again; 2 (batch 0) and 3 (batch 1) go
    cache.begin_batch(ids, now=3)
    cache.place(ids, until=3, current=True)
    assert _cached(cache, *range(1, 9)) == [True, False, False, True, True, True, True, True]
    cache.keep_for(np.array([4], np.int64), until=5)  # batch 5 needs 4: a look-ahead spares it
    assert cache.place(np.array([9], np.int64), until=5, current=False).tolist() != [-1]
    assert _cached(cache, 4, 5, 6, 9) == [True, False, True, True]
    assert cache.evictions == 3


def test_a_keyed_cache_evicts_and_forgets_negative_ids_as_any_other() -> None:
    """A dynamic table's ids are any int64, -1 and other negative hashes included: an evicted
    one is no longer cached, and a restarted shard's rows all count as never fetched."""
    cache = RowCache(rows=1 << 16, dim=2, capacity=2, keyed=True)
    ids = np.array([-1, -(1 << 62)], np.int64)
    cache.begin_batch(ids, now=0)
    cache.fetched[cache.place(ids, until=0, current=True)] = 3
    assert cache.fetched_at(ids).tolist() == [3, 3]
    cache.forget(Part(0, "t", 0, 1, (1 << 16, 2), "float32", True, True))
    assert cache.fetched_at(ids).tolist() == [-1, -1]
    cache.begin_batch(np.array([5, 6], np.int64), now=1)
    cache.place(np.array([5, 6], np.int64), until=1, current=True)
    assert _cached(cache, -1, -(1 << 62), 5, 6) == [False, False, True, True]
    assert cache.evictions == 2


def test_a_cached_tables_gradient_names_global_rows_of_the_tables_shape() -> None:
    cache = RowCache(rows=1000, dim=2, capacity=4)
    cache.begin_batch(np.array([900, 7], np.int64), now=0)
    slots = cache.place(np.array([7, 900], np.int64), until=0, current=True)
    values = np.array([[1, 2], [3, 4], [5, 6]], np.float32)
    g = tf.IndexedSlices(tf.constant(values), tf.constant(slots[[1, 0, 1]]), tf.constant([4, 2]))
    sparse = cache.gradient(g)
    # global ids, each once (900's two rows summed), int32 below 2**31 rows
    assert sparse.indices.tolist() == [7, 900] and sparse.indices.dtype == np.int32
    assert sparse.values.tolist() == [[3, 4], [6, 8]] and tuple(sparse.dense_shape) == (1000, 2)


def _applied(servers: list[Any], version: int) -> None:
    for s in servers:
        wait_until(lambda s=s: fetch_status(s.status)["version"] == version, 30, "the applies")


def _train_recording(ports: int | list[int], **config: Any) -> tuple[dict[str, Any], list[Any]]:
    """Train one worker on this thread; its summary and the gradient lists it pushed."""
    worker = make_worker(ports, BIG, **config)
    pushed: list[Any] = []
    push = worker.pusher.push

    def recording(grads: list[wire.Tensor], *args: Any) -> bool:
        pushed.append(grads)
        return push(grads, *args)

    worker.pusher.push = recording  # type: ignore[method-assign]
    try:
        if config.get("row_cache_rows"):
            assert tuple(worker.model.trainable_variables[0].shape) == (CACHE, 16)
        return worker.run(), pushed
    finally:
        worker.close()


@pytest.mark.parametrize("shards", [1, 2])
def test_a_cached_worker_trains_as_a_full_replica_does(shards: int) -> None:
    """sync:1/1 and one worker: each gradient is computed from the weights after the
    previous one, so a worker holding 150 rows of the table ends the servers at the same
    weights as one holding the whole table (one server, or the table split over two)."""
    steps = 24
    variables = build_model(load_spec(BIG)).trainable_variables
    with serving(BIG, **SYNC) as one:
        full = train(one.port, BIG, steps=steps, worker_id="full", n_fetch=1)
        _applied([one], steps)
        _, expected = pull_full([one.rep], variables)
    with (
        serving(BIG, shard=0, num_shards=shards, **SYNC) as s0,
        serving(BIG, shard=1, num_shards=2, **SYNC) if shards == 2 else nullcontext() as s1,
    ):
        servers = [s0, s1][:shards]
        cached, pushed = _train_recording(
            [s.port for s in servers], steps=steps, worker_id="cached", row_cache_rows=CACHE
        )
        _applied(servers, steps)
        _, got = pull_full([s.rep for s in servers], variables)
    print("full:", full["rows_pulled"], "cached:", cached["rows_pulled"], cached)
    assert cached["row_pulls"] == full["row_pulls"] == [TABLE]
    assert cached["row_cache_rows"] == CACHE and cached["row_cache_evictions"] > 0
    assert cached["held_out"] == pytest.approx(full["held_out"])
    assert len(pushed) == steps
    for grads in pushed:  # row-sparse, global ids of the table's shape
        table = grads[0]
        assert isinstance(table, wire.Sparse) and tuple(table.dense_shape) == (100_000, 16)
        assert ((table.indices % 25_000) < 50).all()  # the data's ids: 25,000 * class + 0..49
    assert max(int(g[0].indices.max()) for g in pushed) >= 75_000  # not slots: global ids
    for a, b in zip(expected, got, strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cache", [None, CACHE])
def test_rows_pulled_in_bf16_are_the_servers_rows_rounded(cache: int | None) -> None:
    """--pull-compress bf16: a row pull installs the server's rows rounded to bfloat16 and
    widened back to float32, into the table (a full replica) or into the row cache's slots."""
    variables = build_model(load_spec(BIG)).trainable_variables
    data = load_spec(BIG).load_data(None)
    x, y = data.x_test[:20], data.y_test[:20]
    with serving(BIG, **SYNC) as server:
        worker = make_worker(
            server.port, BIG, steps=6, n_fetch=1, pull_compress="bf16", row_cache_rows=cache
        )
        try:
            worker.run()
            _applied([server], 6)  # the last push is in: the server's rows stay as they are
            rows = worker.puller.rows
            assert rows is not None
            table = rows.plan.tables[0]
            (ids,) = rows.plan.batch_ids(x)
            rows.plan.forget(0)  # every row counts as never fetched: the batch's are pulled
            pulled = worker.stats["rows_pulled"]
            list(rows.with_rows([(x, y)]))
            assert worker.stats["rows_pulled"] - pulled == ids.size
            held = worker.model.trainable_variables[0].numpy()
            got = held[table.cache.slots(ids)] if table.cache is not None else held[ids]
            doc = fetch_status(server.status)
        finally:
            worker.close()
        _, (want, *_) = pull_full([server.rep], variables)
    assert (table.cache is not None) == (cache is not None)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, want[ids].astype(ml_dtypes.bfloat16).astype(np.float32))
    assert not np.array_equal(got, want[ids])  # rounded: not the server's float32 rows
    assert doc["rows_bf16"] == doc["rows_served"] >= ids.size


def test_a_batch_needing_more_rows_than_the_cache_is_refused_at_start() -> None:
    with pytest.raises(WorkerError, match="more than --row-cache-rows 10"):
        make_worker(1, BIG, row_cache_rows=10)


@pytest.mark.parametrize(
    ("config", "problem"),
    [({"row_pulls": "off"}, "needs row pulls"), ({"graph": "tf1"}, "--graph tf2")],
)
def test_row_cache_rows_is_refused_where_it_cannot_work(
    config: dict[str, Any], problem: str
) -> None:
    with pytest.raises(ConfigError, match=problem):
        make_worker(1, BIG, row_cache_rows=CACHE, **config)
