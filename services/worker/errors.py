"""The worker's own error."""

from __future__ import annotations


class WorkerError(Exception):
    """The worker cannot go on (refused by the server, or the server stayed away too long)."""
