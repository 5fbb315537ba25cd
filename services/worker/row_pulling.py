"""The worker's side of row pulls that talks to the servers: installing replies that carry
table rows, topping up a batch's stale rows before its step, and choosing the rows a
look-ahead pull asks for. ``downpour.worker.rows`` holds the plan (tables, id extractor,
per-row versions); this mixin of ``Worker`` applies it to the worker's shards, model and
figures. Row pulls are off (``Worker.rows`` is None) for models without row-sparse tables.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import tensorflow as tf

from downpour import wire
from downpour.client import Weights
from downpour.transport import ServerUnavailable, Stopped
from downpour.worker.errors import WorkerError
from downpour.worker.splits import DispatchError

if TYPE_CHECKING:
    from downpour.cluster import ShardSet
    from downpour.worker.rows import Lookahead, RowPlan
    from downpour.worker.settings import WorkerConfig


class RowPulling:
    """Row pulls for ``Worker`` (see the module docstring): uses the worker's attributes
    declared here and its ``pull_request``."""

    rows: RowPlan | None
    _stream: Lookahead | None
    shards: ShardSet
    config: WorkerConfig
    stats: dict[str, float]
    step_fn: Any  # GradientStep when rows is set (tf2 graphs only)
    _refresh: bool
    _sync_stalled: bool
    _row_version_steps: list[int]  # per shard, versions moved between its last two replies
    _row_version_gap: list[int]  # per shard, steps between the requests of those two replies
    _row_request_step: int  # the step before which the last pull was requested
    _row_held_step: int  # the same, for the pull whose weights are installed

    def _install_rows(
        self, replies: list[Weights], started: float, rows_only: bool = False
    ) -> None:
        """``install`` with tables kept by row: a table's piece comes as rows (scattered into
        the variable) or whole; the other variables as ``install`` loads them. ``rows_only``:
        replies to a row top-up, which carry rows only and leave the shard versions as
        they are."""
        plan = self.rows
        assert plan is not None
        if not rows_only:
            self.stats["pulls"] += 1
        changed = False
        for shard, weights in zip(self.shards.shards, replies, strict=True):
            if self.shards.note_incarnation(shard, weights.reply.incarnation, weights.version):
                plan.forget(shard.index)  # its versions started again
            if weights.reply.dropped_stale > 0:
                self.stats["dropped_stale"] += weights.reply.dropped_stale
                self._refresh = True
            names = self.shards.wire_names[shard.index]
            whole = not (weights.unchanged or rows_only)
            got = list(weights.tensors)
            expected = [n for n in names if whole or plan.is_table(n)]
            if got != [n for n in expected if n in got] or (
                whole
                and [n for n in expected if not plan.is_table(n)]
                != [n for n in got if not plan.is_table(n)]
            ):
                raise WorkerError(
                    f"weights from server {shard.endpoint} do not match this model's "
                    f"variables on shard {shard.index} (got {got[:3]}..., expected "
                    f"{names[:3]}...): the endpoints are not this model's shards in shard order"
                )
            if len(shard.arrays) != len(names):
                shard.arrays = [None] * len(names)
            for j, name in enumerate(names):
                t = weights.tensors.get(name)
                if t is None:
                    continue
                if plan.is_table(name):
                    n, nbytes = plan.install(
                        name, t, weights.version, self.step_fn.scatter_rows, current=rows_only
                    )
                    shard.arrays[j] = None
                    if isinstance(t, wire.Sparse):
                        self.stats["rows_pulled"] += int(t.indices.shape[0])
                        self.stats["row_bytes_pulled"] += nbytes
                    self.stats["bytes_pulled"] += nbytes
                else:
                    shard.arrays[j] = t
                    self.stats["bytes_pulled"] += wire.densify(t).nbytes
            if whole:
                if shard.version >= 0:
                    self._row_version_steps[shard.index] = max(1, weights.version - shard.version)
                    self._row_version_gap[shard.index] = max(
                        1, self._row_request_step - self._row_held_step
                    )
                shard.version = weights.version
                changed = True
                self._sync_stalled = False
        if changed:
            joined = self.shards.join()
            which = tuple(i for i, a in enumerate(joined) if a is not None)
            self.step_fn.set_some(which, [joined[i] for i in which])
        elif not rows_only:
            self.stats["pulls_unchanged"] += 1
        if not rows_only:
            self._row_held_step = self._row_request_step
            self.stats["pull_ms"] = 1e3 * (time.perf_counter() - started)

    def _ensure_rows(self, x: Any, now: int | None = None) -> None:
        """Before a step: pull at once the rows of its batch that are stale (the look-ahead
        pull did not bring them, or the version moved on since), then count the batch's
        rows as cache hits or misses. ``now``: the batch's index in the run (default: the
        batch the stream handed out last), which row caches keep until the next batch."""
        plan = self.rows
        assert plan is not None
        ids = plan.batch_ids(x)
        if now is None:
            now = max(self._stream.taken - 1, 0) if self._stream is not None else 0
        plan.begin_batch(ids, now)
        wanted = plan.wanted(ids, self.shards.versions)
        if plan.count(wanted):
            self.stats["row_sync_pulls"] += 1
            replies = []
            for shard, rows in zip(self.shards.shards, wanted, strict=True):
                if not any(r.size for r in rows.values()):
                    replies.append(Weights(shard.version, wire.PullReply(shard.incarnation)))
                    continue
                body = self.pull_request(shard, shard.version, rows_only=True)
                try:
                    replies.append(shard.client.pull(body, rows=rows))
                except (ServerUnavailable, Stopped) as exc:
                    raise WorkerError(str(exc)) from None
                except wire.ProtocolError as exc:
                    raise WorkerError(
                        f"server {shard.endpoint} sent a malformed reply: {exc}"
                    ) from None
            self._install_rows(replies, time.perf_counter(), rows_only=True)
        for table, table_ids in zip(plan.tables, ids, strict=True):
            if table.cache is not None and (table.cache.slots(table_ids) < 0).any():
                raise WorkerError(f"rows of {table.variable.path} missing from its row cache")
        hits, misses = plan.consume(ids)
        self.stats["row_hits"] += hits
        self.stats["row_misses"] += misses

    def _with_rows(self, batches: Iterable[tuple[Any, Any]]) -> Iterator[tuple[Any, Any]]:
        """``(features, labels)`` batches outside training (the held-out set), each with its
        rows pulled before it is handed on; a batch whose rows do not fit a row cache is
        halved until they do."""
        plan = self.rows
        assert plan is not None
        now = (self._stream.taken if self._stream is not None else 0) + self.config.n_fetch

        def pieces(x: Any, y: Any) -> Iterator[tuple[Any, Any]]:
            n = int(tf.nest.flatten(y)[0].shape[0])
            fits = all(
                t.cache is None or ids.size <= t.cache.capacity
                for t, ids in zip(plan.tables, plan.batch_ids(x), strict=True)
            )
            if fits or n < 2:
                yield x, y
                return
            for lo, hi in ((0, n // 2), (n // 2, n)):
                yield from pieces(*tf.nest.map_structure(lambda t, a=lo, b=hi: t[a:b], (x, y)))

        for batch in batches:
            for x, y in pieces(*batch):
                self._ensure_rows(x, now=now)  # after every batch of the run: none kept
                now += 1
                yield x, y

    def _lookahead_rows(self, sync: bool) -> list[dict[str, np.ndarray] | None]:
        """Per shard, the table rows to ask with the pull being requested: those of the
        batches its reply will serve (``sync``: installed at once, from the current batch
        on; else at the next pull step) that will be stale by then."""
        plan, stream = self.rows, self._stream
        if plan is None or stream is None:
            return [None] * len(self.shards.shards)
        n = self.config.n_fetch
        now = max(stream.taken - 1, 0)  # the batch computed next
        self._row_request_step = now
        # the next fetch step's batches: the fetch schedule may request a few steps after the
        # last install (before the first batch is taken, the fetch step is n)
        ahead = (now // n + 1) * n if stream.taken else n
        start = now if sync else ahead
        try:
            batches = stream.features(start, start + n)
        except DispatchError as exc:
            raise WorkerError(str(exc)) from None
        ids = plan.union(batches)
        plan.keep_for(ids, start + n - 1)
        return list(plan.wanted(ids, self.shards.versions, ahead=self._versions_ahead(now)))

    def _versions_ahead(self, now: int) -> list[int]:
        """Per shard, how many versions the reply to a pull requested before step ``now``
        will likely be ahead of the weights held (at least 1): the shard's pace between the
        last two whole replies (versions per step between their requests) times the steps
        since the held weights were requested. Pulls requested every N steps apart: the
        versions the shard moved between the last two replies."""
        since = max(1, now - self._row_held_step)
        return [
            max(1, -(-moved * since // gap))  # rounded up
            for moved, gap in zip(self._row_version_steps, self._row_version_gap, strict=True)
        ]
