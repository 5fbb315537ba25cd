"""The worker service: pull weights, compute the whole gradient list, push it; repeat.

DistBelief's knobs: weights are pulled every ``n_fetch`` steps (a pull of an unchanged
version moves no tensors) and gradients are pushed every ``n_push`` steps, averaged over the
steps in between. Every push carries the weight version it was computed from. A pull is
prefetched (requested while steps compute) and timed by ``downpour.worker.schedule`` to
arrive just before the step that installs it, so its weights are no older than they must be.

The worker speaks to the servers only through the client layer (``downpour.cluster.ShardSet``
over one ``downpour.client.ShardClient`` per shard and thread), where nothing blocks forever:
requests time out and their REQ socket is recreated, pushes have a send timeout, and a server
that stays away longer than ``server_timeout_s`` ends the worker with a clear error.

With several server shards (``servers`` lists them in shard order) the worker computes the
same partition as the shards (``downpour.partition``), pushes each shard its slice of every
gradient list under one sequence number, and pulls from all shards at once: one fetcher
thread and REQ socket per shard. Each shard has its own weight version; a push carries the
version of that shard's weights it was computed from, so each shard measures its own staleness.

``compress`` (``none``, ``bf16``, ``topk:RATIO``; ``downpour.worker.compress``) encodes each
shard's slice with that shard's own compressor, so a top-k error-feedback residual belongs to
one slice; the residuals are cleared after a step with a non-finite loss. When a pull reply
says the server's policy dropped some of this worker's gradients as too stale
(``dropped_stale``), the worker waits for fresh weights before its next step instead of
using the prefetched ones, which are a step old. When the server aggregates synchronously
(its hello says ``sync:K/N``), a second gradient from the same weights would only be dropped
as a duplicate, so after each push the worker waits (polling pulls, at most ``sync_wait_s``)
until every shard's version has moved on, as SyncReplicasOptimizer's workers wait for the new
global step; after a wait times out (fewer than K workers left) it stops waiting until it sees
the version move again.

When the server's policy is ``ssp:K`` (stale synchronous parallel) the server may hold a
pull while this worker is more than K clocks (pushes) ahead of the slowest live worker: its
reply says "wait" (``wait_ms``) and the fetcher asks again until served, so the worker
computes nothing meanwhile. Under ssp the worker pulls right before it computes (no
prefetch): a prefetched pull would pass the server's check a push early.
"""

from __future__ import annotations

import contextlib
import logging
import math
import queue
import threading
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

import numpy as np
import tensorflow as tf

from downpour import wire
from downpour.client import Hello, Weights
from downpour.cluster import Shard, ShardSet
from downpour.device import configure_device
from downpour.inputs import InputContext
from downpour.logs import set_log_context, stop_on_signals
from downpour.metrics import Rate, new_worker_stats, peak_rss_mib
from downpour.models import build_model, evaluate, fingerprint_of
from downpour.partition import make_partition
from downpour.pipeline import (
    InputError,
    Inputs,
    build_dataset,
    check_element_spec,
    epoch_batches,
    known_batches,
    resolve_inputs,
)
from downpour.spec import ModelSpec
from downpour.transport import (
    Deadline,
    Refused,
    RemoteError,
    ServerUnavailable,
    Stopped,
    backoff_delays,
    make_context,
)
from downpour.worker.compress import Compressor, parse_compression
from downpour.worker.errors import WorkerError
from downpour.worker.row_cache import (
    caches_of,
    check_batch,
    logical_shapes,
    row_cache_scope,
)
from downpour.worker.row_pulling import RowPulling
from downpour.worker.rows import Lookahead, RowPlan
from downpour.worker.schedule import FetchSchedule
from downpour.worker.settings import WorkerConfig, validate_worker
from downpour.worker.splits import DispatchError, SplitFeed, probe_universe
from downpour.worker.step import Accumulator, GradientStep, batch_signature
from downpour.worker.tf1 import Tf1Step, check_tf1_inputs

log = logging.getLogger("downpour.worker")

RECENT_LOSSES = 20  # the summary's loss_recent averages this many last batches (one is noise)


def _ms(seconds: float | None) -> float | None:
    """Seconds as milliseconds for the summary (None stays None: nothing measured yet)."""
    return None if seconds is None else round(1e3 * seconds, 3)


def batch_rows(labels: Any) -> int:
    """Examples in a batch: the first dimension of its (first) label tensor."""
    return int(tf.nest.flatten(labels)[0].shape[0])


class Fetcher:
    """Weight pulls and heartbeats for one shard on a background thread with its own REQ socket.

    The transfer of version V+1 overlaps the computation on version V; the worker installs
    the result between steps, so a step never sees a mix of two versions. With several shards
    each has a fetcher, so the pulls run concurrently. When the worker has said nothing to a
    shard for ``heartbeat_s`` (a long step, a large n_fetch), the thread sends a heartbeat so
    the shard does not mistake a busy worker for a missing one.
    """

    def __init__(self, worker: Worker, shard: Shard) -> None:
        self.worker = worker
        self.shard = shard
        self.client = worker.shards.new_client(shard)
        self._requests: queue.Queue[tuple[int, dict[str, np.ndarray] | None, float] | None] = (
            queue.Queue(maxsize=1)
        )
        self._results: queue.Queue[Weights | BaseException] = queue.Queue()
        # request -> reply ready, of the reply take() returns next (None: held by ssp, failed)
        self.round_trip_s: float | None = None
        self._thread = threading.Thread(
            target=self._loop, name=f"fetcher-{shard.index}", daemon=True
        )
        self._thread.start()

    def request(self, have: int, rows: dict[str, np.ndarray] | None = None) -> None:
        """Start fetching weights newer than ``have`` (and the table ``rows``, if any)."""
        self._requests.put_nowait((have, rows, time.perf_counter()))

    def take(self) -> Weights:
        """The reply to the last request; waits while the shard keeps answering (an ssp
        server holding the pull answers "wait"), at most the worker's server timeout from
        the shard's last answer."""
        cfg = self.worker.config
        bound = cfg.server_timeout_s + 2 * cfg.request_timeout_s + 5.0
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

    def _loop(self) -> None:
        w = self.worker
        while True:
            try:
                item = self._requests.get(timeout=w.config.heartbeat_s)
            except queue.Empty:
                self._heartbeat()
                continue
            if item is None:
                return
            have, rows, sent = item
            self.round_trip_s = None
            try:
                try:
                    weights = self.client.pull(w.pull_request(self.shard, have), rows=rows)
                    w.shards.saw(self.shard, weights.reply.incarnation)
                    held = weights.reply.wait_ms > 0
                    if held:
                        weights = self._wait_turn(have, weights, rows)
                except (ServerUnavailable, Stopped) as exc:
                    raise WorkerError(str(exc)) from None
                except wire.ProtocolError as exc:
                    raise WorkerError(
                        f"server {self.client.endpoint} sent a malformed reply: {exc}"
                    ) from None
                prepared = w.prepare(self.shard, weights)
                if not held:  # an ssp hold measures the slowest worker, not the transfer
                    self.round_trip_s = time.perf_counter() - sent
                self._results.put(prepared)
            except BaseException as exc:  # handed to the main thread by take()
                self._results.put(exc)

    def _wait_turn(
        self, have: int, weights: Weights, rows: dict[str, np.ndarray] | None = None
    ) -> Weights:
        """ssp: the server holds this pull (this worker is too far ahead); ask again after
        each ``wait_ms`` until it serves the weights. When the worker stops meanwhile, the
        last "wait" reply (unchanged weights, no tensors)."""
        w = self.worker
        t0 = time.perf_counter()
        w.stats["ssp_waits"] += 1
        while weights.reply.wait_ms > 0 and not w._stop.wait(weights.reply.wait_ms / 1e3):
            weights = self.client.pull(w.pull_request(self.shard, have), rows=rows)
            w.shards.saw(self.shard, weights.reply.incarnation)
        w.stats["ssp_wait_ms"] = 1e3 * (time.perf_counter() - t0)
        return weights

    def _heartbeat(self) -> None:
        w = self.worker
        if time.monotonic() - self.shard.last_contact < w.config.heartbeat_s or w.stopping():
            return
        try:
            _, reply = self.client.heartbeat(dict(w.stats))
            w.shards.saw(self.shard, reply.incarnation)  # a restart: the worker greets it again
        except (ServerUnavailable, RemoteError, wire.ProtocolError) as exc:
            log.debug("heartbeat failed: %s", exc)

    def close(self) -> bool:
        """Stop the thread after its current attempt (bounded by the request timeout; the
        worker's stop flag ends its retries) and close its socket. False if it is stuck."""
        with contextlib.suppress(queue.Full):
            self._requests.put_nowait(None)
        self._thread.join(timeout=self.worker.config.request_timeout_s + 1.0)
        if self._thread.is_alive():
            return False
        self.client.close()
        return True


class Worker(RowPulling):
    """One training worker. ``run()`` returns a summary dict, or raises WorkerError."""

    def __init__(self, spec: ModelSpec, config: WorkerConfig, inputs: Inputs | None = None) -> None:
        """Build the model and check the input against it: the first epoch's dataset is
        built and its ``element_spec`` traced into the step, so bad input (InputError) is
        refused here, before anything is sent to a server. ``inputs`` defaults to the spec's
        (``downpour.pipeline.resolve_inputs``). ConfigError (``validate_worker``) for settings
        that contradict each other."""
        validate_worker(config)  # the cross-field checks live there, and only there
        self.device = configure_device(config.device)  # before any TF op; logged by run()
        self.spec = spec
        self.config = config
        self.inputs = inputs if inputs is not None else resolve_inputs(spec, config.data_dir)
        self.id = config.resolved_id()
        self.input_ctx = InputContext(
            worker_index=config.worker_index,
            num_workers=config.num_workers,
            seed=config.seed if config.seed is not None else 0,
            data_dir=config.data_dir,
            batch_size=spec.batch_size,
        )
        with row_cache_scope(config.row_cache_rows):  # big Embeddings as row caches
            self.model = build_model(spec)
        self.caches = caches_of(self.model)
        self.dispatched = config.data_dispatch == "server"
        if self.dispatched:  # the whole data, probed for what the server is to divide
            universe, first = probe_universe(self.inputs.train, self.input_ctx, config.split_size)
        else:
            first = build_dataset(self.inputs.train, self.input_ctx)  # InputError: refused
        check_element_spec(first.element_spec, self.model)
        self.element_spec = first.element_spec
        if config.graph == "tf1":  # the model's Session graph, checked against this Keras model
            check_tf1_inputs(spec, first.element_spec)
            self.step_fn: GradientStep | Tf1Step = Tf1Step(spec, self.model)
        else:
            self.step_fn = GradientStep(spec, self.model, first.element_spec, self.caches)
            try:
                self.step_fn.trace()
            except (ValueError, TypeError) as exc:
                raise InputError(
                    f"model {spec.name!r}: its input_fn's batches {first.element_spec} do not "
                    f"fit the model: {' '.join(str(exc).split())[:600]}"
                ) from None
        if self.caches and isinstance(first, tf.data.Dataset):
            for features, _ in first.take(1):
                check_batch(self.model, self.caches, features)
        self.planned_per_epoch = None if self.dispatched else known_batches(first)
        self.epoch = 0  # the epoch of the batch computed last
        self._input_stream: Iterator[tuple[int, Any]] | None = None
        if not self.dispatched:
            self._batches = self._prime(first)
        variables = self.model.trainable_variables
        self.names = [v.path for v in variables]
        shapes = logical_shapes(variables, self.caches)  # a cache's: its table's
        self.fingerprint = fingerprint_of(
            [(v.path, list(sh), str(v.dtype)) for v, sh in zip(variables, shapes, strict=True)]
        )
        self.payload_bytes = sum(
            int(np.prod(sh)) * np.dtype(str(v.dtype)).itemsize
            for v, sh in zip(variables, shapes, strict=True)
        )
        self.limits = wire.DEFAULT_LIMITS.for_payload(self.payload_bytes)
        endpoints = config.endpoints()
        self.partition = make_partition(
            self.names,
            shapes,
            [str(v.dtype) for v in variables],
            len(endpoints),
            self.fingerprint,
        )
        self.seq = 0
        self._stop = threading.Event()
        # Sent with every push and heartbeat; names and units: downpour.metrics.WORKER_REPORTED.
        # The client layer counts reconnects, backpressure and dropped pushes into it.
        self.stats: dict[str, float] = new_worker_stats()
        self._step_rate = Rate(10.0)
        self.ctx = make_context(config.io_threads)
        self.shards = ShardSet(
            self.ctx,
            endpoints,
            self.partition,
            sender=self.id,
            keys=config.keys,  # CURVE on every socket, and again after a recreate
            timeout_s=config.request_timeout_s,
            server_timeout_s=config.server_timeout_s,
            limits=self.limits,
            max_msg_bytes=self.limits.max_total_bytes,
            push_hwm=config.push_hwm,
            push_timeout_s=config.push_timeout_s,
            push_endpoint=config.push_endpoint,
            counters=self.stats,
            stop=self._stop,
        )
        self.fetchers: list[Fetcher] = []  # one per shard, started by run()
        # one per shard: a top-k residual is kept per position in that shard's slice list
        self.compressors: list[Compressor] = [
            parse_compression(config.compress) for _ in self.shards.shards
        ]
        self._refresh = False  # a shard dropped a stale gradient: pull fresh weights next step
        self.sync = False  # the server aggregates synchronously (hello: policy sync:K/N)
        self.ssp = False  # the server holds pulls of workers too far ahead (hello: ssp:K)
        self._in_flight = False  # every fetcher has a pull under way whose reply is not taken
        self.schedule = FetchSchedule(config.n_fetch)  # when the next prefetch is requested
        self._sync_stalled = False  # a sync wait timed out and no version moved since
        self.rows: RowPlan | None = None  # --row-pulls auto: the tables pulled by row
        self._stream: Lookahead | None = None  # the batches, read ahead for row pulls
        self._row_version_steps = [1] * len(endpoints)
        self._row_version_gap = [config.n_fetch] * len(endpoints)
        self._row_request_step = self._row_held_step = 0
        self.feed: SplitFeed | None = None  # --data-dispatch server: splits from shard 0
        if self.dispatched:
            self.feed = SplitFeed(
                self.inputs.train,
                self.input_ctx,
                universe,
                self.shards.new_client(self.shards.shards[0]),
                epochs=0 if config.steps is not None else int(config.epochs),
                stop=self._stop,
            )
            self._batches = self.feed.batches()  # asks for its first split after the hello

    @property
    def version(self) -> int:
        """The weight version held (with shards: the oldest of the shards' versions)."""
        return self.shards.version

    @property
    def prefetching(self) -> bool:
        """Whether the next pull is requested ahead, as the current step computes (not under
        ssp, whose server checks the pull when it arrives)."""
        return self.config.prefetch and not self.ssp

    # ------------------------------------------------------------ lifecycle

    def stop(self) -> None:
        """Finish the current step, then return from run()."""
        self._stop.set()

    def stopping(self) -> bool:
        """True once stop() was called."""
        return self._stop.is_set()

    def install_signal_handlers(self) -> None:
        """SIGTERM and SIGINT stop the worker cleanly (main thread only)."""
        stop_on_signals(self.stop, log)

    def close(self) -> None:
        """Close sockets and the context; queued pushes get ``push_linger_s`` to leave."""
        self._stop.set()  # ends any retry loop still waiting on the server
        # The input generators are closed here, so their tf.data iterators go now: a worker
        # sits in reference cycles, and a cyclic GC long after would delete them all at once.
        self._batches.close()
        if self._input_stream is not None:
            self._input_stream.close()
        clean = True
        for fetcher in self.fetchers:
            clean = fetcher.close() and clean
        if self.feed is not None:
            self.feed.client.close()
        self.shards.close(self.config.push_linger_s)
        if clean:
            self.ctx.term()  # waits up to the push linger for queued gradients to leave
        else:
            self.ctx.destroy(linger=0)

    # ------------------------------------------------------------ server calls

    def hello(self) -> None:
        """Introduce ourselves to every shard; learn the gradient ports and where our
        sequence resumes."""
        try:
            hellos = self.shards.hello_all(self.spec.name, check=self._check_hello)
        except Refused as exc:
            raise WorkerError(f"server {exc.endpoint} refused this worker: {exc.message}") from None
        except (ServerUnavailable, Stopped) as exc:
            raise WorkerError(str(exc)) from None
        if self.rows is None and self.config.row_pulls == "auto" and self.config.graph == "tf2":
            features = batch_signature(tuple(self.element_spec))[0]
            offered = [h.reply.row_tables for h in hellos]
            self.rows = RowPlan.build(
                self.model,
                self.partition,
                offered,
                features,
                self.config.row_staleness,
                self.caches,
            )
            if self.rows is not None:
                log.info(
                    "row pulls for %s (staleness bound %d versions)",
                    ", ".join(str(t.variable.path) for t in self.rows.tables),
                    self.config.row_staleness,
                )
        for shard, hello in zip(self.shards.shards, hellos, strict=True):
            log.info(
                "worker %s joined server %s (shard %d of %d) at version %d (model %s)",
                self.id,
                shard.endpoint,
                shard.index,
                self.partition.num_shards,
                hello.version,
                self.spec.name,
            )

    def _check_hello(self, shard: Shard, hello: Hello) -> None:
        """What a shard's hello tells this worker: refuse to start when it cannot decode what
        --compress sends; learn its policy and where our sequence resumes."""
        comp = self.compressors[shard.index]
        offered = hello.reply.encodings
        if offered is None:
            offered = (wire.DENSE, wire.SPARSE)  # a server from before compression
        missing = sorted(comp.encodings - set(offered))
        if missing:
            raise WorkerError(
                f"server {shard.endpoint} cannot decode the {', '.join(missing)} encoding "
                f"that --compress {comp.spec} sends (it decodes {', '.join(offered)}): "
                "upgrade the server or use --compress none"
            )
        self.sync = hello.reply.policy.startswith("sync:")
        self.ssp = hello.reply.policy.startswith("ssp:")
        self.seq = max(self.seq, hello.reply.last_seq)

    def pull_request(self, shard: Shard, have: int, rows_only: bool = False) -> wire.PullRequest:
        """A pull request; ``have`` < 0 means this worker holds no weights of the shard yet.
        ``rows_only``: a row top-up, the requested rows and nothing else."""
        # a server from before bf16 pulls sends float32: fine
        encoding = wire.BF16 if self.config.pull_compress == "bf16" else wire.DENSE
        pushed = self.seq if self.ssp else None  # an ssp server counts pushes not yet taken
        if have < 0:
            return wire.PullRequest(encoding=encoding, pushed=pushed, rows_only=rows_only)
        return wire.PullRequest(have, shard.incarnation, encoding, pushed, rows_only)

    def prepare(self, shard: Shard, weights: Weights) -> Weights:
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

    def install(self, replies: list[Weights], started: float) -> None:
        """Load the weights of one pull reply per shard into the model, unless all are
        unchanged; a step then never sees weights of two pulls."""
        if self.rows is not None:
            self._install_rows(replies, started)
            self._rehello()
            return
        self.stats["pulls"] += 1
        changed = False
        for shard, weights in zip(self.shards.shards, replies, strict=True):
            self.shards.note_incarnation(shard, weights.reply.incarnation, weights.version)
            if weights.reply.dropped_stale > 0:
                self.stats["dropped_stale"] += weights.reply.dropped_stale
                self._refresh = True
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
            self._sync_stalled = False
        if changed:
            self.step_fn.set_weights(self.shards.join())
        else:
            self.stats["pulls_unchanged"] += 1
        self.stats["pull_ms"] = 1e3 * (time.perf_counter() - started)
        self._rehello()

    def _rehello(self) -> None:
        """Greet again every shard that restarted since its hello: it may take gradients on
        another port now (``ShardSet.rehello_restarted``)."""
        try:
            self.shards.rehello_restarted()
        except Refused as exc:
            raise WorkerError(
                f"restarted server {exc.endpoint} refused this worker: {exc.message}"
            ) from None
        except ServerUnavailable as exc:
            raise WorkerError(str(exc)) from None
        except Stopped:
            return  # stopping: no step follows

    def _request_all(self, sync: bool = False) -> None:
        """Start every shard's fetcher on a pull of weights newer than those held (with row
        pulls: and the rows of the batches it serves; ``sync``: it is installed at once)."""
        rows = self._lookahead_rows(sync)
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

    def pull(self) -> None:
        """Fetch weights from every shard that has a newer version than ours: waiting for the
        replies (--no-prefetch), or taking what the fetchers brought. The run loop then asks
        the fetch schedule when to start the next."""
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

    def await_new_version(self, pushed_from: list[int]) -> None:
        """With a sync:K/N server: pull until every shard has moved past the versions the last
        push was computed from (a gradient from those weights would be a duplicate), at most
        ``sync_wait_s``; a timeout means fewer than K workers are pushing, so stop waiting
        until a version moves again. A shard that restarted since the push (new incarnation)
        ends the wait at once: the round it held died with it and it restarted from a
        checkpoint, so its version would only move once the waiting workers push again."""
        if self._sync_stalled or all(
            v > p for v, p in zip(self.shards.versions, pushed_from, strict=True)
        ):
            return
        t0 = time.perf_counter()
        deadline = Deadline(self.config.sync_wait_s)
        delay = backoff_delays(0.002, 0.05)
        while not self._stop.is_set():
            if not self._in_flight:  # with prefetch a request per shard is outstanding
                self._request_all(sync=True)
            self.install(self._fetch_all(), t0)
            if all(v > p for v, p in zip(self.shards.versions, pushed_from, strict=True)):
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

    def push(
        self,
        grads: list[wire.Tensor],
        base_versions: list[int],
        loss: float,
        steps: int,
        batch_size: int,
    ) -> bool:
        """Send one gradient message per shard (its slice compressed by that shard's
        compressor, its base version, one shared seq); waits out back-pressure within
        server_timeout_s. ``bytes_sent`` counts the message bytes, ``bytes_raw`` what they
        would have been uncompressed (the same headers, the uncompressed payload). False
        when a planned stop dropped the gradient."""
        self.seq += 1
        body = wire.PushBody(loss=loss, batch_size=batch_size, steps=steps, stats=self.stats)
        t0 = time.perf_counter()
        before = [(c.raw_bytes, c.sent_bytes) for c in self.compressors]
        try:
            sizes = self.shards.push(
                self.seq,
                grads,
                base_versions,
                body,
                encode=lambda i, tensors: self.compressors[i].compress(tensors),
            )
        except Refused as exc:  # a restarted shard, greeted again, refused this worker
            raise WorkerError(
                f"restarted server {exc.endpoint} refused this worker: {exc.message}"
            ) from None
        except ServerUnavailable as exc:
            raise WorkerError(str(exc)) from None
        except Stopped:
            sizes = None
        if sizes is None:  # a planned stop dropped this gradient (and counted it)
            return False
        sent = sum(sizes)
        # the same headers with the uncompressed payload in place of the compressed one
        raw = sent + sum(
            (c.raw_bytes - r0) - (c.sent_bytes - s0)
            for c, (r0, s0) in zip(self.compressors, before, strict=True)
        )
        self.stats["pushes"] += 1
        self.stats["bytes_sent"] += sent
        self.stats["bytes_raw"] += raw
        self.stats["push_ms"] = 1e3 * (time.perf_counter() - t0)
        return True

    # ------------------------------------------------------------ training

    def held_out(self) -> float | None:
        """The spec's metric on the held-out set with this worker's model as it ends: the last
        weights it pulled and its own BatchNorm statistics (None in tf1 mode, whose weights
        live in the TF1 session, or without a held-out set). Row caches get each held-out
        batch's rows pulled before it is scored (None when the worker was stopped, or the
        pulls failed)."""
        if self.config.graph != "tf2" or self.inputs.held_out is None:
            return None
        ds = build_dataset(self.inputs.held_out, self.input_ctx, "held_out_fn")
        if not self.caches:
            return float(evaluate(self.spec, self.model, ds))
        if self.rows is None or self._stop.is_set():
            return None
        try:
            return float(evaluate(self.spec, self.model, self._with_rows(ds)))
        except WorkerError as exc:  # the servers went away after training: no score
            log.warning("no held-out score: pulling its rows failed: %s", exc)
            return None

    def _prime(self, first: Any) -> Iterator[tuple[int, Any]]:
        """The training batches, epoch after epoch, with the first one read already: a
        worker whose share is empty is refused before its hello."""
        cfg = self.config
        epochs = None if cfg.steps is not None else cfg.epochs
        stream = epoch_batches(self.inputs.train, self.input_ctx, epochs, first)
        try:
            head = next(stream)
        except StopIteration:  # epochs > 0 always yields or raises; kept for safety
            raise InputError("input_fn gave no batch") from None
        except (tf.errors.OpError, ValueError, TypeError) as exc:
            if isinstance(exc, InputError):
                raise
            raise InputError(
                f"model {self.spec.name!r}: reading input_fn's first batch: {exc}"
            ) from None

        def chained() -> Iterator[tuple[int, Any]]:
            yield head
            yield from stream

        self._input_stream = stream  # closed by close() even when chained never started

        return chained()

    def total_steps(self) -> int | None:
        """--steps, or --epochs worth of this worker's batches (None: tf.data cannot tell
        how many batches an epoch has before reading it)."""
        if self.config.steps is not None:
            return self.config.steps
        if self.planned_per_epoch is None:
            return None
        return max(1, int(round(self.config.epochs * self.planned_per_epoch)))

    def batches(self) -> Iterator[tuple[Any, Any]]:
        """The training batches this worker computes on, ``(features, labels)`` as the step
        takes them (NumPy for tf1), at most ``--steps`` of them."""
        limit = self.config.steps
        n = 0
        while limit is None or n < limit:  # checked first: a split feed asks for no split more
            item = next(self._batches, None)
            if item is None:
                return
            n += 1
            epoch, (x, y) = item
            self.epoch = epoch
            if self.config.graph == "tf1":
                yield x.numpy(), y.numpy()
            else:
                yield x, y

    def run(self) -> dict[str, Any]:
        """Train until the step budget is spent or stop() is called."""
        cfg = self.config
        data = self.batches()
        total = self.total_steps()
        acc = Accumulator()
        started = time.monotonic()
        loss = float("nan")
        recent: deque[float] = deque(maxlen=RECENT_LOSSES)  # finite batch losses, for the summary
        base_versions = [0] * len(self.shards.shards)
        step = 0
        pushed_from: list[int] | None = None  # base versions of the last push
        set_log_context(worker=self.id, version=lambda: self.version)
        log.info("computing on %s", self.device)
        self.hello()
        self.fetchers = [Fetcher(self, shard) for shard in self.shards.shards]
        first_rows = (
            self.rows.first_rows(len(self.fetchers))
            if self.rows is not None
            else [None] * len(self.fetchers)
        )
        for fetcher, rows in zip(self.fetchers, first_rows, strict=True):
            fetcher.request(-1, rows)  # the first pull from every shard at once
        self.install(self._fetch_all(), time.perf_counter())
        self._stream = Lookahead((x, y, self.feed is not None and self.feed.last) for x, y in data)
        self._schedule_request(0)  # no step time known yet: at once
        finished = False  # the input ran out: --epochs done (or --steps)
        step_started: float | None = None  # when the last step passed its request decision
        while not self._stop.is_set():
            try:
                batch = self._stream.next()
            except DispatchError as exc:
                raise WorkerError(str(exc)) from None
            if batch is None:  # a split feed also ends when stopped while it waits
                finished = not self._stop.is_set()
                break
            x, y, split_end = batch
            if step_started is not None:  # input, compute and push: what a prefetch overlaps
                self.schedule.note_step(time.perf_counter() - step_started)
            if step and step % cfg.n_fetch == 0:
                self.pull()  # under ssp it may wait here for the slowest worker
                if self._stop.is_set():
                    break
            if acc.count == 0:  # the oldest weights in this accumulation, per shard
                if self.sync and pushed_from is not None:
                    self.await_new_version(pushed_from)
                    if self._stop.is_set():
                        break
                base_versions = self.shards.versions
            self._schedule_request(step)  # the pull for the next fetch step, if it is time
            step_started = time.perf_counter()
            if self.rows is not None:  # last: after every install this step may see
                self._ensure_rows(x)
            t0 = time.perf_counter()
            loss, grads = self.step_fn(x, y)
            self.stats["compute_ms"] = 1e3 * (time.perf_counter() - t0)
            acc.add(grads)
            step += 1
            self._step_rate.mark()
            self.stats["steps_per_s"] = round(self._step_rate.per_second(), 3)
            if math.isfinite(loss):
                self.stats["loss"] = loss
                recent.append(loss)
            if acc.count >= cfg.n_push or (split_end and acc.count):
                if self.push(acc.take(), base_versions, loss, step, batch_rows(y)) and split_end:
                    self.feed.split_done(self.seq)  # acknowledged with the next request
                pushed_from = base_versions
            if cfg.log_every and step % cfg.log_every == 0:
                log.info(
                    "worker %s step %d/%s loss %.4f version %d",
                    self.id,
                    step,
                    total if total is not None else "?",
                    loss,
                    self.version,
                )
        if self.feed is not None:
            self.feed.close()  # a finished split not acknowledged yet (stopped, --steps)
        elapsed = time.monotonic() - started
        summary = {
            "worker": self.id,
            "held_out": self.held_out(),
            "steps": step,
            "seconds": round(elapsed, 2),
            "steps_per_s": round(step / max(elapsed, 1e-9), 3),
            "loss": loss,
            "loss_recent": sum(recent) / len(recent) if recent else float("nan"),
            "version": self.version,
            "versions": self.shards.versions,
            "pushes": int(self.stats["pushes"]),
            "pulls": int(self.stats["pulls"]),
            "pulls_unchanged": int(self.stats["pulls_unchanged"]),
            "backpressure": int(self.stats["backpressure"]),
            "reconnects": int(self.stats["reconnects"]),
            "rehellos": int(self.stats["rehellos"]),
            "dropped": int(self.stats["dropped"]),
            "compress": self.compressors[0].spec,
            "pull_compress": self.config.pull_compress,
            "bytes_raw": int(self.stats["bytes_raw"]),
            "bytes_sent": int(self.stats["bytes_sent"]),
            "dropped_stale": int(self.stats["dropped_stale"]),
            "stale_refreshes": int(self.stats["stale_refreshes"]),
            "sync_wait_timeouts": int(self.stats["sync_wait_timeouts"]),
            "ssp_waits": int(self.stats["ssp_waits"]),
            "fetch_lead_steps": self.schedule.last_lead,
            "pull_rtt_ms": _ms(self.schedule.round_trip_s.value),
            "step_ms": _ms(self.schedule.step_s.value),
            "row_pulls": None
            if self.rows is None
            else [str(t.variable.path) for t in self.rows.tables],
            "row_staleness": self.config.row_staleness,
            "bytes_pulled": int(self.stats["bytes_pulled"]),
            "rows_pulled": int(self.stats["rows_pulled"]),
            "row_bytes_pulled": int(self.stats["row_bytes_pulled"]),
            "row_hits": int(self.stats["row_hits"]),
            "row_misses": int(self.stats["row_misses"]),
            "row_sync_pulls": int(self.stats["row_sync_pulls"]),
            "row_cache_rows": self.config.row_cache_rows,
            "row_cache_evictions": sum(c.evictions for c in self.caches.values()),
            "peak_rss_mib": peak_rss_mib(),
            "last_seq": self.seq,
            "epochs": self.epoch + 1 if step else 0,
            "stopped_early": not finished,
        }
        if self.feed is not None:
            summary["dispatch"] = dict(self.feed.counts)
        return summary
