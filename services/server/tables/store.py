"""Chunked row storage for a dynamic table.

``ChunkedStore`` keeps named per-slot fields (a row and its optimizer slots) as lists of
NumPy chunks: growing adds a chunk and copies nothing. Reads and writes group the slots by
chunk once (``plan``), so a call costs O(slots + chunks touched).
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
    allocated and not yet used stays under about 1 / GROW_EVERY of the table. With a
    ``limit`` (a table of known capacity) no chunk reaches past it, so a full table holds no
    unused slot. Which slots are in use is the table's ``RowMap``'s to say; the store only
    grows to hold them (``ensure``)."""

    def __init__(
        self,
        fields: dict[str, tuple[tuple[int, ...], str]],
        chunk_rows: int,
        limit: int | None = None,
    ) -> None:
        if chunk_rows < 1:
            raise ValueError(f"chunk_rows must be positive, got {chunk_rows}")
        self.fields = {k: (tuple(s), np.dtype(d)) for k, (s, d) in fields.items()}
        self.chunk_rows = chunk_rows
        self.limit = limit
        self._chunks: dict[str, list[np.ndarray]] = {k: [] for k in fields}
        self._starts = np.zeros(0, np.int64)  # each chunk's first slot
        self._capacity = 0

    @property
    def capacity(self) -> int:
        """Slots allocated in chunks."""
        return self._capacity

    def nbytes(self, name: str) -> int:
        return sum(c.nbytes for c in self._chunks[name])

    def entry_nbytes(self) -> int:
        """Bytes of one slot's entries in every field."""
        return sum(int(np.prod(shape, dtype=np.int64)) * dt.itemsize
                   for shape, dt in self.fields.values())  # fmt: skip

    def ensure(self, top: int) -> None:
        """Add chunks until slots ``[0, top)`` exist (zeros)."""
        while self._capacity < top:
            size = self.chunk_rows << (self._starts.size // GROW_EVERY)
            if self.limit is not None and self._capacity < self.limit:
                size = min(size, self.limit - self._capacity)
            for name, (shape, dtype) in self.fields.items():
                self._chunks[name].append(np.zeros((size, *shape), dtype))
            self._starts = np.append(self._starts, self._capacity)
            self._capacity += size

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
