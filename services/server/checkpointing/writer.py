"""When to checkpoint, and the writes themselves on a background thread, off the apply path."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from downpour.checkpoints.store import CheckpointStore

log = logging.getLogger("downpour.server")


class CheckpointWriter:
    """Decides when to checkpoint and writes in a background thread.

    The loop thread captures the arrays (cheap) and hands them over; the disk write happens
    off the apply path. One write at a time: a checkpoint that falls due while one is being
    written waits for the next trigger. A ``mark`` is whatever else changes the state
    besides the version (the dispatcher's acknowledged splits): the time trigger also
    fires when only the mark has changed, and the checkpoint of that version is rewritten.
    """

    def __init__(self, store: CheckpointStore, every: int, secs: float) -> None:
        self.store = store
        self.every = every
        self.secs = secs
        self.last_version = -1
        self.last_mark: tuple[int, Any] | None = None
        self.last_time = time.monotonic()
        self.written = 0
        self.failed = 0
        self.last_ms: float | None = None
        self.last_path: str | None = None
        self._busy = threading.Lock()
        self._thread: threading.Thread | None = None
        latest = store.list()
        if latest:
            self.last_version = latest[-1][0]
            self.last_mark = (self.last_version, None)

    def due(self, version: int, mark: Any = None) -> bool:
        """True when N updates or T seconds have passed since the last checkpoint and the
        version or the ``mark`` has changed since."""
        if (version, mark) == self.last_mark or self._busy.locked():
            return False
        by_count = self.every > 0 and version - max(self.last_version, 0) >= self.every
        by_time = self.secs > 0 and time.monotonic() - self.last_time >= self.secs
        return by_count or by_time

    def checkpoint(
        self,
        state: Any,
        server_meta: Callable[[], dict[str, Any]],
        mark: Any = None,
        final: bool = False,
    ) -> None:
        """When a checkpoint of ``state`` is due (or ``final``), capture it on the calling
        thread, between applies, and write it: in the background, or with ``final`` now,
        after any running write. ``server_meta`` gives the metadata that is the server's, not
        its state's (``capture_state``)."""
        if not (final or self.due(state.version, mark)):
            return
        from downpour.server.checkpointing.capture import capture_state  # TensorFlow: not at import

        arrays, meta = capture_state(state)  # fixed variables and tables, one version
        meta |= server_meta()
        if final:
            self.write_now(state.version, arrays, meta, mark)
        else:
            self.submit(state.version, arrays, meta, mark)

    def _write(
        self, version: int, arrays: dict[str, np.ndarray], meta: dict[str, Any], mark: Any = None
    ) -> None:
        t0 = time.perf_counter()
        try:
            path = self.store.write(version, arrays, meta)
        except OSError as exc:
            self.failed += 1
            log.error("checkpoint of version %d failed: %s", version, exc)
            return
        finally:
            self.last_time = time.monotonic()
        self.last_ms = 1e3 * (time.perf_counter() - t0)
        self.last_version = version
        self.last_mark = (version, mark)
        self.last_path = str(path)
        self.written += 1
        log.info("checkpoint of version %d written in %.0f ms", version, self.last_ms)

    def _run(
        self, version: int, arrays: dict[str, np.ndarray], meta: dict[str, Any], mark: Any
    ) -> None:
        try:
            self._write(version, arrays, meta, mark)
        finally:
            self._busy.release()

    def submit(
        self, version: int, arrays: dict[str, np.ndarray], meta: dict[str, Any], mark: Any = None
    ) -> bool:
        """Write in the background; False if a write is already running."""
        if not self._busy.acquire(blocking=False):
            return False
        self._thread = threading.Thread(
            target=self._run, args=(version, arrays, meta, mark), name="checkpoint", daemon=True
        )
        self._thread.start()
        return True

    def write_now(
        self, version: int, arrays: dict[str, np.ndarray], meta: dict[str, Any], mark: Any = None
    ) -> None:
        """Wait for a running write, then write this one on the calling thread (unless
        this version and mark are already written)."""
        with self._busy:
            if (version, mark) != self.last_mark:
                self._write(version, arrays, meta, mark)

    def close(self) -> None:
        """Wait for a background write to finish."""
        if self._thread is not None:
            self._thread.join()

    def snapshot(self) -> dict[str, Any]:
        """Figures for the status document."""
        return {
            "written": self.written,
            "failed": self.failed,
            "last_version": self.last_version,
            "last_ms": self.last_ms,
            "last_path": self.last_path,
            "dir": str(self.store.dir),
        }
