"""Data bigger than memory streams: one epoch over more than 1 GiB of TFRecords peaks within
200 MB of the peak of one epoch over the 3 MiB MNIST-5k files.

Each epoch runs in a process of its own (``tests/stream_epoch.py``): the example's
``input_fn`` iterated to the end, as a worker's input pipeline is, without the worker's
training around it; its peak RSS is the kernel's high-water mark (``VmHWM``). Both figures are
printed (``pytest -s``) and named in the assertion's message.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import TESTS, run_script

from downpour import cli

MODULE = "downpour.examples.mnist_tfrecord"
LARGE_MIB = 1100  # > 1 GB of training records
NEED_FREE = 3 * 2**30
GROWTH_LIMIT_MB = 200


def stream(data_dir: Path) -> dict[str, float]:
    done = run_script(
        TESTS / "stream_epoch.py", MODULE, str(data_dir), timeout_s=600, what="stream_epoch"
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_streaming_over_1gb_of_tfrecords_peaks_within_200mb_of_a_small_set(
    tmp_path: Path,
) -> None:
    free = shutil.disk_usage(tmp_path).free
    if free < NEED_FREE:
        pytest.skip(f"{free / 2**30:.1f} GiB free in {tmp_path}; the test writes 1.1 GiB")
    small, large = tmp_path / "small", tmp_path / "large"
    assert cli.main(["data", "tfrecord", str(small), "--shards", "4"]) == 0
    try:
        args = ["data", "tfrecord", str(large), "--shards", "16", "--size-mb", str(LARGE_MIB)]
        assert cli.main(args) == 0
        large_bytes = sum(p.stat().st_size for p in large.glob("train-*"))
        assert large_bytes >= 2**30
        s, big = stream(small), stream(large)
        big["train"] = json.loads((large / "dataset.json").read_text())["train"]
    finally:
        shutil.rmtree(large, ignore_errors=True)  # pytest keeps recent tmp dirs: free the GB
    assert s["examples"] == 4000
    assert big["examples"] == big["train"]
    growth = (big["peak_rss_mib"] - s["peak_rss_mib"]) * 2**20 / 1e6
    report = (
        f"peak RSS over one epoch: {s['peak_rss_mib']:.0f} MiB for {s['examples']} examples "
        f"(3 MiB of files), {big['peak_rss_mib']:.0f} MiB for {big['examples']} examples "
        f"({large_bytes / 2**30:.2f} GiB of files): {growth:+.0f} MB"
    )
    print(report)
    assert growth < GROWTH_LIMIT_MB, report
