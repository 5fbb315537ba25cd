"""Logging set-up shared by the services: one format, the service name on every line."""

from __future__ import annotations

import logging
import sys
import time
from typing import Any


def setup_logging(service: str, level: str = "INFO") -> None:
    """Log to stderr as ``time level service: message``."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter(f"%(asctime)s %(levelname)s {service}: %(message)s", "%H:%M:%S")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


class RateLimitedLog:
    """Logs a warning once per key per interval, then how many were suppressed meanwhile."""

    def __init__(self, logger: logging.Logger, interval_s: float = 10.0) -> None:
        self.log = logger
        self.interval_s = interval_s
        self.last: dict[str, float] = {}
        self.suppressed: dict[str, int] = {}

    def warning(self, key: str, msg: str, *args: Any) -> None:
        """Log now if this key has been quiet for the interval, else count it."""
        now = time.monotonic()
        if now - self.last.get(key, -1e9) >= self.interval_s:
            n = self.suppressed.pop(key, 0)
            suffix = f" (+{n} more since the last report)" if n else ""
            self.log.warning(msg + suffix, *args)
            self.last[key] = now
        else:
            self.suppressed[key] = self.suppressed.get(key, 0) + 1
