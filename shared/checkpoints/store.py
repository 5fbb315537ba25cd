"""Checkpoints of the server's whole training state, written atomically, the last K kept.

A checkpoint is one file ``ckpt-<version, 12 digits>.npz`` in the state directory: an
uncompressed numpy archive (read with ``downpour.checkpoints.npz``: memory-mapped, no pickle)
holding the shard's parts of every model variable and of every optimizer slot, and the
optimizer's per-shard scalars, each under a key that says what it is
(``downpour.checkpoints.layout``), plus ``__meta__``, a JSON document:

- ``format`` (``FORMAT``; another, or none, is refused naming the file and both formats),
  ``version``, ``written_at``;
- ``arrays``: per key, the model variable's path, the slot, the rows it covers and the whole
  variable's shape (``layout.part_record``), so any number of shards can restore it
  (``downpour.server.checkpointing.restore``);
- ``fingerprint``, ``model``, ``model_ref``, ``shard``, ``num_shards``, ``partition``;
- ``tables``: per dynamic table (by variable path), its record; its arrays, by id, are under
  ``dynamic/<path>/<field>`` (``downpour.server.tables.checkpoint``);
- ``workers``: each worker's last accepted sequence number; under ``--data-dispatch server``,
  ``dispatch``: the split dispatcher's state (``Dispatcher.state()``), taken at the same
  moment as the weights.

A checkpoint is captured between two applies on the loop thread, so every array in it is of
the same version. It is written to ``<name>.tmp-<pid>``, fsynced, renamed into place and the
directory fsynced, so a crash at any moment leaves either the old set of checkpoints or the
old set plus the new one; ``*.tmp-*`` leftovers are removed at the next start.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
import zipfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from downpour.checkpoints.layout import WEIGHTS, array_key, optimizer_slots, part_record
from downpour.checkpoints.npz import NpzArrays

log = logging.getLogger("downpour.server")

FORMAT = 2  # what ``write`` writes and ``read`` reads
META_KEY = "__meta__"
_NAME = re.compile(r"^ckpt-(\d{12})\.npz$")


@dataclass
class Checkpoint:
    """One loaded checkpoint."""

    path: Path
    version: int
    arrays: Mapping[str, np.ndarray]  # memory-mapped: reading rows reads only those pages
    meta: dict[str, Any]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointStore:
    """Reads and writes checkpoints in one state directory.

    ``write_hook`` exists for fault tests only: it is called after the arrays are written and
    before the file is renamed into place, so a test can kill the process at that moment.
    """

    def __init__(
        self, directory: str | os.PathLike[str], keep: int = 3,
        write_hook: Callable[[Path], None] | None = None,
    ) -> None:  # fmt: skip
        if keep < 1:
            raise ValueError("keep must be >= 1")
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.keep = keep
        self.write_hook = write_hook

    def list(self) -> list[tuple[int, Path]]:
        """(version, path) of complete checkpoints, oldest first."""
        found = []
        for p in self.dir.iterdir():
            m = _NAME.match(p.name)
            if m:
                found.append((int(m.group(1)), p))
        return sorted(found)

    def clean_leftovers(self) -> list[Path]:
        """Remove partial files a crash left behind; return what was removed."""
        removed = []
        for p in self.dir.iterdir():
            if ".npz.tmp-" in p.name:
                p.unlink(missing_ok=True)
                removed.append(p)
        if removed:
            log.warning("removed %d partial checkpoint file(s) left by a crash", len(removed))
        return removed

    def write(self, version: int, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> Path:
        """Write one checkpoint atomically, then prune to the newest ``keep``."""
        final = self.dir / f"ckpt-{version:012d}.npz"
        tmp = final.with_name(f"{final.name}.tmp-{os.getpid()}")
        doc = {"format": FORMAT, "version": version, "written_at": time.time(), **meta}
        payload = dict(arrays)
        payload[META_KEY] = np.frombuffer(json.dumps(doc).encode(), dtype=np.uint8)
        with open(tmp, "wb") as f:
            np.savez(f, **payload)
            f.flush()
            if self.write_hook is not None:
                self.write_hook(tmp)
            os.fsync(f.fileno())
        os.replace(tmp, final)
        _fsync_dir(self.dir)
        self.prune()
        return final

    def prune(self) -> None:
        """Delete all but the newest ``keep`` checkpoints."""
        for _, p in self.list()[: -self.keep]:
            p.unlink(missing_ok=True)

    @staticmethod
    def read(path: Path) -> Checkpoint:
        """Open one checkpoint file (its arrays memory-mapped); ValueError if it is damaged
        or of another format."""
        try:
            arrays = NpzArrays(path)
            raw = arrays.members.pop(META_KEY, None)
            meta = None if raw is None else json.loads(bytes(arrays.read_member(raw)).decode())
        except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
            raise ValueError(f"{path}: unreadable checkpoint: {exc}") from None
        if not isinstance(meta, dict):
            raise ValueError(f"{path}: no metadata")
        found = meta.get("format")
        if found != FORMAT:
            said = "no format recorded" if found is None else f"checkpoint format {found!r}"
            raise ValueError(f"{path}: {said}; this version of downpour reads format {FORMAT}")
        return Checkpoint(path, int(meta["version"]), arrays, meta)

    def latest(self) -> Checkpoint | None:
        """The newest checkpoint that loads; damaged ones are skipped with a warning."""
        for _, path in reversed(self.list()):
            try:
                return self.read(path)
            except ValueError as exc:
                log.warning("skipping %s", exc)
        return None


def _parts(state: Any) -> list[tuple[str, dict[str, Any] | None, Any]]:
    """(key, record, variable) of every array a checkpoint of this state holds."""
    parts = state.parts
    out = [
        (array_key(WEIGHTS, p.wire_name), part_record(p, WEIGHTS), v)
        for p, v in zip(parts, state.variables, strict=True)
    ]
    slots, scalars = optimizer_slots(state.optimizer, state.variables)
    out += [(array_key(kind, parts[i].wire_name), part_record(parts[i], kind), v)
            for kind, i, v in slots]  # fmt: skip
    out += [(f"optimizer/{v.name}", None, v) for v in scalars]
    return out


def capture(state: Any) -> dict[str, np.ndarray]:
    """Every array of a ParameterState's checkpoint, by key (``downpour.checkpoints.layout``).

    Called between applies on the loop thread, so the set is one consistent version; the
    arrays stay valid while an apply runs (TensorFlow copies a buffer a read still holds).
    """
    return {key: v.numpy() for key, _, v in _parts(state)}


def records(state: Any) -> dict[str, dict[str, Any]]:
    """The metadata records (``arrays``) of the keys ``capture`` returns."""
    return {
        key: rec if rec is not None else {"variable": None, "slot": key.rpartition("/")[2]}
        for key, rec, _ in _parts(state)
    }


def restore_dispatcher(ckpt: Checkpoint | None, seed: int, lease: Any = None) -> Any:
    """The split dispatcher saved in ``ckpt`` (its splits in flight back in the queue), or
    a fresh one when there is none. ValueError when the saved state is damaged."""
    from downpour.server.dispatch import Dispatcher, LeasePolicy

    doc = None if ckpt is None else ckpt.meta.get("dispatch")
    if doc is None:
        return Dispatcher(seed=seed, lease=lease or LeasePolicy())
    try:
        return Dispatcher.from_state(doc, lease)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{ckpt.path}: dispatcher state: {exc}") from None


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
