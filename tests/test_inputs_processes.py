"""The input pipeline with real processes: three statically sharded workers and a server see
each training example exactly once per epoch; bad input exits 2 with nothing sent."""

from __future__ import annotations

from pathlib import Path

import input_models
import pytest
from conftest import Cluster, summary, wait_until

from downpour.cli.status import fetch_status

pytestmark = pytest.mark.slow


def test_three_workers_train_on_each_example_once_per_epoch(
    cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ids_dir = tmp_path / "ids"
    ids_dir.mkdir()
    monkeypatch.setenv(input_models.IDS_DIR_ENV, str(ids_dir))  # the plugin's record hook
    server = cluster.server(
        "--eval-every", "10", "--lr", "0.02", model="input_models:ids", early=True
    )
    workers = [
        cluster.worker(
            server.port,
            "--epochs",
            "2",
            "--num-workers",
            "3",
            "--worker-index",
            str(i),
            "--seed",
            "9",
            model="input_models:ids",
            worker_id=f"w{i}",
        )
        for i in range(3)
    ]
    for w in workers:
        assert w.wait(timeout=300) == 0, w.log_text()
    sums = [summary(w) for w in workers]
    per_worker = -(-input_models.N_IDS // 3 // 32)  # 200 examples each: 7 batches an epoch
    assert [s["steps"] for s in sums] == [2 * per_worker] * 3
    assert [s["epochs"] for s in sums] == [2, 2, 2]
    share = input_models.N_IDS // 3
    for epoch in range(2):  # what each worker read, epoch by epoch
        seen = []
        for i in range(3):
            (path,) = ids_dir.glob(f"ids-{i}-{epoch}-*.txt")
            ids = [int(line) for line in path.read_text().split()]
            assert len(ids) == share, f"worker {i}, epoch {epoch}"
            seen += ids
        assert sorted(seen) == list(range(input_models.N_IDS)), f"epoch {epoch}"
    assert len(list(ids_dir.glob("ids-*.txt"))) == 6  # no epoch read past the last

    doc = fetch_status(server.status)
    assert doc["updates_applied"] == 3 * 2 * per_worker and doc["rejected_total"] == 0
    assert all(s["held_out"] is not None and s["held_out"] > 0.9 for s in sums)


@pytest.mark.parametrize(
    ("model", "workers", "expected"),
    [
        ("not_a_dataset", 1, "not a tf.data.Dataset"),
        ("wrong_shape", 1, "feature x has shape [None, 5]"),
        ("few_files", 3, "worker 2 of 3 has no file to read"),
    ],
)
def test_bad_input_exits_2_before_saying_hello(
    cluster: Cluster, model: str, workers: int, expected: str
) -> None:
    server = cluster.server(model="input_models:ids")
    bad = cluster.worker(
        server.info["port"],
        "--num-workers",
        str(workers),
        "--worker-index",
        str(workers - 1),
        model=f"input_models:{model}",
        worker_id="bad",
    )
    assert bad.wait(timeout=120) == 2, bad.log_text()
    assert expected in bad.log_text()
    doc = fetch_status(server.status)
    assert doc["workers"] == {} and doc["version"] == 0  # no hello, no pull, no gradient


@pytest.mark.parametrize(("model", "bar"), [("two_inputs", 0.9), ("multilabel", 0.9)])
def test_dict_features_and_2d_labels_train_through_the_server(
    cluster: Cluster, model: str, bar: float
) -> None:
    """Two workers on their shards; the worker's held-out score and the server's own
    evaluation (--eval-every) both read the model's held_out_fn."""
    ref = f"input_models:{model}"
    server = cluster.server("--eval-every", "5", "--lr", "0.05", model=ref, early=True)
    workers = [
        cluster.worker(
            server.port,
            "--epochs",
            "4",
            "--num-workers",
            "2",
            "--worker-index",
            str(i),
            model=ref,
            worker_id=f"w{i}",
        )  # fmt: skip
        for i in range(2)
    ]
    for w in workers:
        assert w.wait(timeout=300) == 0, w.log_text()
    sums = [summary(w) for w in workers]
    assert [s["steps"] for s in sums] == [4 * 19] * 2  # 600 examples each: 19 batches of 32
    assert all(s["held_out"] >= bar for s in sums), sums
    ev = wait_until(lambda: fetch_status(server.status)["eval"], 60, "a server evaluation")
    assert ev["examples"] == 300 and ev["accuracy"] > 0.6  # chance: 0.25 and 0.5
