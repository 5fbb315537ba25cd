"""Everything a worker does to have the right weights before each step.

DistBelief's ``n_fetch``: weights are pulled every ``n_fetch`` steps, and a pull of an
unchanged version moves no tensors. A pull is prefetched (requested while steps compute) and
timed by ``downpour.worker.pull.schedule`` to arrive just before the step that installs it, so its
weights are no older than they must be. With several shards one ``Fetcher`` per shard pulls
concurrently, and a step installs every shard's reply at once, never a mix of two pulls.

When a pull reply says the server's policy dropped some of this worker's gradients as too
stale (``dropped_stale``), the puller waits for fresh weights before the next step instead of
using the prefetched ones, which are a step old. When the servers aggregate synchronously
(``sync:K/N``), a second gradient from the same weights would only be dropped as a duplicate,
so before the first step after a push the puller waits (polling pulls, at most
``sync_wait_s``) until every shard's version has moved on, as SyncReplicasOptimizer's workers
wait for the new global step; after a wait times out (fewer than K workers left) it stops
waiting until it sees the version move again; ``--sync-wait 0`` turns the wait off. Under a
hybrid policy whose dense half is ``sync:K/N`` it waits the same way for the dense updates
each pull reply reports (``dense_version``), since row applies move the versions all the
time. Under ``ssp:K`` the server may hold a pull while this worker is more than K pushes
ahead of the slowest; the puller then pulls right before it computes (no prefetch), since a
prefetched pull would pass the server's check a push early.

Tables served by row go through a ``RowPuller`` (``downpour.worker.rows.pulling``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from downpour import wire
from downpour.net.client import Weights
from downpour.net.cluster import Shard, ShardSet
from downpour.net.transport import Deadline, Stopped, backoff_delays
from downpour.worker.errors import WorkerError, translated
from downpour.worker.pull.fetcher import Fetcher, FetchTimes
from downpour.worker.pull.schedule import FetchSchedule
from downpour.worker.rows.pulling import RowPuller
from downpour.worker.settings import WorkerConfig

log = logging.getLogger("downpour.worker")


class Puller:
    """Weights for one worker's steps: ``start`` pulls the first, ``before_step`` keeps them
    as fresh as the settings ask. ``pushed()`` is the number of pushes sent so far (an ssp
    server counts those it has not taken yet)."""

    def __init__(
        self,
        config: WorkerConfig,
        shards: ShardSet,
        step_fn: Any,
        stats: dict[str, float],
        stop: threading.Event,
        pushed: Callable[[], int],
    ) -> None:
        self.config = config
        self.shards = shards
        self.step_fn = step_fn
        self.stats = stats
        self._stop = stop
        self._pushed = pushed
        self.schedule = FetchSchedule(config.n_fetch)  # when the next prefetch is requested
        self.fetchers: list[Fetcher] = []
        self.rows: RowPuller | None = None  # tables pulled by row, once ``start`` knows them
        self._in_flight = False  # every fetcher has a pull under way whose reply is not taken
        self._refresh = False  # a shard dropped a stale gradient: pull fresh weights next step
        self._sync_stalled = False  # a sync wait timed out and no version moved since
        self._step_started: float | None = None  # when the last step passed before_step

    @property
    def prefetching(self) -> bool:
        """Whether the next pull is requested ahead, as the current step computes (not under
        ssp, whose server checks the pull when it arrives)."""
        return self.config.prefetch and not self.shards.ssp

    def start(self, rows: RowPuller | None) -> None:
        """Start a fetcher per shard and install the first pull of every shard (with
        ``rows``: the tables pulled by row, and their first rows)."""
        cfg = self.config
        times = FetchTimes(
            heartbeat_s=cfg.heartbeat_s,
            give_up_s=cfg.server_timeout_s + 2 * cfg.request_timeout_s + 5.0,
            close_s=cfg.request_timeout_s + 1.0,
        )
        self.rows = rows
        self.fetchers = [
            Fetcher(self.shards, s, self.request, self._prepare, self.stats, self._stop, times)
            for s in self.shards.shards
        ]
        first = rows.first_rows() if rows is not None else [None] * len(self.fetchers)
        for fetcher, r in zip(self.fetchers, first, strict=True):
            fetcher.request(-1, r)  # the first pull from every shard at once
        self.install(self._fetch_all(), time.perf_counter())
        self._schedule_request(0)  # no step time known yet: at once

    def before_step(
        self,
        step: int,
        x: Any,
        fresh: bool,
        pushed_from: list[int] | None,
        pushed_dense_from: list[int | None] | None = None,
    ) -> bool:
        """Before computing ``step`` on features ``x``: install a pull when it is a fetch
        step, wait for a new version after a sync push (``fresh``: the step begins an
        accumulation; ``pushed_from``: the last push's base versions; ``pushed_dense_from``:
        its dense versions, under a hybrid), request the next prefetch when due, and top up
        the batch's rows. False when the worker was stopped meanwhile."""
        now = time.perf_counter()
        if self._step_started is not None:  # input, compute and push: what a prefetch overlaps
            self.schedule.note_step(now - self._step_started)
        if step and step % self.config.n_fetch == 0:
            self.pull()  # under ssp it may wait here for the slowest worker
            if self._stop.is_set():
                return False
        if fresh and self.shards.sync and self.config.sync_wait_s > 0 and pushed_from is not None:
            self.await_new_version(pushed_from, pushed_dense_from)
            if self._stop.is_set():
                return False
        self._schedule_request(step)
        self._step_started = time.perf_counter()
        if self.rows is not None:  # last: after every install this step may see
            self.rows.ensure(x)
        return True

    def request(self, shard: Shard, have: int, rows_only: bool = False) -> wire.PullRequest:
        """A pull request; ``have`` < 0 means this worker holds no weights of the shard yet.
        ``rows_only``: a row top-up, the requested rows and nothing else."""
        encoding = wire.BF16 if self.config.pull_compress == "bf16" else wire.DENSE
        pushed = self._pushed() if self.shards.ssp else None
        # no bound on a top-up, nor after a stale drop: the current weights, however little
        # they moved (a bound of 0 would keep weights whose version the policy found stale
        # when only rows moved); the next bounded pull is served again, to keep a sample
        bound = None if rows_only or self._refresh else self.bound
        if have < 0:  # a bound here has the server keep a sample of what it serves
            return wire.PullRequest(
                encoding=encoding, pushed=pushed, rows_only=rows_only, bound=bound
            )
        return wire.PullRequest(have, shard.incarnation, encoding, pushed, rows_only, bound)

    @property
    def bound(self) -> float | None:
        """The ``--pull-bound`` pulls carry (None: off, or a policy it does not fit: a sync
        round's wait and an ssp hold count every version the server makes, and lookahead
        serves extrapolated weights no version holds)."""
        b = self.config.pull_bound
        if not b:
            return None
        shards = self.shards
        if shards.sync or shards.ssp or shards.extrapolates:
            why = "serves extrapolated weights" if shards.extrapolates else "counts versions"
            shards.notices.warn(
                log,
                "--pull-bound %g is off: %s %s; every new version is taken",
                b,
                shards.policy,
                why,
            )
            return None
        return b

    def _prepare(self, shard: Shard, weights: Weights) -> Weights:
        """On the fetcher thread: a single shard's new weights converted for the step function
        (``GradientStep.prepare``), off the training thread. Several shards' slices are joined
        first, which needs every reply, so ``install`` converts those."""
        if (
            len(self.shards.shards) == 1
            and self.rows is None
            and not weights.unchanged
            and list(weights.tensors) == self.shards.wire_names[shard.index]
        ):
            prepared = self.step_fn.prepare(list(weights.tensors.values()))
            return weights.with_tensors(dict(zip(weights.tensors, prepared, strict=True)))
        return weights

    def pull(self) -> None:
        """Fetch weights from every shard that has a newer version than ours: waiting for the
        replies (no prefetch), or taking what the fetchers brought."""
        t0 = time.perf_counter()
        prefetched = self._in_flight
        if not prefetched:
            self._request_all(sync=True)
        self.install(self._fetch_all(), t0)
        if prefetched and self._refresh:
            # The server dropped gradients of ours as too stale, and what the fetchers brought
            # was requested a step ago: wait for the current weights before the next step.
            self.stats["stale_refreshes"] += 1
            self._request_all(sync=True)
            self.install(self._fetch_all(), t0)
        self._refresh = False

    def install(self, replies: list[Weights], started: float) -> None:
        """Load the weights of one pull reply per shard into the model, unless all are
        unchanged; a step then never sees weights of two pulls. Then greet again every shard
        that restarted since its hello."""
        self.stats["pulls"] += 1
        if any(w.reply.moved is not None for w in replies):  # --pull-bound: kept the held
            self.stats["pulls_within_bound"] += 1
        if self.rows is not None:
            changed, stale = self.rows.install(replies)
        else:
            changed, stale = self._install_whole(replies)
        self._refresh = self._refresh or stale
        if changed:
            self._sync_stalled = False
        else:
            self.stats["pulls_unchanged"] += 1
        self.stats["pull_ms"] = 1e3 * (time.perf_counter() - started)
        try:
            with translated(stopped=False):
                self.shards.rehello_restarted()  # it may take gradients on another port now
        except Stopped:
            return  # stopping: no step follows

    def _install_whole(self, replies: list[Weights]) -> tuple[bool, bool]:
        """``install`` without row pulls: every changed shard's slice, then the joined model."""
        changed = stale = False
        for shard, weights in zip(self.shards.shards, replies, strict=True):
            shard.note_incarnation(weights.reply.incarnation, weights.version)
            if weights.reply.dropped_stale > 0:
                self.stats["dropped_stale"] += weights.reply.dropped_stale
                stale = True
            self.shards.note_dense_version(shard, weights.reply)
            if weights.unchanged:
                continue
            try:
                self.shards.check_slice(shard, weights)
            except ValueError as exc:
                raise WorkerError(str(exc)) from None
            shard.arrays = list(weights.tensors.values())
            shard.version = weights.version
            self.stats["bytes_pulled"] += sum(wire.densify(a).nbytes for a in shard.arrays)
            changed = True
        if changed:
            self.step_fn.set_weights(self.shards.join())
        return changed, stale

    def await_new_version(
        self, pushed_from: list[int], pushed_dense_from: list[int | None] | None = None
    ) -> None:
        """With a sync:K/N server: pull until every shard has moved past the versions the last
        push was computed from, at most ``sync_wait_s``; a timeout means fewer than K workers
        are pushing, so stop waiting until a version moves again. A shard that restarted
        since the push ends the wait at once: the round it held died with it, and its version
        would only move once the waiting workers push again.

        Under a hybrid whose dense half is ``sync:K/N`` the versions move with every row
        apply, so the wait is for the dense versions (``pushed_dense_from``: those the last
        push was computed from) instead: every shard that reports one must have made a dense
        update since. A shard that reports none (it holds no dense variable, or does not
        send it) is not waited for."""

        def moved() -> bool:
            if self.shards.hybrid:
                now = self.shards.dense_versions
                then = pushed_dense_from or [None] * len(now)
                return all(v is None or p is None or v > p for v, p in zip(now, then, strict=True))
            return all(v > p for v, p in zip(self.shards.versions, pushed_from, strict=True))

        if self._sync_stalled or moved():
            return
        t0 = time.perf_counter()
        deadline = Deadline(self.config.sync_wait_s)
        delay = backoff_delays(0.002, 0.05)
        while not self._stop.is_set():
            if not self._in_flight:  # with prefetch a request per shard is outstanding
                self._request_all(sync=True)
            self.install(self._fetch_all(), t0)
            if moved():
                break
            if self.shards.restarted_since_push():
                log.info("server restarted during a sync round: computing from its weights")
                break
            if deadline.expired():
                self.stats["sync_wait_timeouts"] += 1
                self._sync_stalled = True
                log.warning(
                    "no new version within %.1f s of waiting (fewer than K workers pushing?): "
                    "not waiting again until the version moves",
                    self.config.sync_wait_s,
                )
                break
            self._stop.wait(min(delay(), deadline.remaining()))
        self.stats["sync_wait_ms"] = 1e3 * (time.perf_counter() - t0)

    def with_rows(self, batches: Iterable[tuple[Any, Any]]) -> Iterator[tuple[Any, Any]]:
        """Batches outside training with their table rows pulled first (see RowPuller)."""
        assert self.rows is not None
        return self.rows.with_rows(batches)

    def _request_all(self, sync: bool = False) -> None:
        """Start every shard's fetcher on a pull of weights newer than those held (with row
        pulls: and the rows of the batches it serves; ``sync``: it is installed at once)."""
        n = len(self.fetchers)
        rows = self.rows.lookahead(sync) if self.rows is not None else [None] * n
        for shard, fetcher, r in zip(self.shards.shards, self.fetchers, rows, strict=True):
            fetcher.request(shard.version, r)
        self._in_flight = True

    def _fetch_all(self) -> list[Weights]:
        """Every shard's reply to the pull its fetcher is running (they run concurrently);
        the slowest shard's round trip is the pull's, for the fetch schedule."""
        self._in_flight = False
        replies = [fetcher.take() for fetcher in self.fetchers]
        trips = [f.round_trip_s for f in self.fetchers]
        if all(t is not None for t in trips):
            self.schedule.note_round_trip(max(trips))
        return replies

    def _schedule_request(self, step: int) -> None:
        """Prefetching, before computing ``step``: request the pull for the next fetch step
        if the fetch schedule says its reply would otherwise come late
        (``FetchSchedule.due``); with one step left, or no estimates yet, at once."""
        if not self.prefetching or self._in_flight or self._stop.is_set():
            return
        if self.schedule.due(step):
            self.schedule.requested(step)
            self._request_all()

    def close(self) -> bool:
        """Stop every fetcher; False if one is stuck."""
        clean = True
        for fetcher in self.fetchers:
            clean = fetcher.close() and clean
        return clean
