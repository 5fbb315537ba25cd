"""Logging set-up shared by the services: stdlib logging, text or JSON lines, and context.

Every line carries the service (``server`` / ``worker``) and, where they apply, the worker id
and the weight version. A service binds them once with ``set_log_context(worker=...,
version=lambda: ...)`` (a callable is read when a line is written, so the version is current);
a single call can name another worker with ``log.info(..., extra={"worker": wid})``.

Text: ``12:00:01 INFO worker worker=w0 version=17: message``.
JSON (``--log-format json``), one object per line::

    {"time": "2025-01-01T12:00:01.123+00:00", "level": "INFO", "service": "worker",
     "logger": "downpour.worker", "message": "...", "worker": "w0", "version": 17}
"""

from __future__ import annotations

import json
import logging
import signal
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

LOG_FORMATS = ("text", "json")
CONTEXT_FIELDS = ("service", "worker", "version")

# field -> value, or a zero-argument callable read when a line is written
_context: dict[str, Any] = {}


def set_log_context(**fields: Any) -> None:
    """Add fields to every log line of this process; ``None`` removes a field."""
    for name, value in fields.items():
        if value is None:
            _context.pop(name, None)
        else:
            _context[name] = value


_failed_context: set[str] = set()  # context fields whose callable raised, said once each


def _resolve(name: str, value: Any) -> Any:
    """A context field's value; a callable is called. A callable that raises gives None (a
    log line must never fail because of its context), said once per field on stderr: not
    through logging, which would run this filter again."""
    if callable(value):
        try:
            return value()
        except Exception as exc:  # noqa: BLE001 - reported once below, the line still logged
            if name not in _failed_context:
                _failed_context.add(name)
                print(
                    f"downpour logs: the {name!r} log field failed ({exc!r}); "
                    "logged as empty from now on",
                    file=sys.stderr,
                )
            return None
    return value


class ContextFilter(logging.Filter):
    """Puts service, worker and version on each record (a record's own ``extra`` wins)."""

    def filter(self, record: logging.LogRecord) -> bool:
        for name in CONTEXT_FIELDS:
            if getattr(record, name, None) is None:
                setattr(record, name, _resolve(name, _context.get(name)))
        return True


class TextFormatter(logging.Formatter):
    """``time level service worker=W version=V: message`` (absent fields left out)."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(prefix)s: %(message)s", "%H:%M:%S")

    def format(self, record: logging.LogRecord) -> str:
        parts = [str(getattr(record, "service", None) or record.name)]
        for name in ("worker", "version"):
            value = getattr(record, name, None)
            if value is not None:
                parts.append(f"{name}={value}")
        record.prefix = " ".join(parts)
        return super().format(record)


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, service, logger, message, worker, version."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "service": getattr(record, "service", None),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name in ("worker", "version", "suppressed"):
            value = getattr(record, name, None)
            if value is not None:
                doc[name] = value
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


def setup_logging(service: str, level: str = "INFO", fmt: str = "text") -> None:
    """Log to stderr, as text or JSON lines (``fmt``), with ``service`` on every line."""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {LOG_FORMATS}, got {fmt!r}")
    set_log_context(service=service)
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(ContextFilter())
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


class RateLimitedLog:
    """Logs a warning once per key per interval, then how many were suppressed meanwhile.

    ``flush()`` reports what is still suppressed (call it at shutdown, or a burst that ended
    would never be counted). In JSON logs the count is the field ``suppressed``.
    """

    def __init__(
        self,
        logger: logging.Logger,
        interval_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.log = logger
        self.interval_s = interval_s
        self.clock = clock
        self.last: dict[str, float] = {}
        self.suppressed: dict[str, int] = {}
        self.messages: dict[str, tuple[str, tuple[Any, ...]]] = {}  # key -> latest (msg, args)

    def warning(self, key: str, msg: str, *args: Any, extra: dict[str, Any] | None = None) -> None:
        """Log now if this key has been quiet for the interval, else count it."""
        now = self.clock()
        self.messages[key] = (msg, args)
        if now - self.last.get(key, -1e18) >= self.interval_s:
            n = self.suppressed.pop(key, 0)
            suffix = f" (+{n} more since the last report)" if n else ""
            self.log.warning(msg + suffix, *args, extra={**(extra or {}), "suppressed": n or None})
            self.last[key] = now
        else:
            self.suppressed[key] = self.suppressed.get(key, 0) + 1

    def flush(self) -> None:
        """Log the count of every key with suppressed warnings, and reset it."""
        for key, n in sorted(self.suppressed.items()):
            msg, args = self.messages.get(key, (key, ()))
            self.log.warning(
                msg + f" (+{n} more since the last report; latest shown)",
                *args,
                extra={"suppressed": n},
            )
        self.suppressed.clear()


def stop_on_signals(stop: Callable[[], None], logger: logging.Logger) -> None:
    """SIGTERM and SIGINT call ``stop`` (a clean stop, not an exception); main thread only."""

    def handler(signum: int, _frame: Any) -> None:
        logger.info("received %s, stopping", signal.Signals(signum).name)
        stop()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
