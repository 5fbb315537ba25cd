"""The worker defaults the convergence study chose (docs/policies.md, "Fewer bytes per pull"
and "Fewer bytes per push").

bf16 pulls reached the study's targets in 1.02x, 1.01x and 0.98x the updates of float32 pulls
at 1, 4 and 8 workers on MNIST (8 seeds) and 1.00x on the click model, for half the bytes;
bf16 pushes, beside bf16 pulls, in 0.94x, 0.99x and 1.03x the updates of float32 pushes on
MNIST (8 seeds) and 1.00x on the click models, for half the bytes of every dense gradient;
``--n-fetch`` 2 and 4 did not (1.2-2.3x the updates at 4 and 8 workers), so it stays 1;
nor did ``--pull-bound`` on MNIST (0.01: 1.21x at 1 worker; 0.03: 1.19-1.44x), so it stays
0 (off). A change to any of these defaults needs a study row that backs it."""

from __future__ import annotations

import pytest

from downpour.config import loading
from downpour.worker.compress import parse_compression
from downpour.worker.settings import WORKER_OPTIONS, WorkerConfig


def worker_config(*argv: str) -> WorkerConfig:
    """The worker's settings from a ``downpour worker`` command line, no file, no
    environment (the loader every service uses)."""
    return WorkerConfig.from_values(loading.load("worker", WORKER_OPTIONS, list(argv), {}).values())


def test_pulls_and_pushes_are_bf16_and_every_step_by_default() -> None:
    config = worker_config()
    assert config.pull_compress == "bf16"
    assert config.compress == "bf16"
    # the default rounds rows too (docs/policies.md, "Rows in bfloat16": free in the study)
    compressor = parse_compression(config.compress)
    assert "sparse_bf16" in compressor.encodings
    assert compressor.keyed_encoding == "keyed_counted_bf16"
    assert config.n_fetch == 1
    assert config.pull_bound == 0.0


def test_a_pull_bound_is_a_number_at_least_zero(capsys: pytest.CaptureFixture[str]) -> None:
    assert worker_config("--pull-bound", "0.03").pull_bound == 0.03
    with pytest.raises(SystemExit) as err:
        worker_config("--pull-bound", "-0.1")
    assert err.value.code == 2
    assert "--pull-bound: -0.1 is out of range" in capsys.readouterr().err


@pytest.mark.parametrize("form", ["none", "bf16"])
def test_pull_compress_takes_none_for_float32_pulls(form: str) -> None:
    assert worker_config("--pull-compress", form).pull_compress == form


def test_sync_wait_is_five_seconds_by_default_and_zero_turns_the_wait_off(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--sync-wait 0``: a worker of a sync (or hybrid dense=sync) server never waits for
    the round; a negative wait is a usage error naming the option."""
    assert worker_config().sync_wait_s == 5.0
    assert worker_config("--sync-wait", "0").sync_wait_s == 0.0
    with pytest.raises(SystemExit) as err:
        worker_config("--sync-wait", "-1")
    assert err.value.code == 2
    assert "--sync-wait: -1.0 is out of range: allowed a number >= 0" in capsys.readouterr().err
