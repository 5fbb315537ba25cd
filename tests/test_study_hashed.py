"""The study's hashed-id model (``tests/bench/study_hashed.py``): a simulated worker computes on
the server's rows of its batch and pushes them keyed by id through the wire and the server's
check; the held-out score of a state is the model's, scored from the state's rows."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from downpour import wire
from downpour.models import build_model, evaluate
from downpour.server.handlers import check_gradients
from downpour.server.policies import parse_policy
from downpour.server.state import ParameterState
from downpour.wire import Keyed, Message

BENCH = Path(__file__).resolve().parents[1] / "tests" / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import study  # noqa: E402 - the bench module, on the path just set
from study_models import OPTIMIZERS  # noqa: E402

MODEL = "clicks-hashed"


@pytest.fixture(scope="module")
def ctx() -> study._Context:
    return study._context(MODEL)


def _fresh(ctx: study._Context) -> ParameterState:
    state = ParameterState(ctx.spec, OPTIMIZERS[MODEL], 0.01, seed=0)
    ctx.begin(state, parse_policy("async"))
    return state


def _cached_rows(ctx: study._Context, i: int, ids: np.ndarray) -> np.ndarray:
    """The rows of ``ids`` the worker's step reads from table ``i``'s row cache."""
    variable = ctx.model.trainable_variables[i]
    slots = ctx.rows.caches[variable.path].slots(ids)
    assert (slots >= 0).all()
    return variable.numpy()[slots]


def test_a_hashed_worker_computes_on_the_servers_rows_and_pushes_them_keyed(
    ctx: study._Context,
) -> None:
    state = _fresh(ctx)
    stream = ctx.data.stream(0, 2, 0)
    users = []
    for version in (0, 1):  # a fresh table's initial rows, then the rows one update made
        x, y = next(stream)
        users.append(x["user"])
        ctx.install(state, *state.weights(), x)
        ids = ctx.rows.plan.batch_ids(x)
        for table, table_ids in zip(ctx.rows.plan.tables, ids, strict=True):
            i = table.var  # one shard: the model's variable i is the state's
            np.testing.assert_array_equal(
                _cached_rows(ctx, i, table_ids), state.gather(i, table_ids)
            )
        _, grads = ctx.step(x, y)
        msg = Message(wire.PUSH, "w0", seq=version + 1, base_version=version,
                      tensors=dict(zip(state.names, grads, strict=True)))  # fmt: skip
        frames = [bytes(memoryview(f).cast("B")) for f in wire.encode(msg)]
        limits = wire.DEFAULT_LIMITS.for_payload(state.payload_bytes)
        checked = check_gradients(wire.decode(frames, limits), state)
        for g, dynamic, table_ids in zip(checked, state.dynamic, [*ids, None, None], strict=True):
            assert isinstance(g, Keyed) == dynamic
            if dynamic:  # global hashed ids, exactly the batch's
                assert set(np.asarray(g.indices).tolist()) == set(table_ids.tolist())
        state.apply(checked)
    assert ctx.rows.record()["rows_pulled"] >= sum(t.size for t in ids)
    assert len(state.tables["user_factors/embeddings"]) == np.unique(np.concatenate(users)).size


def test_a_fresh_states_score_is_the_freshly_built_models(ctx: study._Context) -> None:
    """Scored from the state's rows (an unseen id reads its initial row), a fresh state scores
    what the model built in one process scores, whose layers create those rows themselves."""
    held, _ = ctx.data.held_out
    state = _fresh(ctx)
    model = build_model(ctx.spec, seed=0)
    got = ctx.rows.score(state, held[:2])
    assert got == pytest.approx(float(evaluate(ctx.spec, model, held[:2])), abs=1e-9)
    assert 0.0 < got < 1.0
    assert ctx.score(state) == pytest.approx(float(evaluate(ctx.spec, model, held)), abs=1e-9)


def test_a_policy_a_dynamic_server_refuses_is_refused_by_the_simulation(
    ctx: study._Context,
) -> None:
    state = ParameterState(ctx.spec, OPTIMIZERS[MODEL], 0.01, seed=0)
    with pytest.raises(ValueError, match="cannot apply the dynamic tables"):
        ctx.begin(state, parse_policy("sync:2/2"))
    with pytest.raises(ValueError, match="fetch 'every'"):
        ctx.begin(state, parse_policy("async"), "n-fetch:2")


def test_study_md_names_dynamic_tables_by_width_not_their_declared_rows() -> None:
    dense = {"parameters": 215306, "dynamic_tables": {}}
    assert study.model_size(dense) == "215,306 parameters"
    hashed = {"parameters": 1092, "dynamic_tables": {"a/embeddings": 16, "b/embeddings": 16}}
    assert study.model_size(hashed) == (
        "1,092 parameters outside 2 dynamic tables of 16-wide rows made on first touch"
    )
