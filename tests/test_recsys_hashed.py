"""The hashed-id recommendation example in one process: the generator's 64-bit ids (int64,
negative values, the Zipf law, a long tail, the planted signal) and the DynamicEmbedding
model trained on them, with int64 ids and with string ids."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from downpour import InputContext
from downpour.examples.clicks import (
    HASHED,
    SMALL,
    ClickConfig,
    generate,
    hashed_ids,
    read_config,
)

# Small enough to train in seconds, with the long tail of HASHED (most users seen once).
SHORT = ClickConfig(users=200_000, items=5_000, events=60_000, held_out=8_000, hashed=True)


def test_hashed_ids_are_a_bijection_onto_all_of_int64() -> None:
    index = np.arange(200_000, dtype=np.int64)
    ids = hashed_ids(index, "user")
    assert ids.dtype == np.int64 and np.unique(ids).size == index.size
    assert (ids < 0).mean() == pytest.approx(0.5, abs=0.01)  # spread over the whole word
    assert np.abs(ids).min() < 2**60 < np.abs(ids).max()
    assert not np.intersect1d(ids, hashed_ids(index, "item")).size  # roles salted apart
    assert not np.intersect1d(ids, hashed_ids(index, "user", seed=1)).size  # and seeds


def test_the_hashed_log_keeps_the_zipf_law_the_signal_and_a_long_tail() -> None:
    log = generate(HASHED)
    features, _ = log.split("train")
    held, _ = log.split("held_out")
    users = np.concatenate([features["user"], held["user"]])
    assert users.dtype == np.int64 and (users < 0).any() and np.abs(users).max() > 2**62
    # the ids are the hashes of the planted indexes: same events, same counts
    by_index = np.sort(np.unique(log.user, return_counts=True)[1])[::-1]
    counts = np.sort(np.unique(users, return_counts=True)[1])[::-1]
    np.testing.assert_array_equal(counts, by_index)
    slope = np.polyfit(np.log(np.arange(1, 101)), np.log(counts[:100]), 1)[0]
    assert -1.3 < slope < -0.9, slope  # frequency ∝ rank ** -1.1
    assert (counts == 1).sum() > 0.6 * counts.size  # most ids are seen once
    unseen = ~np.isin(held["user"], features["user"])
    assert unseen.mean() > 0.1  # new ids keep arriving in the held-out events
    oracle, popularity = log.oracle_auc(), log.popularity_auc()
    assert oracle > popularity + 0.15 > 0.75, (oracle, popularity)
    plain = generate(SMALL).split("train")[0]["user"]
    assert plain.min() >= 0 and plain.max() < SMALL.users  # unhashed logs are unchanged


@pytest.mark.parametrize("strings", [False, True], ids=["int64", "strings"])
def test_the_dynamic_model_trains_in_one_process_past_popularity(strings: bool) -> None:
    from downpour.examples.recsys_hashed import hashed_spec, train_one_process

    log = generate(SHORT)
    got = train_one_process(hashed_spec(SHORT, strings=strings, max_rows=1 << 15), 1)
    assert got > log.popularity_auc() + 0.05, (got, log.popularity_auc())
    assert got < log.oracle_auc()


def test_data_clicks_hashed_writes_the_files_the_hashed_spec_reads(tmp_path: Path) -> None:
    from downpour.cli import main as cli_main
    from downpour.examples.recsys_hashed import hashed_spec

    out, plain = tmp_path / "hashed", tmp_path / "plain"
    size = ["--users", "3000", "--items", "300", "--events", "4000", "--held-out", "500"]
    assert cli_main(["data", "clicks", str(out), "--hashed", *size, "--shards", "2"]) == 0
    config = read_config(out)
    assert config == replace(HASHED, users=3000, items=300, events=4000, held_out=500)
    model_spec = hashed_spec(config, max_rows=4096)
    assert model_spec.input_fn is not None and model_spec.held_out_fn is not None
    seen = [
        (u, i)
        for x, _ in model_spec.input_fn(InputContext(data_dir=str(out), batch_size=256))
        for u, i in zip(x["user"].numpy().tolist(), x["item"].numpy().tolist(), strict=True)
    ]
    features, _ = generate(config).split("train")
    assert sorted(seen) == sorted(
        zip(features["user"].tolist(), features["item"].tolist(), strict=True)
    )
    assert cli_main(["data", "clicks", str(plain), *size]) == 0  # the same log, not hashed
    with pytest.raises(ValueError, match=r"\(ids\); this model's is 3000 x 300 \(hashed ids\)"):
        model_spec.held_out_fn(InputContext(data_dir=str(plain)))
