"""The server-wide figures: what the handlers count and the status document reports."""

from __future__ import annotations

from dataclasses import dataclass, field

from downpour.runtime.metrics import STALENESS_BOUNDS, Ewma, Histogram, Rate, ReasonCounter

# Plain counters, reported under these names at the top level of the status document.
COUNTER_NAMES = (
    "pushes_received",
    "pulls",
    "pulls_unchanged",
    "pulls_bf16",
    "row_pulls",
    "rows_served",
    "rows_bf16",  # of rows_served: sent in bfloat16
    "hellos",
    "bytes_in",
    "bytes_out",
    "status_requests",
    "status_rejected",
    "status_oversize",  # of status_rejected: past the status socket's bound
)


@dataclass
class ServerStats:
    """Counters, rejection reasons, staleness and apply timing of one server.

    The loop thread writes everything except ``status_requests``, ``status_rejected`` and
    ``status_oversize``, which only the status thread writes.
    """

    counters: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTER_NAMES, 0))
    rejected: ReasonCounter = field(default_factory=ReasonCounter)
    staleness: Histogram = field(default_factory=lambda: Histogram(STALENESS_BOUNDS))
    apply_ms: Ewma = field(default_factory=lambda: Ewma(0.05))
    loss: Ewma = field(default_factory=lambda: Ewma(0.05))
    update_rate: Rate = field(default_factory=lambda: Rate(10.0))
