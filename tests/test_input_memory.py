"""Data bigger than memory streams through a real worker: a ``downpour worker`` process that
trains one epoch over more than 1 GB of TFRecords peaks within 200 MB of the same worker
training one epoch over a single small file of the same records.

The model is ``input_models:big_records`` (512 KiB records read with ``interleave`` and
``prefetch``, averaged down before a Dense), trained against a real server. Each worker's
peak resident set is the one its summary reports (``peak_rss_mib``: ``VmHWM``, the
high-water mark of its own address space; ``ru_maxrss`` would also count the pages of the
test process it was forked from). Both figures are printed (``pytest -s``), recorded as test
properties and named in the assertion's message.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import input_models
import pytest
from conftest import Cluster, Service, summary, wait_until

MODEL = "input_models:big_records"
LARGE = (8, 264)  # files, records each: 2112 records of 512 KiB, 1.03 GiB
SMALL = (1, 16)  # one 8 MiB file
NEED_FREE = 3 * 2**30
GROWTH_LIMIT_MB = 200
EPOCH_TIMEOUT_S = 900


def reap(worker: Service, timeout: float) -> int:
    """Wait (bounded) for the worker to exit; its exit code."""
    wait_until(lambda: worker.proc.poll() is not None, timeout, "the worker to finish")
    return int(worker.proc.returncode)


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_a_worker_streaming_1gb_of_tfrecords_peaks_within_200mb_of_a_small_file(
    cluster: Cluster, tmp_path: Path, record_property: Callable[[str, object], None]
) -> None:
    free = shutil.disk_usage(tmp_path).free
    if free < NEED_FREE:
        pytest.skip(f"{free / 2**30:.1f} GiB free in {tmp_path}; the test writes 1.03 GiB")
    small, large = tmp_path / "small", tmp_path / "large"
    server = cluster.server(model=MODEL, early=True)
    try:
        small_bytes = input_models.write_big_records(small, *SMALL)
        large_bytes = input_models.write_big_records(large, *LARGE)
        assert large_bytes >= 2**30
        runs = {}
        for name, data, (files, records) in (("small", small, SMALL), ("large", large, LARGE)):
            worker = cluster.worker(
                server.port, "--epochs", "1", "--data-dir", str(data), model=MODEL, worker_id=name
            )
            code = reap(worker, EPOCH_TIMEOUT_S)
            assert code == 0, worker.log_text()
            s = summary(worker)
            peak = s["peak_rss_mib"]
            steps = -(-files * records // input_models.big_records().batch_size)
            assert (s["steps"], s["epochs"], s["stopped_early"]) == (steps, 1, False)
            runs[name] = peak
    finally:
        shutil.rmtree(large, ignore_errors=True)  # pytest keeps recent tmp dirs: free the GB
    growth = (runs["large"] - runs["small"]) * 2**20 / 1e6
    report = (
        f"worker peak RSS over one epoch: {runs['small']:.0f} MiB on {small_bytes / 2**20:.0f} "
        f"MiB of TFRecords, {runs['large']:.0f} MiB on {large_bytes / 2**30:.2f} GiB: "
        f"{growth:+.0f} MB"
    )
    print(report)
    record_property("peak_rss_small_mib", round(runs["small"], 1))
    record_property("peak_rss_large_mib", round(runs["large"], 1))
    assert growth < GROWTH_LIMIT_MB, report
