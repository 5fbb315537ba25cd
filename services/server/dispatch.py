"""The split dispatcher behind ``--data-dispatch server``: exactly-once epochs over workers
that come and go (the tf.data service's ``distributed_epoch``, done by the parameter server).

The data is divided into *splits*: one per file, or one per ``split_size`` elements. The
*universe* (the file list, or the element count and split size) comes from the first worker
that asks for data: it sends what its ``input_fn`` shards over, with the universe's digest.
Every later request carries the digest, and one that differs is refused
(``DataMismatch``): two workers reading different data would make "each split once"
meaningless, so the server refuses rather than guess which one is right.

An epoch hands out each split of a per-epoch shuffled order (seeded by the server's seed
and the epoch number, the same after a restart). A split handed to a worker is *leased* to
it until the worker acknowledges it; an epoch ends when every split is acknowledged, and
the next one starts at once (until ``max_epochs``, when set, have ended). A worker whose
leases are released (it is gone by liveness, or a restarted process of it asks again) has
its in-flight splits put back at the front of the queue for another worker; its later ack
of such a split is ignored and counted as stale, so each split is acknowledged exactly
once. Each push of a split's gradients names how many of the split's batches it and the
earlier pushes carried (``advance``); a split taken back resumes after those batches for
the worker it goes to next (``Split.skip``), so a batch whose gradients reached the server is
not trained again. While the queue is empty but splits are still in flight a worker is told to wait:
the epoch is not over until those are acknowledged or released.

An ack must not overtake the split's gradients: acks come over REQ/REP, gradients over
PUSH/PULL, so the ack of a split can reach the server before the push that carried the
split's last gradients. An ack names that push's sequence number; while the worker's
accepted seq is below it the ack is *held* (``hold``): the lease stays in flight, no longer
counts against the worker's in-flight limit, and completes when the push arrives
(``pushed``). A held ack is released with the worker's other leases (gone, restarted,
expired), and checkpoints carry it as in flight, never as done.

Pure Python: no sockets, no TensorFlow. The server's loop thread is its only caller.
``state()`` / ``from_state()`` carry it through checkpoints; restored, the splits that were
in flight are back in the queue (their gradients after the checkpoint are lost with it).
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Literal

from downpour.inputs.context import Split
from downpour.wire import DataUniverse, ProtocolError

GRANT_SPLIT: Literal["split"] = "split"
GRANT_WAIT: Literal["wait"] = "wait"
GRANT_END: Literal["end"] = "end"
STATE_FORMAT = 1

COUNTER_NAMES = (
    "handed_out",  # leases granted
    "acked",  # splits acknowledged (each once)
    "acks_stale",  # acks of splits the sender no longer holds (released, other epoch)
    "acks_held",  # acks that arrived before their split's last push (completed on its arrival)
    "released",  # leases taken back (liveness gone, restarted worker, expiry)
    "resent",  # a request at the in-flight limit: the newest lease sent again
    "resumed",  # splits handed out again after a worker's death, from where its pushes ended
    "refused_universe",  # requests with another universe's digest
)


class DataMismatch(ValueError):
    """A worker's data universe differs from the one the dispatcher serves."""


@dataclass(frozen=True)
class LeasePolicy:
    """How splits are lent. ``max_in_flight``: splits one worker may hold unacknowledged; a
    request beyond it is taken as the retry of a lost reply and answered with the newest
    lease again. ``lease_s``: when set, a lease not acknowledged within that many seconds
    goes back to the queue (None: leases last until released)."""

    max_in_flight: int = 1
    lease_s: float | None = None

    def __post_init__(self) -> None:
        if self.max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {self.max_in_flight}")
        if self.lease_s is not None and self.lease_s <= 0:
            raise ValueError(f"lease_s must be > 0 or None, got {self.lease_s}")


@dataclass(frozen=True)
class Grant:
    """The answer to ``next_split``: a split of ``epoch``, or wait (the epoch's last splits
    are in flight elsewhere), or end (``max_epochs`` have ended)."""

    kind: Literal["split", "wait", "end"]
    epoch: int
    split: Split | None = None


@dataclass
class _Lease:
    worker: str
    since: float
    awaiting: int | None = None  # acknowledged, once the worker's push of this seq arrives


@dataclass
class Dispatcher:
    """Hands out the splits of each epoch exactly once; see the module docstring."""

    seed: int = 0
    lease: LeasePolicy = field(default_factory=LeasePolicy)
    universe: DataUniverse | None = None
    max_epochs: int = 0  # 0: unbounded
    epoch: int = 0
    epochs_done: int = 0
    counters: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTER_NAMES, 0))
    _queue: deque[int] = field(default_factory=deque, init=False, repr=False)
    _leases: dict[int, _Lease] = field(default_factory=dict, init=False, repr=False)
    _held: dict[str, list[int]] = field(default_factory=dict, init=False, repr=False)
    _acked: set[int] = field(default_factory=set, init=False, repr=False)
    # batches of each unfinished split of the epoch whose gradients reached the server
    _progress: dict[int, int] = field(default_factory=dict, init=False, repr=False)
    _processes: dict[str, str] = field(default_factory=dict, init=False, repr=False)

    # ------------------------------------------------------------ the universe

    @property
    def configured(self) -> bool:
        """True once a universe has been registered (or restored)."""
        return self.universe is not None

    @property
    def digest(self) -> str | None:
        """The served universe's digest (None before the first registration)."""
        return None if self.universe is None else self.universe.digest()

    @property
    def num_splits(self) -> int:
        """Splits per epoch (0 before the first registration)."""
        return 0 if self.universe is None else self.universe.num_splits

    @property
    def finished(self) -> bool:
        """True when ``max_epochs`` epochs have ended."""
        return bool(self.max_epochs) and self.epochs_done >= self.max_epochs

    def register(self, universe: DataUniverse, max_epochs: int = 0) -> None:
        """Adopt ``universe`` (and its epoch bound) on the first call; later calls must bring
        the same universe (DataMismatch otherwise) and their epoch bound is ignored."""
        if self.universe is None:
            if max_epochs < 0:
                raise ValueError(f"max_epochs must be >= 0, got {max_epochs}")
            self.universe = universe
            self.max_epochs = max_epochs
            self._start_epoch(self.epoch)
            return
        self.check_digest(universe.digest())

    def check_digest(self, digest: str) -> None:
        """DataMismatch (counted) unless ``digest`` is the served universe's."""
        if self.universe is None:
            raise DataMismatch("no data universe registered yet: send it with the first request")
        if digest != self.digest:
            self.counters["refused_universe"] += 1
            raise DataMismatch(
                f"this worker's data (digest {digest[:12]}) differs from the data the "
                f"dispatcher serves ({self.universe.describe()}, digest {self.digest[:12]}): "
                f"every worker's input_fn must shard over the same files or elements"
            )

    def _start_epoch(self, epoch: int) -> None:
        order = list(range(self.num_splits))
        random.Random(f"{self.seed}:{epoch}").shuffle(order)
        self.epoch = epoch
        self._queue = deque(order)
        self._acked = set()
        self._progress = {}

    def _split(self, index: int) -> Split:
        assert self.universe is not None
        u = self.universe
        if u.files is not None:
            return Split(index, file=u.files[index], skip=self._progress.get(index, 0))
        assert u.split_size is not None and u.elements is not None
        start = index * u.split_size
        stop = min(u.elements, start + u.split_size)
        return Split(index, start=start, stop=stop, skip=self._progress.get(index, 0))

    # ------------------------------------------------------------ leases

    def next_split(self, worker_id: str, now: float) -> Grant:
        """A split for ``worker_id`` (leased to it at ``now``), or wait, or end."""
        if self.universe is None:
            raise RuntimeError("next_split before a universe was registered")
        self.expire(now)
        if self.finished:
            return Grant(GRANT_END, self.epoch)
        reading = [i for i in self._held.get(worker_id, []) if self._leases[i].awaiting is None]
        if len(reading) >= self.lease.max_in_flight:
            self.counters["resent"] += 1
            return Grant(GRANT_SPLIT, self.epoch, self._split(reading[-1]))
        if not self._queue:
            return Grant(GRANT_WAIT, self.epoch)
        index = self._queue.popleft()
        self._leases[index] = _Lease(worker_id, now)
        self._held.setdefault(worker_id, []).append(index)
        self.counters["handed_out"] += 1
        if self._progress.get(index):
            self.counters["resumed"] += 1
        return Grant(GRANT_SPLIT, self.epoch, self._split(index))

    def valid_index(self, index: int) -> bool:
        """True if ``index`` names a split of the universe."""
        return 0 <= index < self.num_splits

    def ack(self, worker_id: str, epoch: int, index: int) -> bool:
        """``worker_id`` has finished split ``index`` of ``epoch``. True if that completes
        its lease; False (counted as stale) when the split is not leased to it in the
        current epoch: released meanwhile, or an ack repeated after a lost reply. The
        epoch's last ack starts the next epoch."""
        if not self._leased_to(worker_id, epoch, index):
            self.counters["acks_stale"] += 1
            return False
        self._complete(worker_id, index)
        return True

    def hold(self, worker_id: str, epoch: int, index: int, seq: int) -> bool:
        """``worker_id`` has finished split ``index`` of ``epoch``, its last gradients going
        in push ``seq``, which has not arrived yet: hold the ack until ``pushed`` reports it.
        True if held; False (counted as stale) when the split is not leased to it."""
        if not self._leased_to(worker_id, epoch, index):
            self.counters["acks_stale"] += 1
            return False
        lease = self._leases[index]
        if lease.awaiting is None:
            self.counters["acks_held"] += 1
        lease.awaiting = max(lease.awaiting or 0, seq)
        return True

    def pushed(self, worker_id: str, seq: int) -> list[int]:
        """The push ``seq`` of ``worker_id`` has reached the server: complete its held acks
        awaiting that seq or an earlier one; return their indices."""
        done = [
            i
            for i in self._held.get(worker_id, [])
            if (a := self._leases[i].awaiting) is not None and a <= seq
        ]
        for index in done:
            self._complete(worker_id, index)
        return done

    def advance(self, worker_id: str, epoch: int, index: int, batches: int) -> bool:
        """A push of ``worker_id`` carried gradients of split ``index`` of ``epoch`` up to its
        first ``batches`` batches. True when recorded; False when the split is not leased to
        it in this epoch (a late push of a released lease: the split's next reader already
        starts from what was recorded before)."""
        if not self._leased_to(worker_id, epoch, index):
            return False
        self._progress[index] = max(self._progress.get(index, 0), batches)
        return True

    def _leased_to(self, worker_id: str, epoch: int, index: int) -> bool:
        lease = self._leases.get(index)
        return epoch == self.epoch and lease is not None and lease.worker == worker_id

    def _complete(self, worker_id: str, index: int) -> None:
        """Split ``index``'s lease by ``worker_id`` is done; the epoch's last starts the next."""
        del self._leases[index]
        self._held[worker_id].remove(index)
        if not self._held[worker_id]:
            del self._held[worker_id]
        self._progress.pop(index, None)
        self._acked.add(index)
        self.counters["acked"] += 1
        if len(self._acked) == self.num_splits:
            self.epochs_done += 1
            if not self.finished:
                self._start_epoch(self.epoch + 1)

    def release(self, worker_id: str) -> list[int]:
        """Take back every split leased to ``worker_id`` (front of the queue, in the order
        they were leased); return their indices."""
        indices = self._held.pop(worker_id, [])
        for index in reversed(indices):
            del self._leases[index]
            self._queue.appendleft(index)
        self.counters["released"] += len(indices)
        return indices

    def note_process(self, worker_id: str, process: str) -> list[int]:
        """``worker_id`` speaks from ``process`` (a token per worker process): when that
        differs from the one it spoke from before, the worker restarted and its old
        leases are released (returned). The first token of a worker releases nothing."""
        before = self._processes.get(worker_id)
        self._processes[worker_id] = process
        if before is not None and before != process:
            return self.release(worker_id)
        return []

    def expire(self, now: float) -> list[int]:
        """Release the leases older than ``lease.lease_s`` (none when it is None)."""
        if self.lease.lease_s is None:
            return []
        old = [i for i, lease in self._leases.items() if now - lease.since > self.lease.lease_s]
        for index in old:
            worker = self._leases.pop(index).worker
            self._held[worker].remove(index)
            if not self._held[worker]:
                del self._held[worker]
            self._queue.appendleft(index)
        self.counters["released"] += len(old)
        return old

    def holders(self) -> list[str]:
        """Workers holding at least one lease."""
        return list(self._held)

    def held_by(self, worker_id: str) -> list[int]:
        """The split indices leased to ``worker_id``."""
        return list(self._held.get(worker_id, []))

    # ------------------------------------------------------------ reporting, checkpoints

    def progress(self) -> dict[str, Any]:
        """The status document's ``dispatch`` section: epoch and splits done / in flight /
        left in it, the universe, the lease holders and the counters."""
        return {
            "configured": self.configured,
            "universe": None if self.universe is None else self.universe.describe(),
            "digest": self.digest,
            "epoch": self.epoch,
            "epochs_done": self.epochs_done,
            "max_epochs": self.max_epochs,
            "finished": self.finished,
            "splits_total": self.num_splits,
            "splits_done": len(self._acked),
            "splits_in_flight": len(self._leases),
            "splits_awaiting_push": sum(1 for x in self._leases.values() if x.awaiting is not None),
            "splits_left": len(self._queue),
            "in_flight": {w: list(ix) for w, ix in self._held.items()},
            **self.counters,
        }

    def state(self) -> dict[str, Any]:
        """Everything needed to resume, as plain JSON types (checkpoint metadata)."""
        return {
            "format": STATE_FORMAT,
            "seed": self.seed,
            "universe": None if self.universe is None else self.universe.to_body(),
            "max_epochs": self.max_epochs,
            "epoch": self.epoch,
            "epochs_done": self.epochs_done,
            "queue": list(self._queue),
            "in_flight": sorted(self._leases),
            "acked": sorted(self._acked),
            "progress": {str(i): n for i, n in sorted(self._progress.items())},
            "counters": dict(self.counters),
        }

    @classmethod
    def from_state(cls, doc: dict[str, Any], lease: LeasePolicy | None = None) -> Dispatcher:
        """A dispatcher resuming ``state()``: same universe and epoch, the acknowledged
        splits stay done, the splits in flight go back to the front of the queue (their
        workers' later acks are stale), each resuming after the batches its pushes had
        brought. ValueError when the document is inconsistent."""
        if doc.get("format") != STATE_FORMAT:
            raise ValueError(f"dispatcher state format {doc.get('format')} is not {STATE_FORMAT}")
        d = cls(seed=int(doc["seed"]), lease=lease or LeasePolicy())
        if doc.get("universe") is None:
            return d
        try:
            d.universe = DataUniverse.from_body(doc["universe"])
        except ProtocolError as exc:
            raise ValueError(f"dispatcher state: {exc.message}") from None
        d.max_epochs = int(doc["max_epochs"])
        d.epoch = int(doc["epoch"])
        d.epochs_done = int(doc["epochs_done"])
        queue = [int(i) for i in doc["in_flight"]] + [int(i) for i in doc["queue"]]
        acked = {int(i) for i in doc["acked"]}
        every = set(range(d.num_splits))
        if len(queue) + len(acked) != d.num_splits or set(queue) | acked != every:
            raise ValueError(
                "dispatcher state: the splits queued, in flight and done do not make up "
                f"the {d.num_splits} splits of the universe"
            )
        d._queue = deque(queue)
        d._acked = acked
        d._progress = {int(i): int(n) for i, n in (doc.get("progress") or {}).items()}
        for k, v in (doc.get("counters") or {}).items():
            if k in d.counters:
                d.counters[k] = int(v)
        return d
