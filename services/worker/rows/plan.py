"""Row pulls on the worker: which tables go by row, the ids coming batches gather, and the
row cache with its staleness bound (``--row-pulls``, ``--row-staleness``).

Which tables. A variable is pulled by row when every shard holding a part of it lists that
part in its hello's ``row_tables`` (the server found its gradients row-sparse), a Keras
``Embedding`` of the model owns it, and the model is functional or sequential (the id
extractor below can be built). Otherwise it is pulled whole, as every variable is without
row pulls, and the worker logs why once.

The id extractor. ``keras.Model(<the model's inputs, in its own structure>, [layer.input for each
such Embedding])``,
built once and compiled as one ``tf.function`` over the batches' feature signature: run on a
batch's features it returns, per table, the unique ids that batch's lookups gather, without
running the rest of the model. No user code is needed. The worker reads its input pipeline
ahead (``Lookahead``) so the ids of the batches a prefetched pull will serve are known when
the pull is requested, and the transfer overlaps the computation of the current batch.

The row cache. The worker keeps its full local replica of each table (the model's own
variable) and, per row, the version of its shard at which the row was last fetched
(``fetched``, -1: never). A row is fresh when ``fetched >= shard version - K`` (K =
``--row-staleness``); the shard version is that of the last reply from the shard holding the
row. A look-ahead pull asks for the coming batches' rows that would be stale once the shard
moves one version on; before each step, rows of the batch still stale (the look-ahead missed
them, or the version moved further) are pulled at once (``row_sync_pulls``), asking the
server for those rows only. A reply never overwrites a row with an older version than the
one held. Pulled rows are scattered into the variable (O(rows)); whole variables are
assigned as before. With ``--row-cache-rows N`` a table of more than N rows is no replica
but a bounded cache of N rows (``downpour.worker.rows.cache``), which keeps the same versions
per cached row and places pulled rows in its slots.

Split tables: a table split by row ranges over shards (``downpour.model.partition``) has its ids
routed to the shard holding each, rebased to that shard's slice (``Partition.route_rows``).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from downpour import wire
from downpour.model.build import embedding_tables, gathered_ids, id_extractor
from downpour.model.partition import Part, Partition
from downpour.runtime.metrics import Notices
from downpour.worker.errors import WorkerError
from downpour.worker.rows.cache import RowCache

log = logging.getLogger("downpour.worker")


@dataclass
class RowTable:
    """One table pulled by row: variable ``var`` (model order), its pieces per shard, and the
    version at which each of its rows was last fetched (its shard's version; -1 never):
    ``fetched`` per row of a full replica, or kept per slot by its ``cache``."""

    var: int
    variable: Any
    parts: list[tuple[int, Part]]
    fetched: np.ndarray | None
    cache: RowCache | None = None

    @property
    def rows(self) -> int:
        """Rows of the whole table."""
        if self.cache is not None:
            return self.cache.rows
        assert self.fetched is not None
        return int(self.fetched.shape[0])

    def fetched_at(self, rows: np.ndarray) -> np.ndarray:
        """The version each of these global rows was fetched at (-1: never, not cached)."""
        if self.cache is not None:
            return self.cache.fetched_at(rows)
        assert self.fetched is not None
        return self.fetched[rows]


def _row_tables(
    model: keras.Model,
    partition: Partition,
    offered: Sequence[Sequence[str] | None],
    notices: Notices,
) -> list[int]:
    """The variables to pull by row: every shard holding a part serves it by row and a Keras
    Embedding owns it. Embedding tables the servers do not serve by row are a warning."""
    serves = [set(o or ()) for o in offered]
    variables = model.trainable_variables
    candidates = [
        var
        for var in range(len(variables))
        if (parts := partition.parts_of(var)) and all(p.wire_name in serves[k] for k, p in parts)
    ]
    by_path = embedding_tables(model)
    unserved = sorted(set(by_path) - {variables[i].path for i in candidates})
    if unserved:
        notices.warn(
            log,
            "tables %s are pulled whole: the servers do not serve them by row (their log "
            "and `downpour status` say why)",
            ", ".join(unserved),
        )
    tables = [i for i in candidates if variables[i].path in by_path]
    for i in sorted(set(candidates) - set(tables)):
        log.info("table %s is not a Keras Embedding's: pulled whole", variables[i].path)
    return tables


class RowPlan:
    """The row pulls of one worker: its tables, the id extractor, the staleness bound, and
    the figures (``stats``: rows_pulled, row_bytes_pulled, row_hits, row_misses)."""

    def __init__(
        self,
        model: keras.Model,
        partition: Partition,
        tables: Sequence[int],
        features_spec: Any,
        staleness: int,
        caches: dict[str, RowCache] | None = None,
    ) -> None:
        """``caches``: the row caches of the model (``cache.caches_of``) by variable
        path; each must be one of ``tables``."""
        variables = model.trainable_variables
        by_path = embedding_tables(model)
        layers = [by_path[variables[i].path] for i in tables]
        caches = caches or {}
        self.partition = partition
        self.staleness = staleness
        self.tables = [
            RowTable(i, variables[i], partition.parts_of(i), None, caches[variables[i].path])
            if variables[i].path in caches
            else RowTable(
                i,
                variables[i],
                partition.parts_of(i),
                np.full(int(variables[i].shape[0]), -1, np.int64),
            )
            for i in tables
        ]
        self.cached = [t for t in self.tables if t.cache is not None]
        self.pending_until = 0  # the last batch the pull being requested serves
        self.by_wire = {p.wire_name: (t, p) for t in self.tables for _, p in t.parts}
        extractor = id_extractor(model, layers)

        @tf.function(input_signature=[features_spec])
        def batch_ids(x: Any) -> list[tf.Tensor]:
            return gathered_ids(extractor, x)

        self._batch_ids = batch_ids
        self._batch_ids.get_concrete_function()  # traced now, once
        self._just_fetched: list[list[np.ndarray]] = [[] for _ in self.tables]

    @classmethod
    def build(
        cls,
        model: keras.Model,
        partition: Partition,
        offered: Sequence[Sequence[str] | None],
        features_spec: Any,
        staleness: int,
        caches: dict[str, RowCache] | None = None,
        notices: Notices | None = None,
    ) -> RowPlan | None:
        """The plan for the tables every shard serves by row (``offered``: each shard's
        hello ``row_tables``), or None when there are none or the model gives no extractor
        (a warning, kept in ``notices``). WorkerError when a cached table (``caches``)
        cannot go by row."""
        notices = notices if notices is not None else Notices()
        tables = _row_tables(model, partition, offered, notices)
        plan = None
        if tables:
            try:
                plan = cls(model, partition, tables, features_spec, staleness, caches)
            except (ValueError, AttributeError, TypeError) as exc:  # Keras: not functional
                notices.warn(
                    log,
                    "row pulls off: cannot find the ids a batch gathers in model %s (%s); "
                    "tables are pulled whole",
                    model.name,
                    " ".join(str(exc).split())[:200],
                )
        by_row = {str(t.variable.path) for t in plan.tables} if plan is not None else set()
        missing = sorted(set(caches or {}) - by_row)
        if missing:
            raise WorkerError(
                f"--row-cache-rows: table {missing[0]} cannot be pulled by row (a server does "
                "not serve it by row, or the model gives no id extractor; see the log), and a "
                "row cache cannot hold a table pulled whole"
            )
        return plan

    # ------------------------------------------------------------ ids and staleness

    def batch_ids(self, features: Any) -> list[np.ndarray]:
        """Per table, the unique row ids a batch with these features gathers."""
        return [t.numpy() for t in self._batch_ids(features)]

    def wanted(
        self,
        ids: Sequence[np.ndarray],
        versions: Sequence[int],
        ahead: int | Sequence[int] = 0,
    ) -> list[dict[str, np.ndarray]]:
        """Per shard, {part wire name: rebased ids} of the rows in ``ids`` (per table) that
        are stale: fetched before their shard's version (``versions``) + ``ahead`` - K.
        ``ahead`` (per shard, or one for all): how many versions on the reply of a
        look-ahead pull will likely be.
        Every table piece of a shard is named, with an empty list when no row of it is
        stale: a pull that names no table would get the tables whole. A fixed table's ids
        go as int32 below 2**31 rows (``wire.row_numbers``)."""
        out: list[dict[str, np.ndarray]] = [{} for _ in versions]
        steps = [ahead] * len(versions) if isinstance(ahead, int) else list(ahead)
        for table, table_ids in zip(self.tables, ids, strict=True):
            for k, part, local in self.partition.route_rows(table.var, table_ids):
                fetched = table.fetched_at(part.global_rows(local))
                stale = (fetched < 0) | (fetched < versions[k] + steps[k] - self.staleness)
                wanted = local[stale]  # never fetched (-1) is always stale
                if not part.dynamic:
                    wanted = wire.row_numbers(wanted, part.part_shape[0])
                out[k][part.wire_name] = wanted
        return out

    @staticmethod
    def count(wanted: Sequence[dict[str, np.ndarray]]) -> int:
        """Rows asked for in ``wanted`` (as ``wanted`` returns it)."""
        return sum(int(ids.size) for per_shard in wanted for ids in per_shard.values())

    def union(self, batches: Sequence[Any]) -> list[np.ndarray]:
        """Per table, the unique ids of several batches' features."""
        per = [self.batch_ids(x) for x in batches]
        if not per:
            return [np.zeros(0, np.int64) for _ in self.tables]
        return [np.unique(np.concatenate(col)) for col in zip(*per, strict=True)]

    # ------------------------------------------------------------ replies

    def forget(self, shard: int) -> None:
        """Shard ``shard`` restarted: its versions count anew, so its rows count as never
        fetched (they are pulled again, and any reply may overwrite them)."""
        for table in self.tables:
            for k, part in table.parts:
                if k != shard:
                    continue
                if table.cache is not None:
                    table.cache.forget(part)
                else:
                    assert table.fetched is not None
                    table.fetched[part.start : part.stop] = -1

    def is_table(self, wire_name: str) -> bool:
        """True when this wire name is a piece of a table pulled by row."""
        return wire_name in self.by_wire

    def install(
        self,
        wire_name: str,
        tensor: wire.WireTensor,
        version: int,
        scatter: Any,
        current: bool = False,
    ) -> tuple[int, int]:
        """Put a reply's piece of a table into the local replica: a Sparse (rows) or a whole
        piece (an array: the first load, or a server without row pulls). Rows held at a newer
        version are kept. ``scatter(var, rows, values)`` writes rows of the variable. A
        cached table takes rows only, placed in its slots: ``current``, the rows of the batch
        about to be computed, else of the batches up to ``pending_until``.
        Returns (rows written, bytes received)."""
        table, part = self.by_wire[wire_name]
        by_row = wire.is_rows(tensor)
        if table.cache is not None:
            if not by_row:
                raise WorkerError(
                    f"a server sent the cached table {wire_name} whole: --row-cache-rows "
                    "needs servers that serve it by row"
                )
            return self._install_cached(table, part, tensor, version, scatter, current)
        ids, values = wire.rows_of(tensor)  # a whole piece: every row
        rows = part.global_rows(np.asarray(ids, np.int64))
        values, nbytes = np.asarray(values), tensor.nbytes
        assert table.fetched is not None
        keep = table.fetched[rows] <= version
        if not keep.all():
            rows, values = rows[keep], values[keep]
        if rows.size:
            scatter(table.var, rows, values)
            table.fetched[rows] = version
            if by_row:  # what a batch's row pull brought (a whole load is no miss)
                self._just_fetched[self.tables.index(table)].append(rows)
        return int(rows.size), int(nbytes)

    def _install_cached(
        self,
        table: RowTable,
        part: Part,
        tensor: wire.Sparse,
        version: int,
        scatter: Any,
        current: bool,
    ) -> tuple[int, int]:
        """``install`` of rows of a cached table: placed in slots (``RowCache.place``),
        written there; rows cached at a newer version are kept."""
        cache = table.cache
        assert cache is not None
        rows = part.global_rows(np.asarray(tensor.indices, np.int64))
        values = np.asarray(tensor.values)
        nbytes = tensor.indices.nbytes + values.nbytes
        keep = cache.fetched_at(rows) <= version
        if not keep.all():
            rows, values = rows[keep], values[keep]
        slots = cache.place(rows, self.pending_until, current)
        placed = slots >= 0
        if not placed.all():
            rows, values, slots = rows[placed], values[placed], slots[placed]
        if rows.size:
            scatter(table.var, slots, values)
            cache.fetched[slots] = version
            self._just_fetched[self.tables.index(table)].append(rows)
        return int(rows.size), int(nbytes)

    def begin_batch(self, ids: Sequence[np.ndarray], now: int) -> None:
        """Batch ``now`` with these ids (per table) is next: the caches keep its rows."""
        for table, table_ids in zip(self.tables, ids, strict=True):
            if table.cache is not None:
                table.cache.begin_batch(table_ids, now)

    def keep_for(self, ids: Sequence[np.ndarray], until: int) -> None:
        """A pull is requested for the batches up to ``until`` with these ids (per table):
        the caches keep those rows they hold until then, and place the reply's for them."""
        self.pending_until = until
        for table, table_ids in zip(self.tables, ids, strict=True):
            if table.cache is not None:
                table.cache.keep_for(table_ids, until)

    def first_rows(self, shards: int) -> list[dict[str, np.ndarray] | None]:
        """Per shard, the rows the first pull asks for: none of the cached tables (so they
        do not come whole; None: the shard holds no piece of one)."""
        out: list[dict[str, np.ndarray] | None] = [None] * shards
        for table in self.cached:
            for k, part in table.parts:
                out[k] = {**(out[k] or {}), part.wire_name: np.zeros(0, np.int64)}
        return out

    def consume(self, ids: Sequence[np.ndarray]) -> tuple[int, int]:
        """A batch with these ids (per table) is about to be computed: (hits, misses), where
        a miss is a row fetched for it since the previous batch, a hit a row the cache held."""
        hits = misses = 0
        for j, table_ids in enumerate(ids):
            fetched = self._just_fetched[j]
            self._just_fetched[j] = []
            pulled = np.isin(table_ids, np.concatenate(fetched)) if fetched else False
            n_miss = int(np.count_nonzero(pulled))
            misses += n_miss
            hits += int(table_ids.size) - n_miss
        return hits, misses


class Lookahead:
    """The training batches, read ahead on demand: ``items[i]`` is batch ``i`` of the run.

    Each item is ``(x, y, mark)``: ``mark`` (a split feed's ``SplitMark``, or None) is
    captured when the batch is read, so where a batch stands in its split stays with it.
    """

    def __init__(self, it: Iterator[tuple[Any, Any, Any]]) -> None:
        self._it = it
        self._buf: deque[tuple[Any, Any, Any]] = deque()
        self.taken = 0  # batches handed out by next()
        self.current: tuple[Any, Any, Any] | None = None
        self._done = False

    def _fill(self, n: int) -> None:
        while len(self._buf) < n and not self._done:
            item = next(self._it, None)
            if item is None:
                self._done = True
            else:
                self._buf.append(item)

    def next(self) -> tuple[Any, Any, Any] | None:
        """The next batch, or None at the end."""
        self._fill(1)
        if not self._buf:
            return None
        self.current = self._buf.popleft()
        self.taken += 1
        return self.current

    def features(self, start: int, stop: int) -> list[Any]:
        """Features of batches ``start .. stop-1`` (run indices) that exist: the current one
        (index taken - 1) and those ahead, read from the pipeline as needed."""
        out = []
        first = self.taken - 1
        if self.current is not None and start <= first < stop:
            out.append(self.current[0])
        lo = max(start, self.taken)
        self._fill(stop - self.taken)
        for i in range(lo, stop):
            j = i - self.taken
            if j >= len(self._buf):
                break
            out.append(self._buf[j][0])
        return out
