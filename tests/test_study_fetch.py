"""The study's fetch settings (``tests/bench/fetch_sim.py``, ``study_fetch.py``).

Fast: ``Pulls`` on small float32 arrays through the real wire — when each setting pulls,
what the worker computes on, the bytes counted. Slow: the runner on a tiny grid in its own
process (one TensorFlow thread, as the study runs), checking the records and that a pull
through the wire reproduces ``every``'s run exactly.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import run_script

from downpour import wire

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "tests" / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

from fetch_sim import Pulls, parse_fetch  # noqa: E402

NAMES = ["a", "b"]
LIMITS = wire.DEFAULT_LIMITS


def weights(scale: float) -> list[np.ndarray]:
    """Two float32 arrays whose values need more than bfloat16's 8 bits of mantissa."""
    rng = np.random.default_rng(int(scale * 1000))
    return [
        (scale + rng.standard_normal((3, 5)) / 3).astype(np.float32),
        (scale + rng.standard_normal(7) / 3).astype(np.float32),
    ]


def test_parse_fetch_accepts_the_settings_and_rejects_others() -> None:
    assert parse_fetch("every").direct
    m = parse_fetch("bf16+n-fetch:4")
    assert (m.n_fetch, m.bf16, m.bound, m.direct) == (4, True, None, False)
    assert parse_fetch("adaptive:0.02").bound == 0.02
    for bad in ("n-fetch:0", "n-fetch:x", "adaptive:-1", "fp8", "every+"):
        with pytest.raises(ValueError, match="fetch setting"):
            parse_fetch(bad)


def test_every_hands_over_the_servers_arrays_and_counts_a_dense_reply() -> None:
    pulls = Pulls("every", 1, NAMES, LIMITS)
    w = weights(1.0)
    version, got = pulls.take(0, 5, w)
    assert version == 5 and got is w  # the study's path: the very arrays, no copy
    dense = sum(a.nbytes for a in w)
    assert dense < pulls.bytes_pulled < dense + 200  # the tensors plus a small header
    assert pulls.record()["pull_requests"] == pulls.record()["pulls_installed"] == 1


def test_n_fetch_pulls_every_kth_step_and_keeps_the_held_version_between() -> None:
    pulls = Pulls("n-fetch:3", 2, NAMES, LIMITS)
    seen = []
    for v in range(7):  # the server moves one version per step of worker 0
        version, got = pulls.take(0, v, weights(float(v)))
        seen.append(version)
        np.testing.assert_array_equal(got[0], weights(float(version))[0])
    assert seen == [0, 0, 0, 3, 3, 3, 6]
    assert pulls.requests == pulls.installed == 3
    # a worker held by sync (or dropped) pulls at once, whatever its step
    assert pulls.take(0, 9, weights(9.0), refresh=True)[0] == 9
    assert pulls.take(1, 9, weights(9.0))[0] == 9  # worker 1's first step pulls
    assert pulls.take(1, 10, weights(10.0))[0] == 9


def test_bf16_pulls_install_rounded_weights_for_half_the_bytes() -> None:
    every, bf16 = Pulls("every", 1, NAMES, LIMITS), Pulls("bf16", 1, NAMES, LIMITS)
    w = weights(1.0)
    every.take(0, 1, w)
    _, got = bf16.take(0, 1, w)
    for a, g in zip(w, got, strict=True):
        assert g.dtype == np.float32 and g.shape == a.shape
        assert not (g.view(np.uint32) & 0xFFFF).any()  # bfloat16 values widened to float32
        np.testing.assert_allclose(g, a, rtol=2**-8)
        assert not np.array_equal(g, a)
    assert w[0].dtype == np.float32 and (w[0].view(np.uint32) & 0xFFFF).any()  # server: fp32
    tensors = sum(a.nbytes for a in w)
    assert every.bytes_pulled - bf16.bytes_pulled == pytest.approx(tensors / 2, abs=16)


def test_adaptive_skips_until_the_weights_moved_past_the_bound() -> None:
    pulls = Pulls("adaptive:0.1", 1, NAMES, LIMITS)
    base = weights(1.0)
    w_norm = np.sqrt(sum(float((a.astype(np.float64) ** 2).sum()) for a in base))
    step = [np.full_like(a, 0.04 * w_norm / np.sqrt(a.size * 2)) for a in base]  # 4 % each
    current = base
    versions = []
    for v in range(6):
        versions.append(pulls.take(0, v, current)[0])
        current = [a + s for a, s in zip(current, step, strict=True)]
    # moved 4, 8, 12 % (relative to the current weights' norm, a little over ||base||)
    assert versions == [0, 0, 0, 3, 3, 3]
    assert pulls.skipped == 4 and pulls.installed == 2 and pulls.requests == 6
    full = sum(a.nbytes for a in base)
    assert 2 * full < pulls.bytes_pulled < 2 * full + 6 * 200  # skipped: headers only


def test_adaptive_measures_the_distance_not_the_path() -> None:
    """Weights that step away and back have not moved: the distance to the held version
    decides (as ``--pull-bound``'s server measures it), not the sum of the steps."""
    pulls = Pulls("adaptive:0.1", 1, NAMES, LIMITS)
    base = weights(1.0)
    w_norm = np.sqrt(sum(float((a.astype(np.float64) ** 2).sum()) for a in base))
    step = [np.full_like(a, 0.06 * w_norm / np.sqrt(a.size * 2)) for a in base]  # 6 %
    away = [a + s for a, s in zip(base, step, strict=True)]
    versions = [pulls.take(0, v, away if v % 2 else base)[0] for v in range(6)]
    assert versions == [0] * 6 and pulls.skipped == 5  # summed steps would pass 10 % at v2


def test_adaptive_measures_the_arrays_and_passes_a_dynamic_tables_empty_entry() -> None:
    """A model with a dynamic table pulls it as a ``Keyed`` with no rows (its rows go by id):
    the bound measures the arrays beside it, and the entry goes through the wire as sent."""
    empty = wire.Keyed(np.zeros(0, np.int64), np.zeros((0, 4), np.float32), (1 << 20, 4))
    pulls = Pulls("adaptive:0.1", 1, [*NAMES, "t"], LIMITS)
    base = weights(1.0)
    w_norm = np.sqrt(sum(float((a.astype(np.float64) ** 2).sum()) for a in base))
    moved = [[a + np.full_like(a, f * w_norm / np.sqrt(a.size * 2)) for a in base]
             for f in (0.05, 0.15)]  # fmt: skip
    versions = [pulls.take(0, v, [*w, empty])[0] for v, w in enumerate([base, *moved])]
    assert versions == [0, 0, 2] and pulls.skipped == 1  # 5 % stays held, 15 % is pulled
    _, got = pulls.take(0, 2, [*moved[1], empty])
    assert isinstance(got[2], wire.Keyed) and got[2].indices.size == 0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fetch_runner_tiny_grid_writes_records_and_every_is_reproduced(tmp_path: Path) -> None:
    fetches = "every,adaptive:1e-9,n-fetch:2,bf16"
    done = run_script(
        BENCH / "study_fetch.py",
        *("--out", str(tmp_path), "--workers", "1,2", "--fetch", fetches, "--seeds", "0"),
        *("--target", "0.5", "--eval-every", "10", "--max-updates", "20"),
        *("--max-gradients", "60", "--jobs", "1", "--costs", "44.71,1.51"),
        timeout_s=240,
        what="study_fetch tiny grid",
    )
    assert done.returncode == 0, done.stderr[-4000:]
    doc = json.loads((tmp_path / "fetch-results.json").read_text())
    runs = {(r["workers"], r["fetch"]): r for r in doc["runs"]}
    assert set(runs) == {(w, f) for w in (1, 2) for f in fetches.split(",")}
    for r in runs.values():
        for key in ("bytes_pulled", "bytes_pulled_to_target", "pull_requests", "pulls_skipped"):
            assert key in r, key
        assert r["seed"] == 0 and r["policy"] == "async"
    for w in (1, 2):
        every, wired = runs[(w, "every")], runs[(w, "adaptive:1e-9")]
        # every pull decoded from the wire: the same run, step for step, and the same bytes
        assert wired["curve"] == every["curve"] and wired["pulls_skipped"] == 0
        assert wired["bytes_pulled"] == every["bytes_pulled"]
        assert every["pull_requests"] == every["gradients"]
        half = runs[(w, "n-fetch:2")]
        assert len(half["worker_steps"]) == w and sum(half["worker_steps"]) == half["gradients"]
        assert half["pull_requests"] == sum((s + 1) // 2 for s in half["worker_steps"])
        assert runs[(w, "bf16")]["bytes_pulled"] < 0.51 * every["bytes_pulled"]
    rows = {(r["workers"], r["setting"]): r for r in doc["settings"]}
    assert doc["base"] == "every" and rows[(1, "every")]["updates_vs_base"] == 1.0
    table = (tmp_path / "fetch.md").read_text()
    assert "| n-fetch:2 |" in table and "free" in table


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fetch_runner_compares_push_compressions_with_the_first_setting(tmp_path: Path) -> None:
    """``--push none,bf16`` with ``--fetch bf16``: the base is today's defaults (bf16 pulls,
    float32 pushes), and bf16 pushes send half the bytes per gradient. ``--run-on``: every
    run goes on to the caps, and the tail accuracies are compared."""
    done = run_script(
        BENCH / "study_fetch.py",
        *("--out", str(tmp_path), "--workers", "1,2", "--fetch", "bf16", "--push", "none,bf16"),
        "--run-on",
        *("--seeds", "0", "--target", "0.5", "--eval-every", "10", "--max-updates", "20"),
        *("--max-gradients", "60", "--jobs", "1", "--costs", "44.71,1.51"),
        timeout_s=240,
        what="study_fetch push compressions",
    )
    assert done.returncode == 0, done.stderr[-4000:]
    doc = json.loads((tmp_path / "fetch-results.json").read_text())
    assert doc["base"] == "bf16" and doc["setting_names"] == ["bf16", "bf16 push:bf16"]
    runs = {(r["workers"], r["setting"]): r for r in doc["runs"]}
    assert set(runs) == {(w, s) for w in (1, 2) for s in doc["setting_names"]}
    for w in (1, 2):
        f32, bf16 = runs[(w, "bf16")], runs[(w, "bf16 push:bf16")]
        assert (f32["compress"], bf16["compress"]) == ("none", "bf16")
        assert f32["updates"] == bf16["updates"] == 20  # on to the cap, past the target
        assert f32["fetch"] == bf16["fetch"] == "bf16"
        per_grad = [r["bytes_sent"] / r["gradients"] for r in (f32, bf16)]
        assert 0.49 < per_grad[1] / per_grad[0] < 0.51  # half the bytes, plus the header
    rows = {(r["workers"], r["setting"]): r for r in doc["settings"]}
    assert rows[(1, "bf16")]["updates_vs_base"] == rows[(1, "bf16")]["push_bytes_vs_base"] == 1.0
    pushed = [rows[(w, "bf16 push:bf16")]["push_bytes_vs_base"] for w in (1, 2)]
    reached = [rows[(w, "bf16 push:bf16")]["reached"] for w in (1, 2)]
    assert reached == [1, 1]  # 50 % within 20 updates, as every setting of the tiny grid
    assert all(0.45 < p < 0.55 for p in pushed), pushed
    for w in (1, 2):
        tail = (
            runs[(w, "bf16 push:bf16")]["tail_mean_accuracy"]
            - runs[(w, "bf16")]["tail_mean_accuracy"]
        )
        assert rows[(w, "bf16")]["tail_points_vs_base"] == 0.0
        assert rows[(w, "bf16 push:bf16")]["tail_points_vs_base"] == round(100 * tail, 3)
    table = (tmp_path / "fetch.md").read_text()
    assert "| bf16 push:bf16 |" in table and "bytes pushed" in table and "tail accuracy" in table
