"""The worker registry: what the server knows about each worker id.

A worker is enrolled by its first hello or push and never removed: its record keeps the last
accepted sequence number (so a replay is refused even after a long silence), its counters and
what it last reported. Liveness is derived from the time since it was last heard:
``alive`` up to ``missing_after_s``, ``missing`` up to ``gone_after_s``, ``gone`` after that.

Not thread-safe: the server's loop thread is its only caller; the status thread reads the
published status document, never the registry.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("downpour.server")

ALIVE = "alive"
MISSING = "missing"
GONE = "gone"


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
    staleness: int | None = None
    reported: dict[str, Any] = field(default_factory=dict)

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
            "reported": dict(self.reported),
        }


class WorkerRegistry:
    """Worker records by id, with liveness thresholds and the sequence numbers restored from
    a checkpoint (a worker that comes back after a restart continues from its last seq)."""

    def __init__(
        self,
        missing_after_s: float,
        gone_after_s: float,
        restored_seqs: Mapping[str, int] | None = None,
    ) -> None:
        self.missing_after_s = missing_after_s
        self.gone_after_s = gone_after_s
        self.restored_seqs = dict(restored_seqs or {})
        self._workers: dict[str, WorkerRecord] = {}

    def enrol(self, worker_id: str, now: float) -> WorkerRecord:
        """The record of ``worker_id``, created on first contact; marks it heard at ``now``."""
        rec = self._workers.get(worker_id)
        if rec is None:
            rec = self._workers[worker_id] = WorkerRecord(
                first_seen=now, last_seen=now, last_seq=self.restored_seqs.get(worker_id, 0)
            )
            log.info("worker %s joined", worker_id, extra={"worker": worker_id})
        rec.last_seen = now
        return rec

    def get(self, worker_id: str) -> WorkerRecord | None:
        """The record of an enrolled worker, or None (looking does not enrol)."""
        return self._workers.get(worker_id)

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
        """Every known worker's last accepted seq (restored ones too), for checkpoints."""
        seqs = dict(self.restored_seqs)
        seqs.update({wid: r.last_seq for wid, r in self._workers.items()})
        return seqs

    def status(self, now: float) -> dict[str, dict[str, Any]]:
        """The status document's ``workers`` map."""
        return {wid: r.status(self.liveness(r, now), now) for wid, r in self._workers.items()}
