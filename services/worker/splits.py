"""The worker's side of ``--data-dispatch server``: training batches taken split by split from
the server's dispatcher (``downpour.server.dispatch``) instead of from a static shard.

Before its hello the worker *probes* its ``input_fn`` once (``InputContext.probe``): the
sharding helper it calls tells what the data is (its files, or its element count), which
becomes the ``DataUniverse`` sent to shard 0. A function that calls neither helper, or whose
dataset has an unknown or infinite number of elements, cannot be divided and is refused
(InputError) before anything is sent.

``SplitFeed.batches`` then asks shard 0 for a split, reads ``input_fn(ctx.for_epoch(epoch,
split))`` and yields its batches, one split after another, after the ``split.skip`` batches a
worker that died in it had already pushed (a split's batches come in the same order on every
read). ``mark`` says where the batch yielded last stands in its split (``SplitMark``): pushes
carry it, so the dispatcher knows how far a split is trained. The worker calls ``split_done``
with the seq of the push that carried a split's last gradients; the acknowledgement goes with
the next request, or with ``close``, and names that seq: the server completes it once that
push has arrived (the gradients travel on another socket and may arrive after the ack). When
the dispatcher says wait (the epoch's last splits are in flight elsewhere) the feed waits the
server's retry hint, bounded and cut short by the worker's stop; "end" ends the batches.
The worker's fetcher threads keep heartbeating shard 0 while a split is read.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import tensorflow as tf

from downpour import wire
from downpour.inputs.context import ELEMENTS, FILES, InputContext
from downpour.inputs.pipeline import InputError, InputFn, build_dataset, retire
from downpour.net.client import ShardClient, SplitGrant
from downpour.net.transport import Refused, RemoteError, ServerUnavailable, Stopped
from downpour.worker.errors import DispatchError

log = logging.getLogger("downpour.worker")

SPLIT_BATCHES = 20  # the default split: this many batches of elements
MAX_WAIT_S = 5.0  # longest single wait for the epoch's in-flight splits, whatever the hint


def probe_universe(
    fn: InputFn, ctx: InputContext, split_size: int | None = None
) -> tuple[wire.DataUniverse, tf.data.Dataset]:
    """The data universe ``fn`` shards over, and the probe's dataset (the whole data, for
    checking its element spec). ``split_size``: elements per split (default
    ``SPLIT_BATCHES`` batches). InputError when the data cannot be dispatched."""
    probe = InputContext(
        seed=ctx.seed, data_dir=ctx.data_dir, batch_size=ctx.batch_size, probe=True
    )
    ds = build_dataset(fn, probe)
    try:
        if FILES in probe.found:
            return wire.DataUniverse(files=probe.found[FILES]), ds
        if ELEMENTS in probe.found:
            n = probe.found[ELEMENTS]
            if n < 0:
                what = "infinite" if n == int(tf.data.INFINITE_CARDINALITY) else "unknown"
                raise InputError(
                    f"--data-dispatch server: the dataset input_fn passes to ctx.shard has an "
                    f"{what} number of elements; the server divides a known count (call "
                    "ctx.shard before repeat/filter, or shard files with ctx.shard_files)"
                )
            size = split_size or SPLIT_BATCHES * ctx.batch_size
            return wire.DataUniverse(elements=n, split_size=size), ds
    except ValueError as exc:  # DataUniverse's bounds (no element, too many splits, ...)
        if isinstance(exc, InputError):
            raise
        raise InputError(f"--data-dispatch server: {exc}") from None
    raise InputError(
        "--data-dispatch server: input_fn calls neither ctx.shard_files(files) nor "
        "ctx.shard(dataset), so the server cannot divide its data into splits"
    )


@dataclass(frozen=True)
class SplitMark:
    """Where a batch stands in its split: ``done`` batches of split ``index`` of ``epoch``
    through this one (those skipped included); ``last``: the split's last batch."""

    epoch: int
    index: int
    done: int
    last: bool


class SplitFeed:
    """Batches of the splits shard 0 hands this worker; see the module docstring."""

    def __init__(
        self,
        fn: InputFn,
        ctx: InputContext,
        universe: wire.DataUniverse,
        client: ShardClient,
        *,
        epochs: int,
        stop: threading.Event,
    ) -> None:
        self.fn = fn
        self.ctx = ctx
        self.universe = universe
        self.client = client
        self.epochs = epochs  # 0: unbounded
        self.stop = stop
        self.current: tuple[int, int] | None = None  # (epoch, index) being read
        self.pending: list[tuple[int, int, int]] = []  # (epoch, index, seq), not yet sent
        self.mark: SplitMark | None = None  # of the batch yielded last
        # acked: acks the server took (acks_held of them completed once their push arrived)
        self.counts = {
            "splits": 0,
            "acked": 0,
            "acks_held": 0,
            "acks_stale": 0,
            "waits": 0,
            "batches_skipped": 0,
        }

    def batches(self) -> Iterator[tuple[int, Any]]:
        """``(epoch, batch)`` of split after split until the dispatcher says end (or stop)."""
        while not self.stop.is_set():
            grant = self._ask(want=True)
            if grant is None or grant.kind == "end":
                return
            if grant.kind == "wait" or grant.split is None:
                self.counts["waits"] += 1
                self.stop.wait(min(max(grant.retry_s, 0.01), MAX_WAIT_S))
                continue
            self.current = (grant.epoch, grant.split.index)
            log.debug("reading split %d of epoch %d", grant.split.index, grant.epoch)
            self.counts["splits"] += 1
            split = grant.split
            ds = build_dataset(self.fn, self.ctx.for_epoch(grant.epoch, split))
            if split.skip:
                log.info(
                    "split %d of epoch %d: resuming after its first %d batches (trained by a "
                    "worker that left)",
                    split.index,
                    grant.epoch,
                    split.skip,
                )
                self.counts["batches_skipped"] += split.skip
                ds = ds.skip(split.skip)
            it = iter(ds)
            done = split.skip
            try:
                batch = self._next(it)
                if batch is None:
                    log.info("split %d of epoch %d has no batch left", split.index, grant.epoch)
                    self.split_done()
                while batch is not None:
                    following = self._next(it)
                    done += 1
                    self.mark = SplitMark(grant.epoch, split.index, done, following is None)
                    yield grant.epoch, batch
                    batch = following
            finally:  # tf.data deletes an autotuned iterator slowly: not on this thread
                retire(it)
                del it

    def _next(self, it: Iterator[Any]) -> Any:
        try:
            return next(it, None)
        except (tf.errors.OpError, ValueError, TypeError) as exc:
            raise InputError(f"reading split {self.current}: {exc}") from None

    def split_done(self, seq: int = 0) -> None:
        """The split being read is finished and its last gradients went in push ``seq`` (0:
        none of its batches was pushed): acknowledge it with the next request."""
        if self.current is not None:
            self.pending.append((*self.current, seq))
            self.current = None

    def _ask(self, want: bool) -> SplitGrant | None:
        """One split request carrying the pending acks; None when the worker is stopping."""
        acks = tuple(self.pending)
        try:
            grant = self.client.next_split(self.universe, acks, epochs=self.epochs, want=want)
        except Stopped:
            return None
        except Refused as exc:
            raise DispatchError(
                f"server {exc.endpoint} refused the split request: {exc.message}"
            ) from None
        except (ServerUnavailable, RemoteError, wire.ProtocolError) as exc:
            raise DispatchError(f"split request to {self.client.endpoint}: {exc}") from None
        self.pending.clear()
        self._count(grant.reply)
        return grant

    def _count(self, reply: wire.SplitReply) -> None:
        self.counts["acked"] += reply.acked + reply.held
        self.counts["acks_held"] += reply.held
        self.counts["acks_stale"] += reply.stale

    def close(self) -> None:
        """Acknowledge the finished splits not yet acknowledged (the worker is leaving)."""
        if not self.pending:
            return
        try:
            reply = self.client.ack_splits(self.universe, tuple(self.pending))
        except (Stopped, ServerUnavailable, RemoteError, wire.ProtocolError) as exc:
            log.warning("could not acknowledge splits %s: %s", self.pending, exc)
            return
        self._count(reply)
        self.pending.clear()
