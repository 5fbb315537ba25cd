"""A table far larger than the worker holds: ``tiny_models:ten_million_embedding`` (a
10,000,000 x 64 float32 table, 2.56 GB) split by row ranges over two ``downpour server``
processes, trained by a ``downpour worker`` process with ``--row-cache-rows 50000`` (12.8 MB
of rows). The worker's peak resident set is the one its summary reports (``peak_rss_mib``:
``VmHWM`` of its own address space, read as it ends); it must stay
under a bound set from the cache size: a TensorFlow worker's baseline plus a small multiple
of the cache's bytes, far below the table's size. Both figures are printed (``pytest -s``)
and recorded as test properties.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from conftest import Cluster, summary
from test_input_memory import reap

MODEL = "tiny_models:ten_million_embedding"
TABLE_BYTES = 10_000_000 * 64 * 4
CACHE_ROWS = 50_000
CACHE_BYTES = CACHE_ROWS * 64 * 4
# A downpour worker process with TensorFlow, Keras, a small model and its tf.data input
# resides in well under this; the cache, its slot arrays and a batch's pulled rows are
# bounded by a few times the cache's bytes.
TF_BASELINE_MIB = 900
STEPS = 300


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_worker_caching_50k_rows_of_a_10m_row_table_stays_far_below_its_size(
    cluster: Cluster, record_property: Callable[[str, object], None]
) -> None:
    # Both at once: each shard allocates only its own half of the table.
    servers = [
        cluster.server(
            *("--shard", str(i), "--num-shards", "2", "--optimizer", "sgd", "--lr", "0.5"),
            model=MODEL,
            early=True,
            ready_timeout=300,
        )
        for i in range(2)
    ]
    for s in servers:
        assert s.info["shard"] == servers.index(s)  # waits until it serves
    worker = cluster.worker(
        [s.port for s in servers],
        "--steps",
        str(STEPS),
        "--row-cache-rows",
        str(CACHE_ROWS),
        model=MODEL,
    )
    code = reap(worker, 400)
    assert code == 0, worker.log_text()
    s = summary(worker)
    peak_mib = s["peak_rss_mib"]
    bound_mib = TF_BASELINE_MIB + 4 * CACHE_BYTES / 2**20
    report = (
        f"worker peak RSS {peak_mib:.0f} MiB, bound {bound_mib:.0f} MiB "
        f"(cache {CACHE_BYTES / 2**20:.1f} MiB of a {TABLE_BYTES / 2**20:.0f} MiB table); "
        f"{s['steps']} steps at {s['steps_per_s']:.1f}/s, {s['rows_pulled']} rows pulled, "
        f"{s['row_cache_evictions']} evicted, {s['bytes_pulled'] / 1e6:.1f} MB pulled, "
        f"held-out {s['held_out']:.3f}"
    )
    print(report)
    record_property("peak_rss_mib", round(peak_mib, 1))
    record_property("rss_bound_mib", round(bound_mib, 1))
    assert s["steps"] == STEPS and s["row_pulls"] == ["embed/embeddings"]
    assert s["row_cache_evictions"] > 0  # 300 batches of ~512 ids: far more than 50,000 rows
    assert peak_mib < bound_mib, report
