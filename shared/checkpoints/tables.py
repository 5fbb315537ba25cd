"""Dynamic tables in the checkpoint format: their keys, their records, a set's tables by id.

A dynamic table's arrays (``DynamicTable.export_state``: the live ids, their rows, versions,
counts and slots, its counters and admission sketch) are saved by id under
``dynamic/<variable path>/<field>`` (``layout.DYNAMIC_PREFIX``; no fixed variable's key starts
so), and the metadata's ``tables`` (``TABLES_META``) holds a record per variable path:
``name`` (the layer's, which keys initial values), ``dim``, ``dtype``, ``optimizer``,
``slots``, ``rows`` (live ids), ``shard`` and ``num_shards`` of the writer, and ``fields`` (the
arrays saved). The server writes and restores them (``downpour.server.tables.checkpoint``);
export and serving read a set's tables joined over its shards (``tables_from_checkpoints``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from downpour.checkpoints.layout import DYNAMIC_PREFIX
from downpour.checkpoints.store import CheckpointError

TABLES_META = "tables"  # the metadata key of the table records


def table_key(path: str, field: str) -> str:
    """The checkpoint key of one exported array of the table at variable ``path``."""
    return f"{DYNAMIC_PREFIX}{path}/{field}"


SERVED_FIELDS = ("ids", "rows", "versions")  # what serving reads of each table
FALLBACK_FIELDS = ("fallback_index", "fallback_rows")  # a shard's fallback rows, by number g


def joined_fallback(path: str, states: Sequence[Mapping[str, np.ndarray]]) -> np.ndarray:
    """A table's fallback rows over all shards, row g the fallback row g, from each shard's
    ``fallback_index`` (the numbers g it holds) and ``fallback_rows``; ``(0, dim)`` for a
    table without. CheckpointError unless every number from 0 to B - 1 is held once."""
    have = [s for s in states if "fallback_index" in s and np.asarray(s["fallback_index"]).size]
    dim = np.asarray(states[0]["rows"]).shape[1]
    if not have:
        return np.zeros((0, dim), np.asarray(states[0]["rows"]).dtype)
    index = np.concatenate([np.asarray(s["fallback_index"], np.int64) for s in have])
    rows = np.concatenate([np.asarray(s["fallback_rows"]) for s in have])
    if not np.array_equal(np.sort(index), np.arange(index.size)):
        raise CheckpointError(
            f"dynamic table {path}: the shards' fallback rows are not each of 0..B-1 once "
            f"({index.size} rows held): a shard's checkpoint missing?"
        )
    out = np.empty_like(rows)
    out[index] = rows
    return out


def tables_from_checkpoints(checkpoints: Sequence[Any]) -> dict[str, dict[str, np.ndarray]]:
    """Each dynamic table's live ``ids``, ``rows`` and ``versions``, every shard's joined,
    and its ``fallback`` rows (``joined_fallback``), from checkpoints holding
    ``dynamic/<path>/<field>`` (a ``DynamicTable.export_state`` per table and shard).
    CheckpointError for a field missing or an id on two shards."""
    parts: dict[str, list[dict[str, np.ndarray]]] = {}
    for c in checkpoints:
        found: dict[str, dict[str, np.ndarray]] = {}
        for key, array in c.arrays.items():
            if key.startswith(DYNAMIC_PREFIX):
                path, _, name = key[len(DYNAMIC_PREFIX) :].rpartition("/")
                found.setdefault(path, {})[name] = np.asarray(array)
        for path, state in found.items():
            lacking = [f for f in SERVED_FIELDS if f not in state]
            if lacking:
                raise CheckpointError(f"{c.path}: dynamic table {path} lacks {lacking}")
            parts.setdefault(path, []).append(state)
    out = {}
    for path, states in parts.items():
        out[path] = {f: np.concatenate([s[f] for s in states]) for f in SERVED_FIELDS}
        out[path]["fallback"] = joined_fallback(path, states)
        if np.unique(out[path]["ids"]).size != out[path]["ids"].size:
            raise CheckpointError(f"dynamic table {path}: an id is held by two checkpoints")
    return out
