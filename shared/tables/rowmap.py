"""Which ids of a dynamic table hold a row of their own, and which row each id reads.

``RowMap`` is the one implementation of a table's admission and eviction, used by a server
shard's ``DynamicTable`` and by ``DynamicEmbedding`` in one process, so both decide alike:

- Every id a step touches is counted (its lookups) in a count-min sketch that halves its
  counters every ``window`` touches (``downpour.tables.sketch``): the id's frequency, decayed,
  so yesterday's popular items fade as today's arrive.
- An id with a row of its own keeps it; its row's version (recency) and count are updated.
- An id without one takes a row once it has been touched ``admit_after`` times. While the
  table has free rows it takes one. A full table holds exactly ``own_rows`` (its capacity is
  exact, never over): the candidate takes the row of a victim, the weakest of the rows this
  step did not touch (``lru``: least recently updated; ``lfu``: the lowest decayed frequency),
  only if its frequency estimate beats the victim's (``admission="victim"``, TinyLFU's
  filter), or whatever its count (``always``). Candidates go strongest first against victims
  weakest first. Victims are chosen among all rows of a small table, and among a random sample
  of ``SAMPLE_PER_VICTIM`` rows per victim of a large one, as approximate LRU/LFU caches do
  (Redis's), so a step costs O(ids), not O(table).
- An id refused a row (too few touches, or it lost to the victim) reads and trains its fallback
  row (``fallback_of``: ``mix64(id) mod B`` of the table's ``B`` fallback rows, this shard's
  share), or, in a table without fallback rows, reads its initial value and its gradient is
  dropped.

Per own row the map keeps the id (``IdIndex``), the version (a uint32 past the map's base
version, rebased when a version runs 2**32 past it) and a saturating uint32 count: with the
index's buckets and the Bloom filter's byte, 22 to 27 bytes per live id (the arrays grow by an
eighth at a time); the sketch is the table's, sized by its rows. ``readmitted`` counts
admissions of ids evicted before, by a Bloom filter of the evicted ids (an estimate: a new id
whose two bits are set by others counts too; about 1 % with 8 bits per own row).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from downpour.model.hashing import mix64
from downpour.tables.index import IdIndex
from downpour.tables.sketch import CountMinSketch

SAMPLE_PER_VICTIM = 16  # rows sampled per victim needed, in a table larger than EXACT_BELOW
EXACT_BELOW = 1 << 14  # live rows under which victims are chosen among all rows
COUNT_MAX = np.iinfo(np.uint32).max
VERSION_SPAN = np.iinfo(np.uint32).max  # versions stored past the base, at most
COUNTERS = (  # checkpoints save them in this order: new ones go at the end
    "inserted",
    "admitted",
    "refused",
    "evicted_idle",
    "evicted_capacity",
    "bad_input",
    "refused_victim",
    "readmitted",
    "fallback_lookups",
)
_BLOOM_SALT = np.uint64(0x5851F42D4C957F2D)


@dataclass
class Placed:
    """Where one step's unique ids went: ``slots`` their own rows (-1: refused, they use
    their fallback row), ``new`` the rows admitted by this step (to be initialised), and the
    ``evicted`` ids with the ``freed`` slots they held (reused by the admitted ones)."""

    slots: np.ndarray
    new: np.ndarray
    evicted: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    refused: int = 0  # lookups of the ids refused a row


def sketch_for(own_rows: int | None, admit_after: int) -> CountMinSketch | None:
    """The admission sketch a table of ``own_rows`` needs: sized to its rows (4 rows of
    counters, a power of two at least the own rows, at least 4096 wide; ageing every ten times
    as many touches, TinyLFU's sample), the default sketch for an unbounded table that counts
    for ``admit_after``, none for an unbounded table that admits every id."""
    if own_rows is None:
        return None if admit_after == 1 else CountMinSketch()
    width = 1 << max(12, (max(own_rows, 1) - 1).bit_length())
    return CountMinSketch(width, 4, window=10 * max(own_rows, 1))


class RowMap:
    """One shard's (or the one process's) rows of a dynamic table (module docstring).

    ``own_rows``: rows of their own at most (None: unbounded); ``fallback_rows``: B over all
    shards; ``num_shards``/``shard``: which share of the ids and the fallback rows this is.
    """

    def __init__(
        self,
        own_rows: int | None,
        fallback_rows: int = 0,
        *,
        evict: str = "lru",
        admission: str = "victim",
        admit_after: int = 1,
        num_shards: int = 1,
        shard: int = 0,
        sketch: CountMinSketch | None = None,
        seed: int = 0,
    ) -> None:
        if fallback_rows % num_shards:
            raise ValueError(f"{fallback_rows} fallback rows do not split over {num_shards}")
        self.own_rows, self.fallback_total = own_rows, fallback_rows
        self.evict, self.admission, self.admit_after = evict, admission, admit_after
        self.num_shards, self.shard = num_shards, shard
        self.sketch = sketch if sketch is not None else sketch_for(own_rows, admit_after)
        self.index = IdIndex()
        start = 16 if own_rows is None else own_rows
        if own_rows is not None:
            self.index.reserve_slots(own_rows)
        self.version = np.zeros(start, np.uint32)  # versions past _base (``versions``)
        self._base = 0
        self.count = np.zeros(start, np.uint32)
        self._top = 0  # slots ever handed out: [0, top)
        self._free: list[np.ndarray] = []  # freed slots, reused first
        self._rng = np.random.default_rng(seed)
        bits = 8 * (own_rows if own_rows is not None else 1 << 17)
        self._bloom = np.zeros(1 << max(7, (bits - 1).bit_length() - 3), np.uint8)  # packed
        self.counters = dict.fromkeys(COUNTERS, 0)

    def __len__(self) -> int:
        return len(self.index)

    @property
    def fallback_here(self) -> int:
        """This shard's fallback rows."""
        return self.fallback_total // self.num_shards

    @property
    def top(self) -> int:
        """Slots handed out so far: every slot in use is below it."""
        return self._top

    @property
    def nbytes(self) -> int:
        """Bytes of the map: index, per-row version and count, sketch, Bloom filter."""
        sketch = self.sketch.nbytes if self.sketch is not None else 0
        meta = self.version[: self._capacity()].nbytes + self.count[: self._capacity()].nbytes
        return self.index.nbytes + meta + sketch + self._bloom.nbytes

    def _capacity(self) -> int:
        return self.version.size

    # ------------------------------------------------------------------ reading

    def locate(self, ids: np.ndarray) -> np.ndarray:
        """Each id's own slot, -1 where it has none; changes nothing."""
        return self.index.lookup(ids)

    def fallback_of(self, ids: np.ndarray) -> np.ndarray:
        """Each id's fallback row on this shard (index into its ``fallback_here`` rows), -1
        when the table has none. An id of this shard has ``mix64(id) mod B`` congruent to the
        shard mod S, so its row is that number divided by S."""
        ids = np.asarray(ids, np.int64)
        if self.fallback_total == 0:
            return np.full(ids.shape, -1, np.int64)
        g = mix64(ids.view(np.uint64)) % np.uint64(self.fallback_total)
        return (g // np.uint64(self.num_shards)).astype(np.int64)

    def fallback_index(self) -> np.ndarray:
        """The table-wide number g of each of this shard's fallback rows, in row order."""
        return np.arange(self.fallback_here, dtype=np.int64) * self.num_shards + self.shard

    # ------------------------------------------------------------------ placing a step

    def place(self, ids: np.ndarray, counts: np.ndarray, version: int) -> Placed:
        """Count one step's unique ``ids`` (their lookups ``counts``, >= 1) and give each a
        row: its own (kept, or admitted now, taking a victim's row in a full table) or none
        (refused: its fallback row). Rows touched take ``version``."""
        counts = np.asarray(counts, np.int64)
        slots = self.index.lookup(ids)
        est = self.sketch.add(ids, counts) if self.sketch is not None else counts
        hit = slots >= 0
        self._touch(slots[hit], counts[hit], version)
        new = np.zeros(ids.size, bool)
        placed = Placed(slots, new)
        miss = np.flatnonzero(~hit)
        if miss.size == 0:
            return placed
        able = est[miss] >= self.admit_after
        below = miss[~able]
        cand = miss[able]
        cand = cand[np.lexsort((ids[cand], -est[cand]))]  # strongest first, ties by id
        free = cand.size if self.own_rows is None else max(0, self.own_rows - len(self))
        take_free, rest = cand[:free], cand[free:]
        won: list[np.ndarray] = [take_free]
        got: list[np.ndarray] = [self._allocate(take_free.size)]
        lost = np.empty(0, np.int64)
        if rest.size:
            victims = self._victims(rest.size, exclude=slots[hit])
            n = min(rest.size, victims.size)
            lost = rest[n:]
            rest, victims = rest[:n], victims[:n]
            if self.admission == "victim" and n:
                beats = est[rest] > self.sketch.estimate(self.index.id_of(victims))
                lost = np.concatenate([rest[~beats], lost])
                self.counters["refused_victim"] += int(counts[rest[~beats]].sum())
                rest, victims = rest[beats], victims[beats]
            if victims.size:
                placed.evicted = self._evict(victims, "capacity")
                won.append(rest)
                got.append(victims)
        admitted = np.concatenate(won)
        given = np.concatenate(got)
        self._admit(ids[admitted], given, counts[admitted], version)
        slots[admitted] = given
        new[admitted] = True
        refused = np.concatenate([below, lost])
        placed.refused = int(counts[refused].sum())
        self.counters["refused"] += placed.refused
        if self.fallback_total:
            self.counters["fallback_lookups"] += placed.refused
        return placed

    def _stamp(self, version: int) -> np.uint32:
        """``version`` as stored: past the base, which moves up (older rows clamped at the
        new base: they stay the oldest) when a version would not fit 32 bits."""
        if version - self._base > VERSION_SPAN:
            shift = version - VERSION_SPAN // 2 - self._base
            held = self.version[: self._top].astype(np.int64) - shift
            self.version[: self._top] = np.maximum(held, 0).astype(np.uint32)
            self._base += shift
        return np.uint32(max(version - self._base, 0))

    def versions(self, slots: np.ndarray) -> np.ndarray:
        """The version each of ``slots`` was last updated at (int64)."""
        return self.version[slots].astype(np.int64) + self._base

    def set_versions(self, slots: np.ndarray, versions: np.ndarray) -> None:
        """Set rows' versions (a restore). The base moves to the oldest version held, or as
        far up as the newest needs: then the oldest read as the base."""
        versions = np.asarray(versions, np.int64)
        if not versions.size:
            return
        live = self._live_slots()
        current = self.versions(live)
        lo = int(min(versions.min(), current.min(initial=versions.min())))
        hi = int(max(versions.max(), current.max(initial=versions.max())))
        base = max(lo, hi - VERSION_SPAN)
        if base != self._base:
            self.version[live] = np.clip(current - base, 0, VERSION_SPAN).astype(np.uint32)
            self._base = base
        self.version[slots] = np.clip(versions - base, 0, VERSION_SPAN).astype(np.uint32)

    def _touch(self, slots: np.ndarray, counts: np.ndarray, version: int) -> None:
        self.version[slots] = self._stamp(version)
        total = self.count[slots].astype(np.int64) + counts
        self.count[slots] = np.minimum(total, COUNT_MAX).astype(np.uint32)

    def _admit(self, ids: np.ndarray, slots: np.ndarray, counts: np.ndarray, version: int) -> None:
        """Map new ``ids`` to ``slots`` (free) at ``version`` with their first ``counts``."""
        if not ids.size:
            return
        self.index.insert_new(ids, slots)
        self.version[slots] = self._stamp(version)
        self.count[slots] = np.minimum(counts, COUNT_MAX).astype(np.uint32)
        was = self._bloom_has(ids)
        self.counters["readmitted"] += int(was.sum())
        self.counters["admitted"] += ids.size
        self.counters["inserted"] += ids.size

    def insert(self, ids: np.ndarray, version: int) -> np.ndarray:
        """Give unique ``ids`` without rows their own rows now, bypassing admission (a
        restore, or a read that creates); the caller evicts after if over capacity."""
        slots = self._allocate(ids.size, over=True)
        self.index.insert_new(ids, slots)
        self.version[slots] = self._stamp(version)
        self.count[slots] = 0
        self.counters["inserted"] += ids.size
        return slots

    # ------------------------------------------------------------------ slots

    def _allocate(self, n: int, over: bool = False) -> np.ndarray:
        """``n`` free slots: freed ones first, then new ones (within ``own_rows`` unless
        ``over``: a restore onto fewer shards, evicted right after)."""
        out = []
        while n and self._free:
            head = self._free.pop()
            take, keep = head[:n], head[n:]
            if keep.size:
                self._free.append(keep)
            out.append(take)
            n -= take.size
        if n:
            fresh = np.arange(self._top, self._top + n, dtype=np.int64)
            self._top += n
            self._grow(self._top)
            out.append(fresh)
        return np.concatenate(out) if out else np.empty(0, np.int64)

    def _grow(self, top: int) -> None:
        if top <= self.version.size:
            return
        size = max(top, self.version.size * 9 // 8, 16)
        if self.own_rows is not None and top <= self.own_rows:
            size = min(size, self.own_rows)
        for name in ("version", "count"):
            old = getattr(self, name)
            grown = np.zeros(size, old.dtype)
            grown[: old.size] = old
            setattr(self, name, grown)

    def _live_slots(self) -> np.ndarray:
        return self.index.items()[1]

    def _weakness(self, slots: np.ndarray) -> np.ndarray:
        """A sort order of ``slots``, weakest (first evicted) first; ties by id, so the
        order rows were placed in (which differs between processes) never decides."""
        ids = self.index.id_of(slots)
        freq = self.count[slots] if self.sketch is None else self._estimate(slots)
        if self.evict == "lru" or self.sketch is None:
            return np.lexsort((ids, freq, self.version[slots]))
        return np.lexsort((ids, self.version[slots], freq))

    def _estimate(self, slots: np.ndarray) -> np.ndarray:
        return self.sketch.estimate(self.index.id_of(slots))

    def _victims(self, n: int, exclude: np.ndarray) -> np.ndarray:
        """Up to ``n`` victims, weakest first, none of the ``exclude`` slots (this step's)."""
        live = len(self)
        if live <= max(EXACT_BELOW, SAMPLE_PER_VICTIM * n):
            pool = self._live_slots()
        else:  # a full bounded table has no holes below top; sample among its slots
            pool = np.unique(self._rng.integers(0, self._top, SAMPLE_PER_VICTIM * n))
            pool = pool[self.index.lookup(self.index.id_of(pool)) == pool]
        if exclude.size:
            pool = pool[~np.isin(pool, exclude)]
        return pool[self._weakness(pool)[:n]]

    def _evict(self, slots: np.ndarray, reason: str) -> np.ndarray:
        """Unmap the ids of ``slots``; their ids (the slots are the caller's to reuse)."""
        ids = self.index.id_of(slots)
        self.index.remove(ids)
        self._bloom_add(ids)
        self.counters[f"evicted_{reason}"] += ids.size
        return ids

    def release(self, slots: np.ndarray) -> None:
        """Return freed ``slots`` for reuse."""
        if slots.size:
            self._free.append(np.asarray(slots, np.int64))

    def evict_idle(self, version: int, idle_versions: int) -> tuple[np.ndarray, np.ndarray]:
        """Evict the rows last updated ``idle_versions`` or more versions before ``version``;
        (their ids, their slots, released)."""
        slots = self._live_slots()
        idle = slots[version - self.versions(slots) >= idle_versions]
        ids = self._evict(idle, "idle")
        self.release(idle)
        return ids, idle

    def enforce_capacity(self) -> tuple[np.ndarray, np.ndarray]:
        """Over ``own_rows`` (a restore onto fewer shards): evict the weakest down to it;
        (their ids, their slots, released)."""
        if self.own_rows is None or len(self) <= self.own_rows:
            return np.empty(0, np.int64), np.empty(0, np.int64)
        slots = self._live_slots()
        drop = slots[self._weakness(slots)[: len(self) - self.own_rows]]
        ids = self._evict(drop, "capacity")
        self.release(drop)
        return ids, drop

    # ------------------------------------------------------------------ the Bloom filter

    def _bloom_bits(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The two bit positions of each id in the packed filter."""
        h = mix64(np.asarray(ids, np.int64).view(np.uint64) ^ _BLOOM_SALT)
        mask = np.uint64(8 * self._bloom.size - 1)
        return (h & mask).astype(np.int64), ((h >> np.uint64(32)) & mask).astype(np.int64)

    def _bloom_add(self, ids: np.ndarray) -> None:
        for bit in self._bloom_bits(ids):
            np.bitwise_or.at(self._bloom, bit >> 3, (1 << (bit & 7)).astype(np.uint8))

    def _bloom_has(self, ids: np.ndarray) -> np.ndarray:
        a, b = self._bloom_bits(ids)
        return ((self._bloom[a >> 3] >> (a & 7)) & (self._bloom[b >> 3] >> (b & 7)) & 1) == 1

    # ------------------------------------------------------------------ state

    def live(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids, slots) of the live rows, in slot order."""
        ids, slots = self.index.items()
        order = np.argsort(slots)
        return ids[order], slots[order]

    def sketch_state(self) -> dict[str, np.ndarray]:
        """The sketch as arrays (empty without one)."""
        if self.sketch is None:
            return {}
        return {
            "sketch": self.sketch.counters.copy(),
            "sketch_mass": np.array(self.sketch.mass, np.int64),
            "sketch_window": np.array(self.sketch.window, np.int64),
        }

    def load_sketch(self, state: dict[str, np.ndarray]) -> None:
        """Take the sketch of ``sketch_state`` (a saved one replaces this map's)."""
        if "sketch" not in state:
            return
        depth, width = state["sketch"].shape
        self.sketch = CountMinSketch(width, depth, int(state["sketch_window"]))
        self.sketch.counters[...] = state["sketch"]
        self.sketch.mass = int(state["sketch_mass"])
