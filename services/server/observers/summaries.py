"""``--logdir``: TensorBoard scalars written with ``tf.summary``, off the apply loop.

A thread reads the published status document every ``interval_s`` seconds and writes, at
step = the weight version (updates applied):

- ``training/loss``, ``training/updates_per_s``, ``training/apply_ms``
- ``staleness/mean`` (over the updates since the previous point), ``staleness/max`` (since
  start) and ``staleness/histogram`` (the updates since the previous point, in the status
  document's buckets: an integer staleness s falls in (previous bound, s])
- ``rejected/total``, ``workers/alive``
- ``worker/<id>/steps_per_s``, ``worker/<id>/loss`` (the worker's local batch loss) and
  ``worker/<id>/staleness``
- ``heldout/<metric>`` (``heldout/accuracy`` by default, ``heldout/auc`` for an AUC spec) and
  ``heldout/eval_seconds`` at the evaluated version, for every
  held-out evaluation (``--eval-every``), handed over by the evaluator as it finishes.

TensorFlow's ``tf.summary.scalar``/``histogram`` are thin wrappers that live in the separate
``tensorboard`` package; the server writes the same records with ``tf.summary.write`` and the
plugin metadata those wrappers use (``scalars``: a float32 scalar; ``histograms``: a
``[buckets, 3]`` tensor of left edge, right edge, count), so it needs TensorFlow only and the
files read in any TensorBoard.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from downpour.runtime.metrics import eval_score

log = logging.getLogger("downpour.server")


class SummaryWriter:
    """Writes the server's figures as TensorBoard event files under ``logdir``."""

    def __init__(
        self, logdir: str, get_doc: Callable[[], dict[str, Any]], interval_s: float = 5.0
    ) -> None:
        import tensorflow as tf
        from tensorflow.core.framework.summary_pb2 import SummaryMetadata

        self.tf = tf
        self._scalar_meta = SummaryMetadata(
            plugin_data=SummaryMetadata.PluginData(plugin_name="scalars"), data_class=1
        )  # DATA_CLASS_SCALAR
        self._histogram_meta = SummaryMetadata(
            plugin_data=SummaryMetadata.PluginData(plugin_name="histograms"), data_class=2
        )  # DATA_CLASS_TENSOR
        self.logdir = logdir
        self.get_doc = get_doc
        self.interval_s = interval_s
        self.writer = tf.summary.create_file_writer(logdir)
        self.points = 0
        self._evals: queue.Queue[dict[str, Any]] = queue.Queue()
        self._stop = threading.Event()
        self._last_version = -1
        self._last_counts: list[int] | None = None
        self._last_count_sum = (0, 0.0)
        self._thread = threading.Thread(target=self._loop, name="summaries", daemon=True)

    def start(self) -> None:
        """Start the writer thread."""
        self._thread.start()

    def record_eval(self, result: dict[str, Any]) -> None:
        """Queue one held-out evaluation result (any thread)."""
        self._evals.put(result)

    def close(self) -> None:
        """Write the final point and the queued evaluations, flush, close (bounded)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10.0)
        if not self._thread.is_alive():
            self._write_pending()
        self.writer.close()

    def _loop(self) -> None:
        next_tick = time.monotonic() + self.interval_s
        while not self._stop.is_set():
            try:
                ev = self._evals.get(timeout=max(0.0, next_tick - time.monotonic()))
            except queue.Empty:
                ev = None
            try:
                if ev is not None:
                    self._write_eval(ev)
                    self.writer.flush()
                if time.monotonic() >= next_tick:
                    self._write_doc(self.get_doc())
                    self.writer.flush()
                    next_tick = time.monotonic() + self.interval_s
            except Exception:  # TensorBoard output must never take the server down
                log.exception("writing TensorBoard summaries failed")
                next_tick = time.monotonic() + self.interval_s
        self._write_pending()

    def _write_pending(self) -> None:
        while True:
            try:
                self._write_eval(self._evals.get_nowait())
            except queue.Empty:
                break
        self._write_doc(self.get_doc())
        self.writer.flush()

    def _scalar(self, tag: str, value: Any, step: int) -> None:
        if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
            data = self.tf.constant(float(value), dtype=self.tf.float32)
            self.tf.summary.write(tag, data, step=step, metadata=self._scalar_meta)

    def _write_eval(self, ev: dict[str, Any]) -> None:
        with self.writer.as_default():
            name, value = eval_score(ev)
            self._scalar(f"heldout/{name}", value, int(ev["version"]))
            self._scalar("heldout/eval_seconds", ev.get("seconds"), int(ev["version"]))

    def _write_doc(self, doc: dict[str, Any]) -> None:
        version = doc.get("version")
        if not isinstance(version, int) or version == self._last_version:
            return  # nothing new (idle server): no duplicate points
        self._last_version = version
        st = doc.get("staleness") or {}
        count, total = int(st.get("count", 0)), float(st.get("sum", 0.0))
        prev_count, prev_total = self._last_count_sum
        self._last_count_sum = (count, total)
        with self.writer.as_default():
            s = self._scalar
            s("training/loss", doc.get("loss"), version)
            s("training/updates_per_s", doc.get("updates_per_s"), version)
            s("training/apply_ms", doc.get("apply_ms"), version)
            if count > prev_count:
                s("staleness/mean", (total - prev_total) / (count - prev_count), version)
            s("staleness/max", st.get("max"), version)
            self._staleness_histogram(st, version)
            s("rejected/total", doc.get("rejected_total"), version)
            workers = doc.get("workers") or {}
            s("workers/alive", sum(w.get("state") == "alive" for w in workers.values()), version)
            for wid, w in sorted(workers.items()):
                reported = w.get("reported") or {}
                s(f"worker/{wid}/steps_per_s", reported.get("steps_per_s"), version)
                s(f"worker/{wid}/loss", reported.get("loss", w.get("loss")), version)
                s(f"worker/{wid}/staleness", w.get("staleness"), version)
        self.points += 1

    def _staleness_histogram(self, st: dict[str, Any], version: int) -> None:
        buckets = st.get("buckets") or []
        counts = [int(c) for _, c in buckets]
        prev = self._last_counts or [0] * len(counts)
        self._last_counts = counts
        delta = [max(0, c - p) for c, p in zip(counts, prev, strict=False)]
        if not sum(delta):
            return
        top = float(st.get("max", 0.0))
        rows, left = [], -0.5
        for (bound, _), n in zip(buckets, delta, strict=False):
            right = max(top + 0.5, left + 1.0) if bound == "+Inf" else float(bound) + 0.5
            rows.append((left, right, float(n)))
            left = right
        data = self.tf.constant(np.asarray(rows, dtype=np.float64))
        self.tf.summary.write(
            "staleness/histogram", data, step=version, metadata=self._histogram_meta
        )
