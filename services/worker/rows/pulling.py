"""The worker's side of row pulls that talks to the servers: installing replies that carry
table rows, topping up a batch's stale rows before its step, and choosing the rows a
look-ahead pull asks for. ``downpour.worker.rows.plan`` holds the plan (tables, id extractor,
per-row versions); a ``RowPuller`` applies it to the shards, the step's variables and the
worker's figures. The puller (``downpour.worker.pull.puller``) owns one when the model has
row-sparse tables that the servers serve by row.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from downpour import wire
from downpour.net.client import Weights
from downpour.net.cluster import Shard, ShardSet
from downpour.worker.errors import WorkerError, translated
from downpour.worker.rows.plan import Lookahead, RowPlan


def versions_ahead(
    version_steps: Sequence[int], version_gap: Sequence[int], held_step: int, now: int
) -> list[int]:
    """Per shard, how many versions the reply to a pull requested before step ``now`` will
    likely be ahead of the weights held (at least 1): the shard's pace between the last two
    whole replies (``version_steps`` versions over ``version_gap`` steps between their
    requests) times the steps since the held weights were requested (``held_step``)."""
    since = max(1, now - held_step)
    return [
        max(1, -(-moved * since // gap))  # rounded up
        for moved, gap in zip(version_steps, version_gap, strict=True)
    ]


class RowPuller:
    """Row pulls for one worker: ``install`` whole or row-only replies, ``ensure`` a batch's
    rows before its step, ``lookahead`` the rows a pull should bring, ``with_rows`` for
    batches outside training."""

    def __init__(
        self,
        plan: RowPlan,
        shards: ShardSet,
        step_fn: Any,  # GradientStep: row pulls exist for tf2 graphs only
        stats: dict[str, float],
        stream: Lookahead,
        n_fetch: int,
        make_request: Callable[[Shard, int, bool], wire.PullRequest],
    ) -> None:
        self.plan = plan
        self.shards = shards
        self.step_fn = step_fn
        self.stats = stats
        self.stream = stream
        self.n_fetch = n_fetch
        self._make_request = make_request
        n = len(shards.shards)
        self._version_steps = [1] * n  # per shard, versions moved between its last two replies
        self._version_gap = [n_fetch] * n  # per shard, steps between those replies' requests
        self._request_step = 0  # the step before which the last pull was requested
        self._held_step = 0  # the same, for the pull whose weights are installed

    @property
    def tables(self) -> list[str]:
        """The paths of the tables pulled by row."""
        return [str(t.variable.path) for t in self.plan.tables]

    def install(self, replies: list[Weights], rows_only: bool = False) -> tuple[bool, bool]:
        """Load one reply per shard: a table's piece comes as rows (scattered into the
        variable) or whole; the other variables are loaded whole. ``rows_only``: replies to a
        row top-up, which carry rows only and leave the shard versions as they are. Returns
        (some shard's version moved, some shard dropped a stale gradient of ours)."""
        plan = self.plan
        changed = stale = False
        for shard, weights in zip(self.shards.shards, replies, strict=True):
            if shard.note_incarnation(weights.reply.incarnation, weights.version):
                plan.forget(shard.index)  # its versions started again
            if weights.reply.dropped_stale > 0:
                self.stats["dropped_stale"] += weights.reply.dropped_stale
                stale = True
            whole = not (weights.unchanged or rows_only)
            if not rows_only:
                self.shards.note_dense_version(shard, weights.reply)
            self._check(shard, weights, whole)
            self._load(shard, weights, rows_only)
            if whole:
                if shard.version >= 0:
                    self._version_steps[shard.index] = max(1, weights.version - shard.version)
                    self._version_gap[shard.index] = max(1, self._request_step - self._held_step)
                shard.version = weights.version
                changed = True
        if changed:
            joined = self.shards.join()
            which = tuple(i for i, a in enumerate(joined) if a is not None)
            self.step_fn.set_some(which, [joined[i] for i in which])
        if not rows_only:
            self._held_step = self._request_step
        return changed, stale

    def _check(self, shard: Shard, weights: Weights, whole: bool) -> None:
        """WorkerError unless the reply names this shard's variables (all of them when
        ``whole``, else a subset of its tables) in order."""
        plan = self.plan
        names = self.shards.wire_names[shard.index]
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

    def _load(self, shard: Shard, weights: Weights, rows_only: bool) -> None:
        """Tables' rows into the step's variables; other variables into the shard's slice."""
        names = self.shards.wire_names[shard.index]
        if len(shard.arrays) != len(names):
            shard.arrays = [None] * len(names)
        for j, name in enumerate(names):
            t = weights.tensors.get(name)
            if t is None:
                continue
            if self.plan.is_table(name):
                n, nbytes = self.plan.install(
                    name, t, weights.version, self.step_fn.scatter_rows, current=rows_only
                )
                shard.arrays[j] = None
                if wire.is_rows(t):
                    self.stats["rows_pulled"] += int(t.indices.shape[0])
                    self.stats["row_bytes_pulled"] += nbytes
                self.stats["bytes_pulled"] += nbytes
            else:
                shard.arrays[j] = t
                self.stats["bytes_pulled"] += wire.densify(t).nbytes

    def ensure(self, x: Any, now: int | None = None) -> None:
        """Before a step: pull at once the rows of its batch that are stale (the look-ahead
        pull did not bring them, or the version moved on since), then count the batch's
        rows as cache hits or misses. ``now``: the batch's index in the run (default: the
        batch the stream handed out last), which row caches keep until the next batch."""
        plan = self.plan
        ids = plan.batch_ids(x)
        if now is None:
            now = max(self.stream.taken - 1, 0)
        plan.begin_batch(ids, now)
        wanted = plan.wanted(ids, self.shards.versions)
        if plan.count(wanted):
            self.stats["row_sync_pulls"] += 1
            replies = []
            for shard, rows in zip(self.shards.shards, wanted, strict=True):
                if not any(r.size for r in rows.values()):
                    replies.append(Weights(shard.version, wire.PullReply(shard.incarnation)))
                    continue
                body = self._make_request(shard, shard.version, True)
                with translated(shard.endpoint):
                    replies.append(shard.client.pull(body, rows=rows))
            self.install(replies, rows_only=True)
        for table, table_ids in zip(plan.tables, ids, strict=True):
            if table.cache is not None and (table.cache.slots(table_ids) < 0).any():
                raise WorkerError(f"rows of {table.variable.path} missing from its row cache")
        hits, misses = plan.consume(ids)
        self.stats["row_hits"] += hits
        self.stats["row_misses"] += misses

    def with_rows(self, batches: Iterable[tuple[Any, Any]]) -> Iterator[tuple[Any, Any]]:
        """``(features, labels)`` batches outside training (the held-out set), each with its
        rows pulled before it is handed on; a batch whose rows do not fit a row cache is
        halved until they do."""
        plan = self.plan
        now = self.stream.taken + self.n_fetch

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
                self.ensure(x, now=now)  # after every batch of the run: none kept
                now += 1
                yield x, y

    def lookahead(self, sync: bool) -> list[dict[str, np.ndarray] | None]:
        """Per shard, the table rows to ask with the pull being requested: those of the
        batches its reply will serve (``sync``: installed at once, from the current batch
        on; else at the next pull step) that will be stale by then."""
        plan, stream, n = self.plan, self.stream, self.n_fetch
        now = max(stream.taken - 1, 0)  # the batch computed next
        self._request_step = now
        # the next fetch step's batches: the fetch schedule may request a few steps after the
        # last install (before the first batch is taken, the fetch step is n)
        ahead = (now // n + 1) * n if stream.taken else n
        start = now if sync else ahead
        with translated():
            batches = stream.features(start, start + n)
        ids = plan.union(batches)
        plan.keep_for(ids, start + n - 1)
        behind = versions_ahead(self._version_steps, self._version_gap, self._held_step, now)
        return list(plan.wanted(ids, self.shards.versions, ahead=behind))

    def first_rows(self) -> list[dict[str, np.ndarray] | None]:
        """The rows the first pull of every shard asks for."""
        return self.plan.first_rows(len(self.shards.shards))
