"""A flood of unique ids through one shard's dynamic table: admission refuses the ids seen
once, the capacity bounds the ids admitted exactly, and the table's memory stays within a
bound derived from its capacity whatever the number of ids."""

from __future__ import annotations

import numpy as np

from downpour.model.hashing import mix64
from downpour.server.tables.table import DynamicTable
from downpour.tables.index import REHASH_IN_PLACE
from downpour.tables.policy import TablePolicy
from downpour.tables.sketch import CountMinSketch, false_admit_rate

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
    """The most a table of ``capacity`` rows of its own can hold, in bytes, whatever it is
    fed: live rows never pass the capacity, and the store's chunks stop at it, so per row of
    the capacity the row and its optimizer slots, its version (8 bytes) and count (4), its id
    in the index (8) and one byte of the Bloom filter of evicted ids; the index's buckets
    (4 bytes each) are fewer than ``capacity / 0.3`` (it doubles only while its ids fill more
    than 0.3 of the new size). The sketch is fixed. ``batch`` does not enter: an apply never
    holds more than the capacity, even for a moment."""
    per_row = table.dim * table.dtype.itemsize * (1 + len(table.opt.slots)) + 8 + 4 + 8 + 1
    index = 4 * capacity / (REHASH_IN_PLACE / 2)
    sketch = table.sketch.nbytes if table.sketch is not None else 0
    return int(capacity * per_row + index + sketch + table.map._bloom.nbytes)


def test_a_flood_of_unique_ids_is_refused_and_the_table_stays_bounded() -> None:
    sketch = CountMinSketch(WIDTH, DEPTH, WINDOW)
    assert false_admit_rate(WINDOW / WIDTH, 1, DEPTH) * FLOOD < 0.01
    policy = TablePolicy(CAPACITY, admit_after=2, admission="always")
    table = DynamicTable("flood", DIM, optimizer="adagrad", policy=policy, sketch=sketch)
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
    assert stats["live_rows"] == CAPACITY
    assert peak_bytes <= bound, (peak_bytes, bound)
    rows = table.gather(_ids(FLOOD + TWICE - half, FLOOD + TWICE))  # the last ones admitted
    assert not np.array_equal(rows, table.initial(_ids(FLOOD + TWICE - half, FLOOD + TWICE)))


def test_with_the_default_sketch_a_flood_is_bounded_by_capacity() -> None:
    """The default sketch (2**20 x 4, window 2**19) admits a few ids seen once by collision
    (false_admit_rate at lam <= 1); the capacity bounds what they take."""
    flood, capacity = 2_000_000, 20_000
    policy = TablePolicy(capacity, admit_after=2, admission="always")
    sketch = CountMinSketch()  # the default: what an unbounded table counting for admission has
    table = DynamicTable("flood", DIM, optimizer="adagrad", policy=policy, sketch=sketch)
    bound = bytes_bound(table, capacity, BATCH)
    grads = np.full((BATCH, DIM), 0.01, np.float32)
    for step, lo in enumerate(range(0, flood, BATCH)):
        table.apply(_ids(lo, lo + BATCH), grads, 0.1, version=step)
        assert len(table) <= capacity and table.stats()["bytes"] <= bound
    stats = table.stats()
    assert stats["admitted"] + stats["refused"] == flood
    assert stats["admitted"] <= false_admit_rate(1.0, 1, 4) * flood
    assert stats["evicted_capacity"] == stats["admitted"] - stats["live_rows"] > 0
