"""Held-out evaluation on the server (``--eval-every N``), off the apply loop.

The loop hands over a ``ParameterState.weights()`` snapshot (immutable arrays, shared with
pulls of that version) every N updates; a separate thread loads it into a second copy of the
model and scores the held-out set with ``downpour.models.evaluate``. The loop never waits: while
an evaluation runs, no new snapshot is taken, so evaluations happen every N updates or as often
as they can finish, whichever is rarer.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from downpour.models import build_model, evaluate, recalibrate_batchnorm
from downpour.spec import ModelSpec

log = logging.getLogger("downpour.server")


class HeldOutEvaluator:
    """Scores weight snapshots on the held-out set in its own thread.

    ``on_result`` is called (in the evaluator's thread) with each result dict:
    ``{"version", "accuracy", "time", "seconds", "count", "every", "examples"}``.
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
        data = spec.load_data(data_dir)
        if len(data.x_test) == 0:
            raise ValueError(f"model {spec.name!r} has no held-out examples to evaluate")
        self.spec = spec
        self.every = every
        self.x, self.y = data.x_test, data.y_test
        self.x_train = data.x_train  # BatchNorm statistics are recomputed from it
        self.model = build_model(spec)  # a second copy: the loop's variables are never touched
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
        recalibrate_batchnorm(self.model, self.x_train)  # no-op without BatchNormalization
        accuracy = float(evaluate(self.spec, self.model, self.x, self.y))
        self.count += 1
        self.last = {
            "version": version,
            "accuracy": accuracy,
            "time": time.time(),
            "seconds": round(time.perf_counter() - t0, 4),
            "count": self.count,
            "every": self.every,
            "examples": len(self.x),
        }
        log.info(
            "held-out accuracy %.4f at version %d (%.2f s)",
            accuracy,
            version,
            self.last["seconds"],
            extra={"version": version},
        )
        return self.last
