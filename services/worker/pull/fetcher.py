"""One shard's weight pulls and heartbeats, on a background thread with its own REQ socket.

The transfer of version V+1 overlaps the computation on version V; the puller installs the
result between steps, so a step never sees a mix of two versions. With several shards each
has a fetcher, so the pulls run concurrently. When the worker has said nothing to a shard for
``heartbeat_s`` (a long step, a large n_fetch), the thread sends a heartbeat so the shard does
not mistake a busy worker for a missing one.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from downpour import wire
from downpour.net.client import Weights
from downpour.net.cluster import Shard, ShardSet
from downpour.net.transport import RemoteError, ServerUnavailable
from downpour.worker.errors import WorkerError, translated

log = logging.getLogger("downpour.worker")

Rows = dict[str, np.ndarray] | None  # a pull's table rows, by wire name


@dataclass(frozen=True)
class FetchTimes:
    """The waits a fetcher keeps to: the heartbeat interval, how long ``take`` waits for a
    shard that stopped answering, and how long ``close`` waits for the thread."""

    heartbeat_s: float
    give_up_s: float
    close_s: float


class Fetcher:
    """Pulls for one shard: ``request`` starts one, ``take`` returns its reply.

    ``make_request(have, rows_only)`` builds the pull body; ``prepare`` converts a reply for
    the step on this thread; ``stats`` is the worker's reported figures (``ssp_waits``,
    ``ssp_wait_ms``; heartbeats send it); ``stop`` ends an ssp wait.
    """

    def __init__(
        self,
        shards: ShardSet,
        shard: Shard,
        make_request: Callable[[Shard, int, bool], wire.PullRequest],
        prepare: Callable[[Shard, Weights], Weights],
        stats: dict[str, float],
        stop: threading.Event,
        times: FetchTimes,
    ) -> None:
        self.shards = shards
        self.shard = shard
        self.client = shards.new_client(shard)
        self._make_request = make_request
        self._prepare = prepare
        self._stats = stats
        self._stop = stop
        self._times = times
        self._requests: queue.Queue[tuple[int, Rows, float] | None] = queue.Queue(maxsize=1)
        self._results: queue.Queue[Weights | BaseException] = queue.Queue()
        # request -> reply ready, of the reply take() returns next (None: held by ssp, failed)
        self.round_trip_s: float | None = None
        self._thread = threading.Thread(
            target=self._loop, name=f"fetcher-{shard.index}", daemon=True
        )
        self._thread.start()

    def request(self, have: int, rows: Rows = None) -> None:
        """Start fetching weights newer than ``have`` (and the table ``rows``, if any)."""
        self._requests.put_nowait((have, rows, time.perf_counter()))

    def take(self) -> Weights:
        """The reply to the last request; waits while the shard keeps answering (an ssp
        server holding the pull answers "wait"), at most ``give_up_s`` from the shard's last
        answer."""
        bound = self._times.give_up_s
        while True:
            try:
                result = self._results.get(timeout=1.0)
                break
            except queue.Empty:
                if time.monotonic() - self.shard.last_contact > bound:
                    raise WorkerError(
                        f"no weights from server {self.client.endpoint} within {bound:.0f} s"
                    ) from None
        if isinstance(result, BaseException):
            raise result
        return result

    def _pull(self, have: int, rows: Rows) -> Weights:
        weights = self.client.pull(self._make_request(self.shard, have, False), rows=rows)
        self.shard.saw(weights.reply.incarnation)
        return weights

    def _loop(self) -> None:
        while True:
            try:
                item = self._requests.get(timeout=self._times.heartbeat_s)
            except queue.Empty:
                self._heartbeat()
                continue
            if item is None:
                return
            have, rows, sent = item
            self.round_trip_s = None
            try:
                with translated(self.client.endpoint):
                    weights = self._pull(have, rows)
                    held = weights.reply.wait_ms > 0
                    if held:
                        weights = self._wait_turn(have, weights, rows)
                prepared = self._prepare(self.shard, weights)
                if not held:  # an ssp hold measures the slowest worker, not the transfer
                    self.round_trip_s = time.perf_counter() - sent
                self._results.put(prepared)
            except BaseException as exc:  # handed to the training thread by take()
                self._results.put(exc)

    def _wait_turn(self, have: int, weights: Weights, rows: Rows) -> Weights:
        """ssp: the server holds this pull (this worker is too far ahead); ask again after
        each ``wait_ms`` until it serves the weights. When the worker stops meanwhile, the
        last "wait" reply (unchanged weights, no tensors)."""
        t0 = time.perf_counter()
        self._stats["ssp_waits"] += 1
        while weights.reply.wait_ms > 0 and not self._stop.wait(weights.reply.wait_ms / 1e3):
            weights = self._pull(have, rows)
        self._stats["ssp_wait_ms"] = 1e3 * (time.perf_counter() - t0)
        return weights

    def _heartbeat(self) -> None:
        idle = time.monotonic() - self.shard.last_contact
        if idle < self._times.heartbeat_s or self._stop.is_set():
            return
        try:
            _, reply = self.client.heartbeat(dict(self._stats), self.shards.notices.items())
            self.shard.saw(reply.incarnation)  # a restart: greeted again later
        except (ServerUnavailable, RemoteError, wire.ProtocolError) as exc:
            log.debug("heartbeat failed: %s", exc)

    def close(self) -> bool:
        """Stop the thread after its current attempt (bounded by the request timeout; the
        worker's stop flag ends its retries) and close its socket. False if it is stuck."""
        with contextlib.suppress(queue.Full):
            self._requests.put_nowait(None)
        self._thread.join(timeout=self._times.close_s)
        if self._thread.is_alive():
            return False
        self.client.close()
        return True
