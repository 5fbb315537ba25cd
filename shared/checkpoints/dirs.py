"""State directories: where each shard keeps its checkpoints, and the newest set of them.

A job's state root ``ROOT`` holds one directory per shard, ``ROOT/shard-I`` (``shard_dir``):
``downpour job`` gives ps task I that directory, the chief exports from all of them and
``downpour export`` reads them. ``run-local`` keeps one shard's checkpoints in ``DIR`` itself
and several shards' in ``DIR/shard-I`` (``run_local_dir``), so a run's layout can be read back
from what is on disk (``run_local_layout``). ``--restore-from`` names either kind of directory
(``old_state_dirs``). When a job ends, its chief writes ``ROOT/job-end.json``
(``write_job_end``), which the job's evaluator reads.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from downpour.checkpoints.store import Checkpoint, CheckpointError, CheckpointStore

SHARD_DIR = "shard-"  # the prefix of a shard's directory under a state root: ROOT/shard-I


def shard_dir(root: str | Path, shard: int) -> Path:
    """Shard ``shard``'s state directory under the state root ``root``: ``ROOT/shard-I``."""
    return Path(root) / f"{SHARD_DIR}{shard}"


def shard_dirs(root: str | Path, num_shards: int) -> list[Path]:
    """Every shard's state directory under ``root``, in shard order."""
    return [shard_dir(root, i) for i in range(num_shards)]


def run_local_dir(root: str | Path, shard: int, num_shards: int) -> Path:
    """run-local's state directory of shard ``shard`` of ``num_shards``: ``DIR`` for one
    shard, ``DIR/shard-I`` for several."""
    return Path(root) if num_shards == 1 else shard_dir(root, shard)


def old_state_dirs(text: str) -> list[Path]:
    """The state directories ``--restore-from`` names: comma-separated directories, each a
    shard's state dir, or a parent whose ``shard-I`` subdirectories are (run-local's).
    CheckpointError for a directory that does not exist, or none named."""
    dirs: list[Path] = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        d = Path(item)
        if not d.is_dir():
            raise CheckpointError(f"--restore-from {item}: no such directory")
        subs = sorted(p for p in d.iterdir() if p.is_dir() and p.name.startswith(SHARD_DIR))
        dirs += subs if subs and not any(d.glob("ckpt-*.npz")) else [d]
    if not dirs:
        raise CheckpointError("--restore-from names no directory")
    return dirs


def run_local_layout(state_dir: Path) -> tuple[int, list[Path]] | None:
    """(shard count, the shards' state dirs) of the newest checkpoint under a run-local
    ``--state-dir`` (``run_local_dir``); None if none loads."""
    if not state_dir.is_dir():
        return None
    subs = [p for p in state_dir.iterdir() if p.is_dir() and p.name.startswith(SHARD_DIR)]
    newest = [c for d in [state_dir, *subs] if (c := CheckpointStore(d).latest()) is not None]
    if not newest:
        return None
    n = int(max(newest, key=lambda c: c.version).meta.get("num_shards", 1))
    return n, [run_local_dir(state_dir, i, n) for i in range(n)]


def newest_each(dirs: Sequence[str | Path]) -> list[Checkpoint]:
    """The newest checkpoint that loads in each directory (one per shard), in the order
    given. CheckpointError naming a directory that does not exist or holds none that loads."""
    found = []
    for d in dirs:
        if not Path(d).is_dir():
            raise CheckpointError(f"{d}: no such directory")
        ckpt = CheckpointStore(d).latest()
        if ckpt is None:
            raise CheckpointError(f"{d}: no checkpoint (ckpt-*.npz) that loads")
        found.append(ckpt)
    return found


JOB_END = "job-end.json"  # the chief's record of a job's end, in the state root


def write_job_end(root: str | Path, state: str, version: int, export: str | None) -> Path:
    """Record in the state root that the job ended (``state``: ``done`` or ``failed``) at
    ``version``, and where its final export is: written aside and renamed into place, so a
    reader sees the whole record or none. The evaluator ends on it."""
    path = Path(root) / JOB_END
    doc = {"state": state, "version": version, "export": export, "written_at": time.time()}
    tmp = path.with_name(f"{JOB_END}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(doc), encoding="utf-8")
    os.replace(tmp, path)
    return path


def read_job_end(root: str | Path) -> dict[str, Any] | None:
    """The job-end record of the state root ``root``, or None when there is none (or it does
    not parse as one)."""
    try:
        doc = json.loads((Path(root) / JOB_END).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("state") not in ("done", "failed"):
        return None
    return doc
