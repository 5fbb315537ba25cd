"""Slow tier: a job that completes, in real processes.

Two ps (``downpour server --job-workers 2``), two workers and the chief
(``downpour.cli.job.chief.run_chief``): every process exits 0 on its own, the servers after
their final checkpoint and the chief's acknowledgement, and the chief's export of the final
checkpoints is on disk.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, Cluster, env

from downpour.checkpoints.store import CheckpointStore

pytestmark = pytest.mark.slow

WAIT_S = 300.0
CHIEF = """
import json, sys
from types import SimpleNamespace
from downpour.cli.job.chief import run_chief
tf = SimpleNamespace(**json.loads(sys.argv[1]))
sys.exit(run_chief(tf, sys.argv[2:]))
"""


def test_two_ps_two_workers_and_the_chief_all_exit_0(cluster: Cluster, tmp_path: Path) -> None:
    root = tmp_path / "state"
    servers = [
        cluster.server(
            "--num-shards",
            "2",
            "--shard",
            str(i),
            "--state-dir",
            str(root / f"shard-{i}"),
            "--job-workers",
            "2",
            "--linger-after-done",
            "600",
        )  # fmt: skip
        for i in range(2)
    ]
    ports = [s.port for s in servers]
    tf = {
        "cluster": {"ps": [f"127.0.0.1:{p}" for p in ports], "worker": ["w0:1", "w1:1"]},
        "task_type": "chief",
        "task_index": 0,
    }
    chief = subprocess.Popen(
        [sys.executable, "-c", CHIEF, json.dumps(tf), "--model", "tiny_models:tiny",
         "--state-dir", str(root), "--poll-secs", "0.5",
         "--status-endpoints", ",".join(s.status for s in servers)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env(), cwd=ROOT,
    )  # fmt: skip
    cluster.procs.append(chief)
    workers = [cluster.worker(ports, "--steps", "20", worker_id=f"w{i}") for i in range(2)]
    for w in workers:
        assert w.wait(WAIT_S) == 0, w.log_text()
    out, err = chief.communicate(timeout=WAIT_S)
    assert chief.returncode == 0, err
    for s in servers:  # the chief's acknowledgement, not the 600 s linger, lets them go
        assert s.wait(WAIT_S) == 0, s.log_text()
        assert "job done" in s.log_text()
    versions = [CheckpointStore(root / f"shard-{i}").latest() for i in range(2)]
    assert all(c is not None and c.version == 40 for c in versions)  # 2 workers x 20 pushes
    assert "held-out accuracy: " in out
    assert (root / "export" / "40" / "saved_model.pb").is_file(), out + err
