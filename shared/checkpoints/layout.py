"""What each array of a checkpoint is, and which old rows make up a new part (format 2).

Every array of a checkpoint is a row range of one model variable's weights or of one of its
optimizer slots, or one per-shard scalar of the optimizer. Its key says which, and the
checkpoint's metadata records it (``arrays``: key -> record):

- ``model/<wire name>``: the weights of a part (``path`` or ``path[start:stop]``, as on the
  wire), record ``{"variable": path, "slot": "weights", "rows": [start, stop], "shape": full}``;
- ``optimizer/<slot>/<wire name>``: that part's optimizer slot (``momentum`` and ``velocity``
  for Adam and lazy Adam, ``accumulator`` for Adagrad, none for SGD), record as above with
  the slot's kind;
- ``optimizer/<name>``: a per-shard scalar (``iteration``, ``learning_rate``), record
  ``{"variable": null, "slot": name}``.

Arrays under ``dynamic/`` are a dynamic table's, by id, recorded in the metadata's ``tables``
(``downpour.server.tables.checkpoint``); nothing here reads them.

A checkpoint written without records (by a tool rather than a server) is read through the
partition its metadata names (``pieces_from_parts``). ``plan_rows`` maps any set of old
pieces onto a new part's rows; it is pure arithmetic on row ranges, so it is the same for a
restart on the same layout and for a restore onto another number of shards.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from downpour.model.partition import Part, Partition, make_partition

WEIGHTS = "weights"
MODEL_PREFIX = "model/"
OPTIMIZER_PREFIX = "optimizer/"
DYNAMIC_PREFIX = "dynamic/"  # dynamic tables' arrays (downpour.server.tables.checkpoint)
# A Keras optimizer's slot lists (parallel to its variables) and the slot kind each holds.
SLOT_LISTS = (
    ("_momentums", "momentum"),  # Adam (and lazy Adam's dense part)
    ("_velocities", "velocity"),
    ("_velocity_hats", "velocity_hat"),  # Adam with amsgrad
    ("_accumulators", "accumulator"),  # Adagrad
    ("momentums", "momentum"),  # SGD with momentum
)


def array_key(slot: str, wire_name: str) -> str:
    """The checkpoint key of a part's weights (``slot`` WEIGHTS) or of one of its slots."""
    if slot == WEIGHTS:
        return MODEL_PREFIX + wire_name
    return f"{OPTIMIZER_PREFIX}{slot}/{wire_name}"


def optimizer_slots(optimizer: Any, variables: Sequence[Any]) -> tuple[list, list]:
    """(slots, scalars) of a built Keras optimizer over ``variables``: ``slots`` lists
    (kind, variable index, slot variable), ``scalars`` the optimizer's other variables, which
    must be scalars (its step count and learning rate). ValueError for any other variable:
    a slot this module does not know cannot be mapped to rows."""
    slots = []
    for i, var in enumerate(variables):
        j = optimizer._get_variable_index(var)  # Keras's slot lists are indexed this way
        for attr, kind in SLOT_LISTS:
            if found := getattr(optimizer, attr, None):
                slots.append((kind, i, found[j]))
    taken = {id(v) for _, _, v in slots}
    scalars = [v for v in optimizer.variables if id(v) not in taken]
    odd = [v.name for v in scalars if tuple(v.shape) != ()]
    if odd:
        raise ValueError(
            f"optimizer {type(optimizer).__name__} has variables {odd} that are neither a slot "
            f"of a known kind ({sorted({k for _, k in SLOT_LISTS})}) nor a scalar: a "
            "checkpoint cannot say which rows they cover"
        )
    return slots, scalars


def part_record(part: Part, slot: str) -> dict[str, Any]:
    """The metadata record of a part's weights or slot."""
    return {
        "variable": part.name,
        "slot": slot,
        "rows": [part.start, part.stop],
        "shape": list(part.shape),
    }


@dataclass(frozen=True)
class Piece:
    """One array of one checkpoint (``source``: its index in the set), as its record says."""

    source: int
    key: str
    variable: str | None  # the model variable's path; None for a per-shard scalar
    slot: str
    start: int
    stop: int
    shape: tuple[int, ...] | None  # the whole variable's shape, when recorded
    part_shape: tuple[int, ...]  # this array's shape
    dtype: str


@dataclass(frozen=True)
class Copy:
    """Rows ``src_start:src_stop`` of array ``key`` of checkpoint ``source`` go to rows
    ``dst_start:dst_stop`` of the new part (both relative to their arrays)."""

    source: int
    key: str
    src_start: int
    src_stop: int
    dst_start: int
    dst_stop: int


def _header(arrays: Any, key: str) -> tuple[tuple[int, ...], str]:
    """An array's shape and dtype, from the archive's header when it has one (no data read)."""
    member = getattr(arrays, "members", {}).get(key)
    if member is not None:
        return member.shape, member.dtype.name
    a = arrays[key]
    return tuple(a.shape), a.dtype.name


def pieces_from_records(
    source: int, path: object, arrays: Any, records: Mapping[str, Any]
) -> list[Piece]:
    """The pieces of a checkpoint whose metadata records its arrays. ValueError (naming
    ``path``) for a record that is malformed or names an array the file lacks."""
    out = []
    for key, rec in records.items():
        if key not in arrays:
            raise ValueError(f"{path}: its metadata records {key}, which the file lacks")
        part_shape, dtype = _header(arrays, key)
        try:
            slot = str(rec["slot"])
            if rec["variable"] is None:
                out.append(Piece(source, key, None, slot, 0, 0, None, part_shape, dtype))
                continue
            start, stop = (int(r) for r in rec["rows"])
            shape = tuple(int(d) for d in rec["shape"])
            out.append(
                Piece(
                    source, key, str(rec["variable"]), slot, start, stop, shape, part_shape, dtype
                )  # fmt: skip
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}: malformed record of {key}: {rec!r} ({exc})") from None
    return out


def pieces_from_parts(
    source: int, arrays: Any, parts: Sequence[Part]
) -> tuple[list[Piece], list[str]]:
    """The pieces of a checkpoint without records, read as shard ``parts`` of a partition:
    ``model/<wire>`` and ``optimizer/<slot>/<wire>`` of those parts, ``optimizer/<name>``
    scalars; ``dynamic/`` keys are a dynamic table's, skipped. Returns (pieces, keys that fit
    none of these)."""
    by_wire = {p.wire_name: p for p in parts}
    out, unknown = [], []
    for key in arrays:
        if key.startswith(DYNAMIC_PREFIX):
            continue
        if key.startswith(MODEL_PREFIX):
            slot, wire = WEIGHTS, key[len(MODEL_PREFIX) :]
        elif key.startswith(OPTIMIZER_PREFIX):
            slot, _, wire = key[len(OPTIMIZER_PREFIX) :].partition("/")
            if not wire:
                shape, dtype = _header(arrays, key)
                out.append(Piece(source, key, None, slot, 0, 0, None, shape, dtype))
                continue
        else:
            unknown.append(key)
            continue
        p = by_wire.get(wire)
        if p is None:
            unknown.append(key)
            continue
        shape, dtype = _header(arrays, key)
        out.append(Piece(source, key, p.name, slot, p.start, p.stop, p.shape, shape, dtype))
    return out, unknown


def pieces_of_set(
    checkpoints: Sequence[Any], partition_for: Callable[[int], Partition]
) -> tuple[list[Piece], dict[Any, list[str]]]:
    """Every array of a checkpoint set (``source`` = its index in ``checkpoints``) as a piece:
    as a checkpoint's metadata records it, or, for one without records, by the partition its
    metadata names, which must be ``partition_for(num_shards)``, this model's over that many
    shards. Returns (pieces, the keys that fit no part, by checkpoint path). ValueError for a
    malformed record and for a checkpoint without records of another partition."""
    out: list[Piece] = []
    unknown: dict[Any, list[str]] = {}
    for i, c in enumerate(checkpoints):
        recs = c.meta.get("arrays")
        if isinstance(recs, dict):
            out += pieces_from_records(i, c.path, c.arrays, recs)
            continue
        n = int(c.meta.get("num_shards", 1))
        old = partition_for(n)
        if c.meta.get("partition", old.digest) != old.digest:
            raise ValueError(
                f"{c.path}: written with partition {c.meta.get('partition')}, which is not "
                f"this model's over {n} shard(s) ({old.digest}), and it does not record its "
                "arrays' rows: pass the server's --model"
            )
        pieces, left = pieces_from_parts(i, c.arrays, old.shards[int(c.meta.get("shard", 0))])
        out += pieces
        if left:
            unknown[c.path] = sorted(left)
    return out, unknown


def partition_over(partition: Partition, num_shards: int) -> Partition:
    """The same model's partition over ``num_shards`` shards (the rule of ``make_partition``)."""
    if num_shards == partition.num_shards:
        return partition
    found = {p.var: p for parts in partition.shards for p in parts}
    vs = [found[i] for i in sorted(found)]
    return make_partition(
        [p.name for p in vs], [p.shape for p in vs], [p.dtype for p in vs], num_shards,
        partition.fingerprint, [p.dynamic for p in vs],
    )  # fmt: skip


def _rows_text(start: int, stop: int) -> str:
    return f"rows {start}:{stop}"


def plan_rows(
    variable: str,
    slot: str,
    start: int,
    stop: int,
    shape: tuple[int, ...],
    dtype: str,
    pieces: Sequence[Piece],
) -> list[Copy]:
    """The copies that fill rows ``start:stop`` of ``variable``'s ``slot`` (whole shape
    ``shape``, dtype ``dtype``) from ``pieces`` (any pieces; those of this variable and slot
    are used). ValueError naming the variable for rows no piece holds, pieces that overlap,
    or a piece whose recorded shape, row count, trailing dimensions or dtype differ."""
    what = f"{variable!r} ({slot})"
    mine = sorted((p for p in pieces if p.variable == variable and p.slot == slot),
                  key=lambda p: p.start)  # fmt: skip
    if not mine:
        raise ValueError(
            f"{what}: no checkpoint given holds it (written with another --optimizer, or an "
            "old shard's state dir missing?)"
        )
    if not shape:  # a scalar variable: one piece holds it whole
        _check_piece(what, mine[0], shape, dtype)
        return [Copy(mine[0].source, mine[0].key, 0, 0, 0, 0)]
    for p in mine:
        _check_piece(what, p, shape, dtype)
    for a, b in zip(mine, mine[1:], strict=False):
        if b.start < a.stop:
            raise ValueError(
                f"{what}: {a.key} ({_rows_text(a.start, a.stop)}) and {b.key} "
                f"({_rows_text(b.start, b.stop)}) overlap: two checkpoints of one shard given?"
            )
    copies, at = [], start
    for p in mine:
        if p.stop <= at or at >= stop:
            continue
        if p.start > at:
            break
        end = min(p.stop, stop)
        copies.append(Copy(p.source, p.key, at - p.start, end - p.start, at - start, end - start))
        at = end
    if at < stop:
        nxt = next((p.start for p in mine if p.start > at), stop)
        raise ValueError(
            f"{what}: {_rows_text(at, min(nxt, stop))} are in no checkpoint given "
            "(the state dir of an old shard missing?)"
        )
    return copies


def _check_piece(what: str, p: Piece, shape: tuple[int, ...], dtype: str) -> None:
    """Refuse a piece that does not fit a variable of ``shape`` and ``dtype``."""
    if p.shape is not None and p.shape != shape:
        raise ValueError(f"{what}: {p.key} is of a variable of shape {p.shape}, here {shape}")
    if p.dtype != dtype:
        raise ValueError(f"{what}: {p.key} has dtype {p.dtype}, here {dtype}")
    want = (p.stop - p.start, *shape[1:]) if shape else ()
    if p.part_shape != want or (shape and not 0 <= p.start <= p.stop <= shape[0]):
        raise ValueError(
            f"{what}: {p.key} has shape {p.part_shape} for {_rows_text(p.start, p.stop)} of "
            f"a variable of shape {shape}"
        )


def assemble(
    copies: Sequence[Copy], sources: Sequence[Mapping[str, np.ndarray]], shape: tuple, dtype: str
) -> np.ndarray:
    """The new part's array from its copies: one old array's rows as a view when a single
    copy covers it, else a fresh array with each copy's rows read in (only those rows of a
    memory-mapped array are read)."""
    if len(copies) == 1:
        c = copies[0]
        a = sources[c.source][c.key]
        if not shape:
            return a
        if c.src_stop - c.src_start == shape[0]:
            return a[c.src_start : c.src_stop]
    out = np.empty(shape, dtype)
    for c in copies:
        out[c.dst_start : c.dst_stop] = sources[c.source][c.key][c.src_start : c.src_stop]
    return out
