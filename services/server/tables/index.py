"""An index from int64 ids (any value: no key is reserved) to row slots, vectorised.

An open-addressing hash table in three NumPy arrays: ``keys`` (int64), ``slots`` (int32)
and ``state`` (uint8: empty, full or removed), 13 bytes per bucket. An id's home bucket is
the top bits of ``mix64(id)``; collisions probe linearly. Every call works on whole arrays of
ids, and reads each unresolved id's probe sequence a window of buckets at a time (``WINDOWS``:
4 buckets, then 32, 256, 2048): one NumPy pass per window over the ids still unresolved, so
the long probe sequences a linear-probing table has near its load limit take a few passes,
not one pass per bucket. A call costs O(ids x mean probe length) bucket reads, independent
of the table's size, and is done in chunks of ``CHUNK`` ids to bound its temporaries.

Load factor: before an insert would take the full and removed buckets past ``MAX_LOAD``
(0.8) of the buckets, the table rehashes: doubled (as often as the ids need) when the live ids
would fill more than ``REHASH_IN_PLACE`` (0.6) of it, else at the same size, which drops the
removed buckets ("tombstones"; inserts reuse them too). Growing by inserts alone, the live
ids fill 0.4 to 0.8 of the buckets: 16 to 33 bytes per live id (``nbytes``); after removals
the fill can drop to 0.3 until the next inserts.
"""

from __future__ import annotations

import numpy as np

from downpour.model.initial import as_ids, mix64

MAX_LOAD = 0.8  # full + removed buckets over buckets, at most, after an insert
REHASH_IN_PLACE = 0.6  # live ids over buckets, at most, for a rehash that keeps the size
MIN_BUCKETS = 16
WINDOWS = (4, 32, 256, 2048)  # buckets read per pass, by pass; the last repeats
CHUNK = 1 << 15  # ids per chunk of a call
_EMPTY, _FULL, _GONE = 0, 1, 2


class IdIndex:
    """Maps int64 ids to int32 slots; ``lookup``, ``insert`` and ``remove`` take arrays."""

    def __init__(self, buckets: int = MIN_BUCKETS) -> None:
        self._alloc(max(MIN_BUCKETS, 1 << (max(buckets, 1) - 1).bit_length()))
        self._live = 0

    def _alloc(self, buckets: int) -> None:
        self._keys = np.zeros(buckets, np.int64)
        self._slots = np.zeros(buckets, np.int32)
        self._state = np.zeros(buckets, np.uint8)
        self._gone = 0
        self._shift = np.uint64(64 - (buckets.bit_length() - 1))
        self._mask = buckets - 1

    def __len__(self) -> int:
        return self._live

    @property
    def buckets(self) -> int:
        return self._keys.size

    @property
    def nbytes(self) -> int:
        """Bytes of the index's arrays."""
        return self._keys.nbytes + self._slots.nbytes + self._state.nbytes

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
            st = self._state[p]
            hit = (st == _FULL) & (self._keys[p] == ids[active][:, None])
            ends = hit | (st == _EMPTY)  # the sequence ends at the id, or at an empty bucket
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
        return np.where(where >= 0, self._slots[np.maximum(where, 0)], -1)

    def insert(self, ids: np.ndarray, slots: np.ndarray) -> None:
        """Map each id to its slot (an id already present is remapped; an id repeated in
        the call takes its last slot)."""
        ids = as_ids(ids)
        slots = np.asarray(slots, np.int64)
        if slots.shape != ids.shape:
            raise ValueError(f"{ids.size} ids but slots of shape {slots.shape}")
        if ids.size and (slots.min() < 0 or slots.max() > np.iinfo(np.int32).max):
            raise ValueError("slots must be in [0, 2**31)")
        # the last occurrence of each id: unique over the reversed ids
        uniq, last = np.unique(ids[::-1], return_index=True)
        slots = slots[::-1][last]
        where = self._find(uniq)
        present = where >= 0
        self._slots[where[present]] = slots[present]
        new, new_slots = uniq[~present], slots[~present]
        self._reserve(new.size)
        self._place(new, new_slots)

    def insert_new(self, ids: np.ndarray, slots: np.ndarray) -> None:
        """Map ids the caller knows are unique and absent (a lookup just missed them) to
        their slots: ``insert`` without its deduplication and search. An id that is present
        or repeated would be mapped twice, so this is for that caller only."""
        ids = as_ids(ids)
        slots = np.asarray(slots, np.int64)
        if slots.shape != ids.shape:
            raise ValueError(f"{ids.size} ids but slots of shape {slots.shape}")
        self._reserve(ids.size)
        self._place(ids, slots)

    def remove(self, ids: np.ndarray) -> np.ndarray:
        """Unmap ids; returns the slot each id had (-1 where absent; a repeated id reports
        its slot at each occurrence)."""
        ids = as_ids(ids)
        where = self._find(ids)
        had = np.where(where >= 0, self._slots[np.maximum(where, 0)], -1)
        gone = np.unique(where[where >= 0])
        self._state[gone] = _GONE
        self._live -= gone.size
        self._gone += gone.size
        return had

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids, slots) of every live id, in bucket order."""
        full = self._state == _FULL
        return self._keys[full], self._slots[full].astype(np.int64)

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
        """Put unique ids known to be absent into the first free bucket of their probe
        sequence; ids contending for one bucket: one takes it, the others probe on."""
        for lo in range(0, ids.size, CHUNK):
            self._place_chunk(ids[lo : lo + CHUNK], slots[lo : lo + CHUNK])
        self._live += ids.size

    def _place_chunk(self, ids: np.ndarray, slots: np.ndarray) -> None:
        pos = self._home(ids)
        active = np.arange(ids.size)
        attempt = 0
        while active.size:
            p = self._window(pos[active], attempt)
            free = self._state[p] != _FULL
            has = free.any(axis=1)
            rows = np.flatnonzero(has)
            chosen = p[rows, free[rows].argmax(axis=1)]  # each one's first free bucket
            bucket, first = np.unique(chosen, return_index=True)
            won = active[rows[first]]
            self._gone -= int(np.count_nonzero(self._state[bucket] == _GONE))
            self._keys[bucket] = ids[won]
            self._slots[bucket] = slots[won]
            self._state[bucket] = _FULL
            # the losers go on from the bucket they lost (now full), the ids whose window was
            # full from the bucket after it
            pos[active[rows]] = chosen
            full = active[~has]
            pos[full] = (pos[full] + p.shape[1]) & self._mask
            taken = np.zeros(ids.size, bool)
            taken[won] = True
            active = active[~taken[active]]
            attempt += 1
