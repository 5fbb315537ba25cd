"""The parameter-server service: sockets, the apply loop, validation, bookkeeping.

One thread owns the parameters and serves gradients (PULL) and hello/pull (REP) from one
poll loop, so a weight reply is always a whole version and never races an apply. The status
socket has its own thread and answers from a snapshot the loop publishes, so a slow or
flooding status client never stalls training.

Every valid push goes through the staleness policy (``--policy``, ``downpour.server.policies``):
it is applied (with the policy's learning-rate scale), dropped (counted, not an error: the
sender hears about stale drops in its next pull reply, ``dropped_stale``) or held (``sync:K/N``
aggregation; a partial round is applied when the server stops). With shards each shard runs
its own policy on its own slice and its own version; for ``sync:K/N`` that means each shard
aggregates its rounds independently.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from downpour import security, systemd, wire
from downpour.logs import RateLimitedLog, set_log_context, stop_on_signals
from downpour.metrics import STALENESS_BOUNDS, Ewma, Histogram, Rate, ReasonCounter, clean_reported
from downpour.server.checkpoint import CheckpointStore, CheckpointWriter, capture
from downpour.server.checkpoint import restore as restore_checkpoint
from downpour.server.observe import Observers
from downpour.server.policies import (
    APPLY,
    DROP,
    REASON_LATE,
    REASON_STALE,
    Decision,
    SyncPolicy,
    parse_policy,
)
from downpour.server.settings import ServerConfig
from downpour.server.state import ParameterState
from downpour.spec import ModelSpec
from downpour.transport import bind, make_context
from downpour.wire import Message, ProtocolError

PULL_ENCODINGS = frozenset({wire.DENSE, wire.BF16})  # what a pull may ask the weights in
log = logging.getLogger("downpour.server")

LOOPBACK_PREFIXES = ("127.", "localhost", "::1", "[::1]")


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


class Server:
    """A parameter server for one model. ``run()`` blocks until ``stop()`` or SIGTERM/SIGINT."""

    def __init__(self, spec: ModelSpec, config: ServerConfig) -> None:
        self.spec = spec
        self.config = config
        self.policy = parse_policy(config.policy)  # ValueError names the accepted forms
        if config.num_shards > 1 and config.eval_every:
            raise ValueError(
                "--eval-every needs the whole model: a shard holds part of it (evaluate with "
                "`downpour run-local` or from pulled weights instead)"
            )
        self.state = ParameterState(
            spec,
            config.optimizer,
            config.learning_rate,
            config.seed,
            shard=config.shard,
            num_shards=config.num_shards,
        )
        self.partition = self.state.partition
        self.incarnation = secrets.token_hex(8)
        self.restored_seqs: dict[str, int] = {}
        self.restored_from: int | None = None
        self.checkpoints: CheckpointWriter | None = None
        if config.state_dir:
            self.checkpoints = CheckpointWriter(
                CheckpointStore(config.state_dir, config.keep_checkpoints, _test_write_hook()),
                config.checkpoint_every,
                config.checkpoint_secs,
            )
            self._restore()
        self.limits = wire.DEFAULT_LIMITS.for_payload(self.state.payload_bytes)
        self.workers: dict[str, WorkerRecord] = {}
        self.rejected = ReasonCounter()
        self.staleness = Histogram(STALENESS_BOUNDS)
        self.apply_ms = Ewma(0.05)
        self.loss = Ewma(0.05)
        self.update_rate = Rate(10.0)
        self.counters = {
            "pushes_received": 0,
            "pulls": 0,
            "pulls_unchanged": 0,
            "pulls_bf16": 0,
            "hellos": 0,
            "bytes_in": 0,
            "bytes_out": 0,
            "status_requests": 0,
            "status_rejected": 0,
        }
        self._bf16: tuple[int, list[wire.WireTensor]] | None = None  # version, rounded
        self.started = time.monotonic()
        self.started_wall = time.time()
        self._stop = threading.Event()
        self._published: dict[str, Any] = {}
        self._last_publish = 0.0
        self._warn = RateLimitedLog(log)
        self.obs = Observers(spec, config, lambda: self._published)  # reads snapshots only
        self.ctx = make_context(config.io_threads)
        self.rep = self.ctx.socket(zmq.REP)
        self.pull = self.ctx.socket(zmq.PULL)
        self.status_sock = self.ctx.socket(zmq.REP)
        for s in (self.rep, self.pull, self.status_sock):
            s.setsockopt(zmq.LINGER, 0)
        # A peer sending more than the model could need is cut off before we allocate.
        self.pull.setsockopt(zmq.MAXMSGSIZE, self.limits.max_total_bytes)
        self.rep.setsockopt(zmq.MAXMSGSIZE, 1 << 20)
        self.status_sock.setsockopt(zmq.MAXMSGSIZE, 1 << 16)
        self.auth: security.Authenticator | None = None
        if config.keys is not None:  # CURVE + ZAP on every socket, enforced before any bind
            self.auth = security.Authenticator(self.ctx, config.keys)
            for sock, domain, label in (
                (self.rep, security.TRAINING_DOMAIN, "rep"),
                (self.pull, security.TRAINING_DOMAIN, "push"),
                (self.status_sock, security.STATUS_DOMAIN, "status"),
            ):
                security.configure_curve_server(sock, config.keys, domain)
                self.auth.watch(sock, label)
            try:
                self.auth.start()  # raises SecurityError: the server refuses to start
            except security.SecurityError:
                self.ctx.destroy(linger=0)
                raise
        self.port = bind(self.rep, config.host, config.port)
        self.push_port = bind(self.pull, config.host, config.push_port)
        self.status_port = bind(self.status_sock, config.host, config.status_port)
        self._publish(force=True)
        self._status_thread = threading.Thread(
            target=self._serve_status, name="status", daemon=True
        )

    # ------------------------------------------------------------ durability

    def _restore(self) -> None:
        assert self.checkpoints is not None
        store = self.checkpoints.store
        store.clean_leftovers()
        ckpt = store.latest()
        if ckpt is None:
            log.info("no checkpoint in %s: starting from fresh weights", store.dir)
            return
        restore_checkpoint(self.state, ckpt)
        self.restored_seqs = {str(k): int(v) for k, v in ckpt.meta.get("workers", {}).items()}
        self.restored_from = ckpt.version
        log.info("restored version %d from %s", ckpt.version, ckpt.path)

    def _checkpoint_meta(self) -> dict[str, Any]:
        seqs = dict(self.restored_seqs)
        seqs.update({wid: r.last_seq for wid, r in self.workers.items()})
        return {
            "fingerprint": self.state.fingerprint,
            "model": self.spec.name,
            "model_ref": self.config.model_ref,
            "workers": seqs,
            **self.shard_fields(),
        }

    def shard_fields(self) -> dict[str, Any]:
        """Which shard this is and of which partition (hello, status, ready file, checkpoints)."""
        return {
            "shard": self.config.shard,
            "num_shards": self.config.num_shards,
            "partition": self.partition.digest,
        }

    def _maybe_checkpoint(self, final: bool = False) -> None:
        cp = self.checkpoints
        if cp is None or not (final or cp.due(self.state.version)):
            return
        arrays = capture(self.state)
        if final:
            cp.write_now(self.state.version, arrays, self._checkpoint_meta())
        else:
            cp.submit(self.state.version, arrays, self._checkpoint_meta())

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

    def run(self) -> None:
        """Serve until stopped; then apply what has been received and close the sockets."""
        set_log_context(version=lambda: self.state.version)
        self._status_thread.start()
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
            len(self.state.variables),
            self.state.payload_bytes / 1e6,
            self.state.fingerprint[:12],
            self.config.host,
            self.port,
            self.push_port,
            self.status_port,
        )
        log.info("staleness policy: %s", self.policy)
        watchdog = systemd.Watchdog()  # WatchdogSec=: pings while the loop and status thread run
        poller = zmq.Poller()
        poller.register(self.rep, zmq.POLLIN)
        poller.register(self.pull, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(100))
                if self.rep in events:
                    self._serve_rep_once()
                if self.pull in events:
                    self._drain_pushes(max_messages=16)
                self._maybe_checkpoint()
                watchdog.tick(healthy=self._status_thread.is_alive())
                self.obs.after_loop_pass(self.state)
                self._publish()
            systemd.notify("STOPPING=1\nSTATUS=stopping: applying received gradients")
            self._drain_pushes(deadline=time.monotonic() + self.config.drain_timeout_s)
            self._flush_policy()
            self._maybe_checkpoint(final=True)
        finally:
            self._publish(force=True)
            log.info(
                "stopped at version %d after %d updates; rejected %s",
                self.state.version,
                self.state.version,
                dict(self.rejected) or "none",
            )
            self.close()

    def close(self) -> None:
        """Close sockets and the context (idempotent)."""
        self._stop.set()
        if self.checkpoints is not None:
            self.checkpoints.close()
        if self._status_thread.is_alive():
            self._status_thread.join(timeout=2.0)
        self.obs.close()
        self._warn.flush()
        for s in (self.rep, self.pull, self.status_sock):
            s.close(linger=0)
        if self.auth is not None:
            self.auth.stop()  # closes its sockets, or ctx.term() would wait for them
        self.ctx.term()

    # ------------------------------------------------------------ gradients

    def _drain_pushes(self, max_messages: int = 1 << 30, deadline: float | None = None) -> None:
        for _ in range(max_messages):
            if deadline is not None and time.monotonic() > deadline:
                return
            try:
                frames = self.pull.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._handle_push(frames)
            if self.rep.poll(0, zmq.POLLIN):  # keep weight fetches prompt under a flood
                self._serve_rep_once()

    def _worker(self, worker_id: str) -> WorkerRecord:
        now = time.monotonic()
        rec = self.workers.get(worker_id)
        if rec is None:
            rec = self.workers[worker_id] = WorkerRecord(
                first_seen=now, last_seen=now, last_seq=self.restored_seqs.get(worker_id, 0)
            )
            log.info("worker %s joined", worker_id, extra={"worker": worker_id})
        rec.last_seen = now
        return rec

    def _reject(self, code: str, message: str, sender: str | None) -> None:
        self.rejected[code] += 1
        if sender is not None and sender in self.workers:
            self.workers[sender].rejected += 1
        self._warn.warning(
            code,
            "rejected message from %s: %s: %s",
            sender or "?",
            code,
            message,
            extra={"worker": sender},
        )

    def _gradients(self, msg: Message) -> list[np.ndarray | wire.Sparse]:
        """Check a push's tensors against the model; return them in variable order. A row-sparse
        gradient of a variable the state applies sparsely stays sparse (unless the policy sums
        gradients, which it does densely)."""
        st = self.state
        keep_sparse = not isinstance(self.policy, SyncPolicy)
        if len(msg.tensors) != len(st.names):
            raise ProtocolError(
                wire.R_COUNT, f"{len(msg.tensors)} tensors, model has {len(st.names)}"
            )
        grads = []
        for (name, t), want, shape, dtype, sparse in zip(
            msg.tensors.items(), st.names, st.shapes, st.dtypes, st.sparse, strict=True
        ):
            if name != want:
                raise ProtocolError(wire.R_NAME, f"tensor {name!r} where {want!r} was expected")
            got_shape = wire.logical_shape(t)
            got_dtype = wire.logical_dtype(t)
            if tuple(got_shape) != shape:
                raise ProtocolError(wire.R_SHAPE, f"{name!r}: shape {tuple(got_shape)} != {shape}")
            if got_dtype != dtype:
                raise ProtocolError(wire.R_DTYPE, f"{name!r}: dtype {got_dtype} != {dtype}")
            if sparse and keep_sparse and isinstance(t, wire.Sparse):
                grads.append(t)  # applied to the rows it touches only
            else:
                grads.append(wire.densify(t))
        return grads

    def _check_identity(self, user: str | None, claimed: str) -> None:
        """With CURVE, a worker may only speak as its key's name (ZAP User-Id) or NAME/..."""
        if not security.may_speak_as(user, claimed):
            assert self.auth is not None
            self.auth.deny(security.R_IDENTITY, f"key {user!r} claimed to be {claimed!r}")
            raise ProtocolError(
                security.R_IDENTITY, f"sender {claimed!r} but the message came with {user!r}'s key"
            )

    def _handle_push(self, frames: list[zmq.Frame]) -> None:
        self.counters["pushes_received"] += 1
        self.counters["bytes_in"] += sum(len(f) for f in frames)
        sender: str | None = None
        try:
            msg = wire.decode(frames, self.limits)
            sender = msg.sender
            if msg.type != wire.PUSH:
                raise ProtocolError(
                    wire.R_WRONG_SOCKET, f"{msg.type!r} sent to the gradient socket"
                )
            if self.auth is not None:  # CURVE: count against the key's owner; bind the id
                sender = security.user_id(frames[0])
                self._check_identity(sender, msg.sender)
            rec = self._worker(msg.sender)
            rec.pushes += 1
            # header-only checks first: a replay is refused before any sparse densify
            if msg.seq <= rec.last_seq:
                raise ProtocolError(
                    wire.R_DUPLICATE, f"seq {msg.seq} <= last accepted {rec.last_seq}"
                )
            if msg.base_version > self.state.version:
                raise ProtocolError(
                    wire.R_FUTURE,
                    f"base_version {msg.base_version} > server version {self.state.version}",
                )
            grads = self._gradients(msg)
            if not self.config.allow_nonfinite:
                for name, g in zip(self.state.names, grads, strict=True):
                    if not wire.all_finite(g.values if isinstance(g, wire.Sparse) else g):
                        raise ProtocolError(wire.R_NONFINITE, f"{name!r} has NaN or Inf")
        except ProtocolError as exc:
            self._reject(exc.code, exc.message, sender)
            return
        staleness = self.state.version - msg.base_version
        # Valid and new: the policy decides. A drop or a hold is accepted, not an error.
        decision = self.policy.offer(grads, msg.base_version, self.state.version, msg.sender)
        rec.last_seq = msg.seq
        rec.staleness = staleness
        if decision.action == APPLY:
            self._apply_decision(decision)
        elif decision.action == DROP:
            rec.dropped += 1
            if decision.reason in (REASON_STALE, REASON_LATE):  # told at its next pull
                rec.dropped_unreported += 1
        else:
            rec.held += 1
        rec.steps = int(msg.body.get("steps", rec.steps) or 0)
        loss = msg.body.get("loss")
        if isinstance(loss, float | int) and np.isfinite(loss):
            rec.loss = float(loss)
            self.loss.update(float(loss))
        if "stats" in msg.body:
            rec.reported = clean_reported(msg.body["stats"])

    def _apply_decision(self, decision: Decision) -> None:
        """Apply a policy's update (its gradients, its learning-rate scale); credit its workers."""
        assert decision.grads is not None
        t0 = time.perf_counter()
        self.state.apply(decision.grads, decision.lr_scale)
        self.apply_ms.update(1e3 * (time.perf_counter() - t0))
        self.update_rate.mark()
        self.staleness.observe(decision.staleness)
        for wid in decision.workers:
            if (r := self.workers.get(wid)) is not None:
                r.applied += 1

    def _flush_policy(self) -> None:
        """At shutdown: apply what the policy still holds (a partial sync round), if anything."""
        decision = self.policy.flush(self.state.version)
        if decision is not None and decision.action == APPLY:
            log.info(
                "applying a partial %s round of %d gradients", self.policy, len(decision.workers)
            )
            self._apply_decision(decision)

    # ------------------------------------------------------------ hello / pull

    def _serve_rep_once(self) -> None:
        try:
            frames = self.rep.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return
        self.counters["bytes_in"] += sum(len(f) for f in frames)
        try:
            reply = self._answer(frames)
        except ProtocolError as exc:
            self._reject(exc.code, exc.message, None)
            reply = wire.error_message(exc.code, exc.message)
        except Exception as exc:  # never leave a REQ peer without an answer
            log.exception("internal error answering a request")
            reply = wire.error_message(wire.R_INTERNAL, repr(exc))
        out = wire.encode(reply)
        self.counters["bytes_out"] += sum(memoryview(f).nbytes for f in out)
        self.rep.send_multipart(out, copy=False)

    def _answer(self, frames: list[zmq.Frame]) -> Message:
        msg = wire.decode(frames, wire.DEFAULT_LIMITS)
        if self.auth is not None:  # CURVE: a request speaks only as its key's name
            self._check_identity(security.user_id(frames[0]), msg.sender)
        if msg.type == wire.HELLO:
            return self._hello(msg)
        if msg.type == wire.PULL:
            return self._pull(msg)
        if msg.type == wire.HEARTBEAT:
            return self._heartbeat(msg)
        raise ProtocolError(wire.R_WRONG_SOCKET, f"{msg.type!r} is not served on this socket")

    def _hello(self, msg: Message) -> Message:
        self.counters["hellos"] += 1
        theirs = msg.body.get("fingerprint")
        if theirs != self.state.fingerprint:
            self.rejected[wire.R_FINGERPRINT] += 1
            log.warning(
                "refused worker %s: model fingerprint %s != %s",
                msg.sender,
                theirs,
                self.state.fingerprint,
            )
            return wire.error_message(
                wire.R_FINGERPRINT,
                f"worker model {msg.body.get('model')!r} (fingerprint {theirs}) differs from the "
                f"server's {self.spec.name!r} (fingerprint {self.state.fingerprint}): start the "
                f"worker with the same --model as the server",
            )
        mine = self.shard_fields()
        theirs_part = {k: msg.body.get(k) for k in mine}
        # A client that sends no partition (a plain hello) is accepted by an unsharded server.
        unsharded_client = theirs_part["partition"] is None and self.config.num_shards == 1
        if theirs_part != mine and not unsharded_client:
            self.rejected[wire.R_PARTITION] += 1
            log.warning("refused worker %s: partition %s != %s", msg.sender, theirs_part, mine)
            return wire.error_message(
                wire.R_PARTITION,
                f"worker expects shard {theirs_part['shard']} of {theirs_part['num_shards']} "
                f"(partition {theirs_part['partition']}), this is shard {mine['shard']} of "
                f"{mine['num_shards']} (partition {mine['partition']}): list every shard's "
                f"endpoint in shard order in the worker's --server",
            )
        rec = self._worker(msg.sender)
        return Message(
            wire.HELLO,
            sender="server",
            base_version=self.state.version,
            body={
                "push_port": self.push_port,
                "status_port": self.status_port,
                "fingerprint": self.state.fingerprint,
                "model": self.spec.name,
                "last_seq": rec.last_seq,
                "payload_bytes": self.state.payload_bytes,
                "incarnation": self.incarnation,
                "encodings": sorted(wire.ENCODINGS),
                "policy": self.policy.spec,
                **mine,
            },
        )

    def _heartbeat(self, msg: Message) -> Message:
        rec = self._worker(msg.sender)
        if "stats" in msg.body:
            rec.reported = clean_reported(msg.body["stats"])
        return Message(
            wire.HEARTBEAT,
            "server",
            base_version=self.state.version,
            body={"incarnation": self.incarnation},
        )

    def _pull(self, msg: Message) -> Message:
        self.counters["pulls"] += 1
        rec = self.workers.get(msg.sender)
        body: dict[str, Any] = {"incarnation": self.incarnation}
        if rec is not None:  # pulls count as liveness; only hello and push enrol a worker
            rec.pulls += 1
            rec.last_seen = time.monotonic()
            if rec.dropped_unreported:  # its gradients were too old: it should refresh now
                body["dropped_stale"] = rec.dropped_unreported
                rec.dropped_unreported = 0
        encoding = msg.body.get("encoding", wire.DENSE)
        if encoding not in PULL_ENCODINGS:
            raise ProtocolError(
                wire.R_HEADER,
                f"pull encoding must be one of {', '.join(sorted(PULL_ENCODINGS))}, "
                f"not {encoding!r}",
            )
        version, arrays = self.state.weights()
        if msg.body.get("have") == version and msg.body.get("incarnation") == self.incarnation:
            self.counters["pulls_unchanged"] += 1
            return Message(
                wire.WEIGHTS, "server", base_version=version, body={**body, "unchanged": True}
            )
        tensors: Sequence[wire.WireTensor] = arrays
        if encoding == wire.BF16:
            self.counters["pulls_bf16"] += 1
            tensors = self._bf16_weights(version, arrays)
        return Message(
            wire.WEIGHTS,
            "server",
            base_version=version,
            body=body,
            tensors=dict(zip(self.state.names, tensors, strict=True)),
        )

    def _bf16_weights(self, version: int, arrays: list[np.ndarray]) -> list[wire.WireTensor]:
        """The weights rounded to bfloat16 for pulls that ask for it (``--pull-compress bf16``):
        half the bytes. Rounded once per version, shared by every worker pulling it; float16
        and non-float variables go as they are. The server keeps and updates float32."""
        if self._bf16 is None or self._bf16[0] != version:
            self._bf16 = (version, [wire.as_bf16(a) for a in arrays])
        return self._bf16[1]

    # ------------------------------------------------------------ status

    def worker_state(self, rec: WorkerRecord, now: float) -> str:
        """alive / missing / gone from the time since the worker was last heard."""
        idle = now - rec.last_seen
        if idle <= self.config.missing_after_s:
            return "alive"
        return "missing" if idle <= self.config.gone_after_s else "gone"

    def snapshot(self) -> dict[str, Any]:
        """The status document (fields: docs/cli.md): plain types, JSON-serialisable."""
        now = time.monotonic()
        uptime = now - self.started
        workers = {
            wid: {
                "state": self.worker_state(r, now),
                "last_seen_s": round(now - r.last_seen, 3),
                "pushes": r.pushes,
                "applied": r.applied,
                "dropped": r.dropped,
                "held": r.held,
                "rejected": r.rejected,
                "pulls": r.pulls,
                "last_seq": r.last_seq,
                "steps": r.steps,
                "loss": r.loss,
                "staleness": r.staleness,
                "reported": dict(r.reported),
            }
            for wid, r in self.workers.items()
        }
        return {
            "service": "server",
            "protocol": wire.PROTOCOL_VERSION,
            "model": self.spec.name,
            "fingerprint": self.state.fingerprint,
            **self.shard_fields(),
            "shard_bytes": self.state.payload_bytes,
            "version": self.state.version,
            "updates_applied": self.state.version,
            "updates_per_s": round(self.update_rate.per_second(now), 3),
            "uptime_s": round(uptime, 3),
            "started_at": self.started_wall,
            "apply_ms": self.apply_ms.value,
            "apply_traces": self.state.apply_traces,
            "loss": self.loss.value,
            "staleness": self.staleness.snapshot(),
            "policy": {**self.policy.describe(), "learning_rate": self.state.learning_rate},
            "rejected": dict(self.rejected),
            "rejected_total": self.rejected.total(),
            **security.status_fields(self.auth),
            "workers": workers,
            "incarnation": self.incarnation,
            "restored_from": self.restored_from,
            "checkpoints": self.checkpoints.snapshot() if self.checkpoints else None,
            "eval": self.obs.eval_status(),
            **self.counters,
        }

    def _publish(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._last_publish >= self.config.publish_interval_s:
            self._published = self.snapshot()  # one reference swap: readers see whole dicts
            self._last_publish = now

    def _serve_status(self) -> None:
        sock = self.status_sock
        encoded: tuple[dict[str, Any], list[Any]] | None = None  # one encoding per snapshot
        # A flooding client is paced, so it cannot take CPU (and the GIL) from the loop.
        gap = 1.0 / self.config.status_max_per_s if self.config.status_max_per_s > 0 else 0.0
        next_at = 0.0
        while not self._stop.is_set():
            if not sock.poll(100, zmq.POLLIN):
                continue
            frames = sock.recv_multipart(copy=False)
            try:
                msg = wire.decode(frames, wire.DEFAULT_LIMITS)
                if msg.type != wire.STATUS:
                    raise ProtocolError(
                        wire.R_WRONG_SOCKET, f"{msg.type!r} sent to the status socket"
                    )
                self.counters["status_requests"] += 1
                doc = self._published
                if encoded is None or encoded[0] is not doc:
                    encoded = (doc, wire.encode(Message(wire.STATUS, "server", body=doc)))
                out = encoded[1]
            except ProtocolError as exc:
                self.counters["status_rejected"] += 1  # only this thread writes it
                out = wire.encode(wire.error_message(exc.code, exc.message))
            sock.send_multipart(out)
            if gap:
                next_at = max(next_at, time.monotonic() - 20 * gap) + gap
                self._stop.wait(max(0.0, next_at - time.monotonic()))


def _test_write_hook() -> Callable[[Path], None] | None:
    """Fault tests only: DOWNPOUR_TEST_CHECKPOINT_DELAY_S slows every checkpoint write by that
    many seconds, just before the rename, so a test can kill the server mid-write."""
    delay = float(os.environ.get("DOWNPOUR_TEST_CHECKPOINT_DELAY_S", "0") or 0)
    if delay <= 0:
        return None
    return lambda _tmp: time.sleep(delay)


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and localhost."""
    return host.startswith(LOOPBACK_PREFIXES)
