"""The server-side store of a dynamic embedding table: ids of any int64 value, in a budget.

A ``DynamicTable`` is one shard's share of a table declared by a
``downpour.tables.policy.TablePolicy`` (the layer's): at most ``own_rows`` rows of their own
and its ``fallback_here`` fallback rows, each row with its optimizer slots. Which ids hold
rows is ``downpour.tables.rowmap.RowMap``'s decision, the code the one-process layer runs
too; the rows and slots sit in chunked storage (``store``), the fallback rows in plain arrays:

- ``gather(ids)`` reads rows: an id's own row, or its fallback row, or (a table without
  fallback rows) its initial value (``initial_rows``: a function of (seed, table, id) only);
  nothing is stored unless ``create=True``;
- ``apply(ids, grads, lr, version, step, lookups)`` sums duplicate ids' gradient rows and
  places the ids (``RowMap.place``: counted, admitted against the victim when full, exact
  capacity); an id admitted now starts from its fallback row (``admit_init="fallback"``) or
  its initial value, its slots at their optimizer's initial value; then each own row is
  updated by the row-wise optimizer's rule (``optim``) and each refused id's gradient trains
  its fallback row, summed per fallback row (dropped in a table without fallback rows);
- ``evict_idle`` drops rows not updated for a number of versions; ``enforce_capacity``
  evicts down to the capacity after a restore onto fewer shards. Evicted ids are returned
  (the tombstones of a delta export); a re-admitted id starts again;
- ``export_state`` / ``from_state`` carry everything (rows, slots, versions, counts, the
  fallback rows and their slots, the sketch, the counters) as arrays, exactly.

Bad input (ids not a 1-D integer array, gradient rows not floats of the ids' shape, a
non-finite learning rate, lookups below 1) raises ValueError and counts ``bad_input`` before
any row changes; ``from_state`` refuses a state whose arrays are missing, misshapen or whose
ids repeat. The table is not thread-safe: one thread (the server's loop) calls it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from downpour.model.hashing import as_ids
from downpour.model.initial import Rule, fallback_initial_rows, initial_rows
from downpour.server.tables.optim import RowOptimizer, update_rows
from downpour.server.tables.store import CHUNK_BYTES, CHUNK_ROWS, ChunkedStore
from downpour.tables.policy import TablePolicy
from downpour.tables.rowmap import COUNTERS, RowMap
from downpour.tables.sketch import CountMinSketch

KERAS_EMBEDDING = Rule("uniform", -0.05, 0.05)  # Keras Embedding's default initialiser
UNBOUNDED = TablePolicy(max_rows=None)


@dataclass
class Applied:
    """What one ``apply`` did: distinct ids updated in rows of their own, rows admitted,
    lookups refused a row (trained on their fallback rows), and the ids evicted."""

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
    """Shard ``shard`` of ``num_shards``'s rows of dynamic table ``name``: ``dim`` wide,
    ``dtype``, trained by ``optimizer`` (a ``RowOptimizer``, or its kind with Keras's default
    hyperparameters), within ``policy`` (its budget split over the shards; ``shard_rows``
    overrides this shard's share, own and fallback rows together)."""

    def __init__(
        self,
        name: str,
        dim: int,
        *,
        optimizer: RowOptimizer | str = "sgd",
        rule: Rule = KERAS_EMBEDDING,
        seed: int = 0,
        dtype: str = "float32",
        policy: TablePolicy = UNBOUNDED,
        num_shards: int = 1,
        shard: int = 0,
        shard_rows: int | None = None,
        sketch: CountMinSketch | None = None,
        chunk_rows: int | None = None,
    ) -> None:
        self.opt = optimizer if isinstance(optimizer, RowOptimizer) else RowOptimizer(optimizer)
        if dim < 1:
            raise ValueError(f"dim must be positive, got {dim}")
        if rule.kind == "whole":
            raise ValueError(f"{name}: a dynamic table's rows need a per-id rule, got {rule}")
        self.name, self.dim, self.rule, self.seed = name, dim, rule, seed
        self.dtype = np.dtype(dtype)
        self.policy, self.num_shards, self.shard = policy, num_shards, shard
        own, fallback_here = policy.shard_rows(num_shards)
        if shard_rows is not None:
            own = shard_rows - fallback_here
            if own < 1:
                raise ValueError(
                    f"{name}: {shard_rows} rows on this shard leave none of their own beside "
                    f"its {fallback_here} fallback rows"
                )
        self.map = RowMap(
            own, fallback_here * num_shards, evict=policy.evict, admission=policy.admission,
            admit_after=policy.admit_after, num_shards=num_shards, shard=shard, sketch=sketch,
            seed=seed,
        )  # fmt: skip
        row = ((dim,), dtype)
        fields = {"row": row, **{s: row for s in self.opt.slots}}
        rows = chunk_rows or min(CHUNK_ROWS, max(1, CHUNK_BYTES // (dim * self.dtype.itemsize)))
        self.store = ChunkedStore(fields, rows, limit=own)
        numbers = self.map.fallback_index()
        self.fallback = {
            "row": fallback_initial_rows(rule, seed, name, numbers, dim, str(self.dtype)),
            **{s: self._fresh_slot(s, numbers.size) for s in self.opt.slots},
        }

    @property
    def capacity(self) -> int | None:
        """Rows of their own this shard holds at most (None: unbounded)."""
        return self.map.own_rows

    @property
    def counters(self) -> dict[str, int]:
        return self.map.counters

    @property
    def sketch(self) -> CountMinSketch | None:
        return self.map.sketch

    def __len__(self) -> int:
        return len(self.map)

    def _fresh_slot(self, name: str, n: int) -> np.ndarray:
        return np.full((n, self.dim), self.opt.initial_slot(name), self.dtype)

    def _check_ids(self, ids: np.ndarray) -> np.ndarray:
        try:
            return as_ids(ids)
        except ValueError as e:
            self.counters["bad_input"] += 1
            raise ValueError(f"{self.name}: {e}") from None

    def initial(self, ids: np.ndarray) -> np.ndarray:
        """The initial rows of ``ids``."""
        return initial_rows(self.rule, self.seed, self.name, ids, self.dim, str(self.dtype))

    def _unheld(self, ids: np.ndarray) -> np.ndarray:
        """What ids without rows of their own read: their fallback rows, or, in a table
        without them, their initial values."""
        if self.map.fallback_total:
            return self.fallback["row"][self.map.fallback_of(ids)]
        return self.initial(ids)

    def gather(self, ids: np.ndarray, *, create: bool = False, version: int = 0) -> np.ndarray:
        """Rows of ``ids`` (len(ids), dim); an id without a row of its own reads its fallback
        row (or its initial value), and with ``create`` gets a row of its own at its initial
        value (at ``version``, bypassing admission; over the capacity, the caller's next
        ``enforce_capacity`` or ``apply`` evicts)."""
        ids = self._check_ids(ids)
        slots = self.map.locate(ids)
        out = np.empty((ids.size, self.dim), self.dtype)
        found = slots >= 0
        out[found] = self.store.take("row", self.store.plan(slots[found]))
        if not found.all():
            missing, inverse = np.unique(ids[~found], return_inverse=True)
            if create:
                fresh = self.initial(missing)
                self._store_new(self.map.insert(missing, version), fresh)
            else:
                fresh = self._unheld(missing)
            out[~found] = fresh[inverse]
        return out

    def _store_new(self, slots: np.ndarray, rows: np.ndarray) -> None:
        """Write new rows at ``slots``, their optimizer slots at their initial values."""
        self.store.ensure(self.map.top)
        plan = self.store.plan(slots)
        self.store.put("row", plan, rows)
        for s in self.opt.slots:
            self.store.put(s, plan, self._fresh_slot(s, slots.size))

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
        placed = self.map.place(uniq, counts, version)
        own = placed.slots >= 0
        if placed.new.any():
            fresh = uniq[placed.new]
            start = (
                self._unheld(fresh) if self.policy.admit_init == "fallback" else self.initial(fresh)
            )
            self._store_new(placed.slots[placed.new], start)
        self._update(placed.slots[own], grad[own], lr, step)
        if self.map.fallback_total and not own.all():
            self._update_fallback(uniq[~own], grad[~own], lr, step)
        return Applied(int(own.sum()), int(placed.new.sum()), placed.refused, placed.evicted)

    def _update(self, slots: np.ndarray, grad: np.ndarray, lr: float, step: int) -> None:
        plan = self.store.plan(slots)
        rows = self.store.take("row", plan)
        slot_rows = {s: self.store.take(s, plan) for s in self.opt.slots}
        slot_rows = update_rows(self.opt, rows, slot_rows, grad, lr, step)
        self.store.put("row", plan, rows)
        for s, values in slot_rows.items():
            self.store.put(s, plan, values)

    def _update_fallback(self, ids: np.ndarray, grad: np.ndarray, lr: float, step: int) -> None:
        """Train the fallback rows of ``ids`` by their gradient rows, summed per row."""
        where, inverse = np.unique(self.map.fallback_of(ids), return_inverse=True)
        summed = np.zeros((where.size, self.dim), grad.dtype)
        np.add.at(summed, inverse, grad)
        rows = self.fallback["row"][where]
        slot_rows = {s: self.fallback[s][where] for s in self.opt.slots}
        slot_rows = update_rows(self.opt, rows, slot_rows, summed, lr, step)
        self.fallback["row"][where] = rows
        for s, values in slot_rows.items():
            self.fallback[s][where] = values

    def evict_idle(self, version: int, idle_versions: int) -> np.ndarray:
        """Evict the rows last updated ``idle_versions`` or more versions before
        ``version``; returns their ids."""
        return self.map.evict_idle(version, idle_versions)[0]

    def enforce_capacity(self) -> np.ndarray:
        """Over capacity (a restore onto fewer shards, ``gather(create=True)``): evict the
        weakest rows down to it; the evicted ids."""
        return self.map.enforce_capacity()[0]

    def export_state(self) -> dict[str, np.ndarray]:
        """Everything the table holds, as arrays: live ids in slot order with their rows,
        slots (``slot_<name>``), versions and counts; this shard's fallback rows
        (``fallback_index``: their numbers over the table, ``fallback_rows``,
        ``fallback_slot_<name>``); the sketch and the counters."""
        ids, slots = self.map.live()
        plan = self.store.plan(slots)
        state = {"ids": ids, "rows": self.store.take("row", plan)}
        state |= {f"slot_{s}": self.store.take(s, plan) for s in self.opt.slots}
        state["versions"] = self.map.versions(slots)
        state["counts"] = self.map.count[slots].astype(np.int64)
        state["counters"] = np.array([self.counters[c] for c in COUNTERS], np.int64)
        state["fallback_index"] = self.map.fallback_index()
        state["fallback_rows"] = self.fallback["row"].copy()
        state |= {f"fallback_slot_{s}": self.fallback[s].copy() for s in self.opt.slots}
        return state | self.map.sketch_state()

    @classmethod
    def from_state(cls, state: dict[str, np.ndarray], name: str, **config: object) -> DynamicTable:
        """A table ``name`` built with ``config`` (as the constructor's keywords) holding
        ``state`` from ``export_state``; ValueError for a state that does not fit it. A state
        without fallback rows (or of another number of them) leaves the table's fallback rows
        at their initial values; a shorter counters array (fewer counters) is read as it is."""
        rows = np.asarray(state["rows"]) if "rows" in state else None
        if rows is None or rows.ndim != 2:
            raise ValueError(f"{name}: state rows must be a 2-D array")
        table = cls(name, rows.shape[1], **config)  # type: ignore[arg-type]
        ids = table._check_state(state)
        table.map.load_sketch(state)
        slots = table.map.insert(ids, 0)
        table.map.set_versions(slots, state["versions"])
        table.map.count[slots] = np.clip(state["counts"], 0, np.iinfo(np.uint32).max)
        table.store.ensure(table.map.top)
        plan = table.store.plan(slots)
        table.store.put("row", plan, rows)
        for s in table.opt.slots:
            table.store.put(s, plan, state[f"slot_{s}"])
        if "fallback_index" in state and np.array_equal(
            state["fallback_index"], table.map.fallback_index()
        ):
            table.fallback["row"][...] = state["fallback_rows"]
            for s in table.opt.slots:
                table.fallback[s][...] = state[f"fallback_slot_{s}"]
        saved = [int(v) for v in state["counters"]]
        table.map.counters.update(zip(COUNTERS, saved, strict=False))
        return table

    def _check_state(self, state: dict[str, np.ndarray]) -> np.ndarray:
        """The ids of ``state`` once every array it needs is there with a fitting shape."""
        ids = as_ids(state.get("ids", np.zeros((0, 0))))
        n, dim = ids.size, self.dim
        shapes = {"rows": (n, dim), "versions": (n,), "counts": (n,)}
        shapes |= {f"slot_{s}": (n, dim) for s in self.opt.slots}
        if "sketch" in state:
            shapes |= {"sketch_mass": (), "sketch_window": ()}
        if "fallback_index" in state:
            b = np.shape(state["fallback_index"])[0]
            shapes |= {"fallback_rows": (b, dim)}
            shapes |= {f"fallback_slot_{s}": (b, dim) for s in self.opt.slots}
        for key, shape in shapes.items():
            got = np.shape(state[key]) if key in state else None
            if got != shape:
                raise ValueError(f"{self.name}: state {key!r} must have shape {shape}, got {got}")
        counters = np.shape(state.get("counters", ()))
        if len(counters) != 1 or counters[0] > len(COUNTERS):
            raise ValueError(f"{self.name}: state 'counters' has shape {counters}")
        if np.unique(ids).size != n:
            raise ValueError(f"{self.name}: state ids repeat")
        return ids

    def stats(self) -> dict[str, int]:
        """Live rows, fallback rows, bytes by part (rows, slots, fallback rows, index, sketch,
        metadata, reserved), and counters."""
        per_slot = self.store.entry_nbytes()
        rows_b = self.dtype.itemsize * self.dim
        live = len(self)
        sketch = self.sketch.nbytes if self.sketch is not None else 0
        out = {
            "live_rows": live,
            "fallback_rows": self.map.fallback_here,
            "bytes_rows": rows_b * live,
            "bytes_slots": (per_slot - rows_b) * live,
            "bytes_fallback": sum(a.nbytes for a in self.fallback.values()),
            "bytes_index": self.map.index.nbytes,
            "bytes_sketch": sketch,
            "bytes_meta": self.map.nbytes - self.map.index.nbytes - sketch,
            "bytes_reserved": per_slot * (self.store.capacity - live),
        }
        out["bytes"] = sum(v for k, v in out.items() if k.startswith("bytes_"))
        return out | self.counters
