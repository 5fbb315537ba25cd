"""A flood of unique ids through one shard's dynamic table: admission refuses the ids seen
once, capacity bounds the ids admitted, and the table's memory stays within a bound derived
from its capacity whatever the number of ids."""

from __future__ import annotations

import numpy as np

from downpour.model.initial import mix64
from downpour.server.tables.index import REHASH_IN_PLACE
from downpour.server.tables.sketch import CountMinSketch, false_admit_rate
from downpour.server.tables.table import EVICT_TO, DynamicTable

FLOOD = 10_000_000  # unique ids, each seen once
BATCH = 100_000  # rows per apply
CAPACITY = 200_000
TWICE = 600_000  # then this many new ids, each seen twice (in one apply)
DIM = 8
# A sketch sized for a flood: at most WINDOW touches are counted between halvings, so a bucket
# holds Poisson(lam <= WINDOW / WIDTH = 1/32) touches of other ids, and an id seen once
# passes all DEPTH rows with probability false_admit_rate(1/32, 1, 6) < 1e-9.
WIDTH, DEPTH, WINDOW = 1 << 22, 6, 1 << 17


def _ids(start: int, stop: int) -> np.ndarray:
    """Distinct 64-bit ids (mix64 is a bijection), spread over all of int64."""
    return mix64(np.arange(start, stop, dtype=np.uint64)).view(np.int64)


def bytes_bound(table: DynamicTable, capacity: int, batch: int) -> int:
    """The most a table of ``capacity`` fed ``batch`` new ids per apply can hold, in bytes.

    Live rows peak at ``capacity + batch`` (an apply creates its admitted ids, then evicts
    down to 90 % of the capacity), so the store holds at most that many slots, rounded up to
    whole chunks: per slot the row and the optimizer slots, the version and the count
    (8 bytes each), and 16 bytes of free list (it grows to at most twice the slots). The
    index doubles only while its ids fill more than 0.3 of the new size (it doubles past 0.6
    of the old one), so it has fewer than ``peak / 0.3`` buckets of 13 bytes. The sketch is
    fixed."""
    peak = capacity + batch
    chunk = table.store.chunk_rows
    slots = -(-peak // chunk) * chunk
    per_slot = table.dim * table.dtype.itemsize * (1 + len(table.opt.slots)) + 8 + 8 + 16
    index = 13 * peak / (REHASH_IN_PLACE / 2)
    sketch = table.sketch.nbytes if table.sketch is not None else 0
    return int(slots * per_slot + index + sketch)


def test_a_flood_of_unique_ids_is_refused_and_the_table_stays_bounded() -> None:
    sketch = CountMinSketch(WIDTH, DEPTH, WINDOW)
    assert false_admit_rate(WINDOW / WIDTH, 1, DEPTH) * FLOOD < 0.01
    table = DynamicTable(
        "flood", DIM, optimizer="adagrad", admit_after=2, capacity=CAPACITY, sketch=sketch
    )
    bound = bytes_bound(table, CAPACITY, BATCH)
    grads = np.full((2 * BATCH, DIM), 0.01, np.float32)
    for step, lo in enumerate(range(0, FLOOD, BATCH)):
        done = table.apply(_ids(lo, lo + BATCH), grads[:BATCH], 0.1, version=step)
        assert done.admitted == 0 and done.refused == BATCH
    stats = table.stats()
    assert stats["live_rows"] == 0 and stats["refused"] == FLOOD and stats["admitted"] == 0
    assert stats["bytes"] <= bound

    admitted, evicted, peak_bytes = 0, 0, 0
    half = BATCH // 2
    for lo in range(FLOOD, FLOOD + TWICE, half):
        ids = _ids(lo, lo + half)
        done = table.apply(np.repeat(ids, 2), grads[:BATCH], 0.1, version=lo)
        assert done.admitted == half and done.refused == 0 and done.updated == half
        admitted, evicted = admitted + done.admitted, evicted + done.evicted.size
        assert len(table) <= CAPACITY
        assert len(table) == admitted - evicted
        peak_bytes = max(peak_bytes, table.stats()["bytes"])
    stats = table.stats()
    assert stats["admitted"] == stats["inserted"] == TWICE and stats["refused"] == FLOOD
    assert stats["evicted_capacity"] == evicted == TWICE - stats["live_rows"]
    assert int(EVICT_TO * CAPACITY) <= stats["live_rows"] <= CAPACITY
    assert peak_bytes <= bound, (peak_bytes, bound)
    rows = table.gather(_ids(FLOOD + TWICE - half, FLOOD + TWICE))  # the last ones admitted
    assert not np.array_equal(rows, table.initial(_ids(FLOOD + TWICE - half, FLOOD + TWICE)))


def test_with_the_default_sketch_a_flood_is_bounded_by_capacity() -> None:
    """The default sketch (2**20 x 4, window 2**19) admits a few ids seen once by collision
    (false_admit_rate at lam <= 1); the capacity bounds what they take."""
    flood, capacity = 2_000_000, 20_000
    table = DynamicTable("flood", DIM, optimizer="adagrad", admit_after=2, capacity=capacity)
    bound = bytes_bound(table, capacity, BATCH)
    grads = np.full((BATCH, DIM), 0.01, np.float32)
    for step, lo in enumerate(range(0, flood, BATCH)):
        table.apply(_ids(lo, lo + BATCH), grads, 0.1, version=step)
        assert len(table) <= capacity and table.stats()["bytes"] <= bound
    stats = table.stats()
    assert stats["admitted"] + stats["refused"] == flood
    assert stats["admitted"] <= false_admit_rate(1.0, 1, 4) * flood
    assert stats["evicted_capacity"] == stats["admitted"] - stats["live_rows"] > 0
