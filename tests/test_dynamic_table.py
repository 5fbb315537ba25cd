"""The server-side store of a dynamic table: per-id initial values, the id index, admission,
eviction, the row-wise optimizers (optim.py), and its state for checkpoints."""

from __future__ import annotations

import numpy as np
import pytest

from downpour.model.initial import TRUNCATED_STDDEV, Rule, initial_rows
from downpour.server.tables.store import ChunkedStore
from downpour.server.tables.table import DynamicTable
from downpour.tables.index import IdIndex
from downpour.tables.policy import TablePolicy
from downpour.tables.sketch import CountMinSketch, false_admit_rate

EXTREMES = np.array([-(2**63), 2**63 - 1, 0, -1], np.int64)
RULES = [Rule("uniform", -0.2, 0.3), Rule("normal", 0.5, 0.1), Rule("truncated", 0.0, 0.2)]


def _random_ids(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.concatenate([EXTREMES, rng.integers(-(2**63), 2**63 - 1, n, np.int64)])


# -- initial values ------------------------------------------------------------------------


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.kind)
def test_an_ids_initial_row_depends_on_seed_table_and_id_only(rule: Rule) -> None:
    ids = _random_ids(200)
    rows = initial_rows(rule, 7, "users", ids, 16)
    assert rows.shape == (ids.size, 16) and rows.dtype == np.float32
    perm = np.random.default_rng(1).permutation(ids.size)
    np.testing.assert_array_equal(initial_rows(rule, 7, "users", ids[perm], 16), rows[perm])
    for i in (0, 1, 2, 3, 50):  # alone, and beside other ids
        alone = initial_rows(rule, 7, "users", ids[i : i + 1], 16)
        np.testing.assert_array_equal(alone[0], rows[i])
    for other in (
        initial_rows(rule, 8, "users", ids, 16),
        initial_rows(rule, 7, "items", ids, 16),
    ):
        assert not np.isclose(other, rows).all(axis=1).any()
    assert len({row.tobytes() for row in rows}) == ids.size  # different ids differ


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.kind)
def test_initial_rows_follow_the_rules_distribution(rule: Rule) -> None:
    rows = initial_rows(rule, 3, "t", np.arange(-20_000, 20_000), 25, "float64")
    if rule.kind == "uniform":
        assert rows.min() >= rule.a and rows.max() < rule.b
        mean, std = (rule.a + rule.b) / 2, (rule.b - rule.a) / np.sqrt(12)
    elif rule.kind == "normal":
        mean, std = rule.a, rule.b
    else:
        assert np.abs(rows - rule.a).max() <= 2 * rule.b
        mean, std = rule.a, rule.b * TRUNCATED_STDDEV
    assert abs(rows.mean() - mean) < 5 * std / np.sqrt(rows.size)
    assert abs(rows.std() / std - 1) < 0.005
    if rule.kind == "normal":  # the tails of a normal, not a uniform's
        assert abs(np.mean(np.abs(rows - mean) > 2 * std) - 0.0455) < 0.002


def test_fill_rules_are_constants_and_a_whole_rule_is_refused() -> None:
    np.testing.assert_array_equal(
        initial_rows(Rule("fill", 0.25), 0, "t", EXTREMES, 3), np.full((4, 3), 0.25, np.float32)
    )
    with pytest.raises(ValueError, match="whole"):
        initial_rows(Rule("whole"), 0, "t", EXTREMES, 3)
    with pytest.raises(ValueError, match="per-id rule"):
        DynamicTable("t", 3, rule=Rule("whole"))
    with pytest.raises(ValueError, match="1-D integer"):
        initial_rows(RULES[0], 0, "t", np.zeros(3, np.float32), 3)


# -- the id index --------------------------------------------------------------------------


def test_the_index_maps_any_int64_ids_like_a_dict() -> None:
    """Live ids hold distinct slots (the index keeps each slot's id, as a table's rows do);
    a remapped id takes a fresh one, so no two live ids ever share a slot."""
    index, ref = IdIndex(), {}
    rng = np.random.default_rng(2)
    pool = _random_ids(3000, 3)
    fresh = 0
    for step in range(40):
        ids = rng.choice(pool, 300)  # repeats within a call
        if step % 3 == 2:
            had = index.remove(ids)
            np.testing.assert_array_equal(had, [ref.get(int(i), -1) for i in ids])
            for i in ids:
                ref.pop(int(i), None)
        else:
            slots = fresh + np.arange(ids.size)
            fresh += ids.size
            index.insert(ids, slots)
            ref.update(zip(ids.tolist(), slots.tolist(), strict=True))  # the last one wins
        assert len(index) == len(ref)
        np.testing.assert_array_equal(index.lookup(pool), [ref.get(int(i), -1) for i in pool])
    keys, slots = index.items()
    assert dict(zip(keys.tolist(), slots.tolist(), strict=True)) == ref
    np.testing.assert_array_equal(index.id_of(slots), keys)


def test_the_index_follows_long_wrapping_collision_runs_through_removals() -> None:
    """Ids that all start at the last bucket: their probe sequences wrap past the end and are
    longer than the first probe windows; with removals along the run and ids of bucket 0
    placed into it, every lookup and removal stays what a dict says."""
    index, ref = IdIndex(64), {}
    pool = _random_ids(20_000, 5)
    home = index._home(pool)
    last, first = pool[home == index.buckets - 1], pool[home == 0]
    run = last[:40]  # one run of 40 buckets from bucket 63: 63, 0, 1, ..., 38
    index.insert(run, np.arange(40))
    ref.update(zip(run.tolist(), range(40), strict=True))
    assert index.buckets == 64  # no rehash: the run stays one run
    np.testing.assert_array_equal(index.lookup(run), np.arange(40))
    np.testing.assert_array_equal(index.remove(run[::3]), np.arange(0, 40, 3))
    for i in run[::3].tolist():
        del ref[i]
    index.insert(first[:5], 100 + np.arange(5))  # into the run's removed buckets
    index.insert_new(first[5:8], 200 + np.arange(3))  # known absent: no search first
    ref.update(zip(first[:5].tolist(), range(100, 105), strict=True))
    ref.update(zip(first[5:8].tolist(), range(200, 203), strict=True))
    assert index.buckets == 64 and len(index) == len(ref) == 34
    probe = np.concatenate([run, first[:8], last[40:45], first[8:13]])  # 10 absent ids
    np.testing.assert_array_equal(index.lookup(probe), [ref.get(int(i), -1) for i in probe])
    keys, slots = index.items()
    assert dict(zip(keys.tolist(), slots.tolist(), strict=True)) == ref


def test_the_index_takes_at_most_33_bytes_per_live_id() -> None:
    index = IdIndex()
    ids = _random_ids(100_000, 4)
    for lo in range(0, ids.size, 7000):
        index.insert(ids[lo : lo + 7000], np.arange(lo, min(lo + 7000, ids.size)))
        assert index.nbytes <= 33 * max(len(index), 16)
    sizes = []
    for _ in range(3):  # churn at a steady size: the table stops growing
        for lo in range(0, ids.size, 20_000):
            index.remove(ids[lo : lo + 20_000])
            index.insert(ids[lo : lo + 20_000], np.arange(lo, min(lo + 20_000, ids.size)))
        sizes.append(index.buckets)
    assert sizes[1] == sizes[2] <= 2 * sizes[0]
    np.testing.assert_array_equal(index.lookup(ids), np.arange(ids.size))


def test_chunked_storage_grows_by_chunks_and_stops_at_its_limit() -> None:
    store = ChunkedStore({"row": ((2,), "float32")}, chunk_rows=3)
    store.ensure(7)
    slots = np.arange(7)
    assert store.capacity == 9
    plan = store.plan(slots[::-1])
    store.put("row", plan, np.arange(14, dtype=np.float32).reshape(7, 2))
    got = store.take("row", store.plan(np.array([6, 0])))
    np.testing.assert_array_equal(got, [[0, 1], [12, 13]])
    exact = ChunkedStore({"row": ((2,), "float32")}, chunk_rows=3, limit=8)
    exact.ensure(8)
    assert exact.capacity == 8  # the last chunk ends at the limit: a full table wastes none


def _p(max_rows: int | None = None, **kw: object) -> TablePolicy:
    """A table policy: unbounded unless ``max_rows``, else as given."""
    return TablePolicy(max_rows=max_rows, **kw)  # type: ignore[arg-type]


# -- the table: gather, apply ---------------------------------------------------------------


def test_gather_reads_initial_values_and_stores_only_when_asked() -> None:
    table = DynamicTable("t", 8, seed=5)
    ids = np.concatenate([EXTREMES, EXTREMES[:2]])
    want = initial_rows(table.rule, 5, "t", ids, 8)
    np.testing.assert_array_equal(table.gather(ids), want)
    assert len(table) == 0
    np.testing.assert_array_equal(table.gather(ids, create=True), want)
    assert len(table) == 4 and table.stats()["inserted"] == 4
    np.testing.assert_array_equal(table.gather(ids), want)


def _keras_reference(kind: str, rows: np.ndarray, batches: list, lr: float) -> np.ndarray:
    """The rows after rows.py's ``row_update`` (Keras's own for ``sgd``) applies ``batches``
    of (unique rows, grads)."""
    import keras
    import tensorflow as tf

    from downpour.server.tables.rows import make_optimizer, row_update

    var = keras.Variable(rows, name="t")
    opt = make_optimizer(kind, lr)
    opt.build([var])
    for step, (idx, grad) in enumerate(batches):
        opt.iterations.assign(step)
        if kind == "sgd":
            opt.apply([tf.IndexedSlices(tf.constant(grad), tf.constant(idx), rows.shape)], [var])
        else:
            row_update(kind, opt, var, idx, grad, opt.learning_rate)
    return var.numpy()


@pytest.mark.parametrize("kind", ["sgd", "adagrad", "lazy_adam"])
def test_apply_matches_rows_py_on_the_same_rows(kind: str) -> None:
    rng = np.random.default_rng(6)
    pool = _random_ids(40, 7)
    table = DynamicTable("t", 6, optimizer=kind, chunk_rows=5)
    start = table.gather(pool, create=True)
    batches = []
    for step in range(12):
        ids = rng.choice(pool, 30)  # duplicates, summed first
        grads = rng.normal(size=(30, 6)).astype(np.float32)
        table.apply(ids, grads, 0.05, version=step, step=step + 1)
        rows = np.searchsorted(pool_sorted := np.sort(pool), ids)
        summed = np.zeros((pool.size, 6), np.float32)
        np.add.at(summed, rows, grads)
        touched = np.unique(rows)
        batches.append((touched, summed[touched]))
    order = np.argsort(pool)
    want = _keras_reference(kind, start[order], batches, 0.05)
    got = table.gather(pool_sorted)
    if kind == "lazy_adam":  # NumPy's float32 pow and TensorFlow's differ by an ulp at times
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    else:
        np.testing.assert_array_equal(got, want)


def test_duplicates_in_one_call_are_summed_and_counted() -> None:
    a, b = DynamicTable("t", 4, optimizer="adagrad"), DynamicTable("t", 4, optimizer="adagrad")
    g = np.arange(12, dtype=np.float32).reshape(3, 4)
    a.apply(np.array([-1, 2**63 - 1, -1]), g, 0.1, version=3)
    b.apply(np.array([-1, 2**63 - 1]), np.stack([g[0] + g[2], g[1]]), 0.1, version=3)
    for key in ("rows", "slot_accumulator", "versions"):
        np.testing.assert_array_equal(a.export_state()[key], b.export_state()[key])
    assert a.export_state()["counts"].tolist() == [2, 1]  # touches, in slot order


def test_counted_rows_apply_as_the_lookups_they_sum() -> None:
    """A worker pushes each id once with the lookups it sums (``keyed_counted``): the same
    rows, counts and admissions as its lookups sent one by one. Bad lookups change nothing."""
    from downpour.wire import Keyed, counted_rows

    g = np.arange(20, dtype=np.float32).reshape(5, 4)
    ids = np.array([9, -1, 9, 2**63 - 1, 9])
    k = counted_rows(Keyed(ids, g, (10, 4)))
    one, counted = (DynamicTable("t", 4, optimizer="adagrad", policy=_p(admit_after=3))
                    for _ in "ab")  # fmt: skip
    for version in (1, 2):
        a = one.apply(ids, g, 0.1, version=version)
        b = counted.apply(k.indices, k.values, 0.1, version=version, lookups=k.counts)
        assert (a.admitted, a.refused, a.updated) == (b.admitted, b.refused, b.updated)
        assert (b.admitted, b.refused) == ((1, 2) if version == 1 else (0, 2))  # 9: 3 lookups
    for key in ("rows", "slot_accumulator", "versions", "counts", "ids"):
        np.testing.assert_array_equal(one.export_state()[key], counted.export_state()[key])
    assert counted.export_state()["counts"].tolist() == [6]
    before = counted.export_state()
    for bad in (np.array([1, 0, 1]), np.array([1, 1]), np.array([1.0, 1, 1])):
        with pytest.raises(ValueError, match="lookups"):
            counted.apply(k.indices, k.values, 0.1, version=3, lookups=bad)
    assert counted.counters["bad_input"] == 3
    for key, value in counted.export_state().items():
        if key != "counters":  # which counted the refusals
            np.testing.assert_array_equal(value, before[key])


# -- admission -----------------------------------------------------------------------------


def test_an_id_gets_a_row_at_its_nth_touch_and_earlier_gradients_are_dropped() -> None:
    table = DynamicTable("t", 3, policy=_p(admit_after=3))
    live = np.array([10], np.int64)
    table.gather(live, create=True)
    before = table.gather(live)
    g = np.ones((2, 3), np.float32)
    for touch in (1, 2):
        done = table.apply(np.array([-(2**63), 10]), g * touch, 1.0, version=touch)
        assert done.refused == 1 and done.admitted == 0
        assert table.map.locate(np.array([-(2**63)]))[0] == -1
    np.testing.assert_array_equal(table.gather(live), before - 1 - 2)  # the live row trained
    done = table.apply(np.array([-(2**63)]), g[:1] * 5, 1.0, version=3)
    assert done.admitted == 1
    init = initial_rows(table.rule, 0, "t", np.array([-(2**63)]), 3)
    np.testing.assert_array_equal(table.gather(np.array([-(2**63)])), init - 5)
    stats = table.stats()
    assert (stats["refused"], stats["admitted"], stats["live_rows"]) == (2, 1, 2)


def test_a_refused_gradient_changes_no_row() -> None:
    table = DynamicTable("t", 4, optimizer="lazy_adam", policy=_p(admit_after=3))
    table.gather(EXTREMES, create=True)
    state = table.export_state()
    done = table.apply(np.array([5, 6, 5]), np.ones((3, 4), np.float32), 1.0, version=1)
    assert done.refused == 3 and done.updated == 0
    after = table.export_state()
    for key in ("ids", "rows", "slot_m", "slot_v", "versions", "counts"):
        np.testing.assert_array_equal(after[key], state[key])
    assert table.apply(np.array([6, 6]), np.ones((2, 4), np.float32), 1.0, 2).admitted == 1


def test_the_sketch_never_counts_low_and_ages() -> None:
    sketch = CountMinSketch(width=1 << 10, depth=3, window=1 << 30)
    rng = np.random.default_rng(8)
    truth: dict[int, int] = {}
    for _ in range(20):
        ids = np.unique(rng.integers(-(2**63), 2**63 - 1, 100, np.int64))
        counts = rng.integers(1, 4, ids.size)
        for i, c in zip(ids.tolist(), counts.tolist(), strict=True):
            truth[i] = truth.get(i, 0) + c
        sketch.add(ids, counts)
    keys = np.array(list(truth))
    assert (sketch.estimate(keys) >= np.array(list(truth.values()))).all()
    aged = CountMinSketch(width=64, depth=2, window=10)
    aged.add(np.array([1]), np.array([9]))
    assert aged.add(np.array([1]), np.array([1]))[0] == 10 and aged.estimate(np.array([1]))[0] == 5


def test_false_admissions_follow_the_documented_rate() -> None:
    width, depth, n = 1 << 12, 3, 2
    sketch = CountMinSketch(width, depth, window=1 << 30)
    lam = 0.75
    sketch.add(np.arange(int(lam * width)), np.ones(int(lam * width), np.int64))
    fresh = np.arange(10**6, 10**6 + 50_000)
    early = np.mean(sketch.estimate(fresh) + 1 >= n)  # admitted at their first touch
    assert abs(early - false_admit_rate(lam, n - 1, depth)) < 0.01


# -- eviction ------------------------------------------------------------------------------


def test_idle_rows_are_evicted_counted_and_start_again_from_their_initial_value() -> None:
    table = DynamicTable("t", 4, optimizer="adagrad")
    g = np.ones((4, 4), np.float32)
    table.apply(EXTREMES, g, 0.5, version=1)
    table.apply(EXTREMES[:2], g[:2], 0.5, version=5)
    gone = table.evict_idle(version=7, idle_versions=4)
    assert sorted(gone.tolist()) == sorted(EXTREMES[2:].tolist())
    assert len(table) == 2 and table.stats()["evicted_idle"] == 2
    np.testing.assert_array_equal(table.gather(EXTREMES[2:]), table.initial(EXTREMES[2:]))
    table.apply(EXTREMES[2:3], g[:1], 0.5, version=8)
    fresh = DynamicTable("t", 4, optimizer="adagrad")
    fresh.apply(EXTREMES[2:3], g[:1], 0.5, version=8)
    np.testing.assert_array_equal(table.gather(EXTREMES[2:3]), fresh.gather(EXTREMES[2:3]))


@pytest.mark.parametrize("evict", ["lru", "lfu"])
def test_a_full_table_holds_exactly_its_capacity_and_evicts_by_its_policy(evict: str) -> None:
    table = DynamicTable("t", 2, policy=_p(10, evict=evict, admission="always"), chunk_rows=4)
    g = np.ones((1, 2), np.float32)
    for v in range(10):  # id v at version v, touched 10 - v times
        ids = np.full(10 - v, v, np.int64)
        table.apply(ids, np.ones((ids.size, 2), np.float32), 0.1, version=v)
    assert len(table) == 10
    done = table.apply(np.array([100]), g, 0.1, version=20)
    assert len(table) == 10 and table.stats()["evicted_capacity"] == 1
    # lru: the least recently updated (0); lfu: the least touched (9)
    assert done.evicted.tolist() == ([0] if evict == "lru" else [9])
    assert (table.map.locate(done.evicted) == -1).all()


def test_rows_created_by_gather_are_evicted_by_the_next_capacity_check() -> None:
    table = DynamicTable("t", 2, policy=_p(4))
    for v in range(6):
        table.gather(np.array([v]), create=True, version=v)
    table.gather(np.array([0, 1]), create=True, version=9)  # present: no new rows
    assert len(table) == 6 and table.stats()["inserted"] == 6
    gone = table.enforce_capacity()  # lru: the oldest first
    assert sorted(gone.tolist()) == [0, 1] and len(table) == 4
    assert table.enforce_capacity().size == 0


# -- state, stats, bad input ---------------------------------------------------------------


def test_export_and_restore_round_trip_exactly_and_train_alike() -> None:
    config = {"optimizer": "lazy_adam", "policy": _p(50, admit_after=2), "chunk_rows": 7}
    table = DynamicTable("t", 5, seed=9, **config)
    rng = np.random.default_rng(10)
    pool = _random_ids(60, 11)
    for v in range(10):
        ids = rng.choice(pool, 40)
        table.apply(ids, rng.normal(size=(40, 5)), 0.01, version=v, step=v + 1)
    table.evict_idle(version=10, idle_versions=6)
    state = table.export_state()
    copy = DynamicTable.from_state(state, "t", seed=9, **config)
    again = copy.export_state()
    assert state.keys() == again.keys()
    for key in state:
        np.testing.assert_array_equal(again[key], state[key])
        assert again[key].dtype == state[key].dtype
    counted = {k: v for k, v in table.stats().items() if not k.startswith("bytes")}
    assert {k: v for k, v in copy.stats().items() if k in counted} == counted
    ids, grads = rng.choice(pool, 40), rng.normal(size=(40, 5))
    for t in (table, copy):
        t.apply(ids, grads, 0.01, version=11, step=11)
    np.testing.assert_array_equal(copy.gather(pool), table.gather(pool))


@pytest.mark.parametrize(
    "change",
    [
        lambda s: s.pop("slot_m"),
        lambda s: s.update(counts=s["counts"][:-1]),
        lambda s: s.update(ids=np.r_[s["ids"][:-1], s["ids"][:1]]),
        lambda s: s.update(rows=s["rows"][:, :2]),
        lambda s: s.pop("sketch_window"),
    ],
    ids=["slot", "counts", "repeated_ids", "width", "sketch"],
)
def test_a_state_that_does_not_fit_is_refused(change: object) -> None:
    config = {"optimizer": "lazy_adam", "policy": _p(admit_after=2)}
    table = DynamicTable("t", 3, **config)
    table.gather(EXTREMES, create=True)
    state = table.export_state()
    change(state)  # type: ignore[operator]
    with pytest.raises(ValueError, match="t: state"):
        DynamicTable.from_state(state, "t", **config)


def test_a_sketch_sized_for_an_error_bound() -> None:
    sketch = CountMinSketch.for_error(epsilon=0.001, delta=0.01)
    assert (sketch.width, sketch.depth) == (4096, 5)  # e / 0.001 = 2719 -> 4096; ln 100 -> 5


def test_stats_count_bytes_of_every_part() -> None:
    table = DynamicTable("t", 8, optimizer="adagrad", policy=_p(admit_after=2), chunk_rows=16)
    table.gather(np.arange(20), create=True)
    s = table.stats()
    assert s["live_rows"] == 20
    assert (s["bytes_rows"], s["bytes_slots"]) == (20 * 8 * 4, 20 * 8 * 4)
    assert s["bytes_reserved"] == (32 - 20) * 2 * 8 * 4  # two chunks of 16, 20 slots in use
    assert s["bytes_sketch"] == table.sketch.nbytes > 0
    assert s["bytes_index"] == table.map.index.nbytes
    assert s["bytes"] == sum(v for k, v in s.items() if k.startswith("bytes_"))


@pytest.mark.parametrize(
    "ids, grads",
    [
        (np.zeros((2, 2), np.int64), np.zeros((4, 3))),
        (np.zeros(2, np.float32), np.zeros((2, 3))),
        (np.array([2**64 - 1], np.uint64), np.zeros((1, 3))),
        (np.zeros(2, np.int64), np.zeros((2, 4))),
        (np.zeros(2, np.int64), np.array([["a"] * 3] * 2)),
    ],
)
def test_bad_input_is_refused_counted_and_changes_nothing(ids: object, grads: object) -> None:
    table = DynamicTable("t", 3)
    table.gather(np.zeros(1, np.int64), create=True)
    before = table.export_state()
    with pytest.raises(ValueError, match="t: "):
        table.apply(ids, grads, 0.1, version=1)
    assert table.stats()["bad_input"] == 1
    np.testing.assert_array_equal(table.export_state()["rows"], before["rows"])
