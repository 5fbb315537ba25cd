"""The metrics model shared by both services: counters by reason, histograms, rates, and
the catalogue naming every figure (status key, Prometheus name, kind, unit).

Values are plain Python numbers so a snapshot is msgpack- and JSON-serialisable as it is. The
server keeps its figures in these types and publishes them in its status document; a worker
keeps ``new_worker_stats()`` and sends it with every push and heartbeat; the Prometheus
exporter and the TensorBoard writer read the status document through the catalogue below, so
one name means one thing everywhere.
"""

from __future__ import annotations

import bisect
import logging
import math
import threading
import time
from collections import Counter, deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from downpour.wire.bodies import MAX_NOTICES, NOTICE_CHARS

# Staleness buckets (upper bounds, inclusive); the last bucket is "+Inf".
STALENESS_BOUNDS: tuple[float, ...] = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 128)
# Per-worker staleness buckets: fewer, so that series stay few (x --max-workers workers).
WORKER_STALENESS_BOUNDS: tuple[float, ...] = (0, 1, 2, 4, 8, 16, 32, 64)


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

    def quantile(self, q: float) -> float | None:
        """The upper bound of the bucket holding the ``q`` quantile (the max for the last
        bucket): an upper estimate, as precise as the buckets. None before any observation."""
        if not self.count:
            return None
        rank, seen = q * self.count, 0
        for bound, n in zip(self.bounds, self.counts, strict=False):
            seen += n
            if seen >= rank and seen:
                return min(float(bound), self.max)
        return self.max

    def snapshot(self) -> dict[str, Any]:
        """count, sum, mean, max, p50, p99 and [upper_bound, count] buckets ("+Inf" last)."""
        labels: list[Any] = [*self.bounds, "+Inf"]
        return {
            "count": self.count,
            "sum": self.sum,
            "mean": self.sum / self.count if self.count else 0.0,
            "max": self.max,
            "p50": self.quantile(0.5),
            "p99": self.quantile(0.99),
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
        """Events per second over the window (or since the first event, if sooner).

        Counts the intervals after the first event in the window, not the events: n events
        span n - 1 intervals, and counting n would overstate a rate measured over a few
        events (two events 0.1 s apart are 10/s, not 20/s).
        """
        now = time.monotonic() if now is None else now
        self._trim(now)
        if len(self.events) < 2:
            return 0.0
        span = max(now - self.events[0], 1e-9)
        return (len(self.events) - 1) / span


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


# ---------------------------------------------------------------- the catalogue
#
# Every figure either service exposes, with its key in the status document (or in a worker's
# reported ``stats``), its Prometheus name, kind and unit. Status documents keep the units
# their keys say (``_ms``, ``_s``, bytes); ``scale`` converts to Prometheus' base units.

COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"


@dataclass(frozen=True)
class MetricInfo:
    """One figure: status key, Prometheus name, kind, unit and help text."""

    key: str
    name: str
    kind: str  # COUNTER, GAUGE or HISTOGRAM
    unit: str  # what the *Prometheus* value is measured in ("" = a plain number)
    help: str
    scale: float = 1.0  # Prometheus value = status value * scale (ms -> seconds)


# Top-level numbers of the server's status document.
SERVER_METRICS: tuple[MetricInfo, ...] = (
    MetricInfo(
        "updates_applied", "downpour_updates_applied_total", COUNTER, "", "Gradient lists applied."
    ),
    MetricInfo("version", "downpour_model_version", GAUGE, "", "Current weight version."),
    MetricInfo(
        "shard_bytes",
        "downpour_parameter_bytes",
        GAUGE,
        "bytes",
        "Bytes of the parameters this server (shard) holds.",
    ),
    MetricInfo(
        "slot_bytes",
        "downpour_optimizer_slot_bytes",
        GAUGE,
        "bytes",
        "Bytes of the optimizer's slots for those parameters.",
    ),
    MetricInfo(
        "rss_mib",
        "downpour_resident_bytes",
        GAUGE,
        "bytes",
        "Resident memory of the server process now (VmRSS).",
        2**20,
    ),
    MetricInfo(
        "peak_rss_mib",
        "downpour_peak_resident_bytes",
        GAUGE,
        "bytes",
        "Peak resident memory of the server process (VmHWM).",
        2**20,
    ),
    MetricInfo(
        "updates_per_s",
        "downpour_updates_per_second",
        GAUGE,
        "",
        "Applies per second over the last 10 s.",
    ),
    MetricInfo(
        "apply_ms",
        "downpour_apply_duration_seconds",
        GAUGE,
        "seconds",
        "Moving average of one compiled apply.",
        1e-3,
    ),
    MetricInfo(
        "loss",
        "downpour_training_loss",
        GAUGE,
        "",
        "Moving average of the batch losses workers push.",
    ),
    MetricInfo(
        "pushes_received",
        "downpour_pushes_received_total",
        COUNTER,
        "",
        "Gradient messages received (applied or rejected).",
    ),
    MetricInfo("pulls", "downpour_pulls_total", COUNTER, "", "Weight pulls answered."),
    MetricInfo(
        "pulls_unchanged",
        "downpour_pulls_unchanged_total",
        COUNTER,
        "",
        "Weight pulls answered with 'unchanged' (no tensors sent).",
    ),
    MetricInfo(
        "pulls_bf16",
        "downpour_pulls_bf16_total",
        COUNTER,
        "",
        "Whole-weight pulls answered in bfloat16 (workers with --pull-compress bf16).",
    ),
    MetricInfo(
        "row_pulls",
        "downpour_row_pulls_total",
        COUNTER,
        "",
        "Row pulls answered (pulls that asked for rows of row-sparse tables).",
    ),
    MetricInfo(
        "rows_served",
        "downpour_rows_served_total",
        COUNTER,
        "",
        "Table rows sent in answer to row pulls (unique rows per pull).",
    ),
    MetricInfo(
        "rows_bf16",
        "downpour_rows_bf16_total",
        COUNTER,
        "",
        "Of rows_served: rows sent in bfloat16 (row pulls of workers with --pull-compress bf16).",
    ),
    MetricInfo("hellos", "downpour_hellos_total", COUNTER, "", "Worker hellos answered."),
    MetricInfo("bytes_in", "downpour_received_bytes_total", COUNTER, "bytes", "Bytes received."),
    MetricInfo("bytes_out", "downpour_sent_bytes_total", COUNTER, "bytes", "Bytes sent."),
    MetricInfo(
        "status_requests",
        "downpour_status_requests_total",
        COUNTER,
        "",
        "Status requests answered.",
    ),
    MetricInfo(
        "uptime_s", "downpour_uptime_seconds", GAUGE, "seconds", "Seconds since the server started."
    ),
)

# The staleness histogram and the by-reason counters of the status document.
STALENESS = MetricInfo(
    "staleness",
    "downpour_gradient_staleness",
    HISTOGRAM,
    "",
    "Server version at apply time minus the version the gradient was computed from.",
)
REJECTED = MetricInfo(
    "rejected",
    "downpour_rejected_messages_total",
    COUNTER,
    "",
    "Messages refused, by reason; nothing was applied.",
)
POLICY = MetricInfo(
    "policy",
    "downpour_policy_events_total",
    COUNTER,
    "",
    "Staleness-policy decisions, by event: offered, updates, applied, scaled, dropped_stale, "
    "late, duplicate, future, aggregated, discarded, held_pulls (docs: policies.md).",
)
AUTH_DENIED = MetricInfo(
    "auth_denied",
    "downpour_auth_denied_total",
    COUNTER,
    "",
    "Connections or messages refused by CURVE/ZAP, by reason.",
)

# The ``eval`` part of the status document (``--eval-every``). The score is under the spec's
# metric name (``eval["metric"]``): ``accuracy`` by default, exported as
# downpour_heldout_accuracy as well; every metric is exported as HELDOUT_METRIC{metric=name}.
EVAL_METRICS: tuple[MetricInfo, ...] = (
    MetricInfo(
        "accuracy",
        "downpour_heldout_accuracy",
        GAUGE,
        "",
        "The held-out accuracy at the last evaluation (specs whose metric is accuracy).",
    ),
    MetricInfo(
        "version",
        "downpour_heldout_eval_version",
        GAUGE,
        "",
        "Weight version of the last held-out evaluation.",
    ),
    MetricInfo(
        "count", "downpour_heldout_evaluations_total", COUNTER, "", "Held-out evaluations run."
    ),
    MetricInfo(
        "seconds",
        "downpour_heldout_eval_duration_seconds",
        GAUGE,
        "seconds",
        "Duration of the last held-out evaluation.",
    ),
)

HELDOUT_METRIC = MetricInfo(
    "metric",
    "downpour_heldout_metric",
    GAUGE,
    "",
    "The model's held-out metric at the last evaluation, labelled by its name (accuracy, auc).",
)


def eval_score(ev: dict[str, Any] | None) -> tuple[str, float | None]:
    """(metric name, value) of a held-out evaluation result (the status document's ``eval``);
    the value is None when there is no result or no number under the name."""
    ev = ev or {}
    name = str(ev.get("metric", "accuracy"))
    value = ev.get(name)
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    return name, float(value) if ok else None


# The dynamic tables (``dynamic_tables.<path>`` in the server's status document, one entry per
# table this shard holds a part of): every series is labelled ``table`` (the path); the shard is
# the process, as for every other figure. An entry's numbers are read by what their key says
# (``table_figures``), so a count a table adds shows up without a line here: a key of
# TABLE_METRICS is that figure (sizes and settings, gauges); ``bytes_<part>`` is
# TABLE_PART_BYTES{part}; every other number counts the table's events, TABLE_EVENTS{event}.
# A figure a table adds that is not a count of events needs its line in TABLE_METRICS.
TABLE_METRICS: tuple[MetricInfo, ...] = (
    MetricInfo(
        "live_rows", "downpour_dynamic_table_rows", GAUGE, "", "Live rows of a dynamic table."
    ),
    MetricInfo(
        "bytes",
        "downpour_dynamic_table_bytes",
        GAUGE,
        "bytes",
        "Bytes of a dynamic table: rows, slots, id index, admission sketch, metadata.",
    ),
    MetricInfo(
        "admit_after",
        "downpour_dynamic_table_admit_after",
        GAUGE,
        "",
        "Lookups of an id before its row is stored (--admit-after).",
    ),
    MetricInfo(
        "capacity",
        "downpour_dynamic_table_capacity_rows",
        GAUGE,
        "",
        "Rows of their own a shard keeps of a dynamic table at most (its share of the layer's "
        "max_rows less its fallback rows, or --table-rows-per-shard; absent: unbounded).",
    ),
    MetricInfo(
        "fallback_rows",
        "downpour_dynamic_table_fallback_rows",
        GAUGE,
        "",
        "Fallback rows a shard keeps of a dynamic table: the ids without rows of their own "
        "read and train them, mix64(id) mod B.",
    ),
    MetricInfo(
        "max_rows",
        "downpour_dynamic_table_max_rows",
        GAUGE,
        "",
        "The table's row budget over all shards, its own and fallback rows (the layer's "
        "max_rows; absent: unbounded).",
    ),
    MetricInfo(
        "evict_idle_versions",
        "downpour_dynamic_table_evict_idle_versions",
        GAUGE,
        "",
        "Versions a row may go without an update before it is evicted "
        "(--evict-idle-versions; absent: never).",
    ),
)
TABLE_PART_BYTES = MetricInfo(
    "bytes_",
    "downpour_dynamic_table_part_bytes",
    GAUGE,
    "bytes",
    "Bytes of a dynamic table by part (rows, slots, index, sketch, meta): they add up to "
    "downpour_dynamic_table_bytes.",
)
TABLE_EVENTS = MetricInfo(
    "",
    "downpour_dynamic_table_events_total",
    COUNTER,
    "",
    "Dynamic table events, by kind: every count the table reports (inserted, admitted, "
    "refused lookups, refused_victim of them lost to the victim, evicted_idle, "
    "evicted_capacity, readmitted, fallback_lookups, bad_input, ...); a count by reason as "
    "<count>.<reason>.",
)
TABLE_SIZES = ("live_rows", "bytes")  # of TABLE_METRICS, the sizes; the others are settings


def table_figures(
    entry: Mapping[str, Any],
) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """(named, parts, events) of one dynamic table's status entry: the numbers under the keys
    of TABLE_METRICS, the bytes by part (``bytes_<part>`` as ``part``), and every other number
    as a count of events by key, in the entry's order (a mapping of numbers, counts by reason,
    as one event per item: ``<key>.<reason>``). Text, None and booleans are left out."""
    named_keys = {mi.key for mi in TABLE_METRICS}
    named: dict[str, float] = {}
    parts: dict[str, float] = {}
    events: dict[str, float] = {}
    for key, value in entry.items():
        if isinstance(value, Mapping):
            for reason, n in value.items():
                if (v := _plain_number(n)) is not None:
                    events[f"{key}.{reason}"] = v
            continue
        if (v := _plain_number(value)) is None:
            continue
        if key in named_keys:
            named[key] = v
        elif key.startswith(TABLE_PART_BYTES.key):
            parts[key.removeprefix(TABLE_PART_BYTES.key)] = v
        else:
            events[key] = v
    return named, parts, events


def _plain_number(value: Any) -> float | None:
    """``value`` as a float when it is an int or float (not a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


# What the server records per worker (``workers.<id>`` in the status document).
WORKER_METRICS: tuple[MetricInfo, ...] = (
    MetricInfo(
        "applied",
        "downpour_worker_updates_applied_total",
        COUNTER,
        "",
        "Gradients from this worker that reached the weights (sync: each of an update's K).",
    ),
    MetricInfo(
        "dropped",
        "downpour_worker_policy_dropped_total",
        COUNTER,
        "",
        "Valid gradients from this worker the staleness policy did not apply.",
    ),
    MetricInfo(
        "held",
        "downpour_worker_policy_held_total",
        COUNTER,
        "",
        "Gradients from this worker held for a sync:K/N round.",
    ),
    MetricInfo(
        "rejected",
        "downpour_worker_rejected_messages_total",
        COUNTER,
        "",
        "Messages refused from this worker.",
    ),
    MetricInfo("pushes", "downpour_worker_pushes_received_total", COUNTER, "", "Pushes received."),
    MetricInfo("steps", "downpour_worker_steps", GAUGE, "", "Training steps the worker has run."),
    MetricInfo(
        "staleness",
        "downpour_worker_staleness_last",
        GAUGE,
        "",
        "Staleness of this worker's last accepted gradient (applied, held or dropped).",
    ),
    MetricInfo("loss", "downpour_worker_loss", GAUGE, "", "Batch loss of this worker's last push."),
    MetricInfo(
        "last_seen_s",
        "downpour_worker_last_seen_seconds",
        GAUGE,
        "seconds",
        "Seconds since the server last heard from this worker.",
    ),
)

# How many slow paths a worker reports it runs on (``workers.<id>.notices``, a list of them).
WORKER_NOTICES = MetricInfo(
    "notices",
    "downpour_worker_notices",
    GAUGE,
    "",
    "Slow or degraded paths the worker reports it runs on (downpour status prints them).",
)

# The per-worker staleness histogram (``workers.<id>.staleness_histogram``).
WORKER_STALENESS = MetricInfo(
    "staleness_histogram",
    "downpour_worker_staleness",
    HISTOGRAM,
    "",
    "Staleness of this worker's accepted gradients (applied, held or dropped), in buckets "
    "0, 1, 2, 4, 8, 16, 32, 64, +Inf.",
)

# What a worker reports with every push and heartbeat (``workers.<id>.reported``).
WORKER_REPORTED: tuple[MetricInfo, ...] = (
    MetricInfo(
        "steps_per_s",
        "downpour_worker_steps_per_second",
        GAUGE,
        "",
        "Training steps per second over the last 10 s.",
    ),
    MetricInfo(
        "compute_ms",
        "downpour_worker_compute_seconds",
        GAUGE,
        "seconds",
        "Duration of the last gradient computation.",
        1e-3,
    ),
    MetricInfo(
        "push_ms",
        "downpour_worker_push_seconds",
        GAUGE,
        "seconds",
        "Duration of the last push (including waiting at the high-water mark).",
        1e-3,
    ),
    MetricInfo(
        "pull_ms",
        "downpour_worker_pull_seconds",
        GAUGE,
        "seconds",
        "Time the last weight pull kept training waiting.",
        1e-3,
    ),
    MetricInfo(
        "bytes_sent",
        "downpour_worker_sent_bytes_total",
        COUNTER,
        "bytes",
        "Gradient message bytes sent (after --compress).",
    ),
    MetricInfo(
        "bytes_raw",
        "downpour_worker_raw_bytes_total",
        COUNTER,
        "bytes",
        "What the same gradient messages would have taken uncompressed.",
    ),
    MetricInfo(
        "backpressure",
        "downpour_worker_backpressure_events_total",
        COUNTER,
        "",
        "Pushes that found the send queue full (server slow or away).",
    ),
    MetricInfo("loss", "downpour_worker_local_loss", GAUGE, "", "Loss of the worker's last batch."),
    MetricInfo("pushes", "downpour_worker_pushes_sent_total", COUNTER, "", "Pushes sent."),
    MetricInfo("pulls", "downpour_worker_pulls_total", COUNTER, "", "Weight pulls made."),
    MetricInfo(
        "pulls_unchanged",
        "downpour_worker_pulls_unchanged_total",
        COUNTER,
        "",
        "Weight pulls answered 'unchanged'.",
    ),
    MetricInfo(
        "pulls_within_bound",
        "downpour_worker_pulls_within_bound_total",
        COUNTER,
        "",
        "Weight pulls a server answered 'moved at most --pull-bound': computed on held weights.",
    ),
    MetricInfo(
        "reconnects",
        "downpour_worker_reconnects_total",
        COUNTER,
        "",
        "Requests that timed out and were retried on a new socket.",
    ),
    MetricInfo(
        "rehellos",
        "downpour_worker_rehellos_total",
        COUNTER,
        "",
        "Hellos said again to a server seen restarted (a new incarnation).",
    ),
    MetricInfo(
        "dropped",
        "downpour_worker_dropped_gradients_total",
        COUNTER,
        "",
        "Gradients left unsent: at a planned stop, or blocked for a server that restarted.",
    ),
    MetricInfo(
        "dropped_stale",
        "downpour_worker_stale_dropped_total",
        COUNTER,
        "",
        "Gradients the server's policy dropped as too stale, as told in pull replies.",
    ),
    MetricInfo(
        "stale_refreshes",
        "downpour_worker_stale_refreshes_total",
        COUNTER,
        "",
        "Extra synchronous pulls made because the server dropped a stale gradient.",
    ),
    MetricInfo(
        "sync_wait_ms",
        "downpour_worker_sync_wait_seconds",
        GAUGE,
        "seconds",
        "With a sync:K/N server: how long the last wait for the next version took.",
        1e-3,
    ),
    MetricInfo(
        "sync_wait_timeouts",
        "downpour_worker_sync_wait_timeouts_total",
        COUNTER,
        "",
        "With a sync:K/N server: waits for the next version that timed out.",
    ),
    MetricInfo(
        "ssp_waits",
        "downpour_worker_ssp_waits_total",
        COUNTER,
        "",
        "With an ssp:K server: pulls it held because this worker was more than K ahead.",
    ),
    MetricInfo(
        "ssp_wait_ms",
        "downpour_worker_ssp_wait_seconds",
        GAUGE,
        "seconds",
        "With an ssp:K server: how long the last held pull waited for the slowest worker.",
        1e-3,
    ),
    MetricInfo(
        "bytes_pulled",
        "downpour_worker_pulled_bytes_total",
        COUNTER,
        "bytes",
        "Tensor bytes received in weight pulls (whole variables and table rows), as float32 "
        "once widened (bytes_received: as they travelled).",
    ),
    MetricInfo(
        "bytes_received",
        "downpour_worker_received_bytes_total",
        COUNTER,
        "bytes",
        "Weight pull reply bytes as received (headers and frames; bf16 values at 2 bytes): "
        "what the pulls moved, beside bytes_sent for the pushes.",
    ),
    MetricInfo(
        "rows_pulled",
        "downpour_worker_rows_pulled_total",
        COUNTER,
        "",
        "Table rows received in row pulls.",
    ),
    MetricInfo(
        "row_bytes_pulled",
        "downpour_worker_row_pulled_bytes_total",
        COUNTER,
        "bytes",
        "Bytes of table rows (ids and values) received in row pulls.",
    ),
    MetricInfo(
        "row_hits",
        "downpour_worker_row_hits_total",
        COUNTER,
        "",
        "A batch's table rows found fresh in the row cache (within --row-staleness).",
    ),
    MetricInfo(
        "row_misses",
        "downpour_worker_row_misses_total",
        COUNTER,
        "",
        "A batch's table rows that had to be pulled (not fetched, or too stale).",
    ),
    MetricInfo(
        "row_sync_pulls",
        "downpour_worker_row_sync_pulls_total",
        COUNTER,
        "",
        "Row pulls the training thread waited for: rows the look-ahead pull did not bring.",
    ),
)

# A worker reports at most this many figures; more (or non-numeric, or non-finite) are dropped,
# so a misbehaving worker cannot bloat the status document.
MAX_REPORTED = 64


def rss_mib(pid: int | None = None) -> float | None:
    """The resident set in MiB now of this process, or of process ``pid``: ``VmRSS`` from
    /proc/PID/status. None where /proc does not say."""
    return _proc_status_mib("VmRSS", pid)


def peak_rss_mib(pid: int | None = None) -> float | None:
    """The peak resident set in MiB of this process, or of process ``pid`` (a child the
    caller started, e.g. a server whose memory a test or the bench measures): ``VmHWM``
    from /proc/PID/status, the high-water mark of its own address space since its exec.
    (``ru_maxrss`` is not that: on Linux it keeps the high-water mark of the address space
    the process had before its exec, the forking parent's.) None where /proc does not say
    (no /proc, or the process is gone)."""
    return _proc_status_mib("VmHWM", pid)


def _proc_status_mib(field: str, pid: int | None) -> float | None:
    """A kB field of /proc/PID/status (``self`` when ``pid`` is None) in MiB, or None."""
    try:
        with open(f"/proc/{'self' if pid is None else pid}/status") as f:
            for line in f:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) / 1024  # kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def new_worker_stats() -> dict[str, float]:
    """A worker's ``stats`` at start: every reported figure at zero, ``loss`` NaN (unknown;
    not reported) until the first step. All keys exist from the start, so the heartbeat
    thread can copy the dict while the training thread updates it."""
    stats: dict[str, float] = {m.key: 0.0 if m.kind == GAUGE else 0 for m in WORKER_REPORTED}
    stats["loss"] = math.nan
    return stats


def reported_counts(stats: Mapping[str, float]) -> dict[str, int]:
    """The counters of a worker's reported figures (``WORKER_REPORTED``) as whole numbers:
    what its summary shows of them."""
    return {m.key: int(stats[m.key]) for m in WORKER_REPORTED if m.kind == COUNTER}


def clean_reported(stats: Any) -> dict[str, float]:
    """The finite numbers of a worker's reported ``stats`` (str keys, at most MAX_REPORTED)."""
    if not isinstance(stats, dict):
        return {}
    out: dict[str, float] = {}
    for k, v in stats.items():
        if len(out) >= MAX_REPORTED:
            break
        if (
            isinstance(k, str)
            and len(k) <= 64
            and isinstance(v, int | float)
            and not isinstance(v, bool)
            and math.isfinite(v)
        ):
            out[k] = v
    return out


class Notices:
    """The slow or degraded paths a worker runs on, each a sentence naming what and why.

    ``warn`` logs one at warning level and keeps it; the worker sends what it keeps with every
    push and heartbeat, so the servers' status shows it under the worker (``notices``) and
    ``downpour status`` prints it. At most ``MAX_NOTICES`` are kept, each cut to
    ``NOTICE_CHARS``; a notice already kept is not logged again. Thread-safe.
    """

    def __init__(self) -> None:
        self._items: tuple[str, ...] = ()
        self._lock = threading.Lock()

    def warn(self, logger: logging.Logger, fmt: str, *args: Any) -> None:
        """Log ``fmt % args`` at warning level (once) and keep it for the servers."""
        text = " ".join((fmt % args if args else fmt).split())
        with self._lock:
            kept = text[:NOTICE_CHARS]
            if kept in self._items:
                return
            if len(self._items) < MAX_NOTICES:
                self._items = (*self._items, kept)
        logger.warning("%s", text, stacklevel=2)

    def items(self) -> tuple[str, ...]:
        """The notices kept, in the order they were first given."""
        return self._items
