"""The worker service: pull weights, compute the whole gradient list, push it; repeat.

``Worker.run`` is that loop: the next batch, the puller before the step
(``downpour.worker.pull.puller``: installs pulled weights, waits where the server's policy says,
prefetches the next pull, tops up the batch's table rows), one compiled evaluation of the loss
and the whole gradient list (``downpour.worker.step``), then the pusher
(``downpour.worker.pusher``: accumulation over ``n_push`` steps, compression, one sequence
number per push, byte accounting).

The worker speaks to the servers only through the client layer (``downpour.net.cluster.ShardSet``
over one ``downpour.net.client.ShardClient`` per shard and thread), where nothing blocks forever:
requests time out and their REQ socket is recreated, pushes have a send timeout, and a server
that stays away longer than ``server_timeout_s`` ends the worker with a clear error
(``WorkerError``, translated in one place: ``downpour.worker.errors.translated``).

With several server shards (``servers`` lists them in shard order) the worker computes the
same partition as the shards (``downpour.model.partition``), pushes each shard its slice of every
gradient list under one sequence number, and pulls from all shards at once. Each shard has its
own weight version; a push carries the version of that shard's weights it was computed from,
so each shard measures its own staleness.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

import tensorflow as tf

from downpour import wire
from downpour.inputs.context import InputContext
from downpour.inputs.pipeline import (
    InputError,
    Inputs,
    build_dataset,
    check_element_spec,
    resolve_inputs,
)
from downpour.model.build import build_model, evaluate, fingerprint_of
from downpour.model.partition import Partition, make_partition, message_bytes
from downpour.net.cluster import ShardSet
from downpour.net.transport import make_context
from downpour.runtime.device import configure_device
from downpour.runtime.logs import set_log_context, stop_on_signals
from downpour.runtime.metrics import Notices, Rate, new_worker_stats, peak_rss_mib, reported_counts
from downpour.spec import ModelSpec
from downpour.worker.batches import TrainingBatches
from downpour.worker.compress import parse_compression
from downpour.worker.errors import WorkerError, translated
from downpour.worker.pull.puller import Puller
from downpour.worker.pusher import Pusher
from downpour.worker.rows.cache import caches_of, check_batch, logical_shapes, row_cache_scope
from downpour.worker.rows.plan import Lookahead, RowPlan
from downpour.worker.rows.pulling import RowPuller
from downpour.worker.settings import WorkerConfig, validate_worker
from downpour.worker.step import GradientStep, batch_signature
from downpour.worker.tf1 import Tf1Step, check_tf1_inputs

__all__ = ["Worker", "WorkerError"]

log = logging.getLogger("downpour.worker")

RECENT_LOSSES = 20  # the summary's loss_recent averages this many last batches (one is noise)


def _ms(seconds: float | None) -> float | None:
    """Seconds as milliseconds for the summary (None stays None: nothing measured yet)."""
    return None if seconds is None else round(1e3 * seconds, 3)


def batch_rows(labels: Any) -> int:
    """Examples in a batch: the first dimension of its (first) label tensor."""
    return int(tf.nest.flatten(labels)[0].shape[0])


class Worker:
    """One training worker. ``run()`` returns a summary dict, or raises WorkerError."""

    def __init__(self, spec: ModelSpec, config: WorkerConfig, inputs: Inputs | None = None) -> None:
        """Build the model and check the input against it: the first epoch's dataset is
        built and its ``element_spec`` traced into the step, so bad input (InputError) is
        refused here, before anything is sent to a server. ``inputs`` defaults to the spec's
        (``downpour.inputs.pipeline.resolve_inputs``). ConfigError (``validate_worker``) for
        settings that contradict each other."""
        validate_worker(config)  # the cross-field checks live there, and only there
        self.device = configure_device(config.device)  # before any TF op; logged by run()
        self.spec = spec
        self.config = config
        self.inputs = inputs if inputs is not None else resolve_inputs(spec, config.data_dir)
        self.id = config.resolved_id()
        ctx = InputContext(
            worker_index=config.worker_index,
            num_workers=config.num_workers,
            seed=config.seed if config.seed is not None else 0,
            data_dir=config.data_dir,
            batch_size=spec.batch_size,
            worker_id=self.id,
        )
        self.data = TrainingBatches(self.inputs.train, ctx, config, spec.name)
        # the slow paths this worker takes: logged, and reported to the servers' status
        self.notices = Notices()
        dynamic = self._build_model()
        first = self.data.first_dataset()  # InputError: refused
        self.step_fn = self._build_step(first)
        self.data.prime(first)
        self.partition = self._partition(len(config.endpoints()))
        self._stop = threading.Event()
        # Sent with every push and heartbeat; names and units:
        # downpour.runtime.metrics.WORKER_REPORTED.
        # The client layer counts reconnects, backpressure and dropped pushes into it.
        self.stats: dict[str, float] = new_worker_stats()
        self._step_rate = Rate(10.0)
        self.ctx = make_context(config.io_threads)
        self.shards = self._connect()
        self.pusher = Pusher(self.shards, config.compress, config.n_push, self.stats)
        # every hello checks that the server decodes them
        self.shards.encodings = self.pusher.encodings(bool(dynamic))
        self.shards.sends = f"--compress {config.compress}"
        self.puller = Puller(
            config, self.shards, self.step_fn, self.stats, self._stop, lambda: self.pusher.seq
        )
        self._stream: Lookahead | None = None  # the batches, read ahead for row pulls
        if self.data.dispatched:
            self.data.from_splits(self.shards.new_client(self.shards.shards[0]), self._stop)

    def _build_model(self) -> list[str]:
        """The model, big Embeddings as row caches; its dynamic tables' paths, which need
        row pulls by id (WorkerError when the settings rule them out)."""
        with row_cache_scope(self.config.row_cache_rows):  # big Embeddings as row caches
            self.model = build_model(self.spec)
        self.caches = caches_of(self.model)
        dynamic = sorted(p for p, c in self.caches.items() if c.keyed)
        if dynamic and (self.config.row_pulls != "auto" or self.config.graph != "tf2"):
            raise WorkerError(
                f"model {self.spec.name!r} has dynamic tables ({', '.join(dynamic)}), whose rows "
                "a worker pulls by id: they need --row-pulls auto and --graph tf2"
            )
        return dynamic

    def _build_step(self, first: Any) -> GradientStep | Tf1Step:
        """The step function for the first dataset's batches, traced now: InputError when
        they do not fit the model (or a row cache)."""
        spec, spec_of = self.spec, first.element_spec
        check_element_spec(spec_of, self.model)
        self.element_spec = spec_of
        fused = self._rounds_in_step()
        if self.config.graph == "tf1":  # the model's Session graph, checked against the model
            check_tf1_inputs(spec, spec_of)
            return Tf1Step(spec, self.model)
        step = GradientStep(spec, self.model, spec_of, self.caches, round_bf16=fused)
        try:
            step.trace()
        except (ValueError, TypeError) as exc:
            raise InputError(
                f"model {spec.name!r}: its input_fn's batches {spec_of} do not "
                f"fit the model: {' '.join(str(exc).split())[:600]}"
            ) from None
        if self.caches and isinstance(first, tf.data.Dataset):
            for features, _ in first.take(1):
                check_batch(self.model, self.caches, features)
        return step

    def _rounds_in_step(self) -> bool:
        """Whether the compiled step rounds the dense gradients for ``--compress bf16`` (or
        ``bf16:dense``): only a push of one step's gradients from a Keras step (a warning
        names why not). Rows are rounded by the compressor: they are few values a step."""
        cfg = self.config
        if wire.BF16 not in parse_compression(cfg.compress).encodings:
            return False
        why = (
            f"--n-push {cfg.n_push} averages several steps' gradients before the push"
            if cfg.n_push > 1
            else "--graph tf1 computes them in a Session graph"
            if cfg.graph == "tf1"
            else None
        )
        if why is not None:
            self.notices.warn(
                log,
                "--compress %s: gradients are rounded in NumPy at each push, not in the "
                "compiled step, because %s",
                cfg.compress,
                why,
            )
        return why is None

    def _partition(self, num_shards: int) -> Partition:
        """The model's variables over ``num_shards`` shards, as the servers partition them;
        sets the fingerprint, names and message limits from the logical shapes (a row
        cache's: its table's)."""
        variables = self.model.trainable_variables
        self.names = [v.path for v in variables]
        shapes = logical_shapes(variables, self.caches)
        dtypes = [str(v.dtype) for v in variables]
        self.fingerprint = fingerprint_of(
            [(n, list(sh), d) for n, sh, d in zip(self.names, shapes, dtypes, strict=True)]
        )
        dynamic = [v.path in self.caches and self.caches[v.path].keyed for v in variables]
        self.payload_bytes = sum(
            message_bytes(sh, d, dyn) for sh, d, dyn in zip(shapes, dtypes, dynamic, strict=True)
        )
        self.limits = wire.DEFAULT_LIMITS.for_payload(self.payload_bytes)
        return make_partition(self.names, shapes, dtypes, num_shards, self.fingerprint, dynamic)

    def _connect(self) -> ShardSet:
        """Clients for every shard (no message sent yet)."""
        cfg = self.config
        return ShardSet(
            self.ctx,
            cfg.endpoints(),
            self.partition,
            sender=self.id,
            keys=cfg.keys,  # CURVE on every socket, and again after a recreate
            timeout_s=cfg.request_timeout_s,
            server_timeout_s=cfg.server_timeout_s,
            limits=self.limits,
            max_msg_bytes=self.limits.max_total_bytes,
            push_hwm=cfg.push_hwm,
            push_timeout_s=cfg.push_timeout_s,
            push_endpoint=cfg.push_endpoint,
            counters=self.stats,
            stop=self._stop,
            notices=self.notices,
        )

    @property
    def version(self) -> int:
        """The weight version held (with shards: the oldest of the shards' versions)."""
        return self.shards.version

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
        self.data.close()  # the input generators, so their tf.data iterators go now
        clean = self.puller.close()
        if self.data.feed is not None:
            self.data.feed.client.close()
        self.shards.close(self.config.push_linger_s)
        if clean:
            self.ctx.term()  # waits up to the push linger for queued gradients to leave
        else:
            self.ctx.destroy(linger=0)

    def hello(self) -> RowPuller | None:
        """Introduce ourselves to every shard (each checks the model and partition; we check
        it decodes what --compress sends); learn the gradient ports, the policy and where our
        sequence resumes. The row puller for the tables every shard serves by row, if any."""
        with translated():
            hellos = self.shards.hello_all(self.spec.name)
        if self.data.feed is not None and hellos[0].reply.worker_index is not None:
            index = hellos[0].reply.worker_index  # shard 0 dispatches: its order of workers
            self.data.joined(index, max(hellos[0].reply.workers or 0, index + 1))
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
        cfg = self.config
        served = sorted({t for h in hellos for t in h.reply.row_tables or ()})
        if cfg.graph == "tf1" and served and cfg.row_pulls == "auto":
            self.notices.warn(
                log,
                "--graph tf1: tables %s are pulled whole, though the servers serve them by "
                "row: a Session graph's step takes whole variables",
                ", ".join(served),
            )
        if cfg.row_pulls != "auto" or cfg.graph != "tf2" or self._stream is None:
            return None
        plan = RowPlan.build(
            self.model,
            self.partition,
            [h.reply.row_tables for h in hellos],
            batch_signature(tuple(self.element_spec))[0],
            cfg.row_staleness,
            self.caches,
            self.notices,
        )
        if plan is None:
            return None
        rows = RowPuller(
            plan,
            self.shards,
            self.step_fn,
            self.stats,
            self._stream,
            cfg.n_fetch,
            self.puller.request,
        )
        log.info(
            "row pulls for %s (staleness bound %d versions)",
            ", ".join(rows.tables),
            cfg.row_staleness,
        )
        return rows

    # ------------------------------------------------------------ input

    @property
    def input_ctx(self) -> InputContext:
        """What this worker's ``input_fn`` is told (after the hello under dispatch: its
        place in shard 0's order of the workers)."""
        return self.data.ctx

    def batches(self) -> Iterator[tuple[Any, Any]]:
        """The training batches this worker computes on, ``(features, labels)`` as the step
        takes them (NumPy for tf1), at most ``--steps`` of them (``TrainingBatches``)."""
        return self.data.batches()

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
        if self.puller.rows is None or self._stop.is_set():
            return None
        try:
            return float(evaluate(self.spec, self.model, self.puller.with_rows(ds)))
        except WorkerError as exc:  # the servers went away after training: no score
            log.warning("no held-out score: pulling its rows failed: %s", exc)
            return None

    # ------------------------------------------------------------ training

    def run(self) -> dict[str, Any]:
        """Train until the step budget is spent or stop() is called: the next batch, the
        puller before the step, the gradient step, the pusher."""
        cfg = self.config
        total = self.data.total_steps()
        started = time.monotonic()
        loss = float("nan")
        recent: deque[float] = deque(maxlen=RECENT_LOSSES)  # finite batch losses, for the summary
        step = 0
        feed = self.data.feed
        set_log_context(worker=self.id, version=lambda: self.version)
        log.info("computing on %s", self.device)
        self._stream = Lookahead((x, y, feed and feed.mark) for x, y in self.batches())
        self.puller.start(self.hello())
        finished = False  # the input ran out: --epochs done (or --steps)
        while not self._stop.is_set():
            with translated():
                batch = self._stream.next()
            if batch is None:  # a split feed also ends when stopped while it waits
                finished = not self._stop.is_set()
                break
            x, y, mark = batch
            pusher = self.pusher
            if not self.puller.before_step(
                step, x, pusher.empty, pusher.pushed_from, pusher.pushed_dense_from
            ):
                break
            t0 = time.perf_counter()
            loss, grads = self.step_fn(x, y)
            self.stats["compute_ms"] = 1e3 * (time.perf_counter() - t0)
            step += 1
            self._step_rate.mark()
            self.stats["steps_per_s"] = round(self._step_rate.per_second(), 3)
            if math.isfinite(loss):
                self.stats["loss"] = loss
                recent.append(loss)
            if self.pusher.add(grads, loss, step, batch_rows(y), mark) and mark and mark.last:
                feed.split_done(self.pusher.seq)  # acknowledged with the next request
            if cfg.log_every and step % cfg.log_every == 0:
                log.info(
                    "worker %s step %d/%s loss %.4f version %d",
                    self.id,
                    step,
                    total if total is not None else "?",
                    loss,
                    self.version,
                )
        if feed is not None:
            feed.close()  # a finished split not acknowledged yet (stopped, --steps)
        if finished:
            self._announce_finished()
        elapsed = time.monotonic() - started
        summary = {
            "worker": self.id,
            "held_out": self.held_out(),
            "steps": step,
            "seconds": round(elapsed, 2),
            "steps_per_s": round(step / max(elapsed, 1e-9), 3),
            "loss": loss,
            "loss_recent": sum(recent) / len(recent) if recent else float("nan"),
        }
        return summary | self._figures(step, finished)

    def _announce_finished(self) -> None:
        """Tell the shards that end a job that this worker's work is done, with the seq of
        its last push (WorkerError when one does not answer for the server timeout: the
        job could not complete without it)."""
        with translated():
            told = self.shards.finished(self.pusher.seq, dict(self.stats))
        if told:
            log.info(
                "worker %s finished: told %d server(s), last push seq %d",
                self.id,
                told,
                self.pusher.seq,
            )

    def _figures(self, steps: int, finished: bool) -> dict[str, Any]:
        """The summary's figures past the loss: the reported counters (from the metric
        catalogue), the settings that shaped them and the puller's and pusher's own."""
        rows = self.puller.rows
        schedule = self.puller.schedule
        out: dict[str, Any] = {
            "version": self.version,
            "versions": self.shards.versions,
            **reported_counts(self.stats),
            "compress": self.pusher.compressors[0].spec,
            "pull_compress": self.config.pull_compress,
            "fetch_lead_steps": schedule.last_lead,
            "pull_rtt_ms": _ms(schedule.round_trip_s.value),
            "step_ms": _ms(schedule.step_s.value),
            "row_pulls": None if rows is None else rows.tables,
            "row_staleness": self.config.row_staleness,
            "row_cache_rows": self.config.row_cache_rows,
            "row_cache_evictions": sum(c.evictions for c in self.caches.values()),
            "peak_rss_mib": peak_rss_mib(),
            "last_seq": self.pusher.seq,
            "epochs": self.data.epoch + 1 if steps else 0,
            "stopped_early": not finished,
            "notices": list(self.notices.items()),
        }
        if self.data.feed is not None:
            out["dispatch"] = dict(self.data.feed.counts)
        return out
