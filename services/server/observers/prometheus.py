"""``--metrics-port``: the server's figures on ``/metrics`` for Prometheus.

A custom collector turns the *published* status document (the snapshot the loop swaps in a
few times a second for the status thread) into metric families on each scrape, so a scrape
never reads the loop's live state and never takes a lock the loop needs. Names and units come
from the catalogue in ``downpour.runtime.metrics``; per-worker series carry the label ``worker``,
per-table series the label ``table``. A server is one shard: its scrape target tells the shards
apart, as for every other figure.

The endpoint is plain HTTP without authentication; it binds loopback unless told otherwise.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from downpour.runtime import metrics as m
from downpour.server.dispatch import COUNTER_NAMES as DISPATCH_EVENTS

log = logging.getLogger("downpour.server")

WORKER_STATES = ("alive", "missing", "gone")


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _family(info: m.MetricInfo, labels: list[str] | None = None) -> Metric:
    cls = CounterMetricFamily if info.kind == m.COUNTER else GaugeMetricFamily
    return cls(info.name, info.help, labels=labels, unit=info.unit)


def _scalars(catalogue: Iterable[m.MetricInfo], doc: dict[str, Any]) -> Iterator[Metric]:
    """One unlabelled family per catalogued figure that ``doc`` holds as a number."""
    for mi in catalogue:
        v = _number(doc.get(mi.key))
        if v is not None:
            fam = _family(mi)
            fam.add_metric([], v * mi.scale)
            yield fam


def _cumulative(hist: dict[str, Any]) -> list[tuple[str, float]]:
    """A status histogram's per-bucket counts as Prometheus' cumulative (le, count) pairs."""
    buckets, total = [], 0.0
    for bound, count in hist.get("buckets", []):
        total += count
        buckets.append(("+Inf" if bound == "+Inf" else floatToGoString(bound), total))
    return buckets


class SnapshotCollector(Collector):
    """Builds the metric families from the status document ``get_doc()`` returns."""

    def __init__(self, get_doc: Callable[[], dict[str, Any]]) -> None:
        self.get_doc = get_doc

    def describe(self) -> list[Metric]:
        """Nothing up front: the families depend on the document (workers come and go)."""
        return []

    def collect(self) -> Iterator[Metric]:
        """One family per catalogue entry present in the current document."""
        doc = self.get_doc() or {}
        info = GaugeMetricFamily(
            "downpour_server_info",
            "The model this server holds (value always 1).",
            labels=["model", "fingerprint", "incarnation", "protocol"],
        )
        info.add_metric(
            [
                str(doc.get("model", "")),
                str(doc.get("fingerprint", "")),
                str(doc.get("incarnation", "")),
                str(doc.get("protocol", "")),
            ],
            1,
        )
        yield info
        yield from _scalars(m.SERVER_METRICS, doc)
        yield from self._staleness(doc.get(m.STALENESS.key))
        for mi in (m.REJECTED, m.AUTH_DENIED):
            fam = _family(mi, ["reason"])
            for reason, n in sorted((doc.get(mi.key) or {}).items()):
                fam.add_metric([str(reason)], float(n))
            yield fam
        yield from self._policy(doc.get(m.POLICY.key))
        yield from self._eval(doc.get("eval"))
        yield from self._workers(doc.get("workers") or {})
        yield from self._registry(doc.get("registry"))
        yield from self._checkpoints(doc.get("checkpoints"))
        yield from self._dispatch(doc.get("dispatch"))
        yield from self._tables(doc.get("dynamic_tables") or {})

    def _tables(self, tables: dict[str, dict[str, Any]]) -> Iterator[Metric]:
        """The dynamic tables, labelled ``table``: every number of each table's entry, as the
        catalogue reads it (``downpour.runtime.metrics.table_figures``)."""
        if not tables:
            return
        figures = {path: m.table_figures(t) for path, t in sorted(tables.items())}
        for mi in m.TABLE_METRICS:
            fam = _family(mi, ["table"])
            for path, (named, _, _) in figures.items():
                if mi.key in named:
                    fam.add_metric([path], named[mi.key] * mi.scale)
            if fam.samples:
                yield fam
        parts = _family(m.TABLE_PART_BYTES, ["table", "part"])
        events = _family(m.TABLE_EVENTS, ["table", "event"])
        for path, (_, by_part, by_event) in figures.items():
            for part, v in by_part.items():
                parts.add_metric([path, part], v)
            for event, v in by_event.items():
                events.add_metric([path, event], v)
        yield from (parts, events)

    def _staleness(self, st: dict[str, Any] | None) -> Iterator[Metric]:
        if not st:
            return
        fam = HistogramMetricFamily(m.STALENESS.name, m.STALENESS.help)
        fam.add_metric([], _cumulative(st), sum_value=float(st.get("sum", 0.0)))
        yield fam

    def _policy(self, pol: dict[str, Any] | None) -> Iterator[Metric]:
        if not pol:
            return
        fam = _family(m.POLICY, ["policy", "event"])
        for event, n in sorted((pol.get("counters") or {}).items()):
            if (v := _number(n)) is not None:
                fam.add_metric([str(pol.get("policy", "")), str(event)], v)
        yield fam

    def _eval(self, ev: dict[str, Any] | None) -> Iterator[Metric]:
        if not ev:
            return
        yield from _scalars(m.EVAL_METRICS, ev)
        name, value = m.eval_score(ev)
        if value is not None:
            fam = _family(m.HELDOUT_METRIC, ["metric"])
            fam.add_metric([name], value)
            yield fam

    def _workers(self, workers: dict[str, dict[str, Any]]) -> Iterator[Metric]:
        state = GaugeMetricFamily(
            "downpour_worker_state",
            "1 for the worker's current state (alive, missing, gone), 0 for the others.",
            labels=["worker", "state"],
        )
        counts = dict.fromkeys(WORKER_STATES, 0)
        for wid, w in sorted(workers.items()):
            current = w.get("state")
            counts[current] = counts.get(current, 0) + 1
            for s in WORKER_STATES:
                state.add_metric([wid, s], 1.0 if s == current else 0.0)
        yield state
        by_state = GaugeMetricFamily(
            "downpour_workers", "Workers known to the server, by state.", labels=["state"]
        )
        for s, n in counts.items():
            by_state.add_metric([s], float(n))
        yield by_state
        hist = HistogramMetricFamily(
            m.WORKER_STALENESS.name, m.WORKER_STALENESS.help, labels=["worker"]
        )
        for wid, w in sorted(workers.items()):
            if h := w.get(m.WORKER_STALENESS.key):
                hist.add_metric([wid], _cumulative(h), sum_value=float(h.get("sum", 0.0)))
        yield hist
        notices = _family(m.WORKER_NOTICES, ["worker"])
        for wid, w in sorted(workers.items()):
            notices.add_metric([wid], float(len(w.get(m.WORKER_NOTICES.key) or ())))
        yield notices
        for source, catalogue in ((None, m.WORKER_METRICS), ("reported", m.WORKER_REPORTED)):
            for mi in catalogue:
                fam = _family(mi, ["worker"])
                for wid, w in sorted(workers.items()):
                    figures = (w.get(source) or {}) if source else w
                    v = _number(figures.get(mi.key))
                    if v is not None:
                        fam.add_metric([wid], v * mi.scale)
                yield fam

    def _registry(self, reg: dict[str, Any] | None) -> Iterator[Metric]:
        """The worker registry's fill and bound (``--max-workers``), and what it forgot."""
        if not reg:
            return
        for key, help_text in (
            ("size", "Worker records the server holds."),
            ("max_workers", "Worker records the server holds at most (--max-workers)."),
        ):
            fam = GaugeMetricFamily(f"downpour_registry_{key}", help_text)
            fam.add_metric([], float(reg.get(key, 0)))
            yield fam
        forgotten = CounterMetricFamily(
            "downpour_registry_forgotten",
            "Worker records forgotten (silent for --forget-after, or a gone one replaced).",
        )
        forgotten.add_metric([], float(reg.get("forgotten", 0)))
        yield forgotten

    def _checkpoints(self, cp: dict[str, Any] | None) -> Iterator[Metric]:
        if not cp:
            return
        written = CounterMetricFamily("downpour_checkpoints_written", "Checkpoints written.")
        written.add_metric([], float(cp.get("written", 0)))
        failed = CounterMetricFamily("downpour_checkpoint_failures", "Checkpoint writes failed.")
        failed.add_metric([], float(cp.get("failed", 0)))
        yield written
        yield failed

    def _dispatch(self, d: dict[str, Any] | None) -> Iterator[Metric]:
        """The split dispatcher (``--data-dispatch server``): epoch, splits by state, and
        what it counted."""
        if not d:
            return
        epoch = GaugeMetricFamily("downpour_dispatch_epoch", "The epoch being dispatched.")
        epoch.add_metric([], float(d.get("epoch", 0)))
        yield epoch
        done = CounterMetricFamily("downpour_dispatch_epochs_done", "Epochs fully acknowledged.")
        done.add_metric([], float(d.get("epochs_done", 0)))
        yield done
        splits = GaugeMetricFamily(
            "downpour_dispatch_splits",
            "Splits of the current epoch by state: done (acknowledged), in_flight, left.",
            labels=["state"],
        )
        for state in ("done", "in_flight", "left"):
            splits.add_metric([state], float(d.get(f"splits_{state}", 0)))
        yield splits
        events = CounterMetricFamily(
            "downpour_dispatch_events",
            "Dispatcher events: handed_out, acked, acks_stale, acks_held, released, resent, "
            "refused_universe.",
            labels=["event"],
        )
        for event in DISPATCH_EVENTS:
            if (v := _number(d.get(event))) is not None:
                events.add_metric([event], v)
        yield events


class MetricsExporter:
    """Serves ``/metrics`` over HTTP from its own threads; ``port`` is the bound port."""

    def __init__(self, get_doc: Callable[[], dict[str, Any]], host: str, port: int) -> None:
        from prometheus_client import PlatformCollector, ProcessCollector

        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(SnapshotCollector(get_doc))
        ProcessCollector(registry=self.registry)  # process_cpu_seconds_total, memory, fds
        PlatformCollector(registry=self.registry)  # python_info
        self._httpd, self._thread = start_http_server(port, addr=host, registry=self.registry)
        self.host = host
        self.port = int(self._httpd.server_port)

    def close(self) -> None:
        """Stop serving and release the port (bounded)."""
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=2.0)


def render_text(get_doc: Callable[[], dict[str, Any]]) -> str:
    """The exposition text for a document, without HTTP (tests, debugging)."""
    from prometheus_client import generate_latest

    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(get_doc))
    return generate_latest(registry).decode()
