"""Dynamic tables through downpour: a model whose table is a ``DynamicEmbedding`` fed 64-bit
hashed ids trains through in-process servers and workers on real loopback sockets, in every
input form and over one shard and several; its rows travel keyed by id, are created on the
servers on first touch, and start from the values the layer gives the same ids in one process.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
from conftest import wait_until
from inproc import WorkerThread, make_worker, serving, settle, train
from tiny_models import FORMS, _form_data, embedding_form, hashed

from downpour.cli.status import fetch_status
from downpour.config.settings import ConfigError
from downpour.layers import DynamicEmbedding
from downpour.model.build import build_model
from downpour.model.hashing import id_shard
from downpour.server.state import ParameterState
from downpour.wire import Keyed

TABLE = "embed/embeddings"
STEPS = 60  # two epochs of the 600 examples


@pytest.mark.parametrize("form", FORMS)
def test_the_server_holds_the_table_by_id_in_every_form(form: str) -> None:
    state = ParameterState(embedding_form(form, dynamic=True), "sgd", 0.1)
    assert list(state.tables) == [TABLE] and state.names[0] == TABLE
    assert state.sparse[0] and state.dynamic[0] and len(state.tables[TABLE]) == 0


@pytest.mark.parametrize("form", FORMS)
def test_a_dynamic_table_trains_through_one_server_in_every_form(form: str) -> None:
    spec = embedding_form(form, dynamic=True)
    with serving(spec, optimizer="adagrad", learning_rate=0.5) as server:
        summary = train(server.port, spec, steps=STEPS, worker_id="w", n_fetch=1)
        wait_until(lambda: fetch_status(server.status)["version"] == STEPS, 30, "the applies")
        table = server.server.state.tables[TABLE]
        live = len(table)
    assert summary["row_pulls"] == [TABLE] and summary["rows_pulled"] > 0
    tokens, _, _ = _form_data(600, 3)
    assert 0 < live <= np.unique(tokens).size  # rows created on first touch, for ids pushed
    assert summary["held_out"] is not None and summary["held_out"] > 0.9


def test_two_shards_two_workers_split_the_ids_by_hash() -> None:
    """Each shard holds the ids ``id_shard`` routes to it, none twice; both workers' steps
    reach both shards, and the model learns."""
    spec = embedding_form("dict", dynamic=True)
    config = {"optimizer": "adagrad", "learning_rate": 0.5}
    with (
        serving(spec, shard=0, num_shards=2, **config) as s0,
        serving(spec, shard=1, num_shards=2, **config) as s1,
    ):
        servers = [s0, s1]
        assert s0.info["partition"] == s1.info["partition"]
        ports = [s.port for s in servers]
        threads = [
            WorkerThread(make_worker(ports, spec, worker_id=f"w{i}", steps=40, num_workers=2,
                                     worker_index=i, n_fetch=1))
            for i in (0, 1)
        ]  # fmt: skip
        sums = [t.result() for t in threads]
        for s in servers:
            settle(s.status, sums)
        tables = [s.server.state.tables[TABLE] for s in servers]
        held = [t.export_state()["ids"] for t in tables]
    assert all(h.size > 0 for h in held)
    for k, ids in enumerate(held):
        assert (id_shard(ids, 2) == k).all()
    assert np.intersect1d(held[0], held[1]).size == 0
    tokens, _, _ = _form_data(600, 3)
    assert np.union1d(*held).size <= np.unique(tokens).size
    assert all(s["held_out"] is not None and s["held_out"] > 0.9 for s in sums), sums


def test_initial_rows_agree_with_the_layer_in_one_process() -> None:
    """The rows a server serves for ids it never saw are the ones the layer itself creates
    for them in one process."""
    spec = embedding_form("tensor", dynamic=True)
    model = build_model(spec)
    layer = next(x for x in model.layers if isinstance(x, DynamicEmbedding))
    ids = hashed(np.array([0, 7, 3, 199]))
    local = layer(ids[None, :]).numpy()[0]
    for shards in (1, 3):
        rows = []
        for k in range(shards):
            state = ParameterState(spec, "sgd", 0.1, shard=k, num_shards=shards)
            rows.append(state.gather(0, ids))
        assert all(np.array_equal(r, local) for r in rows)


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ({"policy": "sync:2/2"}, "cannot apply the dynamic tables"),
        ({"policy": "dc:0.5"}, "cannot apply the dynamic tables"),
        ({"policy": "momentum-aware"}, "changes Adam's beta_1"),
        ({"eval_every": 10}, "--eval-every evaluates the model in the server"),
    ],
)
def test_a_server_refuses_what_dynamic_tables_cannot_go_with(
    setting: dict[str, object], message: str
) -> None:
    with (
        pytest.raises(ConfigError, match=message),
        serving(embedding_form("tensor", dynamic=True), **setting),
    ):
        pass


def test_adam_updates_dynamic_rows_lazily_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    with (
        caplog.at_level(logging.WARNING, "downpour.server"),
        serving(embedding_form("tensor", dynamic=True), optimizer="adam") as server,
    ):
        assert server.server.state.tables[TABLE].opt.kind == "lazy_adam"
    assert "updated by lazy_adam (--optimizer adam)" in caplog.text


def test_an_ids_initial_row_does_not_depend_on_the_order_ids_are_first_touched() -> None:
    """Two servers create the same ids in opposite orders, in different pushes: each id's
    first row is its initial value minus its one update, the same on both."""
    spec = embedding_form("tensor", dynamic=True)
    ids = hashed(np.arange(40))
    rows = []
    for order in (ids, ids[::-1]):
        state = ParameterState(spec, "sgd", 0.5)
        for part in np.array_split(order, 4):
            grads = [
                Keyed(part, np.ones((part.size, 8), np.float32), sh) if dyn
                else np.zeros(sh, np.float32)
                for sh, dyn in zip(state.shapes, state.dynamic, strict=True)
            ]  # fmt: skip
            state.apply(grads)
        rows.append(state.gather(0, ids))
    np.testing.assert_array_equal(rows[0], rows[1])
    layer_rows = build_model(spec).layers[1](ids[None, :]).numpy()[0]
    np.testing.assert_allclose(rows[0], layer_rows - 0.5, rtol=1e-6)


def test_a_row_cache_smaller_than_the_layer_and_a_staleness_bound_work_for_dynamic_tables() -> None:
    spec = embedding_form("dict", dynamic=True)
    with serving(spec, optimizer="adagrad", learning_rate=0.5) as server:
        summary = train(server.port, spec, steps=STEPS, worker_id="w", n_fetch=2,
                        row_cache_rows=150, row_staleness=2)  # fmt: skip
    assert summary["row_cache_rows"] == 150 and summary["rows_pulled"] > 0
    assert summary["row_hits"] > 0  # rows reused from the cache within the staleness bound
    assert summary["held_out"] is not None and summary["held_out"] > 0.9


def test_accumulated_pushes_keep_dynamic_rows_keyed() -> None:
    """--n-push 3: three steps' rows in one push, each id once, applied without a refusal."""
    spec = embedding_form("dict", dynamic=True)
    with serving(spec, optimizer="adagrad", learning_rate=0.5) as server:
        summary = train(server.port, spec, steps=30, worker_id="w", n_fetch=1, n_push=3)
        doc = wait_until(
            lambda: (d := fetch_status(server.status))["version"] == 10 and d, 30, "the applies"
        )
    assert summary["pushes"] == 10 and doc["rejected_total"] == 0
    assert doc["dynamic_tables"][TABLE]["live_rows"] > 0
