"""The worker registry: what the server knows about each worker id, bounded.

A record is created by a successful hello, a valid push (one that passed every check) or a
split request, never by a refused message, and at most ``max_workers`` records exist. A new
id beyond the bound takes the place of the least recently heard record if that one is
``gone``; otherwise it is refused (the handlers count ``too_many_workers``). A record that
has been silent for ``forget_after_s`` is forgotten (0: only when its place is needed).

Each id gets an index when the server first hears of it (0, 1, 2, ... in that order, the
restored ids first): kept while its record or its seq is remembered, so a worker that
restarts under its id keeps its index. Under ``--data-dispatch server`` a worker learns its
index from shard 0's hello reply (``InputContext.worker_index``).

A record keeps what the worker's latest hello said it decodes in replies (``accepts``): the
server sends it nothing else. A record a push or a split request made keeps the baseline
(``wire.ACCEPTS_BASELINE``) until a hello says more.

Liveness is derived from the time since a worker was last heard: ``alive`` up to
``missing_after_s``, ``missing`` up to ``gone_after_s``, ``gone`` after that.

Replays: a record keeps the last accepted sequence number, and a push with a seq at or below
it is refused. A forgotten record leaves its id and last seq in a compact map (so do the
seqs restored from a checkpoint), so a replay is still refused after the record is gone and a
worker that comes back continues from its last seq. That map holds at most
``SEQ_MEMORY_FACTOR * max_workers`` ids, the oldest dropped first: an id dropped from it
(a worker silent for longer than ``forget_after_s`` while that many others came and went)
is a new worker to the server.

Not thread-safe: the server's loop thread is its only caller; the status thread reads the
published status document, never the registry.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from downpour import wire
from downpour.runtime.metrics import WORKER_STALENESS_BOUNDS, Histogram

log = logging.getLogger("downpour.server")

ALIVE = "alive"
MISSING = "missing"
GONE = "gone"

MAX_WORKERS = 4096  # --max-workers default
FORGET_AFTER_S = 3600.0  # --forget-after default
SEQ_MEMORY_FACTOR = 16  # ids whose last seq outlives their record, per --max-workers


@dataclass
class WorkerRecord:
    """What the server knows about one worker id."""

    first_seen: float
    last_seen: float
    last_seq: int = 0
    pushes: int = 0
    applied: int = 0  # gradients of this worker that reached the weights (sync: K per update)
    dropped: int = 0  # accepted but not applied by the policy (stale, late, duplicate)
    held: int = 0  # kept for a sync round (later applied, or discarded)
    dropped_unreported: int = 0  # stale drops not yet told to the worker in a pull reply
    rejected: int = 0
    pulls: int = 0
    steps: int = 0
    loss: float | None = None
    index: int = 0  # the order in which the server first heard of this id
    staleness: int | None = None
    reported: dict[str, Any] = field(default_factory=dict)
    notices: tuple[str, ...] = ()  # the slow paths the worker reports it runs on
    accepts: wire.Accepts = wire.ACCEPTS_BASELINE  # what its latest hello said it decodes
    staleness_hist: Histogram = field(default_factory=lambda: Histogram(WORKER_STALENESS_BOUNDS))

    def observe_staleness(self, staleness: int) -> None:
        """Note the staleness of an accepted gradient: the last value and the histogram."""
        self.staleness = staleness
        self.staleness_hist.observe(staleness)

    def status(self, state: str, now: float) -> dict[str, Any]:
        """This worker's entry in the status document's ``workers`` map."""
        return {
            "state": state,
            "last_seen_s": round(now - self.last_seen, 3),
            "pushes": self.pushes,
            "applied": self.applied,
            "dropped": self.dropped,
            "held": self.held,
            "rejected": self.rejected,
            "pulls": self.pulls,
            "last_seq": self.last_seq,
            "steps": self.steps,
            "loss": self.loss,
            "staleness": self.staleness,
            "staleness_histogram": self.staleness_hist.snapshot(),
            "reported": dict(self.reported),
            "notices": list(self.notices),
        }


class WorkerRegistry:
    """Worker records by id (at most ``max_workers``), with liveness thresholds and the last
    seqs of ids without a record (restored from a checkpoint, or forgotten)."""

    def __init__(
        self,
        missing_after_s: float,
        gone_after_s: float,
        restored_seqs: Mapping[str, int] | None = None,
        *,
        max_workers: int = MAX_WORKERS,
        forget_after_s: float = FORGET_AFTER_S,
    ) -> None:
        self.missing_after_s = missing_after_s
        self.gone_after_s = gone_after_s
        self.max_workers = max_workers
        self.forget_after_s = forget_after_s
        self.seq_memory = SEQ_MEMORY_FACTOR * max_workers
        self.forgotten = 0  # records forgotten (silent too long, or a gone one replaced)
        self.seqs_dropped = 0  # ids dropped from the seq memory
        self._seqs: OrderedDict[str, int] = OrderedDict()  # oldest first
        self._indices: OrderedDict[str, int] = OrderedDict()  # oldest first
        self._next_index = 0
        for wid, seq in (restored_seqs or {}).items():
            self._remember(wid, seq)
            self._index(wid)
        self._workers: OrderedDict[str, WorkerRecord] = OrderedDict()  # least recently heard first

    def _remember(self, worker_id: str, seq: int) -> None:
        self._seqs[worker_id] = seq
        self._seqs.move_to_end(worker_id)
        while len(self._seqs) > self.seq_memory:
            self._seqs.popitem(last=False)
            self.seqs_dropped += 1

    def _index(self, worker_id: str) -> int:
        """The id's index, a new one for an id not known (the oldest dropped past the bound
        of the seq memory plus the records)."""
        index = self._indices.get(worker_id)
        if index is None:
            index = self._indices[worker_id] = self._next_index
            self._next_index += 1
            while len(self._indices) > self.seq_memory + self.max_workers:
                self._indices.popitem(last=False)
        return index

    def admit(self, worker_id: str, now: float) -> WorkerRecord | None:
        """The record of ``worker_id``, created if new and there is room (a gone record makes
        room); marks it heard at ``now``. None when the registry is full of workers that are
        alive or missing: the caller refuses the message (``too_many_workers``)."""
        rec = self._workers.get(worker_id)
        if rec is not None:
            self.touch(worker_id, rec, now)
            return rec
        if len(self._workers) >= self.max_workers:
            oldest_id, oldest = next(iter(self._workers.items()))
            if self.liveness(oldest, now) != GONE:
                return None
            self._forget(oldest_id, "its place is needed")
        rec = self._workers[worker_id] = WorkerRecord(
            first_seen=now,
            last_seen=now,
            last_seq=self._seqs.pop(worker_id, 0),
            index=self._index(worker_id),
        )
        log.info("worker %s joined", worker_id, extra={"worker": worker_id})
        return rec

    def touch(self, worker_id: str, rec: WorkerRecord, now: float) -> None:
        """Mark an enrolled worker heard at ``now``."""
        rec.last_seen = now
        self._workers.move_to_end(worker_id)

    def _forget(self, worker_id: str, why: str) -> None:
        rec = self._workers.pop(worker_id)
        self._remember(worker_id, rec.last_seq)
        self.forgotten += 1
        log.info("worker %s forgotten: %s", worker_id, why, extra={"worker": worker_id})

    def forget_idle(self, now: float) -> list[str]:
        """Forget the records silent for more than ``forget_after_s`` (none when it is 0);
        their last seqs stay in the seq memory. Returns their ids. Cheap when there are none:
        the loop calls it every pass."""
        gone: list[str] = []
        if self.forget_after_s <= 0:
            return gone
        while self._workers:
            wid, rec = next(iter(self._workers.items()))
            if now - rec.last_seen <= self.forget_after_s:
                break
            self._forget(wid, f"silent for more than {self.forget_after_s:g} s")
            gone.append(wid)
        return gone

    def get(self, worker_id: str) -> WorkerRecord | None:
        """The record of an enrolled worker, or None (looking does not enrol)."""
        return self._workers.get(worker_id)

    def last_seq(self, worker_id: str) -> int:
        """The last accepted seq of ``worker_id``, enrolled or remembered (0 if unknown)."""
        rec = self._workers.get(worker_id)
        return rec.last_seq if rec is not None else self._seqs.get(worker_id, 0)

    def __contains__(self, worker_id: object) -> bool:
        return worker_id in self._workers

    def __iter__(self) -> Iterator[str]:
        return iter(self._workers)

    def __len__(self) -> int:
        return len(self._workers)

    def liveness(self, rec: WorkerRecord, now: float) -> str:
        """``alive`` / ``missing`` / ``gone`` from the time since the worker was last heard."""
        idle = now - rec.last_seen
        if idle <= self.missing_after_s:
            return ALIVE
        return MISSING if idle <= self.gone_after_s else GONE

    def note_rejected(self, worker_id: str | None) -> None:
        """Count a rejected message against an enrolled worker (unknown ids enrol nobody)."""
        if worker_id is not None and (rec := self._workers.get(worker_id)) is not None:
            rec.rejected += 1

    def credit_applied(self, worker_ids: Iterable[str]) -> None:
        """Count one applied gradient for each of these workers."""
        for wid in worker_ids:
            if (rec := self._workers.get(wid)) is not None:
                rec.applied += 1

    def last_seqs(self) -> dict[str, int]:
        """Every known id's last accepted seq (enrolled, restored or forgotten), for
        checkpoints: at most ``max_workers + seq_memory`` entries."""
        seqs = dict(self._seqs)
        seqs.update({wid: r.last_seq for wid, r in self._workers.items()})
        return seqs

    def summary(self) -> dict[str, int]:
        """The registry's bound and fill, for the status document."""
        return {
            "size": len(self._workers),
            "max_workers": self.max_workers,
            "forgotten": self.forgotten,
            "seqs_remembered": len(self._seqs),
            "seqs_dropped": self.seqs_dropped,
        }

    def status(self, now: float) -> dict[str, dict[str, Any]]:
        """The status document's ``workers`` map."""
        return {wid: r.status(self.liveness(r, now), now) for wid, r in self._workers.items()}
