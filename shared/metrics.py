"""The metrics model shared by both services: counters by reason, histograms, rates.

Values are plain Python numbers so a snapshot is msgpack- and JSON-serialisable as it is.
"""

from __future__ import annotations

import bisect
import time
from collections import Counter, deque
from typing import Any

# Staleness buckets (upper bounds, inclusive); the last bucket is "+Inf".
STALENESS_BOUNDS: tuple[float, ...] = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 128)


class Histogram:
    """Cumulative-free bucket counts with count, sum and max."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.count = 0
        self.sum = 0.0
        self.max = 0.0

    def observe(self, value: float) -> None:
        """Record one observation."""
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.count += 1
        self.sum += value
        self.max = max(self.max, value)

    def snapshot(self) -> dict[str, Any]:
        """count, sum, mean, max and [upper_bound, count] buckets ("+Inf" last)."""
        labels: list[Any] = [*self.bounds, "+Inf"]
        return {
            "count": self.count,
            "sum": self.sum,
            "mean": self.sum / self.count if self.count else 0.0,
            "max": self.max,
            "buckets": [[b, c] for b, c in zip(labels, self.counts, strict=True)],
        }


class Rate:
    """Events per second over a sliding window of recent timestamps."""

    def __init__(self, window_s: float = 10.0) -> None:
        self.window_s = window_s
        self.events: deque[float] = deque()

    def mark(self, now: float | None = None) -> None:
        """Record one event at ``now`` (monotonic seconds)."""
        now = time.monotonic() if now is None else now
        self.events.append(now)
        self._trim(now)

    def _trim(self, now: float) -> None:
        while self.events and self.events[0] < now - self.window_s:
            self.events.popleft()

    def per_second(self, now: float | None = None) -> float:
        """Events per second over the window (or since the first event, if sooner)."""
        now = time.monotonic() if now is None else now
        self._trim(now)
        if len(self.events) < 2:
            return 0.0
        span = max(now - self.events[0], 1e-9)
        return len(self.events) / span


class ReasonCounter(Counter):
    """Counts by reason code (``rejected["nbytes"] += 1``)."""

    def total(self) -> int:  # type: ignore[override]
        """Sum over all reasons."""
        return sum(self.values())


class Ewma:
    """Exponentially weighted moving average; ``value`` is None until the first sample."""

    def __init__(self, alpha: float = 0.1) -> None:
        self.alpha = alpha
        self.value: float | None = None

    def update(self, x: float) -> None:
        """Fold one sample in."""
        self.value = x if self.value is None else (1 - self.alpha) * self.value + self.alpha * x
