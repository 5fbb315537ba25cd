"""Delta exports: the rows changed since a full export, and the ids gone since (tombstones).

A table too large to reload whole is updated in place by a serving system: ``write_delta``
writes, from a full export (``downpour.serving.saved_model``) at versions ``from`` to the
state at versions ``to``, a directory of two files:

- ``delta.json``: ``format`` ("downpour-delta"), ``format_version``, the model's
  ``fingerprint``, ``from_version`` and ``to_version`` (one version per shard: a shard's rows
  carry its own version clock), ``tables`` (per variable path: ``key``, ``layer``, ``dim``,
  ``dtype``, and the counts ``changed`` and ``tombstones``) and ``dense`` (variable paths);
- ``delta.npz``: per table key ``<key>/ids`` and ``<key>/rows`` (the ids new since the full
  export or whose row was updated at or after its shard's ``from`` version, with their rows:
  a row stamped with the export's own version may have changed after it was taken, so it is
  sent again), ``<key>/tombstones`` (ids the full export holds and the state no longer does:
  evicted), and ``<key>/fallback``, a table's fallback rows whole (they are few, and every
  refused id trains them); and ``dense/<i>``, the i-th of ``dense`` whole (dense variables
  are small), except for a fixed Embedding table (the export's ``fixed_tables``): its changed
  rows go as ``fixed/<i>/ids`` (row indices) and ``fixed/<i>/rows``, a row being changed when
  any of its values differs from the full export's (``delta.json``'s ``fixed``: per path,
  ``index`` i and the count ``changed``).

Applying it: drop the tombstones, then insert or overwrite each changed id's row, replace
each table's fallback rows, overwrite the changed rows of the fixed tables and replace the
other dense variables; an unknown id keeps reading its fallback row (or the zero row). Deltas
apply in order: one whose ``from_version`` is not the export's version is refused.
``apply_delta`` does exactly this to a full export with TensorFlow alone and writes the newer
full export, which equals the full export taken at ``to_version``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import tensorflow as tf

from downpour.serving.saved_model import (
    FORMAT_VERSION,
    ServingError,
    Table,
    read_export,
    with_default_row,
    write_extra,
)

DELTA_FORMAT = "downpour-delta"
DELTA_META = "delta.json"
DELTA_ARRAYS = "delta.npz"


def _shards(ids: np.ndarray, num_shards: int) -> np.ndarray:
    """The shard index of each id (all 0 for one shard)."""
    if num_shards == 1:
        return np.zeros(ids.size, np.int64)
    from downpour.model.partition import id_shard

    return id_shard(ids, num_shards)


def changed_rows(table: Table, old_ids: np.ndarray, since: Sequence[int]) -> np.ndarray:
    """Mask of ``table``'s ids that are new since a full export holding ``old_ids`` or were
    updated after their shard's version in ``since`` (a row carries the version its last
    update made, so a full export at version v holds every row stamped v or less)."""
    shard_since = np.asarray(since, np.int64)[_shards(table.ids, len(since))]
    return (table.versions > shard_since) | ~np.isin(table.ids, old_ids)


def write_delta(
    old_dir: str | Path,
    out: str | Path,
    tables: Mapping[str, Table],
    dense: Mapping[str, np.ndarray],
    versions: Sequence[int],
    fingerprint: str,
) -> dict[str, Any]:
    """Write to directory ``out`` the delta from the full export ``old_dir`` to ``tables``
    and ``dense`` (by variable path) at the shards' ``versions``; returns its meta.
    ServingError when ``old_dir`` is not a full export of this model or was taken over
    another number of shards."""
    old, old_ids = read_export(old_dir)
    check_same_model(old, fingerprint, set(tables), list(dense), str(old_dir))
    if len(old["versions"]) != len(versions):
        raise ServingError(
            f"{old_dir} was exported from {len(old['versions'])} shard(s), the state has "
            f"{len(versions)}: a row's version is its shard's, so take a full export"
        )
    arrays: dict[str, np.ndarray] = {}
    records = {}
    for path, record in old["tables"].items():
        table, key = tables[path], record["key"]
        changed = changed_rows(table, old_ids[path], old["versions"])
        arrays[f"{key}/ids"], arrays[f"{key}/rows"] = table.ids[changed], table.rows[changed]
        arrays[f"{key}/tombstones"] = old_ids[path][~np.isin(old_ids[path], table.ids)]
        if int(record.get("fallback_rows", 0)) != table.fallback.shape[0]:
            raise ServingError(
                f"table {path}: {old_dir} holds {record.get('fallback_rows', 0)} fallback rows, "
                f"the state {table.fallback.shape[0]}: take a full export"
            )
        if table.fallback.shape[0]:
            arrays[f"{key}/fallback"] = table.fallback
        records[path] = record | {
            "changed": int(changed.sum()),
            "tombstones": int(arrays[f"{key}/tombstones"].size),
        }
    fixed = {}
    for path in old.get("fixed_tables", []):
        i = old["dense"].index(path)
        changed = changed_fixed_rows(export_variable(old_dir, i), np.asarray(dense[path]), path)
        arrays[f"fixed/{i}/ids"] = np.flatnonzero(changed).astype(np.int64)
        arrays[f"fixed/{i}/rows"] = np.asarray(dense[path])[changed]
        fixed[path] = {"index": i, "changed": int(changed.sum())}
    arrays |= {
        f"dense/{i}": np.asarray(dense[p]) for i, p in enumerate(old["dense"]) if p not in fixed
    }
    meta = {
        "format": DELTA_FORMAT,
        "format_version": FORMAT_VERSION,
        "model": old["model"],
        "fingerprint": fingerprint,
        "from_version": old["versions"],
        "to_version": [int(v) for v in versions],
        "tables": records,
        "dense": old["dense"],
        "fixed": fixed,
    }
    Path(out).mkdir()
    np.savez(Path(out) / DELTA_ARRAYS, **arrays)
    (Path(out) / DELTA_META).write_text(json.dumps(meta, indent=1) + "\n")
    return meta


def export_variable(export_dir: str | Path, i: int) -> np.ndarray:
    """The i-th of a full export's ``dense`` variables, read from its variables checkpoint
    (no graph is loaded)."""
    prefix = Path(export_dir) / "variables" / "variables"
    try:
        return tf.train.load_checkpoint(str(prefix)).get_tensor(
            f"dense/{i}/.ATTRIBUTES/VARIABLE_VALUE"
        )
    except (tf.errors.OpError, ValueError) as exc:
        raise ServingError(f"{export_dir}: dense variable {i} does not read: {exc}") from None


def changed_fixed_rows(old: np.ndarray, new: np.ndarray, path: str) -> np.ndarray:
    """Mask of the rows of fixed table ``path`` in which ``new`` differs from ``old``."""
    if old.shape != new.shape:
        raise ServingError(f"fixed table {path}: shape {new.shape}, the export's {old.shape}")
    return np.any(old != new, axis=1)


def check_same_model(
    meta: dict[str, Any], fingerprint: str, tables: set[str], dense: list[str], where: str
) -> None:
    """ServingError unless ``meta`` (of an export or a delta) is of the model with this
    fingerprint, these dynamic tables and these dense variables."""
    if meta.get("fingerprint") != fingerprint:
        raise ServingError(
            f"{where} is an export of model {meta.get('model')!r} (fingerprint "
            f"{meta.get('fingerprint')}), not of this one (fingerprint {fingerprint})"
        )
    if set(meta["tables"]) != tables or list(meta["dense"]) != dense:
        raise ServingError(
            f"{where} holds tables {sorted(meta['tables'])} and {len(meta['dense'])} dense "
            f"variables; this model has {sorted(tables)} and {len(dense)}"
        )


def read_delta(path: str | Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(meta, arrays) of a delta directory; ServingError if ``path`` is not one."""
    try:
        meta = json.loads((Path(path) / DELTA_META).read_text())
        if meta.get("format") != DELTA_FORMAT or meta.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"format {meta.get('format')!r} {meta.get('format_version')!r}")
        with np.load(Path(path) / DELTA_ARRAYS) as npz:
            arrays = {k: npz[k] for k in npz.files}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ServingError(f"{path} is not a downpour delta export: {exc}") from None
    return meta, arrays


def apply_delta(old_dir: str | Path, delta_dir: str | Path, out_dir: str | Path) -> dict[str, Any]:
    """Write to ``out_dir`` the full export ``old_dir`` with delta ``delta_dir`` applied (see
    the module): TensorFlow and NumPy only, no model code. Returns the new export's meta.
    ServingError for a delta of another model or one that does not start at the export."""
    old, old_ids = read_export(old_dir)
    delta, arrays = read_delta(delta_dir)
    check_same_model(old, delta["fingerprint"], set(delta["tables"]), delta["dense"],
                     str(old_dir))  # fmt: skip
    if delta["from_version"] != old["versions"]:
        raise ServingError(
            f"{delta_dir} applies to the export at version(s) {delta['from_version']}; "
            f"{old_dir} is at {old['versions']}: apply the deltas in order"
        )
    if Path(out_dir).exists():
        raise ServingError(f"{out_dir} exists: remove it or choose another directory")
    loaded = tf.saved_model.load(str(old_dir))
    new_ids = {}
    for path, record in old["tables"].items():
        key = record["key"]
        table = merge(loaded, key, old_ids[path], arrays)
        index = loaded.tables[key].resource_handle
        tf.raw_ops.LookupTableRemoveV2(table_handle=index, keys=old_ids[path])
        tf.raw_ops.LookupTableInsertV2(
            table_handle=index, keys=table.ids, values=np.arange(1, table.ids.size + 1)
        )
        loaded.rows[key].assign(with_default_row(table.rows))
        if f"{key}/fallback" in arrays:
            loaded.fallback[key].assign(arrays[f"{key}/fallback"])
        new_ids[key] = table.ids
    fixed = {int(r["index"]) for r in delta.get("fixed", {}).values()}
    for i, variable in enumerate(loaded.dense):
        if i in fixed:
            put_rows(variable, arrays[f"fixed/{i}/ids"], arrays[f"fixed/{i}/rows"], str(delta_dir))
        else:
            variable.assign(arrays[f"dense/{i}"])
    tf.saved_model.save(loaded, str(out_dir), signatures=loaded.signatures)
    meta = old | {"versions": delta["to_version"]}
    write_extra(Path(out_dir), meta, new_ids)
    return meta


def put_rows(variable: Any, ids: np.ndarray, rows: np.ndarray, where: str) -> None:
    """Overwrite rows ``ids`` of a fixed table ``variable`` with ``rows``; ServingError for
    an id outside the table or rows of another width."""
    n, dim = (int(d) for d in variable.shape)
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= n):
        raise ServingError(f"{where}: a row id of {variable.name} is outside 0..{n - 1}")
    if rows.shape != (ids.size, dim):
        raise ServingError(f"{where}: rows {rows.shape} for {ids.size} ids of width {dim}")
    variable.scatter_update(tf.IndexedSlices(rows.astype(variable.dtype.as_numpy_dtype), ids))


def merge(loaded: Any, key: str, old_ids: np.ndarray, arrays: Mapping[str, np.ndarray]) -> Table:
    """Table ``key`` of a loaded full export with the delta's tombstones dropped and its
    changed rows put in, ids ascending."""
    old_rows = loaded.rows[key].numpy()[1:]
    changed = arrays[f"{key}/ids"]
    keep = ~np.isin(old_ids, np.concatenate([arrays[f"{key}/tombstones"], changed]))
    ids = np.concatenate([old_ids[keep], changed])
    rows = np.concatenate([old_rows[keep], arrays[f"{key}/rows"].astype(old_rows.dtype)])
    return Table(ids, rows, np.zeros(ids.size, np.int64)).sorted()
