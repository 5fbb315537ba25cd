"""Restoring a shard from checkpoints of the same layout or of any other number of shards.

Which checkpoints a shard restores from (``find_sources``):

1. the newest checkpoint of its own ``--state-dir`` that loads, when it is of this shard of
   this partition (a restart);
2. otherwise, with ``--restore-from``, the checkpoint set of the old layout: the newest
   checkpoint that loads in each of the old shards' state directories
   (``downpour.checkpoints.dirs.old_state_dirs``);
   the set must hold each old shard exactly once, all of one partition of this model;
3. otherwise nothing (fresh weights), or an error when the own directory holds a checkpoint
   of another layout and no ``--restore-from`` says where the rest of that layout is.

How (``restore_set``): each of the shard's parts, its weights and every optimizer slot, is
put together from the old arrays that overlap its rows (``layout.plan_rows``), reading only
those rows (the archives are memory-mapped, ``downpour.checkpoints.npz``). Each dynamic table is
rebuilt from the saved ids that are this shard's now, from every old shard
(``downpour.server.tables.checkpoint``). Everything is checked first (model fingerprint, rows
no checkpoint holds, overlapping pieces, shapes, dtypes, missing slots, tables that disagree
with the model); a refused restore assigns nothing. The learning rate is not restored: the
one configured at start wins.

When the old shards stopped at different versions (each checkpoints on its own), the rule is:

- the new version is the largest old version, and the optimizer's step count (``iteration``,
  which Adam's bias correction reads) the largest old one;
- each worker's last accepted sequence number is its largest over the old shards, so no push
  an old shard accepted is applied again;
- the split dispatcher (``--data-dispatch server``) is old shard 0's, which ran it.

Each row keeps the value its old shard had, so the new shards start from the union of the old
shards' last checkpoints, as after a restart of each of them.

``resume`` is what a server with a ``--state-dir`` does at start: find the sources, restore
them, and hand back what the server carries on with (``Resumed``: the version, the workers'
sequence numbers, the finished workers, the dispatcher).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from downpour.checkpoints.dirs import newest_each, old_state_dirs
from downpour.checkpoints.layout import (
    WEIGHTS,
    Piece,
    assemble,
    optimizer_slots,
    partition_over,
    pieces_of_set,
    plan_rows,
)
from downpour.checkpoints.store import Checkpoint, CheckpointStore
from downpour.server.dispatch import Dispatcher, LeasePolicy

log = logging.getLogger("downpour.server")

NOT_RESTORED = frozenset({"learning_rate"})  # the configured one wins


@dataclass
class Restored:
    """What a restore carried over besides the arrays."""

    version: int
    workers: dict[str, int]
    dispatch: Checkpoint | None  # old shard 0's checkpoint, which holds the dispatcher
    sources: list[Checkpoint] = field(default_factory=list)


def _check_model(ckpt: Checkpoint, state: Any) -> None:
    if ckpt.meta.get("fingerprint") != state.fingerprint:
        raise ValueError(
            f"{ckpt.path}: saved for model fingerprint {ckpt.meta.get('fingerprint')}, "
            f"this server has {state.fingerprint}"
        )


def _layout_text(meta: dict[str, Any]) -> str:
    return (
        f"shard {meta.get('shard', 0)} of {meta.get('num_shards', 1)}, partition "
        f"{meta.get('partition')}"
    )


def same_layout(ckpt: Checkpoint, state: Any) -> bool:
    """Whether ``ckpt`` is this shard's own, of this partition (a plain restart)."""
    digest = state.partition.digest
    return (
        ckpt.meta.get("partition", digest) == digest
        and int(ckpt.meta.get("shard", 0)) == state.shard
        and int(ckpt.meta.get("num_shards", 1)) == state.partition.num_shards
    )


def find_sources(state: Any, store: CheckpointStore, restore_from: str | None) -> list[Checkpoint]:
    """The checkpoints this shard restores from (see the module docstring); empty: none."""
    own = store.latest()
    if own is not None:
        _check_model(own, state)
        if same_layout(own, state):
            return [own]
    if restore_from:
        dirs = old_state_dirs(restore_from)
        found = newest_each(dirs)
        log.info(
            "resharding: shard %d of %d restores from %d checkpoint(s) of %d shard(s): %s",
            state.shard,
            state.partition.num_shards,
            len(found),
            int(found[0].meta.get("num_shards", 1)),
            ", ".join(str(c.path) for c in found),
        )
        return found
    if own is not None:
        raise ValueError(
            f"{own.path}: a checkpoint of {_layout_text(own.meta)}; this server is shard "
            f"{state.shard} of {state.partition.num_shards}, partition "
            f"{state.partition.digest}: give each shard its own --state-dir, or pass "
            "--restore-from with the old layout's state directories to reshard"
        )
    return []


def _check_set(ckpts: Sequence[Checkpoint], state: Any) -> None:
    """Refuse a set that is not this shard's own checkpoint nor every shard of one layout."""
    for c in ckpts:
        _check_model(c, state)
    if len(ckpts) == 1 and same_layout(ckpts[0], state):
        return
    layouts = {(int(c.meta.get("num_shards", 1)), c.meta.get("partition")) for c in ckpts}
    if len(layouts) > 1:
        raise ValueError(
            "the checkpoints are of different layouts: "
            + ", ".join(f"{c.path} ({_layout_text(c.meta)})" for c in ckpts)
        )
    n = layouts.pop()[0]
    shards = sorted(int(c.meta.get("shard", 0)) for c in ckpts)
    if shards != list(range(n)):
        raise ValueError(
            f"need the checkpoint of each of the {n} old shard(s) once, got shard(s) {shards} "
            f"from {', '.join(str(c.path) for c in ckpts)}"
        )


def source_pieces(ckpts: Sequence[Checkpoint], state: Any) -> list[Piece]:
    """Every array of the set, as its records (or the partition its metadata names) say;
    ValueError for an array this model lacks."""
    pieces, unknown = pieces_of_set(ckpts, lambda n: partition_over(state.partition, n))
    for path, keys in unknown.items():
        raise ValueError(f"{path}: holds arrays this model lacks: {keys}")
    return pieces


def _plan(state: Any, pieces: Sequence[Piece]) -> tuple[list, dict[str, Any]]:
    """(variable, copies, shape, dtype) per target array, and each scalar's new value."""
    parts = state.parts
    slots, scalars = optimizer_slots(state.optimizer, state.variables)
    targets = [(WEIGHTS, i, v) for i, v in enumerate(state.variables)] + slots
    plans = []
    for kind, i, var in targets:
        p = parts[i]
        shape, dtype = tuple(int(d) for d in var.shape), np.dtype(str(var.dtype)).name
        copies = plan_rows(p.name, kind, p.start, p.stop, p.shape, dtype, pieces)
        plans.append((var, copies, shape, dtype))
    values = {}
    for v in scalars:
        if v.name in NOT_RESTORED:
            continue
        found = [pc for pc in pieces if pc.variable is None and pc.slot == v.name]
        if not found:
            raise ValueError(f"optimizer scalar {v.name!r}: no checkpoint given holds it")
        values[v.name] = (v, found)
    used = {k for k, _, _ in targets}
    extra = sorted({pc.slot for pc in pieces if pc.variable is not None} - used)
    if extra:
        log.warning("checkpoint slots %s are not used by --optimizer %s: not restored",
                    extra, state.optimizer_name)  # fmt: skip
    return plans, values


def restore_set(state: Any, ckpts: Sequence[Checkpoint]) -> Restored:
    """Load ``ckpts`` (this shard's own checkpoint, or one per shard of an old layout) into
    ``state``; see the module docstring. ValueError, with nothing assigned, when refused."""
    if not ckpts:
        raise ValueError("no checkpoint to restore from")
    _check_set(ckpts, state)
    pieces = source_pieces(ckpts, state)
    plans, scalars = _plan(state, pieces)
    from downpour.server.tables.checkpoint import load_tables  # TensorFlow: not at import

    tables = load_tables(state, ckpts)
    arrays = [c.arrays for c in ckpts]
    for var, copies, shape, dtype in plans:
        var.assign(assemble(copies, arrays, shape, dtype))
    for var, found in scalars.values():
        var.assign(max(np.asarray(arrays[pc.source][pc.key]) for pc in found))
    state.tables.update(tables)
    state.version = max(c.version for c in ckpts)
    workers: dict[str, int] = {}
    for c in ckpts:
        for k, v in c.meta.get("workers", {}).items():
            workers[str(k)] = max(int(v), workers.get(str(k), -1))
    first = [c for c in ckpts if int(c.meta.get("shard", 0)) == 0]
    own = len(ckpts) == 1 and same_layout(ckpts[0], state)
    dispatch = ckpts[0] if own else (first[0] if first else None)
    return Restored(state.version, workers, dispatch, list(ckpts))


def restore(state: Any, ckpt: Checkpoint) -> None:
    """Load a checkpoint of this shard's own layout into ``state`` (a restart)."""
    _check_model(ckpt, state)
    if not same_layout(ckpt, state):
        raise ValueError(
            f"{ckpt.path}: a checkpoint of {_layout_text(ckpt.meta)}; this server is shard "
            f"{state.shard} of {state.partition.num_shards}: give each shard its own "
            "--state-dir (restore_set reshards a whole old set)"
        )
    restore_set(state, [ckpt])


def restore_dispatcher(
    ckpt: Checkpoint | None, seed: int, lease: LeasePolicy | None = None
) -> Dispatcher:
    """The split dispatcher saved in ``ckpt`` (its splits in flight back in the queue), or
    a fresh one when there is none. ValueError when the saved state is damaged."""
    doc = None if ckpt is None else ckpt.meta.get("dispatch")
    if doc is None:
        return Dispatcher(seed=seed, lease=lease or LeasePolicy())
    try:
        return Dispatcher.from_state(doc, lease)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{ckpt.path}: dispatcher state: {exc}") from None


@dataclass
class Resumed:
    """What a server resumes from its state directory (``resume``); the defaults when it
    found no checkpoint."""

    version: int | None = None  # the version restored; None: fresh weights
    seconds: float | None = None  # reading and assigning the checkpoint(s)
    workers: dict[str, int] = field(default_factory=dict)  # each worker's last accepted seq
    finished: dict[str, int] = field(default_factory=dict)  # workers a checkpoint says finished
    dispatcher: Dispatcher | None = None  # the split dispatcher, restored when there is one


def resume(
    state: Any,
    store: CheckpointStore,
    restore_from: str | None,
    dispatcher: Dispatcher | None,
    seed: int,
) -> Resumed:
    """Restore ``state`` from what ``find_sources`` finds for ``store`` (the leftovers of an
    interrupted write removed first) and ``--restore-from``; fresh weights when nothing is
    found. The workers' sequence numbers come from the checkpoints, the finished workers
    from this shard's own checkpoint only; ``dispatcher`` (set when the server dispatches
    data) is replaced by the one the checkpoints hold. ValueError when refused."""
    store.clean_leftovers()
    t0 = time.perf_counter()
    sources = find_sources(state, store, restore_from)
    if not sources:
        log.info("no checkpoint in %s: starting from fresh weights", store.dir)
        return Resumed(dispatcher=dispatcher)
    done = restore_set(state, sources)
    out = Resumed(done.version, round(time.perf_counter() - t0, 3), done.workers)
    if len(sources) == 1 and same_layout(sources[0], state):
        finished = sources[0].meta.get("finished") or {}
        out.finished = {str(w): int(seq) for w, seq in finished.items()}
    log.info(
        "restored version %d in %.1f s from %s",
        done.version,
        out.seconds,
        ", ".join(str(c.path) for c in sources),
    )
    if dispatcher is not None:
        out.dispatcher = restore_dispatcher(done.dispatch, seed)
        if out.dispatcher.configured:
            log.info(
                "resuming epoch %d: %d of %d splits done, the rest back in the queue",
                out.dispatcher.epoch,
                out.dispatcher.progress()["splits_done"],
                out.dispatcher.num_splits,
            )
    return out
