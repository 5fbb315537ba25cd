"""Chunked row storage for a dynamic table.

``ChunkedStore`` keeps named per-slot fields (rows, optimizer slots, metadata) as lists of
fixed-size NumPy chunks: growing adds a chunk and copies nothing; a freed slot is reused by
the next allocation. Reads and writes group the slots by chunk once (``plan``), so a call
costs O(slots + chunks touched).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

CHUNK_BYTES = 4 << 20  # bytes of a chunk of rows (the widest field), at most
CHUNK_ROWS = 1 << 14  # rows of a chunk, at most: a small table holds little unused space


@dataclass(frozen=True)
class Plan:
    """Slots grouped by chunk: ``parts`` is (chunk, positions in the call, offsets)."""

    size: int
    parts: tuple[tuple[int, np.ndarray, np.ndarray], ...]


GROW_EVERY = 8  # chunks of one size before the next chunk's size doubles


class ChunkedStore:
    """Per-slot fields ``name -> (shape of one entry, dtype)`` in chunks of ``chunk_rows``
    slots, each size doubling after ``GROW_EVERY`` chunks of it: a table of n rows has about
    ``GROW_EVERY * log2(n / chunk_rows)`` chunks, so a call whose rows are spread over the
    whole table (random ids) groups them into few chunks at any size, while the space
    allocated and not yet used stays under about 1 / GROW_EVERY of the table."""

    def __init__(self, fields: dict[str, tuple[tuple[int, ...], str]], chunk_rows: int) -> None:
        if chunk_rows < 1:
            raise ValueError(f"chunk_rows must be positive, got {chunk_rows}")
        self.fields = {k: (tuple(s), np.dtype(d)) for k, (s, d) in fields.items()}
        self.chunk_rows = chunk_rows
        self._chunks: dict[str, list[np.ndarray]] = {k: [] for k in fields}
        self._starts = np.zeros(0, np.int64)  # each chunk's first slot
        self._capacity = 0
        self._top = 0  # slots ever handed out: [0, top)
        self._free = np.empty(0, np.int64)  # freed slots, a stack
        self._nfree = 0

    @property
    def capacity(self) -> int:
        """Slots allocated in chunks."""
        return self._capacity

    @property
    def in_use(self) -> int:
        return self._top - self._nfree

    def nbytes(self, name: str) -> int:
        return sum(c.nbytes for c in self._chunks[name])

    @property
    def free_nbytes(self) -> int:
        return self._free.nbytes

    def allocate(self, n: int) -> np.ndarray:
        """``n`` slots: freed ones first, then new ones (adding chunks as needed)."""
        reuse = min(n, self._nfree)
        slots = self._free[self._nfree - reuse : self._nfree][::-1].copy()
        self._nfree -= reuse
        fresh = np.arange(self._top, self._top + n - reuse, dtype=np.int64)
        self._top += fresh.size
        while self._capacity < self._top:
            size = self.chunk_rows << (self._starts.size // GROW_EVERY)
            for name, (shape, dtype) in self.fields.items():
                self._chunks[name].append(np.zeros((size, *shape), dtype))
            self._starts = np.append(self._starts, self._capacity)
            self._capacity += size
        return np.concatenate([slots, fresh])

    def release(self, slots: np.ndarray) -> None:
        """Return ``slots`` (unique, in use) for reuse."""
        need = self._nfree + slots.size
        if need > self._free.size:
            grown = np.empty(max(need, 2 * self._free.size), np.int64)
            grown[: self._nfree] = self._free[: self._nfree]
            self._free = grown
        self._free[self._nfree : need] = slots
        self._nfree = need

    def plan(self, slots: np.ndarray) -> Plan:
        """Group ``slots`` by chunk for ``take`` and ``put``."""
        slots = np.asarray(slots, np.int64)
        if slots.size == 0:
            return Plan(0, ())
        chunk = np.searchsorted(self._starts, slots, side="right") - 1
        offset = slots - self._starts[chunk]
        if chunk.min() == chunk.max():
            return Plan(slots.size, ((int(chunk[0]), np.arange(slots.size), offset),))
        order = np.argsort(chunk, kind="stable")
        sorted_chunks = chunk[order]
        cuts = np.flatnonzero(np.diff(sorted_chunks)) + 1
        parts = tuple(
            (int(sorted_chunks[lo]), pos, offset[pos])
            for lo, pos in zip(np.r_[0, cuts], np.split(order, cuts), strict=True)
        )
        return Plan(slots.size, parts)

    def take(self, name: str, plan: Plan) -> np.ndarray:
        """A copy of field ``name`` at the planned slots, in call order."""
        shape, dtype = self.fields[name]
        out = np.empty((plan.size, *shape), dtype)
        chunks = self._chunks[name]
        for c, pos, off in plan.parts:
            out[pos] = chunks[c][off]
        return out

    def put(self, name: str, plan: Plan, values: np.ndarray) -> None:
        """Write ``values`` (call order) into field ``name`` at the planned slots."""
        chunks = self._chunks[name]
        for c, pos, off in plan.parts:
            chunks[c][off] = values[pos]
