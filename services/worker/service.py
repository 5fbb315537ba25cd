"""The worker service: pull weights, compute the whole gradient list, push it; repeat.

DistBelief's knobs: weights are pulled every ``n_fetch`` steps (a pull of an unchanged
version moves no tensors) and gradients are pushed every ``n_push`` steps, averaged over the
steps in between. Every push carries the weight version it was computed from.

Nothing blocks forever: requests time out and their REQ socket is recreated, pushes have a
send timeout, and a server that stays away longer than ``server_timeout_s`` ends the worker
with a clear error.

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
"""

from __future__ import annotations

import contextlib
import logging
import math
import queue
import threading
import time
import zlib
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq

from downpour import security, wire
from downpour.data import Dataset
from downpour.logs import RateLimitedLog, set_log_context, stop_on_signals
from downpour.metrics import Rate, new_worker_stats
from downpour.models import build_model, evaluate, fingerprint
from downpour.partition import make_partition
from downpour.spec import ModelSpec
from downpour.transport import (
    Deadline,
    RemoteError,
    ReqClient,
    RequestTimeout,
    backoff_delays,
    make_context,
    tcp,
)
from downpour.wire import Message
from downpour.worker.compress import Compressor, parse_compression
from downpour.worker.settings import WorkerConfig
from downpour.worker.step import Accumulator, GradientStep
from downpour.worker.tf1 import Tf1Step

log = logging.getLogger("downpour.worker")

RECENT_LOSSES = 20  # the summary's loss_recent averages this many last batches (one is noise)


class WorkerError(Exception):
    """The worker cannot go on (refused by the server, or the server stayed away too long)."""


@dataclass
class Link:
    """What the worker holds for one server shard: sockets, incarnation, weights and version."""

    index: int
    host: str
    port: int
    req: ReqClient
    push_sock: zmq.Socket | None = None
    push_port: int | None = None
    incarnation: str | None = None
    version: int = -1  # this shard's weight version held locally; -1 = none yet
    arrays: list[Any] = field(default_factory=list)  # its parts, as last pulled (maybe tensors)
    fetcher: Fetcher | None = None
    last_contact: float = field(default_factory=time.monotonic)


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
    """Weight pulls and heartbeats for one shard on a background thread with its own REQ socket.

    The transfer of version V+1 overlaps the computation on version V; the worker installs
    the result between steps, so a step never sees a mix of two versions. With several shards
    each has a fetcher, so the pulls run concurrently. When the worker has said nothing to a
    shard for ``heartbeat_s`` (a long step, a large n_fetch), the thread sends a heartbeat so
    the shard does not mistake a busy worker for a missing one.
    """

    def __init__(self, worker: Worker, link: Link) -> None:
        self.worker = worker
        self.link = link
        self.client = worker.new_client(link.host, link.port)
        self._requests: queue.Queue[int | None] = queue.Queue(maxsize=1)
        self._results: queue.Queue[Message | BaseException] = queue.Queue()
        self._thread = threading.Thread(
            target=self._loop, name=f"fetcher-{link.index}", daemon=True
        )
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
                have = self._requests.get(timeout=w.config.heartbeat_s)
            except queue.Empty:
                self._heartbeat()
                continue
            if have is None:
                return
            try:
                reply = w.call(self.link, self.client, w.pull_message(self.link, have))
                self._results.put(w.prepare(self.link, reply))
            except BaseException as exc:  # handed to the main thread by take()
                self._results.put(exc)

    def _heartbeat(self) -> None:
        w = self.worker
        if time.monotonic() - self.link.last_contact < w.config.heartbeat_s or w.stopping():
            return
        msg = Message(wire.HEARTBEAT, w.id, body={"stats": dict(w.stats)})
        try:
            self.client.request(msg, w.limits, retries=0)
            self.link.last_contact = time.monotonic()
        except (RequestTimeout, RemoteError, wire.ProtocolError) as exc:
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
        self.step_fn = (  # tf1: the model's Session graph, checked against this Keras model
            Tf1Step(spec, self.model)
            if config.graph == "tf1"
            else GradientStep(spec, self.model, data.x_train[:1])
        )
        variables = self.model.trainable_variables
        self.names = [v.path for v in variables]
        self.fingerprint = fingerprint(variables)
        self.payload_bytes = sum(
            int(np.prod(v.shape)) * np.dtype(str(v.dtype)).itemsize for v in variables
        )
        self.limits = wire.DEFAULT_LIMITS.for_payload(self.payload_bytes)
        endpoints = config.endpoints()
        if config.push_endpoint is not None and len(endpoints) > 1:
            raise WorkerError("--push-endpoint works with one server, not with shards")
        self.partition = make_partition(
            self.names,
            [tuple(int(d) for d in v.shape) for v in variables],
            [str(v.dtype) for v in variables],
            len(endpoints),
            self.fingerprint,
        )
        self.wire_names = [[p.wire_name for p in parts] for parts in self.partition.shards]
        self.seq = 0
        self._stop = threading.Event()
        self._warn = RateLimitedLog(log)
        # Sent with every push and heartbeat; names and units: downpour.metrics.WORKER_REPORTED.
        self.stats: dict[str, float] = new_worker_stats()
        self._step_rate = Rate(10.0)
        self.ctx = make_context(config.io_threads)
        self.links = [
            Link(i, host, port, self.new_client(host, port))
            for i, (host, port) in enumerate(endpoints)
        ]
        # one per shard: a top-k residual is kept per position in that shard's slice list
        self.compressors: list[Compressor] = [
            parse_compression(config.compress) for _ in self.links
        ]
        self._refresh = False  # a shard dropped a stale gradient: pull fresh weights next step
        self.sync = False  # the server aggregates synchronously (hello: policy sync:K/N)
        self._sync_stalled = False  # a sync wait timed out and no version moved since
        self._pushed_incarnations: list[str | None] = []  # each shard's, at the last push

    @property
    def version(self) -> int:
        """The weight version held (with shards: the oldest of the shards' versions)."""
        return min(link.version for link in self.links)

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
        clean = True
        for link in self.links:
            if link.fetcher is not None:
                clean = link.fetcher.close() and clean
            link.req.close()
            if link.push_sock is not None:
                link.push_sock.close(linger=int(1000 * self.config.push_linger_s))
        if clean:
            self.ctx.term()  # waits up to the push linger for queued gradients to leave
        else:
            self.ctx.destroy(linger=0)

    # ------------------------------------------------------------ server calls

    def new_client(self, host: str, port: int) -> ReqClient:
        """A REQ client for a server's REP port (one per thread)."""
        return ReqClient(
            self.ctx,
            tcp(host, port),
            timeout_s=self.config.request_timeout_s,
            retries=0,
            max_msg_bytes=self.limits.max_total_bytes,
            configure=security.curve_client(self.config.keys),  # CURVE survives a recreate
        )

    def call(self, link: Link, client: ReqClient, msg: Message) -> Message:
        """One request, retried with capped backoff until server_timeout_s; never hangs."""
        deadline = Deadline(self.config.server_timeout_s)
        delay = backoff_delays(0.1, 2.0)
        while True:
            try:
                reply = client.request(msg, self.limits)
                link.last_contact = time.monotonic()
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
        """Introduce ourselves to every shard; learn the gradient ports and where our
        sequence resumes."""
        for link in self.links:
            self._hello(link)

    def _hello(self, link: Link) -> None:
        msg = Message(
            wire.HELLO,
            self.id,
            body={
                "fingerprint": self.fingerprint,
                "model": self.spec.name,
                "variables": len(self.names),
                "shard": link.index,
                "num_shards": self.partition.num_shards,
                "partition": self.partition.digest,
            },
        )
        try:
            reply = self.call(link, link.req, msg)
        except RemoteError as exc:
            raise WorkerError(
                f"server {link.req.endpoint} refused this worker: {exc.message}"
            ) from None
        self._note_incarnation(link, reply)
        self._check_encodings(link, reply)
        self.sync = str(reply.body.get("policy", "")).startswith("sync:")
        push_port = int(reply.body["push_port"])
        self.seq = max(self.seq, int(reply.body.get("last_seq", 0)))
        if push_port != link.push_port:
            if link.push_sock is not None:
                link.push_sock.close(linger=0)
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, self.config.push_hwm)
            sock.setsockopt(zmq.SNDTIMEO, int(1000 * self.config.push_timeout_s))
            if self.config.keys is not None:
                security.configure_curve_client(sock, self.config.keys)
            sock.connect(tcp(*(self.config.push_endpoint or (link.host, push_port))))
            link.push_sock, link.push_port = sock, push_port
        log.info(
            "worker %s joined server %s (shard %d of %d) at version %d (model %s)",
            self.id,
            link.req.endpoint,
            link.index,
            self.partition.num_shards,
            reply.base_version,
            self.spec.name,
        )

    def _check_encodings(self, link: Link, reply: Message) -> None:
        """Refuse to start when the server cannot decode what --compress sends."""
        comp = self.compressors[link.index]
        offered = reply.body.get("encodings")
        if not isinstance(offered, list):
            offered = [wire.DENSE, wire.SPARSE]  # a server from before compression
        missing = sorted(comp.encodings - {str(e) for e in offered})
        if missing:
            raise WorkerError(
                f"server {link.req.endpoint} cannot decode the {', '.join(missing)} encoding "
                f"that --compress {comp.spec} sends (it decodes {', '.join(map(str, offered))}): "
                "upgrade the server or use --compress none"
            )

    def pull_message(self, link: Link, have: int) -> Message:
        """A pull request; ``have`` < 0 means this worker holds no weights of the shard yet."""
        body: dict[str, Any] = {"have": have, "incarnation": link.incarnation} if have >= 0 else {}
        if self.config.pull_compress == "bf16":  # a server from before it sends float32: fine
            body["encoding"] = wire.BF16
        return Message(wire.PULL, self.id, body=body)

    def prepare(self, link: Link, reply: Message) -> Message:
        """On the fetcher thread: a single shard's new weights converted for the step function
        (``GradientStep.prepare``), off the training thread. Several shards' slices are joined
        first, which needs every reply, so ``install`` converts those."""
        if (
            len(self.links) == 1
            and not reply.body.get("unchanged")
            and list(reply.tensors) == self.wire_names[link.index]
        ):
            prepared = self.step_fn.prepare(list(reply.tensors.values()))
            reply.tensors = dict(zip(reply.tensors, prepared, strict=True))
        return reply

    def install(self, replies: list[Message], started: float) -> None:
        """Load the weights of one pull reply per shard into the model, unless all are
        unchanged; a step then never sees weights of two pulls."""
        self.stats["pulls"] += 1
        changed = False
        for link, reply in zip(self.links, replies, strict=True):
            self._note_incarnation(link, reply)
            dropped = reply.body.get("dropped_stale")
            if isinstance(dropped, int) and not isinstance(dropped, bool) and dropped > 0:
                self.stats["dropped_stale"] += dropped
                self._refresh = True
            if reply.body.get("unchanged"):
                continue
            if list(reply.tensors) != self.wire_names[link.index]:
                raise WorkerError(
                    f"weights from server {link.req.endpoint} do not match this model's "
                    f"variables on shard {link.index}"
                )
            link.arrays = list(reply.tensors.values())
            link.version = reply.base_version
            changed = True
            self._sync_stalled = False
        if changed:
            if len(self.links) == 1:
                arrays = self.links[0].arrays
            else:
                arrays = self.partition.join([lk.arrays for lk in self.links], len(self.names))
            self.step_fn.set_weights(arrays)
        else:
            self.stats["pulls_unchanged"] += 1
        self.stats["pull_ms"] = 1e3 * (time.perf_counter() - started)

    def _note_incarnation(self, link: Link, reply: Message) -> None:
        inc = reply.body.get("incarnation")
        if link.incarnation is not None and inc != link.incarnation:
            log.warning(
                "server %s restarted (now at version %d); continuing",
                link.req.endpoint,
                reply.base_version,
            )
        link.incarnation = inc

    def _fetch_all(self) -> list[Message]:
        """Every shard's reply to the pull its fetcher is running (they run concurrently)."""
        return [link.fetcher.take() for link in self.links if link.fetcher is not None]

    def pull(self) -> None:
        """Fetch weights from every shard that has a newer version than ours: waiting for the
        replies (--no-prefetch), or taking what the fetchers brought and starting the next."""
        t0 = time.perf_counter()
        if not self.config.prefetch:
            for link in self.links:
                assert link.fetcher is not None
                link.fetcher.request(link.version)
        self.install(self._fetch_all(), t0)
        if self.config.prefetch and self._refresh:
            # The server dropped gradients of ours as too stale, and what the fetchers brought
            # was requested a step ago: wait for the current weights before the next step.
            self.stats["stale_refreshes"] += 1
            for link in self.links:
                assert link.fetcher is not None
                link.fetcher.request(link.version)
            self.install(self._fetch_all(), t0)
        self._refresh = False
        if self.config.prefetch:
            for link in self.links:
                assert link.fetcher is not None
                link.fetcher.request(link.version)

    def await_new_version(self, pushed_from: list[int]) -> None:
        """With a sync:K/N server: pull until every shard has moved past the versions the last
        push was computed from (a gradient from those weights would be a duplicate), at most
        ``sync_wait_s``; a timeout means fewer than K workers are pushing, so stop waiting
        until a version moves again. A shard that restarted since the push (new incarnation)
        ends the wait at once: the round it held died with it and it restarted from a
        checkpoint, so its version would only move once the waiting workers push again."""
        if self._sync_stalled or all(
            lk.version > v for lk, v in zip(self.links, pushed_from, strict=True)
        ):
            return
        t0 = time.perf_counter()
        deadline = Deadline(self.config.sync_wait_s)
        delay = backoff_delays(0.002, 0.05)
        in_flight = self.config.prefetch  # with prefetch a request per shard is outstanding
        while not self._stop.is_set():
            if not in_flight:
                for link in self.links:
                    assert link.fetcher is not None
                    link.fetcher.request(link.version)
            self.install(self._fetch_all(), t0)
            in_flight = False
            if all(lk.version > v for lk, v in zip(self.links, pushed_from, strict=True)):
                break
            if self._restarted_since_push():
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
        if self.config.prefetch and not in_flight:
            for link in self.links:
                assert link.fetcher is not None
                link.fetcher.request(link.version)
        self.stats["sync_wait_ms"] = 1e3 * (time.perf_counter() - t0)

    def _restarted_since_push(self) -> bool:
        """Some shard has another incarnation than when the last push was sent to it."""
        return any(
            lk.incarnation != inc
            for lk, inc in zip(self.links, self._pushed_incarnations, strict=False)
        )

    def push(
        self,
        grads: list[wire.Tensor],
        base_versions: list[int],
        loss: float,
        steps: int,
        batch_size: int,
    ) -> None:
        """Send one gradient message per shard (its slice compressed by that shard's
        compressor, its base version, one shared seq); waits out back-pressure within
        server_timeout_s. ``bytes_sent`` counts the message bytes, ``bytes_raw`` what they
        would have been uncompressed (the same headers, the uncompressed payload)."""
        self.seq += 1
        per_shard = [grads] if len(self.links) == 1 else self.partition.split(grads)
        body = {"loss": loss, "batch_size": batch_size, "steps": steps, "stats": self.stats}
        t0 = time.perf_counter()
        sent = raw = 0
        for link, tensors in zip(self.links, per_shard, strict=True):
            comp = self.compressors[link.index]
            raw0, sent0 = comp.raw_bytes, comp.sent_bytes
            encoded = comp.compress(tensors)
            msg = Message(
                wire.PUSH,
                self.id,
                seq=self.seq,
                base_version=base_versions[link.index],
                body=body,
                tensors=dict(zip(self.wire_names[link.index], encoded, strict=True)),
            )
            frames = wire.encode(msg)
            if not self._send(link, frames):
                return
            n = sum(memoryview(f).nbytes for f in frames)
            sent += n
            raw += n - (comp.sent_bytes - sent0) + (comp.raw_bytes - raw0)
        self._pushed_incarnations = [link.incarnation for link in self.links]
        self.stats["pushes"] += 1
        self.stats["bytes_sent"] += sent
        self.stats["bytes_raw"] += raw
        self.stats["push_ms"] = 1e3 * (time.perf_counter() - t0)

    def _send(self, link: Link, frames: list[Any]) -> bool:
        """Send one push to one shard; False if dropped because the worker is stopping."""
        assert link.push_sock is not None
        deadline = Deadline(self.config.server_timeout_s)
        while True:
            try:
                link.push_sock.send_multipart(frames, copy=False)
                return True
            except zmq.Again:
                self.stats["backpressure"] += 1
                self._warn.warning(
                    "backpressure", "push blocked at the high-water mark (server slow or away)"
                )
                if self._stop.is_set():  # a planned stop: this gradient is dropped, and counted
                    self.stats["dropped"] += 1
                    log.info("stopping: dropped one unsent gradient (seq %d)", self.seq)
                    return False
                if deadline.expired():
                    raise WorkerError(
                        f"could not push gradients: server {link.req.endpoint} not taking them"
                    ) from None

    # ------------------------------------------------------------ training

    def held_out(self) -> float | None:
        """The spec's metric on the held-out set with this worker's model as it ends: the last
        weights it pulled and its own BatchNorm statistics (None in tf1 mode, whose weights
        live in the TF1 session, or without held-out examples)."""
        if self.config.graph != "tf2" or not len(self.data.x_test):
            return None
        return float(evaluate(self.spec, self.model, self.data.x_test, self.data.y_test))

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
        recent: deque[float] = deque(maxlen=RECENT_LOSSES)  # finite batch losses, for the summary
        base_versions = [0] * len(self.links)
        step = 0
        pushed_from: list[int] | None = None  # base versions of the last push
        set_log_context(worker=self.id, version=lambda: self.version)
        self.hello()
        for link in self.links:  # the first pull from every shard at once
            link.fetcher = Fetcher(self, link)
            link.fetcher.request(-1)
        self.install(self._fetch_all(), time.perf_counter())
        if cfg.prefetch:
            for link in self.links:
                assert link.fetcher is not None
                link.fetcher.request(link.version)
        while step < total and not self._stop.is_set():
            if step and step % cfg.n_fetch == 0:
                self.pull()
            if acc.count == 0:  # the oldest weights in this accumulation, per shard
                if self.sync and pushed_from is not None:
                    self.await_new_version(pushed_from)
                    if self._stop.is_set():
                        break
                base_versions = [link.version for link in self.links]
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
                recent.append(loss)
            if acc.count >= cfg.n_push:
                self.push(acc.take(), base_versions, loss, step, self.spec.batch_size)
                pushed_from = base_versions
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
            "held_out": self.held_out(),
            "steps": step,
            "seconds": round(elapsed, 2),
            "steps_per_s": round(step / max(elapsed, 1e-9), 3),
            "loss": loss,
            "loss_recent": sum(recent) / len(recent) if recent else float("nan"),
            "version": self.version,
            "versions": [link.version for link in self.links],
            "pushes": int(self.stats["pushes"]),
            "pulls": int(self.stats["pulls"]),
            "pulls_unchanged": int(self.stats["pulls_unchanged"]),
            "backpressure": int(self.stats["backpressure"]),
            "reconnects": int(self.stats["reconnects"]),
            "dropped": int(self.stats["dropped"]),
            "compress": self.compressors[0].spec,
            "pull_compress": self.config.pull_compress,
            "bytes_raw": int(self.stats["bytes_raw"]),
            "bytes_sent": int(self.stats["bytes_sent"]),
            "dropped_stale": int(self.stats["dropped_stale"]),
            "stale_refreshes": int(self.stats["stale_refreshes"]),
            "sync_wait_timeouts": int(self.stats["sync_wait_timeouts"]),
            "last_seq": self.seq,
            "stopped_early": step < total,
        }
        return summary
