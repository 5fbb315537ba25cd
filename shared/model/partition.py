"""How the model's variables are split across S parameter-server shards.

Every shard and every worker computes the partition from the same inputs (the model's
trainable variables in order, and S) with the same deterministic rule, so nothing has to be
distributed: a shard announces the partition's digest in ``hello`` and refuses a worker whose
digest differs.

The rule (greedy by bytes, as DistBelief balanced its shards):

1. ``share`` = total bytes / S. A variable larger than ``share`` with at least two rows is
   split along its first dimension into ``min(S, rows)`` row ranges of near-equal size;
   piece ``i`` goes to shard ``i``. This is what keeps one large embedding or dense kernel
   from landing on one machine.
2. The remaining whole variables, largest first (ties by variable order), each go to the
   shard with the fewest bytes so far (ties to the lower shard index).
3. Within a shard, parts are ordered by variable index: that is the order on the wire.

A dynamic table (``downpour.layers.DynamicEmbedding``: rows keyed by ids of any value) is not
split by rows and counts in no shard's share: every shard holds one part of it, the ids
``hashing.id_shard`` routes there, under ``name#k`` (``name`` alone with one shard). Its ids
travel as they are (``Keyed``), never rebased.

A whole variable travels under its own name; a row range under ``name[start:stop]``. The
optimizers the server offers (Adam, Adagrad, SGD, lazy Adam) are element-wise (row-wise for
a table), so a sharded update is the same arithmetic as an unsharded one. A row pull of a
split table sends each id to the shard holding its row, rebased (``Partition.route_rows``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from downpour.model.hashing import id_shard
from downpour.wire import BFloat16, Tensor, is_keyed, row_range


@dataclass(frozen=True)
class Part:
    """One piece of one variable: rows ``start:stop`` of variable ``var`` (all rows if whole);
    for a ``dynamic`` table, the ids of shard ``start`` of ``stop`` (``hashing.id_shard``)."""

    var: int
    name: str
    start: int
    stop: int
    shape: tuple[int, ...]  # the whole variable's shape (a dynamic table's: as declared)
    dtype: str
    whole: bool
    dynamic: bool = False

    @property
    def wire_name(self) -> str:
        """The tensor name on the wire: the variable's, ``name[start:stop]`` for a slice,
        ``name#k`` for shard k's ids of a dynamic table."""
        if self.dynamic and not self.whole:
            return f"{self.name}#{self.start}"
        return self.name if self.whole else f"{self.name}[{self.start}:{self.stop}]"

    @property
    def part_shape(self) -> tuple[int, ...]:
        """This piece's shape (a dynamic table's: its declared shape)."""
        if self.whole or self.dynamic:
            return self.shape
        return (self.stop - self.start, *self.shape[1:])

    @property
    def nbytes(self) -> int:
        """This piece's size in bytes (a dynamic table's grows with its rows: 0 here)."""
        if self.dynamic:
            return 0
        return int(np.prod(self.part_shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize

    def mine(self, ids: np.ndarray) -> np.ndarray:
        """Which of these global row ids (int64) this piece holds (a bool mask)."""
        if self.dynamic:
            return id_shard(ids, self.stop) == self.start
        if self.whole:
            return np.ones(ids.shape, bool)
        return (ids >= self.start) & (ids < self.stop)

    def local(self, ids: np.ndarray) -> np.ndarray:
        """Global row ids of this piece as the shard addresses them (rebased to a slice's
        first row; a dynamic table's ids as they are)."""
        return ids if self.whole or self.dynamic else ids - self.start

    def global_rows(self, ids: np.ndarray) -> np.ndarray:
        """The inverse of ``local``."""
        return ids if self.whole or self.dynamic else ids + self.start

    def take(self, a: Tensor | BFloat16) -> Tensor | BFloat16:
        """This piece of a full-variable gradient (``wire.row_range``): a row view (no copy)
        or the sparse rows, renumbered; a gradient rounded to bfloat16 in the worker's step
        gives a row view of its bits. A dynamic table's: the rows of its ids here."""
        if self.dynamic:
            if not is_keyed(a):
                raise ValueError(f"{self.name}: a dynamic table's gradient must be Keyed rows")
            keep = self.mine(a.indices)
            return a if keep.all() else a.select(keep)
        if self.whole:
            return a
        return row_range(a, self.start, self.stop)


def message_bytes(shape: Sequence[int], dtype: str | np.dtype, dynamic: bool = False) -> int:
    """The most bytes a variable's tensor takes in a message (its limits): its dense bytes;
    a dynamic table's declared rows travel keyed, each with its int64 id and, in a push,
    its int32 count of lookups."""
    rows = int(shape[0]) if dynamic and len(shape) else 0
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize + 12 * rows


@dataclass(frozen=True)
class Partition:
    """Which parts each shard holds; ``shards[i]`` is shard i's parts in wire order."""

    num_shards: int
    shards: tuple[tuple[Part, ...], ...]
    fingerprint: str

    @property
    def digest(self) -> str:
        """A short hash of the partition and model: equal on every shard and worker or refused."""
        doc = [
            self.fingerprint,
            self.num_shards,
            [
                [[p.name, p.start, p.stop, *(["dynamic"] if p.dynamic else [])] for p in parts]
                for parts in self.shards
            ],
        ]
        return hashlib.sha256(json.dumps(doc).encode()).hexdigest()[:16]

    def shard_bytes(self) -> list[int]:
        """Bytes of parameters per shard."""
        return [sum(p.nbytes for p in parts) for parts in self.shards]

    def split(self, grads: Sequence[Tensor | BFloat16]) -> list[list[Tensor | BFloat16]]:
        """A full gradient list (variable order) as one list per shard, in wire order."""
        return [[p.take(grads[p.var]) for p in parts] for parts in self.shards]

    def join(self, per_shard: Sequence[Sequence[Any]], n_vars: int) -> list[Any]:
        """Full variables from each shard's arrays (wire order); slices are concatenated.
        A variable whose pieces are None (a table kept by row, not as arrays) or a dynamic
        table joins to None."""
        pieces: list[list[tuple[int, Any]]] = [[] for _ in range(n_vars)]
        for parts, arrays in zip(self.shards, per_shard, strict=True):
            for p, a in zip(parts, arrays, strict=True):
                pieces[p.var].append((p.start, None if p.dynamic else a))
        out: list[Any] = []
        for i, ps in enumerate(pieces):
            if not ps:
                raise ValueError(f"variable {i} is on no shard")
            ps.sort(key=lambda t: t[0])
            if any(a is None for _, a in ps):
                out.append(None)
            else:
                out.append(ps[0][1] if len(ps) == 1 else np.concatenate([a for _, a in ps]))
        return out

    def parts_of(self, var: int) -> list[tuple[int, Part]]:
        """(shard index, part) of every piece of variable ``var``, by first row."""
        found = [(k, p) for k, parts in enumerate(self.shards) for p in parts if p.var == var]
        return sorted(found, key=lambda t: t[1].start)

    def route_rows(self, var: int, ids: np.ndarray) -> list[tuple[int, Part, np.ndarray]]:
        """Row ids of variable ``var`` (its global rows) split by the shard holding each:
        (shard index, part, the ids in that part rebased to its first row, int64), for every
        part of the variable (an empty id list where none fall)."""
        ids = np.asarray(ids, dtype=np.int64)
        return [(k, p, p.local(ids[p.mine(ids)])) for k, p in self.parts_of(var)]

    def describe(self) -> str:
        """A table of the partition, for ``downpour server --show-partition``."""
        total = sum(self.shard_bytes()) or 1
        lines = [
            f"partition {self.digest} of model {self.fingerprint[:12]} over "
            f"{self.num_shards} shard(s)"
        ]
        for i, (parts, nbytes) in enumerate(zip(self.shards, self.shard_bytes(), strict=True)):
            lines.append(
                f"shard {i}: {nbytes / 1e6:.3f} MB ({100 * nbytes / total:.1f} %), "
                f"{len(parts)} part(s)"
            )
            for p in parts:
                shape = "x".join(map(str, p.part_shape)) or "scalar"
                lines.append(f"  {p.wire_name:<48} {shape:>16} {p.nbytes / 1e6:>10.3f} MB")
        return "\n".join(lines)


def make_partition(
    names: Sequence[str],
    shapes: Sequence[tuple[int, ...]],
    dtypes: Sequence[str | np.dtype],
    num_shards: int,
    fingerprint: str,
    dynamic: Sequence[bool] = (),
) -> Partition:
    """The partition of these variables over ``num_shards`` shards (see the module docstring);
    ``dynamic``: which variables are dynamic tables (none by default)."""
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    dts = [np.dtype(d).name for d in dtypes]
    keyed = set(i for i, d in enumerate(dynamic) if d)
    sizes = [
        0 if i in keyed else int(np.prod(s, dtype=np.int64)) * np.dtype(d).itemsize
        for i, (s, d) in enumerate(zip(shapes, dts, strict=True))
    ]
    share = sum(sizes) / num_shards
    loads = [0] * num_shards
    assigned: list[list[Part]] = [[] for _ in range(num_shards)]
    whole: list[int] = []
    for i, (name, shape, dt, size) in enumerate(zip(names, shapes, dts, sizes, strict=True)):
        rows = shape[0] if shape else 0
        if i in keyed:
            for k in range(num_shards):
                part = Part(i, name, k, num_shards, tuple(shape), dt, num_shards == 1, True)
                assigned[k].append(part)
        elif num_shards > 1 and size > share and rows >= 2:
            pieces = min(num_shards, rows)
            for k in range(pieces):
                start, stop = k * rows // pieces, (k + 1) * rows // pieces
                part = Part(i, name, start, stop, tuple(shape), dt, whole=False)
                assigned[k].append(part)
                loads[k] += part.nbytes
        else:
            whole.append(i)
    for i in sorted(whole, key=lambda j: (-sizes[j], j)):
        k = min(range(num_shards), key=lambda s: (loads[s], s))
        rows = shapes[i][0] if shapes[i] else 0
        assigned[k].append(Part(i, names[i], 0, rows, tuple(shapes[i]), dts[i], whole=True))
        loads[k] += sizes[i]
    for k, parts in enumerate(assigned):
        if not parts:
            raise ValueError(
                f"{num_shards} shards for a model with {len(names)} variables leaves shard {k} "
                "empty: use fewer shards"
            )
        parts.sort(key=lambda p: (p.var, p.start))
    return Partition(num_shards, tuple(tuple(p) for p in assigned), fingerprint)
