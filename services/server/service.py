"""The parameter-server service: the loop that ties sockets, handlers and state together.

One thread owns the parameters: it polls the REP socket (hello, weight pulls, heartbeats)
and the gradient socket, passes each message to ``downpour.server.handlers`` (whose gradient
handler also applies the policy's decisions) and sends the replies, so a weight reply is
always a whole version and never races an apply. Between messages it writes checkpoints,
feeds the observers and publishes the status document. The status socket has its own
thread and answers from the published document, so a slow or flooding status client never
stalls training.

Where the parts live: sockets and CURVE in ``sockets``, the worker registry in ``registry``,
request and gradient handling in ``handlers``, the status document and the status socket's
thread in ``status_doc`` (``StatusBoard``), the versioned variables and compiled apply in
``state``, restoring at start and writing checkpoints in ``checkpointing``. With shards each
shard runs its own policy on its own slice and its own version; for ``sync:K/N`` that means
each shard aggregates its rounds independently. On stop the loop drains the gradients
already received, applies a partial sync round, writes a final checkpoint and closes.

With ``--job-workers N`` the server also ends on its own (``downpour.server.job``): once N
workers have finished it does the same drain, flush and final checkpoint, marks its status
``job: done`` (or ``failed``), keeps serving pulls and status until a reader acknowledges
or ``--linger-after-done`` passes, and ``run()`` returns the exit code (0, or 3: failed).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import secrets
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from downpour import wire
from downpour.checkpoints.store import CheckpointStore
from downpour.net import security
from downpour.net.receive import Oversize, keep_receive_buffers, recv_bounded
from downpour.runtime import systemd
from downpour.runtime.device import configure_device
from downpour.runtime.logs import RateLimitedLog, set_log_context, stop_on_signals
from downpour.server.checkpointing.restore import Resumed, resume
from downpour.server.checkpointing.writer import CheckpointWriter
from downpour.server.dispatch import Dispatcher
from downpour.server.handlers import (
    HandlerContext,
    Rejection,
    Reply,
    flush_policy,
    handle_gradients,
    handle_request,
    refuse_oversize,
    release_gone,
    socket_bounds,
)
from downpour.server.job import FAILED, JobTracker
from downpour.server.observers import Observers
from downpour.server.observers.exports import ServingExporter
from downpour.server.policies.base import parse_policy
from downpour.server.registry import WorkerRegistry
from downpour.server.settings import ModelFacts, ServerConfig, validate_server
from downpour.server.sockets import ServerSockets
from downpour.server.state import DYNAMIC_OPTIMIZER, ParameterState
from downpour.server.stats import ServerStats
from downpour.server.status_doc import StatusBoard, build_status
from downpour.server.tables.shard import TableOptions
from downpour.spec import ModelSpec

RETAIN_PUSHES = 4  # pushes' worth of freed receive buffers the heap keeps for the next ones
RETAIN_MAX_BYTES = 1 << 28  # ... but never more (frames over 32 MiB are not kept anyway)

__all__ = ["Server", "ServerConfig"]

log = logging.getLogger("downpour.server")


def note_dynamic_optimizer(state: ParameterState, optimizer: str) -> None:
    """Say at warning level when the dynamic tables' rows are updated by another optimizer
    than ``--optimizer`` (adam's rows go lazily: ``DYNAMIC_OPTIMIZER``)."""
    kind = DYNAMIC_OPTIMIZER[optimizer]
    if state.tables and kind != optimizer:
        log.warning(
            "dynamic tables %s are updated by %s (--optimizer %s): rows and moments change "
            "only where a gradient touches them",
            ", ".join(sorted(state.tables)),
            kind,
            optimizer,
        )


def largest_dense_frame(state: ParameterState) -> int:
    """Bytes of the largest tensor a push carries whole (row-sparse ones carry rows): the
    largest receive buffer ``keep_receive_buffers`` should keep on the heap."""
    return max(
        (
            int(np.prod(shape)) * dtype.itemsize
            for shape, dtype, sparse in zip(state.shapes, state.dtypes, state.sparse, strict=True)
            if not sparse
        ),
        default=0,
    )


class Server:
    """A parameter server for one model. ``run()`` blocks until ``stop()`` or SIGTERM/SIGINT."""

    def __init__(self, spec: ModelSpec, config: ServerConfig) -> None:
        """Build the server for ``spec`` from ``config``: ConfigError (``validate_server``)
        for settings that contradict each other or the model, ValueError for a policy it
        cannot parse."""
        validate_server(config)  # the cross-field checks live there, and only there
        log.info("computing on %s", configure_device(config.device))  # before any TF op
        self.spec = spec
        self.config = config
        self.policy = parse_policy(config.policy)  # ValueError names the accepted forms
        self.state = self._build_state()
        self.partition = self.state.partition
        self.incarnation = secrets.token_hex(8)
        self._resume()
        self.limits = wire.DEFAULT_LIMITS.for_payload(self.state.payload_bytes)
        self.receive_heap = keep_receive_buffers(
            largest_dense_frame(self.state),
            min(RETAIN_PUSHES * self.state.payload_bytes, RETAIN_MAX_BYTES),
        )
        self.registry = WorkerRegistry(
            config.missing_after_s,
            config.gone_after_s,
            self.restored_seqs,
            max_workers=config.max_workers,
            forget_after_s=config.forget_after_s,
        )
        self.stats = ServerStats()
        self.job: JobTracker | None = None
        if config.job_workers:
            self.job = JobTracker(config.job_workers, config.job_timeout_s, config.drain_timeout_s)
            self.job.restore(self.restored_finished, time.monotonic())
        self.started = time.monotonic()
        self.started_wall = time.time()
        self._stop = threading.Event()
        self._warn = RateLimitedLog(log)
        self.board = StatusBoard(
            self.stats.counters,
            self.snapshot,
            interval_s=config.publish_interval_s,
            max_per_s=config.status_max_per_s,
            stop=self._stop,
        )
        self._observe()
        self._open_sockets()
        self.handler_ctx = self._handler_context()
        self.request_bound, self.gradient_bound = socket_bounds(self.handler_ctx)
        self.board.publish(force=True)

    def _build_state(self) -> ParameterState:
        """The parameters, with the dynamic tables' overrides; checked again with the model."""
        config = self.config
        state = ParameterState(
            self.spec,
            config.optimizer,
            config.learning_rate,
            config.seed,
            shard=config.shard,
            num_shards=config.num_shards,
            table_options=TableOptions(
                config.table_rows_per_shard,
                config.fallback_rows,
                config.evict_policy,
                config.admission,
                config.admit_after,
                config.admit_init,
                config.evict_idle_versions,
            ),
        )
        validate_server(config, ModelFacts(tuple(state.tables)))  # and with the model
        note_dynamic_optimizer(state, config.optimizer)
        return state

    def _resume(self) -> None:
        """The split dispatcher and the checkpoint writer, and what a checkpoint in the state
        directory restores (``downpour.server.checkpointing.restore.resume``)."""
        config = self.config
        dispatcher = Dispatcher(seed=config.seed) if config.data_dispatch == "server" else None
        self.checkpoints: CheckpointWriter | None = None
        resumed = Resumed(dispatcher=dispatcher)
        if config.state_dir:
            self.checkpoints = CheckpointWriter(
                CheckpointStore(config.state_dir, config.keep_checkpoints, _test_write_hook()),
                config.checkpoint_every,
                config.checkpoint_secs,
            )
            resumed = resume(
                self.state, self.checkpoints.store, config.restore_from, dispatcher, config.seed
            )
        self.dispatcher = resumed.dispatcher
        self.restored_seqs = resumed.workers
        self.restored_from = resumed.version
        self.restore_s = resumed.seconds  # reading and assigning the checkpoint(s)
        self.restored_finished = resumed.finished  # workers a checkpoint says finished

    def _observe(self) -> None:
        """The observers (evaluation, TensorBoard, Prometheus) and the serving exports."""
        config = self.config
        self.obs = Observers(self.spec, config, lambda: self.board.document)  # reads snapshots
        self.exports: ServingExporter | None = None
        if config.export_every:
            self.exports = ServingExporter(self.spec, config.export_dir, config.export_every,
                                           config.export_keep, self.state.fingerprint)  # fmt: skip

    def _open_sockets(self) -> None:
        """Bind the REP, gradient and status sockets (CURVE first, with keys)."""
        config = self.config
        # a row request carries ids: the request limit grows with --max-pull-rows per table
        self.max_request_bytes = wire.request_max_bytes(
            config.max_pull_rows, sum(self.state.sparse)
        )
        self.sockets = ServerSockets(
            config.host,
            config.port,
            config.push_port,
            config.status_port,
            max_gradient_bytes=self.limits.max_total_bytes,
            max_request_bytes=self.max_request_bytes,
            io_threads=config.io_threads,
            keys=config.keys,
        )
        self.auth = self.sockets.auth
        self.port = self.sockets.port
        self.push_port = self.sockets.push_port
        self.status_port = self.sockets.status_port

    def _handler_context(self) -> HandlerContext:
        """What the handlers read and update (``downpour.server.handlers``)."""
        config = self.config
        return HandlerContext(
            state=self.state,
            policy=self.policy,
            registry=self.registry,
            model=self.spec.name,
            incarnation=self.incarnation,
            shard=self.shard_fields(),
            push_port=self.push_port,
            status_port=self.status_port,
            limits=self.limits,
            max_request_bytes=self.max_request_bytes,
            request_limits=dataclasses.replace(
                wire.DEFAULT_LIMITS, max_pull_rows=config.max_pull_rows
            ),
            stats=self.stats,
            allow_nonfinite=config.allow_nonfinite,
            authenticated=self.sockets.authenticated,
            dispatcher=self.dispatcher,
            job=self.job,
        )

    # ------------------------------------------------------------ durability

    def _checkpoint_meta(self) -> dict[str, Any]:
        """The checkpoint metadata that is the server's, not its state's (``capture_state``)."""
        return {
            "model": self.spec.name,
            "model_ref": self.config.model_ref,
            "workers": self.registry.last_seqs(),
            **({"dispatch": self.dispatcher.state()} if self.dispatcher is not None else {}),
            **({"finished": dict(self.job.finished)} if self.job is not None else {}),
        }

    def shard_fields(self) -> dict[str, Any]:
        """Which shard this is and of which partition (hello, status, ready file, checkpoints)."""
        return {
            "shard": self.config.shard,
            "num_shards": self.config.num_shards,
            "partition": self.partition.digest,
        }

    def _maybe_checkpoint(self, final: bool = False) -> None:
        if self.checkpoints is not None:
            # the dispatcher's acknowledged splits change the state without changing the version
            mark = None if self.dispatcher is None else self.dispatcher.counters["acked"]
            self.checkpoints.checkpoint(self.state, self._checkpoint_meta, mark, final)

    # ------------------------------------------------------------ lifecycle

    def endpoints(self) -> dict[str, Any]:
        """Where this server listens, as written to the ready file."""
        return {
            "pid": os.getpid(),
            "host": self.config.host,
            "port": self.port,
            "push_port": self.push_port,
            "status_port": self.status_port,
            "fingerprint": self.state.fingerprint,
            "version": self.state.version,
            **self.shard_fields(),
            **self.obs.endpoints(),
        }

    def _write_ready_file(self) -> None:
        if not self.config.ready_file:
            return
        path = Path(self.config.ready_file)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.endpoints()))
        os.replace(tmp, path)

    def stop(self) -> None:
        """Ask the loop to finish: drain received gradients, then return from run()."""
        self._stop.set()

    def install_signal_handlers(self) -> None:
        """SIGTERM and SIGINT stop the server cleanly (main thread only)."""
        stop_on_signals(self.stop, log)
        if (auth := self.auth) is not None:  # SIGHUP: re-read the allow-lists (key rotation)
            signal.signal(signal.SIGHUP, lambda _signum, _frame: auth.request_reload())

    def run(self) -> int:
        """Serve until stopped, or until the job ends (``--job-workers``); then apply what
        has been received and close the sockets. The exit code: 0, or 3 for a failed job."""
        set_log_context(version=lambda: self.state.version)
        self.board.start(self.sockets.status_sock)
        self.obs.start()
        self._write_ready_file()
        # systemd Type=notify: ready only now, with the sockets bound and any checkpoint restored
        systemd.notify(
            f"READY=1\nMAINPID={os.getpid()}\nSTATUS=serving version {self.state.version} on "
            f"{self.config.host} ports {self.port}/{self.push_port}/{self.status_port}"
        )
        log.info(
            "serving %s shard %d/%d (%d tensors, %.1f MB, fingerprint %s) on %s ports %d/%d/%d",
            self.spec.name,
            self.config.shard,
            self.config.num_shards,
            len(self.state.names),
            self.state.payload_bytes / 1e6,
            self.state.fingerprint[:12],
            self.config.host,
            self.port,
            self.push_port,
            self.status_port,
        )
        log.info("staleness policy: %s", self.policy)
        watchdog = systemd.Watchdog()  # WatchdogSec=: pings while the loop and status thread run
        rep, grad_sock = self.sockets.rep, self.sockets.grad_sock
        poller = zmq.Poller()
        poller.register(rep, zmq.POLLIN)
        poller.register(grad_sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(100))
                if rep in events:
                    self._serve_request_once()
                if grad_sock in events:
                    self._drain_gradients(max_messages=16)
                self.registry.forget_idle(time.monotonic())
                release_gone(self.handler_ctx)
                self._maybe_checkpoint()
                watchdog.tick(healthy=self.board.alive())
                self.obs.after_loop_pass(self.state)
                if self.exports is not None:
                    self.exports.after_loop_pass(self.state)
                self.board.publish()
                self._job_pass(poller)
            systemd.notify("STOPPING=1\nSTATUS=stopping: applying received gradients")
            if self.job is None or not self.job.ended:
                self._finish()
        finally:
            self.board.publish(force=True)
            log.info(
                "stopped at version %d after %d updates; rejected %s",
                self.state.version,
                self.state.version,
                dict(self.stats.rejected) or "none",
            )
            self.close()
        return 0 if self.job is None else self.job.exit_code()

    def _finish(self) -> bool:
        """Apply the gradients received and what the policy holds, write the final checkpoint;
        False when that checkpoint could not be written."""
        self._drain_gradients(deadline=time.monotonic() + self.config.drain_timeout_s)
        flush_policy(self.handler_ctx)
        self._maybe_checkpoint(final=True)
        if self.exports is not None:
            self.exports.final(self.state)
        cp = self.checkpoints
        return cp is None or cp.last_version == self.state.version

    def _job_pass(self, poller: zmq.Poller) -> None:
        """End the job when its verdict comes (``downpour.server.job``): final checkpoint, then
        the status says so and the gradient socket is no longer read; once ended, stop when a
        reader has acknowledged or the linger has passed."""
        job = self.job
        if job is None:
            return
        now = time.monotonic()
        if job.ended:
            if job.released(now, self.board.acked.is_set(), self.config.linger_after_done_s):
                self._stop.set()
            return
        verdict = job.verdict(self.registry, now)
        if verdict is None:
            return
        state, reason = verdict
        if not self._finish():
            state, reason = FAILED, f"{reason}; the final checkpoint could not be written"
        job.end(state, reason, self.state.version, time.monotonic())
        poller.unregister(self.sockets.grad_sock)  # pushes after the end are not read
        systemd.notify(f"STATUS=job {state} at version {self.state.version}")
        self.board.publish(force=True)

    def close(self) -> None:
        """Close sockets and the context (idempotent)."""
        self._stop.set()
        if self.checkpoints is not None:
            self.checkpoints.close()
        if self.exports is not None:
            self.exports.close()
        self.board.join(2.0)
        self.obs.close()
        self._warn.flush()
        self.sockets.close()

    # ------------------------------------------------------------ messages

    def _drain_gradients(self, max_messages: int = 1 << 30, deadline: float | None = None) -> None:
        """Handle up to ``max_messages`` received pushes (until ``deadline``), answering any
        waiting request between them so weight pulls stay prompt under a flood."""
        grad_sock, rep = self.sockets.grad_sock, self.sockets.rep
        for _ in range(max_messages):
            if deadline is not None and time.monotonic() > deadline:
                return
            try:
                frames = recv_bounded(grad_sock, self.gradient_bound, zmq.NOBLOCK)
            except zmq.Again:
                return
            if isinstance(frames, Oversize):
                bound = self.gradient_bound
                self._report(refuse_oversize(self.handler_ctx, frames, bound, "a push"))
            else:
                ctx, peer = self.handler_ctx, self.sockets.peer_key(frames)
                outcome = handle_gradients(frames, ctx, peer)
                if outcome.rejection is not None:
                    self._report(outcome.rejection)
            if rep.poll(0, zmq.POLLIN):
                self._serve_request_once()

    def _serve_request_once(self) -> None:
        """Answer one waiting request on the REP socket, if there is one."""
        rep = self.sockets.rep
        try:
            frames = recv_bounded(rep, self.request_bound, zmq.NOBLOCK)
        except zmq.Again:
            return
        try:
            if isinstance(frames, Oversize):
                rejection = refuse_oversize(
                    self.handler_ctx, frames, self.request_bound, "a request"
                )
                reply = Reply(wire.error_message(rejection.code, rejection.message), rejection)
            else:
                reply = handle_request(frames, self.handler_ctx, self.sockets.peer_key(frames))
        except Exception as exc:  # never leave a REQ peer without an answer
            log.exception("internal error answering a request")
            reply = Reply(wire.error_message(wire.R_INTERNAL, repr(exc)))
        if reply.rejection is not None:
            self._report(reply.rejection)
        out = wire.encode(reply.message)
        self.stats.counters["bytes_out"] += sum(memoryview(f).nbytes for f in out)
        rep.send_multipart(out, copy=False)

    def _report(self, rejection: Rejection) -> None:
        """Log a refusal (rate-limited per reason); an identity refusal is also an
        authentication denial."""
        if rejection.code == security.R_IDENTITY and self.auth is not None:
            self.auth.deny(security.R_IDENTITY, rejection.message)
        self._warn.warning(
            rejection.code,
            "rejected message from %s: %s: %s",
            rejection.sender or "?",
            rejection.code,
            rejection.message,
            extra={"worker": rejection.sender},
        )

    # ------------------------------------------------------------ status

    def snapshot(self) -> dict[str, Any]:
        """The status document (fields: docs/cli.md): plain types, JSON-serialisable."""
        return build_status(
            self.handler_ctx,
            now=time.monotonic(),
            started=self.started,
            started_wall=self.started_wall,
            restored_from=self.restored_from,
            restore_s=self.restore_s,
            checkpoints=self.checkpoints.snapshot() if self.checkpoints else None,
            evaluation=self.obs.eval_status(),
            exports=self.exports.snapshot() if self.exports is not None else None,
            auth=self.auth,
            receive_heap=self.receive_heap,
        )


def _test_write_hook() -> Callable[[Path], None] | None:
    """Fault tests only: DOWNPOUR_TEST_CHECKPOINT_DELAY_S slows every checkpoint write by that
    many seconds, just before the rename, so a test can kill the server mid-write."""
    delay = float(os.environ.get("DOWNPOUR_TEST_CHECKPOINT_DELAY_S", "0") or 0)
    if delay <= 0:
        return None
    return lambda _tmp: time.sleep(delay)
