"""``RowMap``: a dynamic table's admission and eviction, the one implementation the servers'
tables and the one-process layer share; and ``TablePolicy``, the budget they split."""

from __future__ import annotations

import numpy as np
import pytest

from downpour.model.hashing import id_shard, mix64
from downpour.tables.policy import FALLBACK_MULTIPLE, TablePolicy
from downpour.tables.rowmap import RowMap


def _ids(*values: int) -> np.ndarray:
    return np.array(values, np.int64)


def _step(m: RowMap, ids: np.ndarray, version: int, counts: np.ndarray | None = None) -> object:
    counts = np.ones(ids.size, np.int64) if counts is None else counts
    return m.place(ids, counts, version)


def test_a_free_table_admits_and_keeps_each_id_its_row() -> None:
    m = RowMap(4)
    p = _step(m, _ids(10, 20, 30), 1)
    assert p.new.all() and sorted(p.slots.tolist()) == [0, 1, 2]
    again = _step(m, _ids(20, 10), 2)
    assert not again.new.any()
    np.testing.assert_array_equal(again.slots, m.locate(_ids(20, 10)))
    assert len(m) == 3 and m.counters["admitted"] == 3


def test_a_full_table_admits_a_newcomer_only_over_a_weaker_victim() -> None:
    """TinyLFU: a new id seen once does not take the row of an id seen five times; one seen
    more often than the weakest row takes that row, which is evicted."""
    m = RowMap(3, admission="victim", evict="lru")
    for v in range(5):  # 1, 2, 3 touched five times each; 1 first, 3 last
        for k in (1, 2, 3):
            _step(m, _ids(k), 3 * v + k)
    once = _step(m, _ids(99), 20)
    assert once.slots.tolist() == [-1] and not once.new.any()
    assert m.counters["refused_victim"] == 1 and len(m) == 3
    for v in range(21, 27):  # 42 comes back, more often than the others were seen
        p = _step(m, _ids(42), v)
    assert p.new.tolist() == [True]
    assert set(m.live()[0].tolist()) == {42, 2, 3} and m.counters["evicted_capacity"] == 1
    assert p.evicted.tolist() == [1]  # the least recently updated row


def test_always_admission_is_a_plain_lru_cache() -> None:
    m = RowMap(2, admission="always", evict="lru")
    _step(m, _ids(1), 1)
    _step(m, _ids(2), 2)
    p = _step(m, _ids(3), 3)
    assert p.new.tolist() == [True] and p.evicted.tolist() == [1]
    assert set(m.live()[0].tolist()) == {2, 3}


def test_lfu_evicts_the_least_frequent_row() -> None:
    m = RowMap(2, admission="always", evict="lfu")
    _step(m, _ids(1, 2), 1, np.array([5, 1]))
    _step(m, _ids(1), 2)  # 1 is also the more recent: lfu must not look at recency first
    _step(m, _ids(2), 3)
    p = _step(m, _ids(3), 4)
    assert p.evicted.tolist() == [2]


def test_the_capacity_is_exact_under_a_flood_of_new_ids() -> None:
    rng = np.random.default_rng(0)
    for admission in ("victim", "always"):
        m = RowMap(100, admission=admission)
        for v in range(200):
            ids = np.unique(rng.integers(-(2**62), 2**62, 60))
            _step(m, ids, v)
            assert len(m) <= 100
        assert len(m) == 100


def test_an_id_below_admit_after_gets_no_row_until_its_count_reaches_it() -> None:
    m = RowMap(None, 8, admit_after=3)
    assert _step(m, _ids(7), 1).slots.tolist() == [-1]
    assert _step(m, _ids(7), 2).slots.tolist() == [-1]
    assert m.counters["refused"] == 2 and m.counters["fallback_lookups"] == 2
    assert _step(m, _ids(7), 3).new.tolist() == [True]
    assert _step(m, _ids(8), 4, np.array([3])).new.tolist() == [True]  # 3 lookups at once


def test_a_row_touched_by_the_step_is_never_its_victim() -> None:
    m = RowMap(2, admission="always", evict="lru")
    _step(m, _ids(1, 2), 1)
    p = _step(m, _ids(1, 2, 3), 2)  # both rows are this step's: no victim for 3
    assert p.slots[2] == -1 and set(m.live()[0].tolist()) == {1, 2}


def test_victims_of_a_large_table_come_from_a_sample_and_are_weak() -> None:
    """Past EXACT_BELOW rows the victim is the weakest of a random sample: still among the
    oldest rows, and the table stays exactly at its capacity."""
    from downpour.tables.rowmap import EXACT_BELOW

    n = EXACT_BELOW * 2
    m = RowMap(n, admission="always")
    ids = np.arange(n, dtype=np.int64)
    for v, chunk in enumerate(np.array_split(ids, 64)):
        _step(m, chunk, v)
    p = _step(m, np.arange(n, n + 100, dtype=np.int64), 1000)
    assert len(m) == n and p.evicted.size == 100
    assert np.median(p.evicted) < n / 8  # from the oldest 1/8 of the rows


def test_readmitted_counts_ids_that_come_back_after_eviction() -> None:
    m = RowMap(1, admission="always")
    _step(m, _ids(1), 1)
    _step(m, _ids(2), 2)  # evicts 1
    _step(m, _ids(1), 3)  # 1 is back
    assert m.counters["readmitted"] == 1 and m.counters["admitted"] == 3


@pytest.mark.parametrize("shards", [1, 2, 3, 4, 8])
def test_every_id_reads_the_same_fallback_row_on_any_number_of_shards(shards: int) -> None:
    """B a multiple of the shard count: an id's shard holds its fallback row, whose number
    over the table is mix64(id) mod B whatever the shard count."""
    b = 2 * FALLBACK_MULTIPLE
    ids = np.random.default_rng(shards).integers(-(2**63), 2**63 - 1, 5000, dtype=np.int64)
    want = (mix64(ids.view(np.uint64)) % np.uint64(b)).astype(np.int64)
    owner = id_shard(ids, shards)
    for s in range(shards):
        m = RowMap(10, b, num_shards=shards, shard=s)
        mine = owner == s
        local = m.fallback_of(ids[mine])
        assert local.min() >= 0 and local.max() < m.fallback_here == b // shards
        np.testing.assert_array_equal(m.fallback_index()[local], want[mine])


def test_the_budget_splits_into_own_and_fallback_rows_per_shard() -> None:
    p = TablePolicy(max_rows=4096, fallback_rows=0.25)
    assert p.fallback_total(1) == 1680  # 1024 asked, at least 840: a multiple of 840
    assert p.shard_rows(1) == (4096 - 1680, 1680)
    assert p.shard_rows(4) == (-(-(4096 - 1680) // 4), 1680 // 4)
    small = TablePolicy(max_rows=64, fallback_rows=10)
    assert small.fallback_total(3) == 12 and small.shard_rows(3) == (18, 4)
    assert TablePolicy(max_rows=None, fallback_rows=100).shard_rows(2) == (None, 50)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_rows": 0}, "max_rows must be >= 1"),
        ({"fallback_rows": 1.0, "max_rows": 1}, "leaves no row of its own"),
        ({"fallback_rows": 0.5, "max_rows": None}, "a fraction of max_rows needs max_rows"),
        ({"fallback_rows": 2.5}, "a fraction below 1 or a count"),
        ({"evict": "fifo"}, "evict must be one of"),
        ({"admission": "maybe"}, "admission must be one of"),
        ({"admit_init": "zeros"}, "admit_init must be one of"),
        ({"admit_after": 0}, "admit_after must be in"),
    ],
)
def test_contradictory_or_out_of_range_policies_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TablePolicy(**kwargs)


def test_a_budget_too_small_for_the_shards_is_refused() -> None:
    with pytest.raises(ValueError, match="leaves 2 rows of their own for 4 shards"):
        TablePolicy(max_rows=6, fallback_rows=2).shard_rows(4)


def test_versions_past_32_bits_keep_their_order_and_ages() -> None:
    """Versions are stored as 32 bits past a base that moves up when a version would not
    fit: rows within 2**31 of the newest keep their exact versions, older ones read as the
    base (still the oldest), and rows idle for long are still evicted as idle."""
    m = RowMap(None)
    _step(m, _ids(1), 5)
    _step(m, _ids(2), 2**32 + 10)  # the base moves up: 1's version no longer fits
    _step(m, _ids(3), 2**32 + 20)
    ids, slots = m.live()
    versions = dict(zip(ids.tolist(), m.versions(slots).tolist(), strict=True))
    assert (versions[2], versions[3]) == (2**32 + 10, 2**32 + 20)
    assert versions[1] < versions[2]
    gone, _ = m.evict_idle(2**32 + 20, idle_versions=2**31)
    assert gone.tolist() == [1]
    m.set_versions(m.locate(_ids(2)), np.array([2**31]))  # a restore of an older version
    assert m.versions(m.locate(_ids(2, 3))).tolist() == [2**31, 2**32 + 20]
    m.set_versions(m.locate(_ids(2)), np.array([7]))  # 2**32 + 13 older than 3: clamped
    assert m.versions(m.locate(_ids(2, 3))).tolist() == [21, 2**32 + 20]
