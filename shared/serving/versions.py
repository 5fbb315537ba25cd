"""Serving exports kept current while training runs: numbered versions as TF Serving lays them out.

The export directory (``--export-dir``) holds::

    <dir>/<version>/               a full export (``downpour.serving.saved_model``): a SavedModel
    <dir>/deltas/<from>-<to>/      the delta from version <from> to version <to>
                                   (``downpour.serving.delta``: delta.json, delta.npz)
    <dir>/.tmp-<version>-<pid>/    a version being written (never a number)

A version is built in its ``.tmp-`` directory, every file and the directory fsynced, then
``os.rename``-d to its number, which is atomic on one filesystem: a reader polling ``<dir>`` for
numeric directories (TF Serving's ``--model_base_path``) sees a version whole or not at all. A
delta is written the same way, and *before* the version it leads to, so a follower that sees
version ``<to>`` finds ``deltas/<from>-<to>/`` already there. After each version only the newest
``keep`` are kept, and the deltas that start from a removed version are removed too: every
delta left applies to a version still in the directory, and a follower older than the oldest
version reloads the newest whole. A crash mid-write leaves only a ``.tmp-`` directory, removed
by ``clean_leftovers`` at the next start.

``export_versions`` is the whole step (full export, delta, rename, prune) for a model given its
weights and its dynamic tables' rows; the server's ``--export-every`` and the chief call it.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import keras

    from downpour.serving.saved_model import Table

log = logging.getLogger("downpour.serving.saved_model")

DELTAS = "deltas"
TMP_PREFIX = ".tmp-"
_VERSION = re.compile(r"^\d+$")
_DELTA = re.compile(r"^(\d+)-(\d+)$")


def versions(base: str | Path) -> list[int]:
    """The complete versions in ``base``, oldest first (numeric directory names only)."""
    base = Path(base)
    if not base.is_dir():
        return []
    return sorted(int(p.name) for p in base.iterdir() if _VERSION.match(p.name) and p.is_dir())


def deltas(base: str | Path) -> list[tuple[int, int]]:
    """The (from, to) of every complete delta in ``base``, in order."""
    folder = Path(base) / DELTAS
    if not folder.is_dir():
        return []
    found = (_DELTA.match(p.name) for p in folder.iterdir())
    return sorted((int(m.group(1)), int(m.group(2))) for m in found if m)


def delta_dir(base: str | Path, start: int, end: int) -> Path:
    """Where the delta from version ``start`` to version ``end`` lives."""
    return Path(base) / DELTAS / f"{start}-{end}"


def clean_leftovers(base: str | Path) -> list[Path]:
    """Remove the ``.tmp-`` directories a crash left in ``base`` (and its deltas folder)."""
    removed = []
    for folder in (Path(base), Path(base) / DELTAS):
        if folder.is_dir():
            for p in folder.iterdir():
                if p.name.startswith(TMP_PREFIX):
                    shutil.rmtree(p, ignore_errors=True)
                    removed.append(p)
    if removed:
        log.warning("removed %d partial export(s) a crash left: %s", len(removed), removed)
    return removed


def fsync_tree(root: Path) -> None:
    """fsync every file and directory under ``root`` (``root`` too), deepest first."""
    for folder, _dirs, files in os.walk(root, topdown=False):
        for name in files:
            _fsync(Path(folder) / name, os.O_RDONLY)
        _fsync(Path(folder), os.O_RDONLY)


def _fsync(path: Path, flags: int) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(final: Path, build: Callable[[Path], object]) -> Path:
    """Write directory ``final`` atomically: ``build(tmp)`` fills a ``.tmp-`` directory beside
    it (``tmp`` does not exist yet: ``build`` creates it), which is fsynced and renamed to
    ``final``. Whatever ``build`` raises, the ``.tmp-`` directory is removed and it propagates;
    ``final`` never exists half-written. FileExistsError when ``final`` exists."""
    if final.exists():
        raise FileExistsError(f"{final} exists")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f"{TMP_PREFIX}{final.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        build(tmp)
        fsync_tree(tmp)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync(final.parent, os.O_RDONLY)
    return final


def prune(base: str | Path, keep: int) -> list[Path]:
    """Keep the newest ``keep`` versions and the deltas starting at one of them; return what
    was removed. The oldest go first, so a reader loading one has the newest to move to."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    held = versions(base)
    gone = [Path(base) / str(v) for v in held[:-keep]]
    kept = set(held[-keep:])
    gone += [delta_dir(base, a, b) for a, b in deltas(base) if a not in kept]
    for p in gone:
        shutil.rmtree(p, ignore_errors=True)
    return gone


@dataclass
class Written:
    """What ``export_versions`` wrote: the version directory and the delta to it, if any."""

    version: int
    path: Path
    delta: Path | None
    removed: list[Path]


def export_versions(
    base: str | Path,
    model: keras.Model,
    version: int,
    weights: Mapping[str, np.ndarray],
    tables: Mapping[str, Table],
    fingerprint: str,
    name: str,
    shard_versions: Sequence[int] | None = None,
    keep: int = 5,
) -> Written:
    """Write version ``version`` of ``model`` into export directory ``base`` (see the module):
    ``weights`` are its trainable variables that are not dynamic tables, by variable path
    (assigned to ``model``), ``tables`` its dynamic tables' rows by path (every shard's),
    ``shard_versions`` the version of each shard they were taken at (default
    ``[version]``: one shard). The delta from the newest version already in ``base`` is
    written first (a warning, and no delta, when that version is not an export of this
    model). ValueError for a version not above the newest there, a weight the model lacks or
    lacks a weight; ``saved_model.ServingError`` for a model that cannot be served."""
    from downpour.serving.delta import write_delta
    from downpour.serving.saved_model import ServingError, dense_variables, write_export

    base = Path(base)
    held = versions(base)
    if held and version <= held[-1]:
        raise ValueError(f"{base}: version {version} is not above the newest, {held[-1]}")
    assign_weights(model, weights)
    shards = [int(v) for v in (shard_versions if shard_versions is not None else [version])]
    written_delta = None
    if held:
        dense = {v.path: np.asarray(v.numpy()) for v in dense_variables(model)}
        target = delta_dir(base, held[-1], version)
        try:
            written_delta = publish(
                target,
                lambda tmp: write_delta(
                    base / str(held[-1]), tmp, tables, dense, shards, fingerprint
                ),  # fmt: skip
            )
        except ServingError as exc:
            log.warning("no delta from version %d to %d: %s", held[-1], version, exc)
    try:
        path = publish(
            base / str(version),
            lambda tmp: write_export(model, tables, tmp, shards, fingerprint, name),
        )
    except BaseException:  # no delta is left leading to a version that is not there
        if written_delta is not None:
            shutil.rmtree(written_delta, ignore_errors=True)
        raise
    return Written(version, path, written_delta, prune(base, keep))


def assign_weights(model: keras.Model, weights: Mapping[str, np.ndarray]) -> None:
    """Assign ``weights`` (by variable path) to ``model``'s trainable variables that are not
    dynamic tables; ValueError naming a path one side lacks."""
    from downpour.serving.saved_model import dense_variables

    fixed = [v for v in dense_variables(model) if v.trainable]
    paths = {v.path for v in fixed}
    if paths != set(weights):
        raise ValueError(
            f"weights for {sorted(set(weights) - paths)} the model lacks, none for "
            f"{sorted(paths - set(weights))}"
        )
    for v in fixed:
        v.assign(weights[v.path])
