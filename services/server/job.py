"""A job that completes (``downpour server --job-workers N``): the server ends the job once N
distinct workers have finished, or fails it when the rest stay away.

A worker that has done its epochs or steps sends every shard a heartbeat with ``finished``:
the sequence number of its last push (``wire.HeartbeatRequest``). The tracker keeps one
entry per worker id, so a worker restarted under its id counts once, whether it finished
before its restart, after it, or both. The sequence of a job:

1. ``running``: fewer than N workers have finished.
2. N have finished: the job is done once each one's last push has reached the server (its
   last accepted seq is at least the one it announced); a push that never arrives (dropped,
   refused) is waited for at most ``grace_s`` (``--drain-timeout``), then the job ends
   without it, saying so at warning level.
3. ``done``: the service applies what the policy still holds, writes its final checkpoint,
   then keeps answering weight pulls and status (the chief scores the final model) until a
   reader acknowledges (a status request with ``ack="done"``) or ``--linger-after-done``
   seconds have passed, and exits 0.
4. ``failed``: at least one worker has finished, every other worker the registry knows is
   ``gone``, and for ``--job-timeout`` seconds no unfinished worker was heard from and none
   finished. The service writes its final checkpoint, lingers as for ``done``, and exits
   ``EXIT_FAILED`` (3): the platform marks the job failed. A job where no worker ever
   finishes is not ended by the server (the platform's own limits apply).

The finished workers and their last seqs go into every checkpoint (``finished``), so a
server restarted mid-job still counts the workers that finished before it stopped.

Not thread-safe: the server's loop thread is its only caller.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from downpour.server.registry import GONE, WorkerRegistry

log = logging.getLogger("downpour.server")

RUNNING = "running"
DONE = "done"
FAILED = "failed"
EXIT_FAILED = 3  # the server's exit code when the job failed
JOB_TIMEOUT_S = 600.0  # --job-timeout default
LINGER_AFTER_DONE_S = 60.0  # --linger-after-done default


@dataclass
class JobTracker:
    """The job's state on one server: which workers finished (their last seqs) and whether
    the job is running, done or failed."""

    workers: int
    timeout_s: float = JOB_TIMEOUT_S
    grace_s: float = 10.0
    finished: dict[str, int] = field(default_factory=dict)
    state: str = RUNNING
    reason: str | None = None
    version: int | None = None  # the final checkpoint's version
    reports: int = 0  # finished heartbeats accepted (repeats included)
    repeats: int = 0  # of reports: from a worker already counted
    unknown: int = 0  # finished heartbeats from ids the server has no trace of: ignored
    counted_at: float | None = None  # when the N-th worker finished
    last_finish: float | None = None
    ended_at: float | None = None

    def restore(self, finished: Mapping[str, int], now: float) -> None:
        """Count the workers a checkpoint says finished (restored at start)."""
        for worker, seq in finished.items():
            self.finished.setdefault(str(worker), int(seq))
        if self.finished:
            self.last_finish = now
        if len(self.finished) >= self.workers:
            self.counted_at = now

    def note_finished(
        self, worker: str, last_seq: int, registry: WorkerRegistry, now: float
    ) -> None:
        """A worker says it finished, its last push being ``last_seq``. Counted once per id
        (a repeat keeps the larger seq); ignored once the job has ended, and from an id the
        registry neither holds nor remembers (its hello never reached this server)."""
        if self.state != RUNNING:
            return
        if worker not in registry and registry.last_seq(worker) == 0:
            self.unknown += 1
            log.warning(
                "worker %s says it finished at seq %d, but this server never heard from it: "
                "not counted",
                worker,
                last_seq,
                extra={"worker": worker},
            )
            return
        self.reports += 1
        if worker in self.finished:
            self.repeats += 1
            self.finished[worker] = max(self.finished[worker], last_seq)
            return
        self.finished[worker] = last_seq
        self.last_finish = now
        log.info(
            "worker %s finished (last push seq %d): %d of %d",
            worker,
            last_seq,
            len(self.finished),
            self.workers,
            extra={"worker": worker},
        )
        if len(self.finished) >= self.workers:
            self.counted_at = now

    def verdict(self, registry: WorkerRegistry, now: float) -> tuple[str, str] | None:
        """(DONE or FAILED, why) when the job has just reached its end; None while it runs
        (and once it has ended)."""
        if self.state != RUNNING:
            return None
        if self.counted_at is not None:
            behind = sorted(w for w, seq in self.finished.items() if registry.last_seq(w) < seq)
            why = f"{len(self.finished)} of {self.workers} workers finished"
            if not behind:
                return DONE, why
            if now - self.counted_at < self.grace_s:
                return None
            log.warning(
                "the last pushes of %s did not arrive within %g s: ending the job without them",
                ", ".join(behind),
                self.grace_s,
            )
            return DONE, f"{why}; the last pushes of {', '.join(behind)} never arrived"
        return self._failure(registry, now)

    def _failure(self, registry: WorkerRegistry, now: float) -> tuple[str, str] | None:
        """(FAILED, why) when some worker finished and the rest have been away for the
        timeout; None otherwise."""
        if not self.finished or self.timeout_s <= 0 or self.last_finish is None:
            return None
        quiet_since = self.last_finish
        for worker in registry:
            if worker in self.finished:
                continue
            rec = registry.get(worker)
            assert rec is not None
            if registry.liveness(rec, now) != GONE:
                return None
            quiet_since = max(quiet_since, rec.last_seen)
        if now - quiet_since < self.timeout_s:
            return None
        return FAILED, (
            f"{len(self.finished)} of {self.workers} workers finished and no other worker "
            f"was heard from for {self.timeout_s:g} s (--job-timeout)"
        )

    def end(self, state: str, reason: str, version: int, now: float) -> None:
        """Record the job's end: ``state`` DONE or FAILED at the final checkpoint's ``version``."""
        self.state, self.reason, self.version, self.ended_at = state, reason, version, now
        level = logging.INFO if state == DONE else logging.ERROR
        log.log(level, "job %s at version %d: %s", state, version, reason)

    @property
    def ended(self) -> bool:
        """True once the job is done or failed."""
        return self.state != RUNNING

    def released(self, now: float, acked: bool, linger_s: float) -> bool:
        """True once an ended job may let the server exit: a reader ``acked`` the end, or
        ``linger_s`` seconds have passed since it."""
        if self.ended_at is None or not (acked or now - self.ended_at >= linger_s):
            return False
        why = "acknowledged" if acked else f"no acknowledgement in {linger_s:g} s"
        log.info("job %s: %s; exiting with %d", self.state, why, self.exit_code())
        return True

    def exit_code(self) -> int:
        """The server's exit code: EXIT_FAILED for a failed job, else 0."""
        return EXIT_FAILED if self.state == FAILED else 0

    def status(self, now: float) -> dict[str, Any]:
        """The status document's ``job`` section."""
        return {
            "state": self.state,
            "workers": self.workers,
            "finished": sorted(self.finished),
            "version": self.version,
            "reason": self.reason,
            "ended_s": None if self.ended_at is None else round(now - self.ended_at, 3),
            "reports": self.reports,
            "repeats": self.repeats,
            "unknown": self.unknown,
            "timeout_s": self.timeout_s,
        }
