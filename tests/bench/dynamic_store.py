"""The dynamic table's store measured on its own (not part of ``make bench``).

    .venv/bin/python tests/bench/dynamic_store.py [--rows 1000000] [--dim 64] [--batch 8192]

Prints, as JSON: ``insert_rows_per_s`` (new ids created and updated per second by ``apply``
into one ``lazy_adam`` table, batches of distinct random int64 ids), ``update_rows_per_s``
(the same batches again: rows that exist), and ``bytes_per_live_row_ratio`` (the table's
``stats()["bytes"]`` over the raw bytes of its live rows and slots) at ``--rows`` live rows,
with the bytes by part; ``rss_ratio`` is the growth of the process's resident memory over
the run over the same raw bytes (Linux).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from downpour.server.tables.table import DynamicTable


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure(rows: int, dim: int, batch: int) -> dict[str, float]:
    """Fill a ``lazy_adam`` table of width ``dim`` with ``rows`` new ids by ``apply`` in
    batches of ``batch``, then update them all once more; the rates and the memory ratio."""
    before = _rss()
    table = DynamicTable("bench", dim, optimizer="lazy_adam")
    rng = np.random.default_rng(0)
    ids = np.unique(rng.integers(-(2**63), 2**63 - 1, int(rows * 1.01), np.int64))[:rows]
    ids = rng.permutation(ids)
    grads = rng.normal(size=(batch, dim)).astype(np.float32)
    rates = {}
    for name in ("insert_rows_per_s", "update_rows_per_s"):
        start = time.perf_counter()
        for step, lo in enumerate(range(0, rows, batch)):
            part = ids[lo : lo + batch]
            table.apply(part, grads[: part.size], 0.001, version=step, step=step + 1)
        rates[name] = rows / (time.perf_counter() - start)
    del ids, grads
    rss = _rss() - before
    stats = table.stats()
    raw = stats["live_rows"] * dim * np.dtype("float32").itemsize * (1 + len(table.opt.slots))
    ratios = {"bytes_per_live_row_ratio": stats["bytes"] / raw, "rss_ratio": rss / raw}
    return rates | ratios | {"raw_bytes": raw} | stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8192)
    args = parser.parse_args()
    print(json.dumps(measure(args.rows, args.dim, args.batch), indent=1))


if __name__ == "__main__":
    main()
