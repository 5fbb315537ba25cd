"""An index from int64 ids (any value: no key is reserved) to row slots, vectorised and compact.

Two NumPy arrays: ``buckets`` (int32), an open-addressing hash table whose entry is 0 for an
empty bucket, -1 for a removed one and ``slot + 1`` for an id's slot; and ``ids`` (int64), the
id held in each slot. A bucket stores no key: a probe compares the id in the slot it names,
as CPython's dict keeps its entries apart from its index. So a live id costs its 8-byte entry
in ``ids`` plus 4 bytes per bucket over the load factor (5 to 10 bytes), and the table's owner
reads the id of any slot (``id_of``), which eviction needs to find its victims' ids.

An id's home bucket is the top bits of ``mix64(id)``; collisions probe linearly. Every call
works on whole arrays of ids, and reads each unresolved id's probe sequence a window of buckets
at a time (``WINDOWS``: 4 buckets, then 32, 256, 2048): one NumPy pass per window over the ids
still unresolved, so the long probe sequences a linear-probing table has near its load limit
take a few passes, not one pass per bucket. A call costs O(ids x mean probe length) bucket
reads, independent of the table's size, and is done in chunks of ``CHUNK`` ids to bound its
temporaries.

Load factor: before an insert would take the full and removed buckets past ``MAX_LOAD`` (0.8)
of the buckets, the table rehashes: doubled (as often as the ids need) when the live ids would
fill more than ``REHASH_IN_PLACE`` (0.6) of it, else at the same size, which drops the removed
buckets ("tombstones"; inserts reuse them too). The slots' ``ids`` array grows by an eighth
when a slot past its end is mapped (``reserve_slots`` sizes it at once for a known capacity).
"""

from __future__ import annotations

import numpy as np

from downpour.model.hashing import as_ids, mix64

MAX_LOAD = 0.8  # full + removed buckets over buckets, at most, after an insert
REHASH_IN_PLACE = 0.6  # live ids over buckets, at most, for a rehash that keeps the size
MIN_BUCKETS = 16
WINDOWS = (4, 32, 256, 2048)  # buckets read per pass, by pass; the last repeats
CHUNK = 1 << 15  # ids per chunk of a call
_EMPTY, _GONE = 0, -1  # bucket values; a full bucket holds slot + 1 >= 1
MAX_SLOT = np.iinfo(np.int32).max - 1


class IdIndex:
    """Maps int64 ids to int32 slots; ``lookup``, ``insert`` and ``remove`` take arrays."""

    def __init__(self, buckets: int = MIN_BUCKETS) -> None:
        self._alloc(max(MIN_BUCKETS, 1 << (max(buckets, 1) - 1).bit_length()))
        self._live = 0
        self._ids = np.zeros(16, np.int64)  # the id of each slot (stale once unmapped)

    def _alloc(self, buckets: int) -> None:
        self._buckets = np.zeros(buckets, np.int32)
        self._gone = 0
        self._shift = np.uint64(64 - (buckets.bit_length() - 1))
        self._mask = buckets - 1

    def __len__(self) -> int:
        return self._live

    @property
    def buckets(self) -> int:
        return self._buckets.size

    @property
    def nbytes(self) -> int:
        """Bytes of the index's arrays (its buckets and the slots' ids)."""
        return self._buckets.nbytes + self._ids.nbytes

    def reserve_slots(self, slots: int) -> None:
        """Make room for ids in slots ``[0, slots)`` now (a table of known capacity)."""
        if slots > self._ids.size:
            grown = np.zeros(slots, np.int64)
            grown[: self._ids.size] = self._ids
            self._ids = grown

    def id_of(self, slots: np.ndarray) -> np.ndarray:
        """The id mapped to each of ``slots`` (each must be mapped)."""
        return self._ids[np.asarray(slots, np.int64)]

    def _home(self, ids: np.ndarray) -> np.ndarray:
        return (mix64(ids.view(np.uint64)) >> self._shift).astype(np.int64)

    def _window(self, pos: np.ndarray, attempt: int) -> np.ndarray:
        """The buckets of each probe sequence from ``pos`` on, in probe order: one row per
        position, as many columns as pass ``attempt`` reads (at most every bucket)."""
        width = min(WINDOWS[min(attempt, len(WINDOWS) - 1)], self.buckets)
        return (pos[:, None] + np.arange(width)) & self._mask

    def _find(self, ids: np.ndarray) -> np.ndarray:
        """The bucket holding each id, -1 where absent."""
        if ids.size > CHUNK:
            return np.concatenate(
                [self._find(ids[lo : lo + CHUNK]) for lo in range(0, ids.size, CHUNK)]
            )
        pos = self._home(ids)
        found = np.full(ids.size, -1, np.int64)
        active = np.arange(ids.size)
        attempt = 0
        while active.size:
            p = self._window(pos[active], attempt)
            b = self._buckets[p]
            full = b > 0
            hit = full & (self._ids[np.where(full, b - 1, 0)] == ids[active][:, None])
            ends = hit | (b == _EMPTY)  # the sequence ends at the id, or at an empty bucket
            done = ends.any(axis=1)
            rows = np.flatnonzero(done)
            first = ends[rows].argmax(axis=1)
            at_id = hit[rows, first]
            found[active[rows[at_id]]] = p[rows[at_id], first[at_id]]
            active = active[~done]
            pos[active] = (pos[active] + p.shape[1]) & self._mask
            attempt += 1
        return found

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """The slot of each id (int64), -1 where absent; repeated ids are fine."""
        ids = as_ids(ids)
        where = self._find(ids)
        return np.where(where >= 0, self._buckets[np.maximum(where, 0)].astype(np.int64) - 1, -1)

    def _check_slots(self, ids: np.ndarray, slots: object) -> np.ndarray:
        slots = np.asarray(slots, np.int64)
        if slots.shape != ids.shape:
            raise ValueError(f"{ids.size} ids but slots of shape {slots.shape}")
        if ids.size and (slots.min() < 0 or slots.max() > MAX_SLOT):
            raise ValueError(f"slots must be in [0, {MAX_SLOT}]")
        return slots

    def _claim(self, ids: np.ndarray, slots: np.ndarray) -> None:
        """Record ``ids`` as the ids of ``slots``, growing the slots' array by an eighth."""
        if slots.size and int(slots.max()) >= self._ids.size:
            self.reserve_slots(max(int(slots.max()) + 1, self._ids.size * 9 // 8, 16))
        self._ids[slots] = ids

    def insert(self, ids: np.ndarray, slots: np.ndarray) -> None:
        """Map each id to its slot (an id already present is remapped; an id repeated in
        the call takes its last slot)."""
        ids = as_ids(ids)
        slots = self._check_slots(ids, slots)
        # the last occurrence of each id: unique over the reversed ids
        uniq, last = np.unique(ids[::-1], return_index=True)
        slots = slots[::-1][last]
        where = self._find(uniq)
        present = where >= 0
        self._claim(uniq, slots)
        self._buckets[where[present]] = (slots[present] + 1).astype(np.int32)
        new, new_slots = uniq[~present], slots[~present]
        self._reserve(new.size)
        self._place(new, new_slots)

    def insert_new(self, ids: np.ndarray, slots: np.ndarray) -> None:
        """Map ids the caller knows are unique and absent (a lookup just missed them) to
        their slots: ``insert`` without its deduplication and search. An id that is present
        or repeated would be mapped twice, so this is for that caller only."""
        ids = as_ids(ids)
        slots = self._check_slots(ids, slots)
        self._claim(ids, slots)
        self._reserve(ids.size)
        self._place(ids, slots)

    def remove(self, ids: np.ndarray) -> np.ndarray:
        """Unmap ids; returns the slot each id had (-1 where absent; a repeated id reports
        its slot at each occurrence)."""
        ids = as_ids(ids)
        where = self._find(ids)
        had = np.where(where >= 0, self._buckets[np.maximum(where, 0)].astype(np.int64) - 1, -1)
        gone = np.unique(where[where >= 0])
        self._buckets[gone] = _GONE
        self._live -= gone.size
        self._gone += gone.size
        return had

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids, slots) of every live id, in bucket order."""
        b = self._buckets[self._buckets > 0].astype(np.int64) - 1
        return self._ids[b], b

    def _reserve(self, extra: int) -> None:
        """Rehash when ``extra`` more ids would take full and removed buckets past
        ``MAX_LOAD``: at the same size when the live ids fill at most ``REHASH_IN_PLACE``
        of it (dropping the removed buckets), else doubled as often as needed."""
        if self._live + self._gone + extra <= MAX_LOAD * self.buckets:
            return
        buckets = self.buckets
        if self._live + extra > REHASH_IN_PLACE * buckets:
            buckets *= 2
            while self._live + extra > MAX_LOAD * buckets:
                buckets *= 2
        ids, slots = self.items()
        self._alloc(buckets)
        self._live = 0
        self._place(ids, slots)

    def _place(self, ids: np.ndarray, slots: np.ndarray) -> None:
        """Put unique ids known to be absent (their slots' ids already recorded) into the
        first free bucket of their probe sequence; ids contending for one bucket: one takes
        it, the others probe on."""
        for lo in range(0, ids.size, CHUNK):
            self._place_chunk(ids[lo : lo + CHUNK], slots[lo : lo + CHUNK])
        self._live += ids.size

    def _place_chunk(self, ids: np.ndarray, slots: np.ndarray) -> None:
        pos = self._home(ids)
        active = np.arange(ids.size)
        attempt = 0
        while active.size:
            p = self._window(pos[active], attempt)
            free = self._buckets[p] <= 0
            has = free.any(axis=1)
            rows = np.flatnonzero(has)
            chosen = p[rows, free[rows].argmax(axis=1)]  # each one's first free bucket
            bucket, first = np.unique(chosen, return_index=True)
            won = active[rows[first]]
            self._gone -= int(np.count_nonzero(self._buckets[bucket] == _GONE))
            self._buckets[bucket] = (slots[won] + 1).astype(np.int32)
            # the losers go on from the bucket they lost (now full), the ids whose window was
            # full from the bucket after it
            pos[active[rows]] = chosen
            full = active[~has]
            pos[full] = (pos[full] + p.shape[1]) & self._mask
            taken = np.zeros(ids.size, bool)
            taken[won] = True
            active = active[~taken[active]]
            attempt += 1
