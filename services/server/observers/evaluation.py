"""Held-out evaluation on the server (``--eval-every N``), off the apply loop.

The loop hands over a ``ParameterState.weights()`` snapshot (immutable arrays, shared with
pulls of that version) every N updates; a separate thread loads it into a second copy of the
model and scores the held-out set (the spec's ``held_out_fn``, or its Dataset's:
``downpour.inputs.pipeline``) with the spec's metric. The loop never waits: while an evaluation
runs, no new snapshot is taken, so evaluations happen every N updates or as often as they can
finish, whichever is rarer.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from downpour.inputs.pipeline import build_dataset, context, resolve_inputs, training_features
from downpour.model.build import batchnorm_layers, build_model, predict, recalibrate_batchnorm
from downpour.spec import ModelSpec

log = logging.getLogger("downpour.server")


class HeldOutEvaluator:
    """Scores weight snapshots on the held-out set in its own thread.

    ``on_result`` is called (in the evaluator's thread) with each result dict:
    ``{"version", "metric", <metric>, "time", "seconds", "count", "every", "examples"}``, where
    ``metric`` is the spec's ``metric_name`` (``accuracy`` by default) and the value is under
    that name (``result["auc"]`` for an AUC spec).
    """

    def __init__(
        self,
        spec: ModelSpec,
        data_dir: str | None,
        every: int,
        on_result: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        if every < 1:
            raise ValueError(f"eval every must be >= 1 update, got {every}")
        inputs = resolve_inputs(spec, data_dir)
        if inputs.held_out is None:
            raise ValueError(
                f"model {spec.name!r} has no held-out set to evaluate (give it a held_out_fn)"
            )
        self.spec = spec
        self.every = every
        ctx = context(spec, data_dir)
        self.held_out = build_dataset(inputs.held_out, ctx, "held_out_fn")
        self.train_fn, self.ctx = inputs.train, ctx  # BatchNorm statistics are recomputed from it
        self._bn_batches: list[Any] | None = None
        self.model = build_model(spec)  # a second copy: the loop's variables are never touched
        self.has_batchnorm = bool(batchnorm_layers(self.model))
        self.on_result = on_result
        self.last: dict[str, Any] | None = None
        self.count = 0
        self.failed = 0
        self._next_version = every
        self._pending: tuple[int, Sequence[np.ndarray]] | None = None
        self._wake = threading.Condition()
        self._busy = False
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="evaluator", daemon=True)

    def start(self) -> None:
        """Start the evaluation thread."""
        self._thread.start()

    def due(self, version: int) -> bool:
        """True when ``version`` should be evaluated and the evaluator is free (loop thread)."""
        return version >= self._next_version and not self._busy

    def submit(self, version: int, arrays: Sequence[np.ndarray]) -> None:
        """Hand over a weight snapshot; returns at once."""
        with self._wake:
            self._pending = (version, arrays)
            self._busy = True
            self._next_version = version + self.every
            self._wake.notify()

    def snapshot(self) -> dict[str, Any] | None:
        """The last result (for the status document), or None before the first."""
        return self.last

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the thread after the evaluation in progress (bounded wait)."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        if self._thread.is_alive():
            self._thread.join(timeout=timeout_s)

    def _loop(self) -> None:
        while True:
            with self._wake:
                while self._pending is None and not self._closed:
                    self._wake.wait()
                if self._closed:
                    return
                assert self._pending is not None
                version, arrays = self._pending
                self._pending = None
            try:
                result = self._evaluate(version, arrays)
            except Exception:  # a broken metric must not take the server down
                self.failed += 1
                log.exception("held-out evaluation of version %d failed", version)
                result = None
            finally:
                self._busy = False
            if result is not None and self.on_result is not None:
                try:
                    self.on_result(result)
                except Exception:
                    log.exception("handling the evaluation result failed")

    def _evaluate(self, version: int, arrays: Sequence[np.ndarray]) -> dict[str, Any]:
        t0 = time.perf_counter()
        for var, a in zip(self.model.trainable_variables, arrays, strict=True):
            var.assign(a)
        if self._bn_batches is None:  # read once: the same batches for every version
            self._bn_batches = (
                training_features(self.train_fn, self.ctx, 20) if self.has_batchnorm else []
            )
        recalibrate_batchnorm(self.model, self._bn_batches)  # no-op without BatchNormalization
        labels, outputs = predict(self.model, self.held_out)
        score = float(self.spec.metric(labels, outputs))
        name = self.spec.metric_name
        self.count += 1
        self.last = {
            "version": version,
            "metric": name,
            name: score,
            "time": time.time(),
            "seconds": round(time.perf_counter() - t0, 4),
            "count": self.count,
            "every": self.every,
            "examples": len(labels),
        }
        log.info(
            "held-out %s %.4f at version %d (%.2f s)",
            name,
            score,
            version,
            self.last["seconds"],
            extra={"version": version},
        )
        return self.last
