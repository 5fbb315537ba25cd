"""The worker's own error, and the one place the client layer's errors become it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from downpour import wire
from downpour.net.cluster import Incompatible
from downpour.net.transport import Refused, ServerUnavailable, Stopped


class WorkerError(Exception):
    """The worker cannot go on (refused by the server, or the server stayed away too long)."""


class DispatchError(Exception):
    """Shard 0 refused or stopped answering split requests; the message says why."""


@contextlib.contextmanager
def translated(endpoint: str | None = None, *, stopped: bool = True) -> Iterator[None]:
    """Raise the client layer's errors inside as WorkerError, with a message that says what
    to do. ``endpoint``: the server a malformed reply came from. ``stopped=False`` lets
    ``Stopped`` through, for callers to whom a stop is a normal end, not an error."""
    try:
        yield
    except Refused as exc:  # another model, partition or protocol version: fix the config
        raise WorkerError(f"server {exc.endpoint} refused this worker: {exc.message}") from None
    except Incompatible as exc:
        if any(m.startswith(wire.KEYED_COUNTED) for m in exc.missing):  # no flag avoids them
            raise WorkerError(
                f"{exc}: upgrade the server (a worker pushes a dynamic table's rows each id "
                "once, with its lookups)"
            ) from None
        raise WorkerError(f"{exc}: upgrade the server or use --compress none") from None
    except ServerUnavailable as exc:
        raise WorkerError(str(exc)) from None
    except wire.ProtocolError as exc:
        where = f"server {endpoint}" if endpoint else "a server"
        raise WorkerError(f"{where} sent a malformed reply: {exc}") from None
    except DispatchError as exc:
        raise WorkerError(str(exc)) from None
    except Stopped as exc:
        if not stopped:
            raise
        raise WorkerError(str(exc)) from None
