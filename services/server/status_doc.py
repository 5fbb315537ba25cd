"""The server's status document: plain types, JSON-serialisable (fields: docs/cli.md).

Built by the loop thread from what the handlers keep (``HandlerContext``) and published as
one dict (``StatusBoard``); the status socket, the Prometheus exporter and the TensorBoard
writer only ever read a published document, so none of them can stall or race the loop. The
status socket has its own thread (``StatusBoard``'s), which answers from the published
document, so a slow or flooding status client never stalls training.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from downpour import wire
from downpour.memory import malloc
from downpour.net import security
from downpour.net.receive import Bound, Oversize, ReceiveHeap, recv_bounded
from downpour.runtime.metrics import peak_rss_mib, rss_mib
from downpour.server.handlers import HandlerContext, check_status_request
from downpour.server.job import DONE, FAILED
from downpour.server.sockets import STATUS_MAX_BYTES
from downpour.wire import ProtocolError

STATUS_BOUND = Bound(1, STATUS_MAX_BYTES)  # a status request is one small header


def build_status(
    ctx: HandlerContext,
    *,
    now: float,
    started: float,
    started_wall: float,
    restored_from: int | None = None,
    restore_s: float | None = None,
    checkpoints: dict[str, Any] | None = None,
    evaluation: dict[str, Any] | None = None,
    exports: dict[str, Any] | None = None,
    auth: security.Authenticator | None = None,
    receive_heap: ReceiveHeap | None = None,
) -> dict[str, Any]:
    """The status document at monotonic time ``now``, for a server started at monotonic
    ``started`` (wall clock ``started_wall``); the checkpoint, evaluation and authentication
    sections (and the serving exports') come from their owners, and ``receive_heap`` is what
    ``keep_receive_buffers`` set."""
    state, stats = ctx.state, ctx.stats
    held, slots = state.held_bytes()
    return {
        "service": "server",
        "protocol": wire.PROTOCOL_VERSION,
        "model": ctx.model,
        "fingerprint": state.fingerprint,
        **ctx.shard,
        "shard_bytes": held,
        "slot_bytes": slots,
        "peak_rss_mib": peak_rss_mib(),
        "rss_mib": rss_mib(),
        "malloc": malloc.status(now),
        "version": state.version,
        "updates_applied": state.version,
        "updates_per_s": round(stats.update_rate.per_second(now), 3),
        "uptime_s": round(now - started, 3),
        "started_at": started_wall,
        "apply_ms": stats.apply_ms.value,
        "apply_traces": state.apply_traces,
        # "flat", or why every apply binds its inputs again (logged at warning level)
        "apply_call": state.apply_call_problem or "flat",
        "loss": stats.loss.value,
        "staleness": stats.staleness.snapshot(),
        "policy": {**ctx.policy.describe(), "learning_rate": state.learning_rate},
        "row_tables": [n for n, sparse in zip(state.names, state.sparse, strict=True) if sparse],
        "pull_bounds": ctx.movement.describe(),
        "row_detection": None if state.row_sparsity is None else state.row_sparsity.problem,
        "dynamic_tables": state.table_status(),
        "rejected": _rejected(ctx),
        "rejected_total": stats.rejected.total() + stats.counters["status_oversize"],
        **security.status_fields(auth),
        "workers": ctx.registry.status(now),
        "registry": ctx.registry.summary(),
        "incarnation": ctx.incarnation,
        "restored_from": restored_from,
        "restore_s": restore_s,
        "checkpoints": checkpoints,
        "eval": evaluation,
        "exports": exports,
        "dispatch": None if ctx.dispatcher is None else ctx.dispatcher.progress(),
        "job": None if ctx.job is None else ctx.job.status(now),
        "receive_heap": _receive_heap(receive_heap),
        **stats.counters,
    }


def _receive_heap(heap: ReceiveHeap | None) -> dict[str, int] | str | None:
    """What ``keep_receive_buffers`` set, or why it set nothing (logged at warning level)."""
    if heap is None or heap.problem is not None:
        return None if heap is None else heap.problem
    return {"reused_frame_bytes": heap.reused_frame_bytes, "retained_bytes": heap.retained_bytes}


def _rejected(ctx: HandlerContext) -> dict[str, int]:
    """Refusals by reason: the loop's, and the status socket's oversize requests (counted by
    the status thread apart, so neither thread writes the other's counter)."""
    rejected = dict(ctx.stats.rejected)
    if n := ctx.stats.counters["status_oversize"]:
        rejected[wire.R_OVERSIZE] = rejected.get(wire.R_OVERSIZE, 0) + n
    return rejected


class StatusBoard:
    """The status document as last published, and the status socket's thread answering
    every request from it.

    The loop publishes (``publish``: the document ``build`` returns, at most every
    ``interval_s`` unless forced; one reference swap, so readers see whole dicts). The
    thread (``start``) only reads: it encodes each published document once, paces a
    flooding client to ``max_per_s`` requests a second (0: unpaced), and sets ``acked``
    when a reader acknowledges the job's end. It counts into ``counters`` only what the
    status socket sees (``ServerStats``), and stops with ``stop``.
    """

    def __init__(
        self,
        counters: dict[str, int],
        build: Callable[[], dict[str, Any]],
        *,
        interval_s: float,
        max_per_s: float,
        stop: threading.Event,
    ) -> None:
        self.sock: zmq.Socket | None = None  # given at ``start``
        self.counters = counters
        self.build = build
        self.interval_s = interval_s
        self.max_per_s = max_per_s
        self.stop = stop
        self.document: dict[str, Any] = {}
        self.acked = threading.Event()  # a reader acknowledged the job's end
        self._last_publish = 0.0
        self._thread = threading.Thread(target=self._serve, name="status", daemon=True)

    def publish(self, force: bool = False) -> None:
        """Build and publish the document when ``interval_s`` has passed (or ``force``)."""
        now = time.monotonic()
        if force or now - self._last_publish >= self.interval_s:
            self.document = self.build()  # one reference swap: readers see whole dicts
            self._last_publish = now

    def start(self, sock: zmq.Socket) -> None:
        """Start answering ``sock``, the status socket."""
        self.sock = sock
        self._thread.start()

    def alive(self) -> bool:
        """The status thread is running."""
        return self._thread.is_alive()

    def join(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the status thread to end (after ``stop``)."""
        if self._thread.is_alive():
            self._thread.join(timeout=timeout_s)

    def _serve(self) -> None:
        sock, counters = self.sock, self.counters
        assert sock is not None
        encoded: tuple[dict[str, Any], list[Any]] | None = None  # one encoding per snapshot
        # A flooding client is paced, so it cannot take CPU (and the GIL) from the loop.
        gap = 1.0 / self.max_per_s if self.max_per_s > 0 else 0.0
        next_at = 0.0
        while not self.stop.is_set():
            if not sock.poll(100, zmq.POLLIN):
                continue
            frames = recv_bounded(sock, STATUS_BOUND)
            try:
                if isinstance(frames, Oversize):
                    counters["status_oversize"] += 1
                    raise ProtocolError(
                        wire.R_OVERSIZE,
                        f"a status request of {frames.frames} frames and {frames.nbytes} bytes "
                        f"is larger than this socket accepts ({STATUS_BOUND.nbytes} bytes) in "
                        f"at most {STATUS_BOUND.frames} frame",
                    )
                req = check_status_request(frames)
                counters["status_requests"] += 1
                doc = self.document
                job = doc.get("job")
                if req.ack == DONE and job is not None and job["state"] in (DONE, FAILED):
                    self.acked.set()
                if encoded is None or encoded[0] is not doc:
                    encoded = (doc, wire.encode(wire.status_reply(doc)))
                out = encoded[1]
            except ProtocolError as exc:
                counters["status_rejected"] += 1  # only this thread writes it
                out = wire.encode(wire.error_message(exc.code, exc.message))
            sock.send_multipart(out)
            if gap:
                next_at = max(next_at, time.monotonic() - 20 * gap) + gap
                self.stop.wait(max(0.0, next_at - time.monotonic()))
