"""The worker service: pull weights, compute the whole gradient list, push it; repeat.

DistBelief's knobs: weights are pulled every ``n_fetch`` steps (a pull of an unchanged
version moves no tensors) and gradients are pushed every ``n_push`` steps, averaged over the
steps in between. Every push carries the weight version it was computed from.

Nothing blocks forever: requests time out and their REQ socket is recreated, pushes have a
send timeout, and a server that stays away longer than ``server_timeout_s`` ends the worker
with a clear error.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import queue
import socket
import threading
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import zmq

from services.worker.step import Accumulator, GradientStep
from shared import protocol, security
from shared.data import Dataset
from shared.logs import RateLimitedLog, set_log_context, stop_on_signals
from shared.metrics import Rate, new_worker_stats
from shared.models import ModelSpec, build_model, fingerprint
from shared.protocol import Message
from shared.transport import (
    Deadline,
    RemoteError,
    ReqClient,
    RequestTimeout,
    backoff_delays,
    make_context,
    tcp,
)

log = logging.getLogger("downpour.worker")


class WorkerError(Exception):
    """The worker cannot go on (refused by the server, or the server stayed away too long)."""


@dataclass
class WorkerConfig:
    """Everything a worker needs besides the model."""

    host: str = "127.0.0.1"
    port: int = 5570
    worker_id: str = ""
    steps: int | None = None
    epochs: float = 1.0
    n_fetch: int = 1
    n_push: int = 1
    seed: int | None = None
    request_timeout_s: float = 10.0
    server_timeout_s: float = 120.0
    push_timeout_s: float = 1.0
    push_hwm: int = 4
    push_linger_s: float = 30.0
    prefetch: bool = True
    push_endpoint: tuple[str, int] | None = None  # overrides the push port hello announces
    heartbeat_s: float = 2.0
    io_threads: int = 1
    log_every: int = 50
    keys: security.ClientKeys | None = None  # CURVE on every socket when set (--key)

    def resolved_id(self) -> str:
        """The configured id, or hostname-pid."""
        return self.worker_id or f"{socket.gethostname()}-{os.getpid()}"


def batches(data: Dataset, batch_size: int, seed: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Endless full batches, reshuffled every epoch with a per-worker seed."""
    rng = np.random.default_rng(seed)
    n = len(data.x_train)
    if n < batch_size:
        raise ValueError(f"{n} training examples, fewer than one batch of {batch_size}")
    while True:
        order = rng.permutation(n)
        for i in range(0, n - batch_size + 1, batch_size):
            idx = np.sort(order[i : i + batch_size])
            yield data.x_train[idx], data.y_train[idx]


class Fetcher:
    """Weight pulls and heartbeats on a background thread with its own REQ socket.

    The transfer of version V+1 overlaps the computation on version V; the worker installs
    the result between steps, so a step never sees a mix of two versions. When the worker has
    said nothing to the server for ``heartbeat_s`` (a long step, a large n_fetch), the thread
    sends a heartbeat so the server does not mistake a busy worker for a missing one.
    """

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.client = worker.new_client()
        self._requests: queue.Queue[int | None] = queue.Queue(maxsize=1)
        self._results: queue.Queue[Message | BaseException] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="fetcher", daemon=True)
        self._thread.start()

    def request(self, have: int) -> None:
        """Start fetching weights newer than ``have``."""
        self._requests.put_nowait(have)

    def take(self) -> Message:
        """The reply to the last request; waits at most the worker's server timeout."""
        cfg = self.worker.config
        bound = cfg.server_timeout_s + 2 * cfg.request_timeout_s + 5.0
        try:
            result = self._results.get(timeout=bound)
        except queue.Empty:
            raise WorkerError(f"no weights from the server within {bound:.0f} s") from None
        if isinstance(result, BaseException):
            raise result
        return result

    def _loop(self) -> None:
        w = self.worker
        while True:
            try:
                have = self._requests.get(timeout=w.config.heartbeat_s)
            except queue.Empty:
                self._heartbeat()
                continue
            if have is None:
                return
            try:
                self._results.put(w.call(self.client, w.pull_message(have)))
            except BaseException as exc:  # handed to the main thread by take()
                self._results.put(exc)

    def _heartbeat(self) -> None:
        w = self.worker
        if time.monotonic() - w.last_contact < w.config.heartbeat_s or w.stopping():
            return
        msg = Message(protocol.HEARTBEAT, w.id, body={"stats": dict(w.stats)})
        try:
            self.client.request(msg, w.limits, retries=0)
            w.last_contact = time.monotonic()
        except (RequestTimeout, RemoteError, protocol.ProtocolError) as exc:
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


class Worker:
    """One training worker. ``run()`` returns a summary dict, or raises WorkerError."""

    def __init__(self, spec: ModelSpec, config: WorkerConfig, data: Dataset) -> None:
        self.spec = spec
        self.config = config
        self.data = data
        self.id = config.resolved_id()
        self.model = build_model(spec)
        self.step_fn = GradientStep(spec, self.model, data.x_train[:1])
        self.names = [v.path for v in self.model.trainable_variables]
        self.fingerprint = fingerprint(self.model.trainable_variables)
        self.payload_bytes = sum(
            int(np.prod(v.shape)) * np.dtype(str(v.dtype)).itemsize
            for v in self.model.trainable_variables
        )
        self.limits = protocol.DEFAULT_LIMITS.for_payload(self.payload_bytes)
        self.version = -1  # weights held locally; -1 = none yet
        self.seq = 0
        self.push_port: int | None = None
        self._stop = threading.Event()
        self._warn = RateLimitedLog(log)
        # Sent with every push and heartbeat; names and units: shared.metrics.WORKER_REPORTED.
        self.stats: dict[str, float] = new_worker_stats()
        self._step_rate = Rate(10.0)
        self.ctx = make_context(config.io_threads)
        self.req = self.new_client()
        self.fetcher: Fetcher | None = None
        self.incarnation: str | None = None
        self.last_contact = time.monotonic()
        self.push_sock: zmq.Socket | None = None

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
        clean = self.fetcher.close() if self.fetcher is not None else True
        self.req.close()
        if self.push_sock is not None:
            self.push_sock.close(linger=int(1000 * self.config.push_linger_s))
        if clean:
            self.ctx.term()  # waits up to the push linger for queued gradients to leave
        else:
            self.ctx.destroy(linger=0)

    # ------------------------------------------------------------ server calls

    def new_client(self) -> ReqClient:
        """A REQ client for the server's REP port (one per thread)."""
        return ReqClient(
            self.ctx,
            tcp(self.config.host, self.config.port),
            timeout_s=self.config.request_timeout_s,
            retries=0,
            max_msg_bytes=self.limits.max_total_bytes,
            configure=security.curve_client(self.config.keys),  # CURVE survives a recreate
        )

    def call(self, client: ReqClient, msg: Message) -> Message:
        """One request, retried with capped backoff until server_timeout_s; never hangs."""
        deadline = Deadline(self.config.server_timeout_s)
        delay = backoff_delays(0.1, 2.0)
        while True:
            try:
                reply = client.request(msg, self.limits)
                self.last_contact = time.monotonic()
                return reply
            except RequestTimeout:
                if self._stop.is_set():
                    raise WorkerError("stopped while waiting for the server") from None
                if deadline.expired():
                    raise WorkerError(
                        f"server {client.endpoint} did not answer for "
                        f"{self.config.server_timeout_s:.0f} s"
                    ) from None
                self.stats["reconnects"] += 1
                log.warning("server %s not answering; retrying", client.endpoint)
                self._stop.wait(min(delay(), deadline.remaining()))

    def hello(self) -> None:
        """Introduce ourselves; learn the gradient port and where our sequence resumes."""
        msg = Message(
            protocol.HELLO,
            self.id,
            body={
                "fingerprint": self.fingerprint,
                "model": self.spec.name,
                "variables": len(self.names),
            },
        )
        try:
            reply = self.call(self.req, msg)
        except RemoteError as exc:
            raise WorkerError(f"server refused this worker: {exc.message}") from None
        self._note_incarnation(reply)
        push_port = int(reply.body["push_port"])
        self.seq = max(self.seq, int(reply.body.get("last_seq", 0)))
        if push_port != self.push_port:
            if self.push_sock is not None:
                self.push_sock.close(linger=0)
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, self.config.push_hwm)
            sock.setsockopt(zmq.SNDTIMEO, int(1000 * self.config.push_timeout_s))
            if self.config.keys is not None:
                security.configure_curve_client(sock, self.config.keys)
            sock.connect(tcp(*(self.config.push_endpoint or (self.config.host, push_port))))
            self.push_sock, self.push_port = sock, push_port
        log.info(
            "worker %s joined server %s at version %d (model %s)",
            self.id,
            self.req.endpoint,
            reply.base_version,
            self.spec.name,
        )

    def pull_message(self, have: int) -> Message:
        """A pull request; ``have`` < 0 means this worker holds no weights yet."""
        body = {"have": have, "incarnation": self.incarnation} if have >= 0 else {}
        return Message(protocol.PULL, self.id, body=body)

    def install(self, reply: Message, started: float) -> None:
        """Load the weights of a pull reply into the model, unless they are unchanged."""
        self.stats["pulls"] += 1
        self._note_incarnation(reply)
        if reply.body.get("unchanged"):
            self.stats["pulls_unchanged"] += 1
        else:
            if list(reply.tensors) != self.names:
                raise WorkerError("weights from the server do not match this model's variables")
            self.step_fn.set_weights(list(reply.tensors.values()))
            self.version = reply.base_version
        self.stats["pull_ms"] = 1e3 * (time.perf_counter() - started)

    def _note_incarnation(self, reply: Message) -> None:
        inc = reply.body.get("incarnation")
        if self.incarnation is not None and inc != self.incarnation:
            log.warning("server restarted (now at version %d); continuing", reply.base_version)
        self.incarnation = inc

    def pull(self) -> None:
        """Fetch weights if the server has a newer version than ours: synchronously, or by
        taking what the background fetcher brought and starting the next fetch."""
        t0 = time.perf_counter()
        if self.fetcher is None or not self.config.prefetch:
            self.install(self.call(self.req, self.pull_message(self.version)), t0)
            return
        self.install(self.fetcher.take(), t0)
        self.fetcher.request(self.version)

    def push(
        self,
        grads: list[protocol.Tensor],
        base_version: int,
        loss: float,
        steps: int,
        batch_size: int,
    ) -> None:
        """Send one gradient message; waits out back-pressure within server_timeout_s."""
        assert self.push_sock is not None
        self.seq += 1
        msg = Message(
            protocol.PUSH,
            self.id,
            seq=self.seq,
            base_version=base_version,
            body={"loss": loss, "batch_size": batch_size, "steps": steps, "stats": self.stats},
            tensors=dict(zip(self.names, grads, strict=True)),
        )
        frames = protocol.encode(msg)
        t0 = time.perf_counter()
        deadline = Deadline(self.config.server_timeout_s)
        while True:
            try:
                self.push_sock.send_multipart(frames, copy=False)
                break
            except zmq.Again:
                self.stats["backpressure"] += 1
                self._warn.warning(
                    "backpressure", "push blocked at the high-water mark (server slow or away)"
                )
                if self._stop.is_set():  # a planned stop: this gradient is dropped, and counted
                    self.stats["dropped"] += 1
                    log.info("stopping: dropped one unsent gradient (seq %d)", self.seq)
                    return
                if deadline.expired():
                    raise WorkerError("could not push gradients: server not taking them") from None
        self.stats["pushes"] += 1
        self.stats["bytes_sent"] += sum(memoryview(f).nbytes for f in frames)
        self.stats["push_ms"] = 1e3 * (time.perf_counter() - t0)

    # ------------------------------------------------------------ training

    def total_steps(self) -> int:
        """--steps, or --epochs worth of full batches."""
        if self.config.steps is not None:
            return self.config.steps
        per_epoch = len(self.data.x_train) // self.spec.batch_size
        return max(1, int(round(self.config.epochs * per_epoch)))

    def run(self) -> dict[str, Any]:
        """Train until the step budget is spent or stop() is called."""
        cfg = self.config
        seed = cfg.seed if cfg.seed is not None else zlib.crc32(self.id.encode())
        data = batches(self.data, self.spec.batch_size, seed)
        total = self.total_steps()
        acc = Accumulator()
        started = time.monotonic()
        loss = float("nan")
        base_version = 0
        step = 0
        set_log_context(worker=self.id, version=lambda: self.version)
        self.hello()
        self.install(self.call(self.req, self.pull_message(-1)), time.perf_counter())
        self.fetcher = Fetcher(self)
        if cfg.prefetch:
            self.fetcher.request(self.version)
        while step < total and not self._stop.is_set():
            if step and step % cfg.n_fetch == 0:
                self.pull()
            if acc.count == 0:
                base_version = self.version  # the oldest weights in this accumulation
            x, y = next(data)
            t0 = time.perf_counter()
            loss, grads = self.step_fn(x, y)
            self.stats["compute_ms"] = 1e3 * (time.perf_counter() - t0)
            acc.add(grads)
            step += 1
            self._step_rate.mark()
            self.stats["steps_per_s"] = round(self._step_rate.per_second(), 3)
            if math.isfinite(loss):
                self.stats["loss"] = loss
            if acc.count >= cfg.n_push:
                self.push(acc.take(), base_version, loss, step, self.spec.batch_size)
            if cfg.log_every and step % cfg.log_every == 0:
                log.info(
                    "worker %s step %d/%d loss %.4f version %d",
                    self.id,
                    step,
                    total,
                    loss,
                    self.version,
                )
        elapsed = time.monotonic() - started
        summary = {
            "worker": self.id,
            "steps": step,
            "seconds": round(elapsed, 2),
            "steps_per_s": round(step / max(elapsed, 1e-9), 3),
            "loss": loss,
            "version": self.version,
            "pushes": int(self.stats["pushes"]),
            "pulls": int(self.stats["pulls"]),
            "pulls_unchanged": int(self.stats["pulls_unchanged"]),
            "backpressure": int(self.stats["backpressure"]),
            "reconnects": int(self.stats["reconnects"]),
            "dropped": int(self.stats["dropped"]),
            "last_seq": self.seq,
            "stopped_early": step < total,
        }
        return summary
