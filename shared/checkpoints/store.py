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
import time
import zipfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from downpour.checkpoints.npz import NpzArrays

log = logging.getLogger("downpour.checkpoints")

FORMAT = 2  # what ``write`` writes and ``read`` reads
META_KEY = "__meta__"
_NAME = re.compile(r"^ckpt-(\d{12})\.npz$")


class CheckpointError(ValueError):
    """A checkpoint, or a set of them, that cannot be read as asked; the message names the
    file or directory and what is wrong."""


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
