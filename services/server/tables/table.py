"""The server-side store of a dynamic embedding table: ids of any int64 value, rows on demand.

A ``DynamicTable`` holds, for the ids a shard owns, one row and its optimizer slots per live
id, in chunked storage (``store``) addressed through an id index
(``index``):

- ``gather(ids)`` reads rows; a missing id reads its initial value (``initial_rows``: a
  function of (seed, table, id) only) and is not stored unless ``create=True``;
- ``apply(ids, grads, lr, version, step)`` sums duplicate ids' gradient rows, then updates
  the rows by its row-wise optimizer's rule (``optim``: the rule a fixed table's rows take
  too), creating missing rows at their initial value (slots at their optimizer's initial
  value) first;
- admission (``admit_after=n``): a missing id's touches (each occurrence in an apply counts
  one) are counted in a count-min sketch (``sketch``); below ``n`` its gradient rows
  are dropped and counted as ``refused``; the touch that brings it to ``n`` creates its row
  and applies that gradient (``admitted``). An evicted id is still in the sketch (until it
  ages out), so it is usually admitted again at its next touch;
- eviction: ``evict_idle`` drops rows not updated for a number of versions; with a
  ``capacity``, an apply that leaves more live rows evicts down to 90 % of it, least recently
  updated (``lru``) or least often touched (``lfu``) first. Evicted ids are returned (the
  tombstones of a delta export); a re-touched evicted id starts again from its initial value;
- ``export_state`` / ``from_state`` carry everything (rows, slots, versions, counts, the
  sketch, the counters) as arrays, exactly.

Bad input (ids not a 1-D integer array, gradient rows not floats of the ids' shape, a
non-finite learning rate) raises ValueError and counts ``bad_input`` before any row changes;
``from_state`` refuses a state whose arrays are missing, misshapen or whose ids repeat.
The table is not thread-safe: one thread (the server's loop) calls it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from downpour.model.initial import Rule, as_ids, initial_rows
from downpour.server.settings import EVICT_POLICIES  # --evict-policy's choices
from downpour.server.tables.index import IdIndex
from downpour.server.tables.optim import RowOptimizer, update_rows
from downpour.server.tables.sketch import SATURATE, CountMinSketch
from downpour.server.tables.store import CHUNK_BYTES, CHUNK_ROWS, ChunkedStore

EVICT_TO = 0.9  # a table over its capacity evicts down to this fraction of it
KERAS_EMBEDDING = Rule("uniform", -0.05, 0.05)  # Keras Embedding's default initialiser
COUNTERS = (
    "inserted",
    "admitted",
    "refused",
    "evicted_idle",
    "evicted_capacity",
    "bad_input",
)


@dataclass
class Applied:
    """What one ``apply`` did: distinct ids updated, created (admitted), gradient rows
    refused, and the ids evicted for capacity afterwards."""

    updated: int = 0
    admitted: int = 0
    refused: int = 0
    evicted: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))


def _sum_duplicates(
    ids: np.ndarray, grads: np.ndarray, lookups: np.ndarray
) -> tuple[np.ndarray, ...]:
    """(unique ids, their gradient rows summed in the order they come, the lookups of each:
    ``lookups`` of its rows added up)."""
    uniq, inverse = np.unique(ids, return_inverse=True)
    if uniq.size == ids.size:
        order = np.argsort(ids, kind="stable")
        return uniq, grads[order], lookups[order]
    summed = np.zeros((uniq.size, *grads.shape[1:]), grads.dtype)
    np.add.at(summed, inverse, grads)
    counts = np.zeros(uniq.size, np.int64)
    np.add.at(counts, inverse, lookups)
    return uniq, summed, counts


class DynamicTable:
    """One shard's rows of dynamic table ``name``: ``dim`` wide, ``dtype``, trained by
    ``optimizer`` (a ``RowOptimizer``, or its kind with Keras's default hyperparameters)."""

    def __init__(
        self,
        name: str,
        dim: int,
        *,
        optimizer: RowOptimizer | str = "sgd",
        rule: Rule = KERAS_EMBEDDING,
        seed: int = 0,
        dtype: str = "float32",
        admit_after: int = 1,
        sketch: CountMinSketch | None = None,
        capacity: int | None = None,
        policy: str = "lru",
        chunk_rows: int | None = None,
    ) -> None:
        self.opt = optimizer if isinstance(optimizer, RowOptimizer) else RowOptimizer(optimizer)
        if not 1 <= admit_after <= SATURATE:
            raise ValueError(f"admit_after must be in [1, {SATURATE}], got {admit_after}")
        if policy not in EVICT_POLICIES:
            raise ValueError(f"policy must be one of {EVICT_POLICIES}, got {policy!r}")
        if dim < 1:
            raise ValueError(f"dim must be positive, got {dim}")
        if rule.kind == "whole":
            raise ValueError(f"{name}: a dynamic table's rows need a per-id rule, got {rule}")
        if capacity is not None and capacity < 1:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.name, self.dim, self.rule, self.seed = name, dim, rule, seed
        self.dtype = np.dtype(dtype)
        self.admit_after, self.capacity, self.policy = admit_after, capacity, policy
        self.sketch = sketch if sketch is not None or admit_after == 1 else CountMinSketch()
        row = ((dim,), dtype)
        fields = {"row": row, **{s: row for s in self.opt.slots}}
        fields |= {"version": ((), "int64"), "count": ((), "int64")}
        rows = chunk_rows or min(CHUNK_ROWS, max(1, CHUNK_BYTES // (dim * self.dtype.itemsize)))
        self.store = ChunkedStore(fields, rows)
        self.index = IdIndex()
        self.counters = dict.fromkeys(COUNTERS, 0)

    def __len__(self) -> int:
        return len(self.index)

    def _check_ids(self, ids: np.ndarray) -> np.ndarray:
        try:
            return as_ids(ids)
        except ValueError as e:
            self.counters["bad_input"] += 1
            raise ValueError(f"{self.name}: {e}") from None

    def initial(self, ids: np.ndarray) -> np.ndarray:
        """The initial rows of ``ids``."""
        return initial_rows(self.rule, self.seed, self.name, ids, self.dim, str(self.dtype))

    def gather(self, ids: np.ndarray, *, create: bool = False, version: int = 0) -> np.ndarray:
        """Rows of ``ids`` (len(ids), dim); a missing id reads its initial value, and with
        ``create`` is stored (at ``version``, bypassing admission; the capacity is left to
        the caller's next ``enforce_capacity`` or ``apply``, which return the evicted ids)."""
        ids = self._check_ids(ids)
        slots = self.index.lookup(ids)
        out = np.empty((ids.size, self.dim), self.dtype)
        found = slots >= 0
        out[found] = self.store.take("row", self.store.plan(slots[found]))
        if not found.all():
            missing, inverse = np.unique(ids[~found], return_inverse=True)
            fresh = self.initial(missing)
            out[~found] = fresh[inverse]
            if create:
                self._create(missing, fresh, version)
        return out

    def _create(self, ids: np.ndarray, rows: np.ndarray, version: int) -> np.ndarray:
        """Store new unique ``ids`` (absent from the index) with ``rows``; returns their
        slots."""
        slots = self.store.allocate(ids.size)
        plan = self.store.plan(slots)
        self.store.put("row", plan, rows)
        for s in self.opt.slots:
            self.store.put(s, plan, np.full((ids.size, self.dim), self.opt.initial_slot(s)))
        self.store.put("version", plan, np.full(ids.size, version, np.int64))
        self.store.put("count", plan, np.zeros(ids.size, np.int64))
        self.index.insert_new(ids, slots)  # unique, and absent: the caller's lookup missed them
        self.counters["inserted"] += ids.size
        return slots

    def apply(
        self,
        ids: np.ndarray,
        grads: np.ndarray,
        lr: float,
        version: int,
        step: int = 1,
        lookups: np.ndarray | None = None,
    ) -> Applied:
        """Apply gradient rows ``grads`` (len(ids), dim) of ``ids`` at learning rate ``lr``;
        touched rows take ``version``; ``step`` is Adam's step number (iterations + 1).
        ``lookups``: how many lookups each row sums (a worker pushes each id once with its
        count); None: one each. Admission and each row's count go by lookups."""
        ids = self._check_ids(ids)
        grads = np.asarray(grads)
        lookups = np.ones(ids.size, np.int64) if lookups is None else np.asarray(lookups)
        if (
            grads.shape != (ids.size, self.dim)
            or not np.issubdtype(grads.dtype, np.floating)
            or not np.isfinite(lr)
            or lookups.shape != (ids.size,)
            or lookups.dtype.kind not in "iu"
            or (ids.size and int(lookups.min()) < 1)
        ):
            self.counters["bad_input"] += 1
            raise ValueError(
                f"{self.name}: gradient rows must be floats of shape ({ids.size}, {self.dim}), "
                f"lookups {ids.size} integers >= 1 and lr finite, got {grads.dtype} "
                f"{grads.shape}, lookups {lookups.dtype} {lookups.shape} and {lr}"
            )
        uniq, grad, counts = _sum_duplicates(ids, grads, lookups.astype(np.int64, copy=False))
        slots = self.index.lookup(uniq)
        missing = slots < 0
        done = Applied()
        if missing.any():
            new = missing.copy()
            if self.sketch is not None:
                estimate = self.sketch.add(uniq[missing], counts[missing])
                refused = estimate < self.admit_after
                new[np.flatnonzero(missing)[refused]] = False
                done.refused = int(counts[missing][refused].sum())
                self.counters["refused"] += done.refused
            keep = ~missing | new
            uniq, grad, counts, slots = uniq[keep], grad[keep], counts[keep], slots[keep]
            new = new[keep]
            slots[new] = self._create(uniq[new], self.initial(uniq[new]), version)
            done.admitted = int(new.sum())
            self.counters["admitted"] += done.admitted
        self._update(slots, grad, counts, lr, version, step)
        done.updated = uniq.size
        done.evicted = self.enforce_capacity()
        return done

    def _update(
        self,
        slots: np.ndarray,
        grad: np.ndarray,
        counts: np.ndarray,
        lr: float,
        version: int,
        step: int,
    ) -> None:
        plan = self.store.plan(slots)
        rows = self.store.take("row", plan)
        slot_rows = {s: self.store.take(s, plan) for s in self.opt.slots}
        slot_rows = update_rows(self.opt, rows, slot_rows, grad, lr, step)
        self.store.put("row", plan, rows)
        for s, values in slot_rows.items():
            self.store.put(s, plan, values)
        self.store.put("version", plan, np.full(slots.size, version, np.int64))
        self.store.put("count", plan, self.store.take("count", plan) + counts)

    def _live(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids, slots) of the live rows, in slot order."""
        ids, slots = self.index.items()
        order = np.argsort(slots)
        return ids[order], slots[order]

    def _evict(self, ids: np.ndarray, slots: np.ndarray, reason: str) -> np.ndarray:
        self.index.remove(ids)
        self.store.release(slots)
        self.counters[f"evicted_{reason}"] += ids.size
        return ids

    def evict_idle(self, version: int, idle_versions: int) -> np.ndarray:
        """Evict the rows last updated ``idle_versions`` or more versions before
        ``version``; returns their ids."""
        ids, slots = self._live()
        last = self.store.take("version", self.store.plan(slots))
        idle = version - last >= idle_versions
        return self._evict(ids[idle], slots[idle], "idle")

    def enforce_capacity(self) -> np.ndarray:
        """Over capacity: evict down to ``EVICT_TO`` of it by the policy; the evicted ids."""
        if self.capacity is None or len(self) <= self.capacity:
            return np.empty(0, np.int64)
        ids, slots = self._live()
        plan = self.store.plan(slots)
        last, count = self.store.take("version", plan), self.store.take("count", plan)
        order = np.lexsort((count, last) if self.policy == "lru" else (last, count))
        drop = order[: len(self) - int(EVICT_TO * self.capacity)]
        return self._evict(ids[drop], slots[drop], "capacity")

    def export_state(self) -> dict[str, np.ndarray]:
        """Everything the table holds, as arrays: live ids in slot order with their rows,
        slots (``slot_<name>``), versions and counts, the sketch and the counters."""
        ids, slots = self._live()
        plan = self.store.plan(slots)
        state = {"ids": ids, "rows": self.store.take("row", plan)}
        state |= {f"slot_{s}": self.store.take(s, plan) for s in self.opt.slots}
        state["versions"] = self.store.take("version", plan)
        state["counts"] = self.store.take("count", plan)
        state["counters"] = np.array([self.counters[c] for c in COUNTERS], np.int64)
        if self.sketch is not None:
            state["sketch"] = self.sketch.counters.copy()
            state["sketch_mass"] = np.array(self.sketch.mass, np.int64)
            state["sketch_window"] = np.array(self.sketch.window, np.int64)
        return state

    @classmethod
    def from_state(cls, state: dict[str, np.ndarray], name: str, **config: object) -> DynamicTable:
        """A table ``name`` built with ``config`` (as the constructor's keywords) holding
        ``state`` from ``export_state``; ValueError for a state that does not fit it."""
        rows = np.asarray(state["rows"]) if "rows" in state else None
        if rows is None or rows.ndim != 2:
            raise ValueError(f"{name}: state rows must be a 2-D array")
        table = cls(name, rows.shape[1], **config)  # type: ignore[arg-type]
        ids = table._check_state(state)
        if "sketch" in state:
            depth, width = state["sketch"].shape
            table.sketch = CountMinSketch(width, depth, int(state["sketch_window"]))
            table.sketch.counters[...] = state["sketch"]
            table.sketch.mass = int(state["sketch_mass"])
        slots = table.store.allocate(ids.size)
        plan = table.store.plan(slots)
        table.store.put("row", plan, rows)
        for s in table.opt.slots:
            table.store.put(s, plan, state[f"slot_{s}"])
        table.store.put("version", plan, state["versions"])
        table.store.put("count", plan, state["counts"])
        table.index.insert(ids, slots)
        table.counters = dict(zip(COUNTERS, (int(v) for v in state["counters"]), strict=True))
        return table

    def _check_state(self, state: dict[str, np.ndarray]) -> np.ndarray:
        """The ids of ``state`` once every array it needs is there with a fitting shape."""
        ids = as_ids(state.get("ids", np.zeros((0, 0))))
        n, dim = ids.size, self.dim
        shapes = {"rows": (n, dim), "versions": (n,), "counts": (n,), "counters": (len(COUNTERS),)}
        shapes |= {f"slot_{s}": (n, dim) for s in self.opt.slots}
        if "sketch" in state:
            shapes |= {"sketch_mass": (), "sketch_window": ()}
        for key, shape in shapes.items():
            got = np.shape(state[key]) if key in state else None
            if got != shape:
                raise ValueError(f"{self.name}: state {key!r} must have shape {shape}, got {got}")
        if np.unique(ids).size != n:
            raise ValueError(f"{self.name}: state ids repeat")
        return ids

    def stats(self) -> dict[str, int]:
        """Live rows, bytes by part (rows, slots, index, sketch, metadata) and counters."""
        meta = self.store.nbytes("version") + self.store.nbytes("count")
        out = {
            "live_rows": len(self),
            "bytes_rows": self.store.nbytes("row"),
            "bytes_slots": sum(self.store.nbytes(s) for s in self.opt.slots),
            "bytes_index": self.index.nbytes,
            "bytes_sketch": self.sketch.nbytes if self.sketch is not None else 0,
            "bytes_meta": meta + self.store.free_nbytes,
        }
        out["bytes"] = sum(v for k, v in out.items() if k.startswith("bytes_"))
        return out | self.counters
