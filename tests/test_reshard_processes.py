"""Slow tier: real server processes restore a checkpoint set onto another number of shards.

Two shards train with two workers and stop (SIGTERM: a final checkpoint each). That set is
restored onto 1 shard and onto 3 (``--restore-from``), whose weights and Adam slots, joined
by row range, equal the old set's; the 3 shards then train on with the same workers' ids
(their sequence numbers carried over) and their set is restored onto 2, which train on too.
The in-process cases (every pair of 1..4 shards, refusals, a replay) are in
tests/test_reshard.py and tests/test_snapshot_consistency.py.
"""

from __future__ import annotations

import signal
from pathlib import Path

import numpy as np
import pytest
from conftest import Cluster, Service, summary

from downpour.checkpoints.layout import assemble, pieces_from_records, plan_rows
from downpour.checkpoints.store import CheckpointStore
from downpour.cli.status import fetch_status

MODEL = "tiny_models:embedding"  # a row-sparse table split by rows, and a dense layer
CKPT = ("--optimizer", "adam", "--checkpoint-every", "0", "--checkpoint-secs", "0")


def _joined(dirs: list[Path]) -> tuple[list[int], dict[tuple[str, str], np.ndarray]]:
    """(versions, every variable's weights and slots) of the newest checkpoints in ``dirs``."""
    ckpts = [CheckpointStore(d).latest() for d in dirs]
    assert all(c is not None for c in ckpts), dirs
    pieces = [p for i, c in enumerate(ckpts)
              for p in pieces_from_records(i, c.path, c.arrays, c.meta["arrays"])]  # fmt: skip
    out = {}
    for key in {(p.variable, p.slot) for p in pieces if p.variable is not None}:
        shape = next(p.shape for p in pieces if (p.variable, p.slot) == key)
        dtype = next(p.dtype for p in pieces if (p.variable, p.slot) == key)
        copies = plan_rows(*key, 0, shape[0] if shape else 0, shape, dtype, pieces)
        out[key] = np.array(assemble(copies, [c.arrays for c in ckpts], shape, dtype))
    return [c.version for c in ckpts], out


def _stop(servers: list[Service]) -> None:
    """SIGTERM: each server drains and writes its final checkpoint."""
    for s in servers:
        assert s.info["version"] >= 0  # serving: its restore is done
        s.proc.send_signal(signal.SIGTERM)
    for s in servers:
        assert s.wait(timeout=120) == 0, s.log_text()


def _layout(cluster: Cluster, root: Path, n: int, *args: str) -> list[Service]:
    """``n`` shards with their state dirs ``root/shard-I``, starting side by side."""
    return [
        cluster.server(
            "--shard",
            str(i),
            "--num-shards",
            str(n),
            "--state-dir",
            str(root / f"shard-{i}"),
            *CKPT,
            *args,
            model=MODEL,
            early=True,
        )  # fmt: skip
        for i in range(n)
    ]


def _train(cluster: Cluster, servers: list[Service], steps: int) -> list[dict]:
    ports = [s.port for s in servers]
    workers = [
        cluster.worker(ports, "--steps", str(steps), model=MODEL, worker_id=f"w{i}")
        for i in range(2)
    ]
    for w in workers:
        assert w.wait(timeout=240) == 0, w.log_text()
    return [summary(w) for w in workers]


def _same(a: dict, b: dict) -> None:
    assert set(a) == set(b) and any(slot == "velocity" for _, slot in a)
    for key in a:
        assert np.array_equal(a[key], b[key]), key


@pytest.mark.slow
def test_two_shards_restore_onto_three_and_one_and_three_onto_two(
    cluster: Cluster, tmp_path: Path
) -> None:
    two, three, one, back = (tmp_path / d for d in ("two", "three", "one", "back"))
    servers = _layout(cluster, two, 2)
    sums = _train(cluster, servers, 30)
    assert all(s["pushes"] == 30 for s in sums)
    _stop(servers)
    versions, before = _joined([two / "shard-0", two / "shard-1"])
    assert min(versions) >= 1

    servers = _layout(cluster, three, 3, "--restore-from", str(two))
    servers.append(
        cluster.server(
            "--state-dir",
            str(one / "shard-0"),
            *CKPT,
            "--restore-from",
            str(two),
            model=MODEL,
            early=True,
        )  # fmt: skip
    )
    for s in servers:
        doc = fetch_status(s.status, timeout_s=30)
        assert doc["restored_from"] == doc["version"] == max(versions)
    _stop(servers[3:])  # the one shard: its final checkpoint holds what it restored
    _same(_joined([one / "shard-0"])[1], before)

    sums = _train(cluster, servers[:3], 20)  # the same workers' ids train on
    assert all(s["pushes"] == 20 for s in sums), sums
    docs = [fetch_status(s.status, timeout_s=30) for s in servers[:3]]
    assert all(d["version"] == max(versions) + 40 and d["rejected_total"] == 0 for d in docs)
    _stop(servers[:3])
    versions, before = _joined([three / f"shard-{i}" for i in range(3)])

    servers = _layout(cluster, back, 2, "--restore-from", str(three))
    _stop(servers)
    after_versions, after = _joined([back / "shard-0", back / "shard-1"])
    assert after_versions == [max(versions)] * 2
    _same(after, before)
    servers = _layout(cluster, back, 2, "--restore-from", str(three))  # own checkpoints first
    assert all(s["pushes"] == 10 for s in _train(cluster, servers, 10))
    docs = [fetch_status(s.status, timeout_s=30) for s in servers]
    assert all(d["restored_from"] == max(versions) for d in docs)
    assert all(d["version"] == max(versions) + 20 for d in docs), docs
