"""Logging set-up shared by the services: one format, the service name on every line."""

from __future__ import annotations

import logging
import sys


def setup_logging(service: str, level: str = "INFO") -> None:
    """Log to stderr as ``time level service: message``."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter(f"%(asctime)s %(levelname)s {service}: %(message)s", "%H:%M:%S")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
