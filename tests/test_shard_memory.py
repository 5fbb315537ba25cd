"""A shard allocates only its own parts of the model, and the layout never changes a weight.

Real ``downpour server`` processes:

* ``tiny_models:ten_million_embedding`` (a 10,000,000 x 64 float32 table, 2.56 GB) with
  ``--optimizer adagrad``, split over 2 and over 4 shards started at the same time: each
  shard's peak resident set (``VmHWM`` of its process, read once it is ready) stays under
  the issue's bound, the TensorFlow process baseline + 1.5 x (its slice's bytes + its slots'
  bytes). Adagrad keeps one accumulator per variable, so a shard's slots are as many bytes as
  its slice (the ``shard_bytes`` of its status document).
* a one-shard server and a three-shard cluster of the same model and seed serve byte-identical
  initial weights, pulled whole through the shard client (``downpour.net.cluster.pull_full``).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from conftest import Cluster, Service

from downpour.cli.status import fetch_status
from downpour.model.build import define_model
from downpour.net.cluster import partition_of, pull_full
from downpour.runtime.metrics import peak_rss_mib
from downpour.spec import load_spec

TABLE_MODEL = "tiny_models:ten_million_embedding"
BASELINE_MODEL = "tiny_models:tiny"
ADAGRAD_SLOTS = 1  # accumulators per variable: a shard's slots are 1 x its slice
BOUND_FACTOR = 1.5
# What a shard of the 10M x 64 table and a baseline server may need at once, in MiB: each
# shard its slice and slots (2.56 GB x 2 / shards) on top of a TensorFlow process (under
# 1 GiB), plus the baseline server. Checked against MemAvailable before starting.
TABLE_MIB = 10_000_000 * 64 * 4 / 2**20
TF_PROCESS_MIB = 1024
START_TIMEOUT_S = 400.0  # import, the table declared, a 5M-row slice filled, on 2 busy cores


def available_mib() -> float:
    """MemAvailable of this machine in MiB (0 where /proc/meminfo does not say)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        return 0.0
    return 0.0


def peak_at_ready(server: Service) -> float:
    """The server's VmHWM in MiB once it is ready (waits, bounded, for its ready file)."""
    assert server.info["port"]
    peak = peak_rss_mib(server.proc.pid)
    assert peak is not None, f"no VmHWM for pid {server.proc.pid}:\n{server.log_text()}"
    return peak


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("shards", [2, 4])
def test_each_shard_of_a_10m_row_table_peaks_under_baseline_plus_1_5x_its_bytes(
    cluster: Cluster, shards: int, record_property: Callable[[str, object], None]
) -> None:
    """The baseline is measured in the same test: the VmHWM at ready of a ``downpour server``
    of ``tiny_models:tiny`` started the same way (same options, at the same time as the
    shards), i.e. TensorFlow, Keras and a server with a model of a few kB."""
    need = TF_PROCESS_MIB * (shards + 1) + 2 * TABLE_MIB * (1 + ADAGRAD_SLOTS) / 2
    if available_mib() < need:
        pytest.skip(f"{available_mib():.0f} MiB available, the test needs about {need:.0f}")
    common = ("--num-shards", str(shards), "--optimizer", "adagrad", "--seed", "3")
    servers = [
        cluster.server(
            "--shard", str(i), *common, model=TABLE_MODEL, early=True,
            ready_timeout=START_TIMEOUT_S,
        )
        for i in range(shards)
    ]  # fmt: skip
    base = cluster.server(
        "--optimizer", "adagrad", "--seed", "3", model=BASELINE_MODEL, early=True,
        ready_timeout=START_TIMEOUT_S,
    )  # fmt: skip
    baseline = peak_at_ready(base)
    peaks = [peak_at_ready(s) for s in servers]
    docs = [fetch_status(s.status, timeout_s=30) for s in servers]
    assert [d["shard"] for d in docs] == list(range(shards))
    assert sum(d["shard_bytes"] for d in docs) > TABLE_MIB * 2**20  # the table and the head
    lines, ratios = [f"baseline (tiny server) VmHWM {baseline:.0f} MiB"], []
    for i, (peak, doc) in enumerate(zip(peaks, docs, strict=True)):
        held = doc["shard_bytes"] * (1 + ADAGRAD_SLOTS) / 2**20  # slice + slots, MiB
        bound = baseline + BOUND_FACTOR * held
        ratios.append((peak - baseline) / held)
        lines.append(
            f"shard {i}/{shards}: VmHWM {peak:.0f} MiB, slice + slots {held:.0f} MiB, "
            f"bound {bound:.0f} MiB, (VmHWM - baseline) / (slice + slots) {ratios[-1]:.2f}"
        )
        record_property(f"shard{i}_vmhwm_mib", round(peak, 1))
        record_property(f"shard{i}_slice_slots_mib", round(held, 1))
    record_property("baseline_vmhwm_mib", round(baseline, 1))
    record_property("max_ratio", round(max(ratios), 3))
    report = "\n".join(lines)
    print(report)
    assert max(ratios) <= BOUND_FACTOR, report


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("model", ["tiny_models:embedding_list", "tiny_models:wide"])
def test_one_shard_and_three_shards_serve_byte_identical_initial_weights(
    cluster: Cluster, model: str
) -> None:
    """``embedding_list``: its table split by rows over the three shards and a dense head;
    ``wide``: a dense kernel split by rows (``downpour server --show-partition``)."""
    seed = ("--seed", "11")
    one = cluster.server(*seed, model=model, early=True)
    three = [
        cluster.server("--shard", str(i), "--num-shards", "3", *seed, model=model, early=True)
        for i in range(3)
    ]
    variables = define_model(load_spec(model), 11).trainable_variables  # names and shapes
    layout = partition_of(variables, 3)
    assert any(not p.whole for parts in layout.shards for p in parts)  # a variable is split
    assert all(s.info["partition"] == layout.digest for s in three)
    versions_one, whole = pull_full([one.rep], variables)
    versions_three, joined = pull_full([s.rep for s in three], variables)
    assert versions_one == [0] and versions_three == [0, 0, 0]
    assert len(whole) == len(joined) == len(variables)
    for v, a, b in zip(variables, whole, joined, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape == tuple(v.shape), v.path
        assert a.tobytes() == b.tobytes(), f"{v.path}: the layouts serve different bytes"
    kernels = [a for v, a in zip(variables, whole, strict=True) if "bias" not in v.path]
    assert all(np.count_nonzero(a) > a.size // 2 for a in kernels)  # drawn, not zeros
