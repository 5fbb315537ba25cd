"""Row-sparse tables are found, served and pulled by row whatever form the model's inputs
take (one tensor, a list, a dict, a nested dict), and a model that cannot be probed says so
in the log and in ``downpour status`` instead of silently serving every table whole.
In-process servers and workers on real loopback sockets."""

from __future__ import annotations

import logging

import pytest
from conftest import wait_until
from inproc import serving, train
from tiny_models import FORMS, embedding_form

from downpour.cli.status import fetch_status, render
from downpour.server.state import ParameterState
from downpour.spec import load_spec

TABLE = "embed/embeddings"
STEPS = 12


@pytest.mark.parametrize("form", FORMS)
def test_the_server_finds_the_table_row_sparse_in_every_input_form(form: str) -> None:
    state = ParameterState(embedding_form(form), "sgd", 0.1)
    assert state.row_sparsity is not None and state.row_sparsity.problem is None
    by_row = [n for n, s in zip(state.names, state.sparse, strict=True) if s]
    assert by_row == [TABLE]


@pytest.mark.parametrize("form", FORMS)
def test_a_worker_pulls_the_table_by_row_in_every_input_form(form: str) -> None:
    """The bytes pulled follow the ids: by row, the table's rows pulled are at most the ids
    the steps gathered, and the worker moves a fraction of what pulling it whole moves."""
    spec = embedding_form(form)
    with serving(spec, optimizer="sgd", learning_rate=0.1) as server:
        doc = fetch_status(server.status)
        assert doc["row_tables"] == [TABLE] and doc["row_detection"] is None
        by_row = train(server.port, spec, steps=STEPS, worker_id="rows", n_fetch=1)
    with serving(spec, optimizer="sgd", learning_rate=0.1) as server:
        whole = train(server.port, spec, steps=STEPS, worker_id="whole", n_fetch=1, row_pulls="off")
    assert by_row["row_pulls"] == [TABLE] and whole["row_pulls"] is None
    ids_gathered = (STEPS + 1) * spec.batch_size * 6  # the look-ahead reads one batch more
    assert 0 < by_row["rows_pulled"] <= ids_gathered
    assert whole["rows_pulled"] == 0
    assert by_row["bytes_pulled"] * 4 < whole["bytes_pulled"], (by_row, whole)


@pytest.mark.parametrize("form", ["dict", "nested"])
def test_a_row_cache_works_for_dict_and_nested_inputs(form: str) -> None:
    """--row-cache-rows: the 5,000-row table is a 200-row cache on the worker."""
    spec = embedding_form(form)
    with serving(spec, optimizer="sgd", learning_rate=0.1) as server:
        summary = train(
            server.port, spec, steps=STEPS, worker_id="cached", n_fetch=1, row_cache_rows=200
        )
        wait_until(lambda: fetch_status(server.status)["version"] == STEPS, 30, "the applies")
    assert summary["row_pulls"] == [TABLE] and summary["rows_pulled"] > 0
    assert summary["row_cache_rows"] == 200 and summary["held_out"] is not None


def test_the_recsys_example_pulls_its_tables_by_row() -> None:
    spec = load_spec("downpour.examples.recsys:spec")
    tables = ["item_bias/embeddings", "item_factors/embeddings"]
    tables += ["user_bias/embeddings", "user_factors/embeddings"]
    with serving(spec, optimizer="adagrad", learning_rate=0.1) as server:
        assert sorted(fetch_status(server.status)["row_tables"]) == tables
        summary = train(server.port, spec, steps=STEPS, worker_id="recsys", n_fetch=1)
    assert sorted(summary["row_pulls"]) == tables
    assert summary["rows_pulled"] > 0 and summary["row_bytes_pulled"] > 0


def test_a_model_that_cannot_be_probed_is_a_warning_in_the_log_and_in_status(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A subclassed model declares no inputs: the server cannot probe it for row-sparse
    gradients, and says so, naming the table and the reason."""
    with (
        caplog.at_level(logging.WARNING, logger="downpour.server"),
        serving("tiny_models:subclassed_embedding") as server,
    ):
        doc = fetch_status(server.status)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("row-sparse" in m and "embed/embeddings" in m for m in warned), warned
    assert doc["row_tables"] == []
    assert "declares no inputs" in doc["row_detection"]
    assert "WARNING: cannot probe model 'bag'" in render(doc)
