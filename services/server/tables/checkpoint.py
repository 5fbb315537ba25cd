"""Dynamic tables in checkpoints: saved by id, restored onto any number of shards.

Saving (``capture_tables``, on the loop thread next to the fixed variables' capture, so the
tables are of the same version): every array of each table's ``DynamicTable.export_state()``
(copies of the live rows only) under its key, with its record, as ``downpour.checkpoints.tables``
lays them out.

Restoring (``load_tables``, then ``restore_tables`` installs them): the set is this shard's own
checkpoint or one checkpoint of each old shard. Each of the shard's tables keeps the saved ids
``hashing.id_shard(ids, S) == shard`` (S the new shard count) with their rows, slots,
versions and counts. An id of old shard ``k`` (of S') is on new shard ``s`` only if
``k = s (mod gcd(S, S'))``, so only those old shards are read (just the own one when S = S').

- Counters: old shard ``k``'s go to new shard ``k mod S``, so the totals over the shards are
  kept and a restart (S = S') keeps each shard's own.
- Admission sketches: the sketches of the old shards read are merged by elementwise saturating
  addition (masses summed, the window kept) when their shapes and windows agree. Every id was
  counted only by the old shard that held it and counters only add, so its estimate in the
  merged sketch is at least its old one: no id needs more touches than on its old layout (until
  the next halving, which comes once the summed mass reaches the window, as on any shard). The
  other old shards' touches share the buckets, so the merge over-estimates: an id short of
  ``admit_after`` is admitted early at the rate ``sketch.false_admit_rate`` gives for
  the summed load (up to S' / gcd(S, S') times one shard's). Sketches of different shapes
  cannot be added: the table then starts a fresh sketch, with a warning.
- Refused, naming the checkpoint and table, before any table is replaced: a set that is not
  one checkpoint per old shard, a table missing or one the model lacks, another layer name,
  dim, dtype or optimizer, a malformed record, a recorded array the file lacks or whose shape
  disagrees, ids saved by a shard that does not hold them.

- Fallback rows: the new shard takes the fallback rows whose numbers are its own from the old
  shards that hold them, when the old and new layouts have the same number of them (B a
  multiple of both shard counts, ``downpour.tables.policy``); otherwise they start again from
  their initial values, with a warning.

A table restored over its capacity (onto fewer shards) evicts its weakest rows down to it at
once; this is logged.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from downpour.checkpoints.store import Checkpoint
from downpour.checkpoints.tables import TABLES_META, table_key
from downpour.model.hashing import id_shard
from downpour.server.tables.table import DynamicTable
from downpour.tables.rowmap import COUNTERS
from downpour.tables.sketch import SATURATE

log = logging.getLogger("downpour.server")


def capture_tables(state: Any) -> tuple[dict[str, np.ndarray], dict[str, dict[str, Any]]]:
    """(arrays by key, records by variable path) of ``state.tables``, for one checkpoint:
    the arrays go with the fixed variables' (``checkpointing.capture``), the records under the
    metadata's ``tables``. Called between applies, with the fixed variables' capture, so both
    are of one version."""
    arrays: dict[str, np.ndarray] = {}
    records: dict[str, dict[str, Any]] = {}
    for path, table in state.tables.items():
        exported = table.export_state()
        arrays |= {table_key(path, f): a for f, a in exported.items()}
        records[path] = {
            "name": table.name,
            "dim": table.dim,
            "dtype": table.dtype.name,
            "optimizer": table.opt.kind,
            "slots": list(table.opt.slots),
            "rows": int(exported["ids"].size),
            "shard": state.shard,
            "num_shards": state.partition.num_shards,
            "fields": sorted(exported),
        }
    return arrays, records


@dataclass(frozen=True)
class _Saved:
    """One old shard's arrays of one table (memory-mapped), checked against the model."""

    shard: int
    num_shards: int
    arrays: Mapping[str, np.ndarray]


def _row_fields(model: DynamicTable) -> tuple[str, ...]:
    """The exported arrays with one entry per live id."""
    return ("ids", "rows", "versions", "counts", *(f"slot_{s}" for s in model.opt.slots))


def _layout(ckpt: Checkpoint) -> tuple[int, int]:
    return int(ckpt.meta.get("shard", 0)), int(ckpt.meta.get("num_shards", 1))


def _records(ckpts: Sequence[Checkpoint], paths: Sequence[str]) -> list[dict[str, Any]]:
    """Each checkpoint's table records; ValueError when its tables are not the model's."""
    out = []
    for c in ckpts:
        recs = c.meta.get(TABLES_META, {})
        if not isinstance(recs, dict):
            raise ValueError(f"{c.path}: malformed dynamic table records: {recs!r}")
        missing, extra = sorted(set(paths) - set(recs)), sorted(set(recs) - set(paths))
        if missing:
            raise ValueError(
                f"{c.path}: holds no dynamic table {missing} (written for another model?)"
            )
        if extra:
            raise ValueError(f"{c.path}: holds dynamic tables {extra}, which this model lacks")
        out.append(recs)
    return out


def _check_old_set(ckpts: Sequence[Checkpoint], shard: int, num_shards: int) -> None:
    """ValueError unless the set is this shard's own checkpoint or one checkpoint of each
    old shard."""
    layouts = [_layout(c) for c in ckpts]
    if layouts == [(shard, num_shards)]:
        return
    counts = {n for _, n in layouts}
    if len(counts) == 1 and sorted(k for k, _ in layouts) == list(range(counts.pop())):
        return
    raise ValueError(
        "dynamic tables need this shard's own checkpoint or one of each old shard, got "
        + ", ".join(
            f"{c.path} (shard {k} of {n})" for c, (k, n) in zip(ckpts, layouts, strict=True)
        )
    )


def _expected_shapes(
    model: DynamicTable, rows: int, arrays: Mapping[str, np.ndarray]
) -> dict[str, tuple[int, ...]]:
    """The shape each exported array must have for ``rows`` live ids of ``model`` (the
    sketch's scalars too when it has one, the fallback rows when it saved them; the sketch's
    own shape is its config's, and a counters array may be shorter: an older checkpoint's)."""
    wide = ("rows", *(f"slot_{s}" for s in model.opt.slots))
    shapes = {f: (rows, model.dim) if f in wide else (rows,) for f in _row_fields(model)}
    if "sketch" in arrays:
        shapes |= {"sketch_mass": (), "sketch_window": ()}
    if "fallback_index" in arrays:
        b = np.shape(arrays["fallback_index"])[0]
        shapes |= {"fallback_index": (b,), "fallback_rows": (b, model.dim)}
        shapes |= {f"fallback_slot_{s}": (b, model.dim) for s in model.opt.slots}
    return shapes


def _read(ckpt: Checkpoint, path: str, rec: Any, model: DynamicTable) -> _Saved:
    """One old shard's table, every recorded fact checked against ``model`` and the file."""
    what = f"{ckpt.path}: dynamic table {path!r}"
    try:
        saved = (str(rec["name"]), int(rec["dim"]), str(rec["dtype"]), str(rec["optimizer"]))
        layout, rows = (int(rec["shard"]), int(rec["num_shards"])), int(rec["rows"])
        fields = [str(f) for f in rec["fields"]]
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{what}: malformed record {rec!r} ({exc})") from None
    here = (model.name, model.dim, model.dtype.name, model.opt.kind)
    for label, was, now in zip(("layer", "dim", "dtype", "optimizer"), saved, here, strict=True):
        if was != now:
            raise ValueError(f"{what}: saved with {label} {was!r}, this server has {now!r}")
    if layout != _layout(ckpt):
        raise ValueError(
            f"{what}: recorded as shard {layout[0]} of {layout[1]}, the file's metadata says "
            "shard {} of {}".format(*_layout(ckpt))
        )
    lacking = [f for f in fields if table_key(path, f) not in ckpt.arrays]
    if lacking:
        raise ValueError(f"{what}: its metadata records {lacking}, which the file lacks")
    arrays = {f: ckpt.arrays[table_key(path, f)] for f in fields}
    for f, shape in _expected_shapes(model, rows, arrays).items():
        got = arrays[f].shape if f in arrays else None
        if got != shape:
            raise ValueError(f"{what}: {f!r} must have shape {shape} ({rows} rows), got {got}")
    counters = np.shape(arrays.get("counters", ()))
    if len(counters) != 1 or not 1 <= counters[0] <= len(COUNTERS):
        raise ValueError(f"{what}: 'counters' must have at most {len(COUNTERS)}, got {counters}")
    if arrays["ids"].dtype != np.int64 or arrays["rows"].dtype != model.dtype:
        raise ValueError(
            f"{what}: ids {arrays['ids'].dtype}, rows {arrays['rows'].dtype}; want int64 and "
            f"{model.dtype}"
        )
    sketch = arrays.get("sketch")
    if sketch is not None and (sketch.ndim != 2 or sketch.dtype != np.uint8):
        raise ValueError(f"{what}: sketch {sketch.dtype} {sketch.shape}, want 2-D uint8")
    stray = id_shard(arrays["ids"], layout[1]) != layout[0]
    if stray.any():
        raise ValueError(
            f"{what}: {int(stray.sum())} ids (first {arrays['ids'][stray][0]}) belong to "
            f"another shard of {layout[1]}: a damaged checkpoint"
        )
    return _Saved(*layout, arrays)


def _take(parts: Sequence[np.ndarray], masks: Sequence[np.ndarray]) -> np.ndarray:
    """The masked entries of ``parts``, concatenated (one part kept whole: no copy)."""
    if len(parts) == 1 and masks[0].all():
        return parts[0]
    return np.concatenate([p[m] for p, m in zip(parts, masks, strict=True)])


def _merged_sketch(path: str, mine: Sequence[_Saved]) -> dict[str, np.ndarray]:
    """The sketch arrays of the new shard: the old ones added (see the module docstring),
    or none (a fresh sketch) when they cannot be added."""
    have = [s.arrays for s in mine if "sketch" in s.arrays]
    if not have:
        return {}
    kinds = {(a["sketch"].shape, int(a["sketch_window"])) for a in have}
    if len(have) < len(mine) or len(kinds) > 1:
        log.warning(
            "dynamic table %r: the old shards' admission sketches differ (%d of %d have one, "
            "shapes and windows %s): they cannot be added, so its admission counts start afresh",
            path, len(have), len(mine), sorted(kinds),
        )  # fmt: skip
        return {}
    total = np.asarray(have[0]["sketch"], np.uint16)
    for a in have[1:]:
        total += a["sketch"]
        np.minimum(total, SATURATE, out=total)
    return {
        "sketch": total.astype(np.uint8),
        "sketch_mass": np.array(sum(int(a["sketch_mass"]) for a in have), np.int64),
        "sketch_window": np.array(int(have[0]["sketch_window"]), np.int64),
    }


def _fallback(path: str, model: DynamicTable, mine: Sequence[_Saved]) -> dict[str, np.ndarray]:
    """The fallback rows of the new shard (``model``'s numbers g) from the old shards that
    hold them; none (they start at their initial values, with a warning) when the old shards
    saved none or another number of them (B not a multiple of both shard counts)."""
    want = model.map.fallback_index()
    if not want.size:
        return {}
    have = [s for s in mine if "fallback_index" in s.arrays]
    total = have[0].arrays["fallback_index"].size * have[0].num_shards if have else 0
    numbers = np.concatenate([np.asarray(s.arrays["fallback_index"], np.int64) for s in have]
                             or [np.empty(0, np.int64)])  # fmt: skip
    if total != model.map.fallback_total or not np.isin(want, numbers).all():
        log.warning(
            "dynamic table %r: the checkpoints hold %d fallback rows, this layout %d: its "
            "fallback rows start again from their initial values",
            path, total, model.map.fallback_total,
        )  # fmt: skip
        return {}
    pos = np.argsort(numbers)
    at = pos[np.searchsorted(numbers, want, sorter=pos)]
    fields = ("fallback_rows", *(f"fallback_slot_{s}" for s in model.opt.slots))
    out = {"fallback_index": want}
    for f in fields:
        out[f] = np.concatenate([np.asarray(s.arrays[f]) for s in have])[at]
    return out


def _assemble(path: str, model: DynamicTable, saved: Sequence[_Saved], shard: int, n: int) -> dict:
    """The ``export_state`` arrays of new shard ``shard`` of ``n`` from the old shards'."""
    g = math.gcd(saved[0].num_shards, n)
    mine = [s for s in saved if s.shard % g == shard % g]  # the only ones with ids of ours
    masks = [id_shard(s.arrays["ids"], n) == shard for s in mine]
    state = {f: _take([s.arrays[f] for s in mine], masks) for f in _row_fields(model)}
    counters = np.zeros(len(COUNTERS), np.int64)
    for s in mine:
        if s.shard % n == shard:
            old = np.asarray(s.arrays["counters"], np.int64)  # an older checkpoint: fewer
            counters[: old.size] += old
    fallback = _fallback(path, model, mine)
    return state | {"counters": counters} | _merged_sketch(path, mine) | fallback


def load_tables(state: Any, ckpts: Sequence[Checkpoint]) -> dict[str, DynamicTable]:
    """The tables ``state.tables`` holds after restoring ``ckpts`` (this shard's own
    checkpoint, or one per old shard), built with ``state.table_config(path)``; see the
    module docstring. ValueError when refused; ``state`` is not changed."""
    paths = list(state.tables)
    if not paths and not any(c.meta.get(TABLES_META) for c in ckpts):
        return {}
    shard, n = state.shard, state.partition.num_shards
    _check_old_set(ckpts, shard, n)
    records = _records(ckpts, paths)
    out = {}
    for path in paths:
        model = state.tables[path]
        saved = [_read(c, path, r[path], model) for c, r in zip(ckpts, records, strict=True)]
        arrays = _assemble(path, model, saved, shard, n)
        table = DynamicTable.from_state(arrays, model.name, **state.table_config(path))
        if table.capacity is not None and len(table) > table.capacity:
            n_rows = len(table)
            table.enforce_capacity()
            log.warning(
                "dynamic table %r: %d rows restored, over this shard's capacity %d: the "
                "weakest %d evicted",
                path, n_rows, table.capacity, n_rows - len(table),
            )  # fmt: skip
        out[path] = table
    log.info(
        "dynamic tables of shard %d of %d restored from %d checkpoint(s): %s", shard, n,
        len(ckpts), ", ".join(f"{p} ({len(t)} rows)" for p, t in out.items()),
    )  # fmt: skip
    return out


def restore_tables(state: Any, ckpts: Sequence[Checkpoint]) -> None:
    """Replace ``state.tables`` by those ``ckpts`` hold (``load_tables``); nothing changes
    when refused."""
    state.tables.update(load_tables(state, ckpts))
