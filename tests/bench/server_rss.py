"""A server's resident memory over a fault-free run: the soak's server (Deep MNIST, SGD,
checkpoints every 5 s, held-out evaluation every 100 updates) and 4 workers on this machine,
the server's ``VmRSS`` and the status document's ``malloc`` section every 5 s.

    python tests/bench/server_rss.py SECONDS LABEL [SERVER FLAGS...]

Prints one JSON line per sample and writes them to ``runs/server-rss/LABEL.json``. Run it
with ``MALLOC_ARENA_MAX=16`` (glibc's own limit on 2 cores) and without, one after the other,
to see what the server's arena limit does (docs/reliability.md#memory).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))

import soak  # noqa: E402
from conftest import ROOT, Cluster  # noqa: E402

from downpour.cli.status import fetch_status  # noqa: E402

MODEL = "downpour.models:deep_mnist"
WORKERS = 4
EVERY_S = 5.0


def main(seconds: float, label: str, flags: list[str]) -> list[dict]:
    """Run the server and workers for ``seconds``; the samples."""
    out_dir = ROOT / "runs" / "server-rss"
    work = out_dir / label
    work.mkdir(parents=True, exist_ok=True)
    cluster = Cluster(work)
    samples: list[dict] = []
    try:
        server = cluster.server(
            "--state-dir", str(work / "state"), "--checkpoint-every", "0",
            "--checkpoint-secs", "5", "--keep-checkpoints", "2", "--eval-every", "100",
            "--optimizer", "sgd", "--lr", "0.05", *flags, model=MODEL, ready_timeout=300,
        )  # fmt: skip
        for i in range(WORKERS):
            cluster.worker(
                server.port, "--steps", "1000000", "--num-workers", str(WORKERS),
                "--worker-index", str(i), model=MODEL, worker_id=f"w{i}",
            )  # fmt: skip
        t0 = time.monotonic()
        while (now := time.monotonic() - t0) < seconds:
            doc = fetch_status(server.status, timeout_s=15)
            sample = {
                "t_s": round(now),
                "version": doc["version"],
                "rss_mib": round(soak.rss_mb(server.proc.pid), 1),
                "malloc": doc.get("malloc"),
            }
            samples.append(sample)
            print(json.dumps(sample), flush=True)
            time.sleep(EVERY_S)  # the sampling interval
    finally:
        cluster.stop()
    (out_dir / f"{label}.json").write_text(json.dumps(samples, indent=1))
    return samples


if __name__ == "__main__":
    main(float(sys.argv[1]), sys.argv[2], sys.argv[3:])
