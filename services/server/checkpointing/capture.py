"""A checkpoint of a ``ParameterState``, captured between applies so the set is one version:
every array by key with its record (``downpour.checkpoints.layout``), and the tables by id.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from downpour.checkpoints.layout import WEIGHTS, array_key, optimizer_slots, part_record
from downpour.checkpoints.tables import TABLES_META
from downpour.server.tables.checkpoint import capture_tables


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


def capture_state(state: Any) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """(arrays, metadata) of one checkpoint of ``state``: its fixed variables and slots
    (``capture``) and its tables by id (``capture_tables``), of one version, and
    what a restore checks them by: the model fingerprint, the shard layout and the ``arrays``
    and ``tables`` records. Called between applies (the server's loop thread); the caller adds
    the metadata that is not the state's (model name, workers' sequence numbers, ...)."""
    tables, table_records = capture_tables(state)
    meta = {
        "fingerprint": state.fingerprint,
        "shard": state.shard,
        "num_shards": state.partition.num_shards,
        "partition": state.partition.digest,
        "arrays": records(state),
        TABLES_META: table_records,
    }
    return capture(state) | tables, meta
