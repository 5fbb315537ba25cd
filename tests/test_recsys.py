"""The recommendation example without service processes: the click-log generator (seeded,
Zipf-skewed, a planted signal, a disjoint held-out split), the exact AUC, a spec's metric name
as the server's evaluation, status and Prometheus report it, and the example's input
functions over memory and over the files ``downpour data clicks`` writes."""

from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from downpour import InputContext, ModelSpec
from downpour.cli.status import render
from downpour.examples.clicks import SMALL, ClickConfig, generate, read_config, zipf_ids
from downpour.spec import auc

TINY = ClickConfig(users=400, items=150, events=6_000, held_out=1_000, seed=3)
SHORT_LOG = ClickConfig(users=2_000, items=500, events=40_000, held_out=4_000, seed=5)


def _brute_auc(labels: np.ndarray, scores: np.ndarray) -> float:
    pos, neg = scores[labels == 1], scores[labels == 0]
    wins = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    return float(wins / (len(pos) * len(neg)))


def test_auc_is_the_exact_pairwise_rank_statistic_with_ties_as_half() -> None:
    rng = np.random.default_rng(0)
    for _ in range(20):
        n = int(rng.integers(2, 60))
        labels = rng.integers(0, 2, n)
        labels[:2] = [0, 1]
        scores = rng.integers(0, 5, n).astype(np.float64)  # many ties
        assert auc(labels, scores) == pytest.approx(_brute_auc(labels, scores), abs=1e-12)
    assert auc(np.array([0, 0, 1, 1]), np.array([[0.1], [0.4], [0.35], [0.8]])) == 0.75
    assert auc(np.array([0, 1]), np.array([5.0, 5.0])) == 0.5
    with pytest.raises(ValueError, match="both classes"):
        auc(np.ones(4), np.arange(4.0))
    with pytest.raises(ValueError, match="3 labels for 4 scores"):
        auc(np.array([0, 1, 0]), np.arange(4.0))


def test_the_generator_is_deterministic_in_its_seed() -> None:
    a, b = generate(TINY), generate(TINY)
    for field in ("user", "item", "click", "logit", "train", "test"):
        assert np.array_equal(getattr(a, field), getattr(b, field)), field
    c = generate(replace(TINY, seed=4))
    assert not np.array_equal(a.user, c.user) and not np.array_equal(a.click, c.click)


def test_ids_are_zipf_distributed_and_the_hot_ids_scattered() -> None:
    rng = np.random.default_rng(1)
    ids = zipf_ids(rng, 5_000, 1.1, 400_000)
    assert ids.min() >= 0 and ids.max() < 5_000 and ids.dtype == np.int64
    counts = np.sort(np.bincount(ids, minlength=5_000))[::-1]
    ranks = np.arange(1, 101)
    slope = np.polyfit(np.log(ranks), np.log(counts[:100]), 1)[0]
    assert -1.3 < slope < -0.9, slope  # frequency ∝ rank ** -1.1
    assert counts[:50].sum() > 0.4 * len(ids)  # 1 % of the ids: over 40 % of the draws
    hot = np.argsort(np.bincount(ids, minlength=5_000))[::-1][:50]
    assert hot.max() > 2_500  # the permutation spreads the hot ids over the table


def test_the_planted_signal_is_learnable_and_its_best_auc_known() -> None:
    log = generate(SMALL)
    oracle, popularity = log.oracle_auc(), log.popularity_auc()
    assert 0.84 < oracle < 0.9, oracle  # docs/recommendation.md quotes 0.8676
    assert oracle > popularity + 0.15 > 0.75  # factors, not popularity alone, reach the top
    rng = np.random.default_rng(0)
    assert abs(auc(log.click[log.test], rng.random(len(log.test))) - 0.5) < 0.02
    assert 0.3 < log.click.mean() < 0.5


def test_the_held_out_split_is_disjoint_and_covers_the_log() -> None:
    log = generate(TINY)
    train, held = log.split("train"), log.split("held_out")
    assert len(held[1]) == TINY.held_out and len(train[1]) == TINY.events - TINY.held_out
    assert not set(train[0]["id"]) & set(held[0]["id"])
    assert sorted([*train[0]["id"], *held[0]["id"]]) == list(range(TINY.events))
    assert set(np.unique(held[1])) == {0.0, 1.0}


def test_a_spec_names_its_metric_and_bad_names_are_refused() -> None:
    from downpour.examples.wine import build, load_wine

    assert ModelSpec(name="m", build=build, load_data=load_wine).metric_name == "accuracy"
    assert ModelSpec(name="m", build=build, load_data=load_wine, metric_name="auc_pr")
    for bad in ("AUC", "version", "time", "a b", "", "x" * 40):
        with pytest.raises(ValueError, match="metric_name"):
            ModelSpec(name="m", build=build, load_data=load_wine, metric_name=bad)


def test_status_and_prometheus_report_the_metric_under_its_name() -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from downpour.server.observers.prometheus import render_text

    ev = {"version": 40, "metric": "auc", "auc": 0.8125, "time": 1.0, "count": 3, "every": 20}
    doc = {"version": 40, "model": "recsys", "eval": ev, "workers": {}}
    assert "held-out auc 0.8125 at version 40" in render(doc)
    fams = {f.name: f for f in text_string_to_metric_families(render_text(lambda: doc))}
    (sample,) = fams["downpour_heldout_metric"].samples
    assert sample.labels == {"metric": "auc"} and sample.value == 0.8125
    assert "downpour_heldout_accuracy" not in fams  # an AUC is not reported as an accuracy


def test_the_servers_evaluator_scores_the_recsys_model_by_auc() -> None:
    from downpour.examples.recsys import make_spec
    from downpour.model.build import build_model
    from downpour.server.observers.evaluation import HeldOutEvaluator

    spec = make_spec(TINY, "recsys_tiny")
    model = build_model(spec)
    got: list[dict[str, Any]] = []
    done = threading.Event()
    evaluator = HeldOutEvaluator(spec, None, 1, on_result=lambda r: (got.append(r), done.set()))
    evaluator.start()
    try:
        evaluator.submit(7, [v.numpy() for v in model.trainable_variables])
        assert done.wait(60), "no evaluation result"
    finally:
        evaluator.close()
    (result,) = got
    assert result["metric"] == "auc" and result["version"] == 7 and "accuracy" not in result
    assert result["examples"] == TINY.held_out and 0.3 < result["auc"] < 0.7  # untrained


def _events(ds: Any) -> list[tuple[int, int, float]]:
    return [
        (int(u), int(i), float(c))
        for x, y in ds
        for u, i, c in zip(x["user"].numpy(), x["item"].numpy(), y.numpy(), strict=True)
    ]


def _expected(log: Any) -> list[tuple[int, int, float]]:
    f, y = log.split("train")
    return sorted(zip(f["user"].tolist(), f["item"].tolist(), y.tolist(), strict=True))


def test_two_workers_share_the_in_memory_log_once_per_epoch() -> None:
    from downpour.examples.recsys import make_spec

    spec = make_spec(TINY, "recsys_tiny")
    assert spec.input_fn is not None
    seen = []
    for i in range(2):
        ctx = InputContext(worker_index=i, num_workers=2, seed=5, batch_size=64)
        seen += _events(spec.input_fn(ctx))
        assert ctx.used == ["elements"]
    assert sorted(seen) == _expected(generate(TINY))


def test_data_clicks_writes_files_the_example_reads(tmp_path: Path) -> None:
    from downpour.cli import main as cli_main
    from downpour.examples.recsys import make_spec, spec

    out = tmp_path / "clicks"
    args = ["--users", "400", "--items", "150", "--events", "6000", "--held-out", "1000"]
    assert cli_main(["data", "clicks", str(out), *args, "--seed", "3", "--shards", "2"]) == 0
    assert read_config(out) == TINY
    assert cli_main(["data", "clicks", str(out), *args]) == 2  # refuses to overwrite

    tiny = make_spec(TINY, "recsys_tiny")
    assert tiny.input_fn is not None and tiny.held_out_fn is not None
    seen = []
    for i in range(2):
        ctx = InputContext(worker_index=i, num_workers=2, data_dir=str(out), batch_size=64)
        seen += _events(tiny.input_fn(ctx))
        assert ctx.used == ["files"]
    log = generate(TINY)
    assert sorted(seen) == _expected(log)
    held = _events(tiny.held_out_fn(InputContext(data_dir=str(out))))
    f, y = log.split("held_out")
    assert held == list(zip(f["user"].tolist(), f["item"].tolist(), y.tolist(), strict=True))

    default = spec()  # 20k x 5k tables: a log of other tables is refused, saying why
    assert default.input_fn is not None
    with pytest.raises(ValueError, match="400 users x 150 items"):
        default.input_fn(InputContext(data_dir=str(out)))


def test_the_tower_model_has_a_dense_part_every_batch_updates_and_learns() -> None:
    """``recsys:tower``: the tables come out of the step as rows, the tower's 5,249
    parameters dense; trained in one process it ranks past popularity, short of the
    oracle."""
    from downpour.examples.recsys import build_tower, make_spec, train_one_process
    from downpour.model.build import build_model
    from downpour.wire import Sparse
    from downpour.worker.step import GradientStep

    spec = make_spec(
        SHORT_LOG, "recsys_tower_short", build=lambda: build_tower(SHORT_LOG.users, SHORT_LOG.items)
    )
    model = build_model(spec)
    ctx = InputContext(batch_size=spec.batch_size, seed=0)
    first = spec.input_fn(ctx)
    x, y = next(iter(first))
    _, grads = GradientStep(spec, model, first.element_spec)(x, y)
    tables = {
        v.path
        for v, g in zip(model.trainable_variables, grads, strict=True)
        if isinstance(g, Sparse)
    }
    assert tables == {
        f"{t}/embeddings" for t in ("user_factors", "item_factors", "user_bias", "item_bias")
    }
    dense = [v for v in model.trainable_variables if v.path not in tables]
    assert sum(int(np.prod(v.shape)) for v in dense) == 5_249
    log = generate(SHORT_LOG)
    got = train_one_process(spec, 1)
    assert log.popularity_auc() + 0.02 < got < log.oracle_auc(), (got, log.popularity_auc())
