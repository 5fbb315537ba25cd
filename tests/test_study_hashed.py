"""The study's hashed-id model (``tests/bench/study_hashed.py``): a simulated worker computes on
the server's rows of its batch and pushes them keyed by id through the wire and the server's
check; the held-out score of a state is the model's, scored from the state's rows."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from downpour import wire
from downpour.config.settings import ConfigError
from downpour.model.build import build_model, evaluate
from downpour.server.handlers import check_gradients
from downpour.server.policies.base import parse_policy
from downpour.server.state import ParameterState
from downpour.wire import Keyed, Message

BENCH = Path(__file__).resolve().parents[1] / "tests" / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import study  # noqa: E402 - the bench module, on the path just set
from study_hashed import HashedWorker  # noqa: E402
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
    with pytest.raises(ConfigError, match="cannot apply the dynamic tables"):
        ctx.begin(state, parse_policy("sync:2/2"))
    with pytest.raises(ValueError, match="fetch setting"):
        ctx.begin(state, parse_policy("async"), "n-fetch:0")


def _rows_of(worker: HashedWorker, x: object) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Per table variable: (the batch's ids, the rows the worker's step reads for them)."""
    out = {}
    for table, ids in zip(worker.plan.tables, worker.plan.batch_ids(x), strict=True):
        variable = worker.model.trainable_variables[table.var]
        slots = worker.caches[variable.path].slots(ids)
        assert (slots >= 0).all()
        out[table.var] = (ids, variable.numpy()[slots])
    return out


def _push(state: ParameterState, grads: list, version: int) -> None:
    """``grads`` computed on ``version`` through the wire and the server's check, applied."""
    msg = Message(wire.PUSH, "w", seq=state.version + 1, base_version=version,
                  tensors=dict(zip(state.names, grads, strict=True)))  # fmt: skip
    frames = [bytes(memoryview(f).cast("B")) for f in wire.encode(msg)]
    limits = wire.DEFAULT_LIMITS.for_payload(state.payload_bytes)
    state.apply(check_gradients(wire.decode(frames, limits), state))


def test_held_weights_give_each_worker_its_own_caches_and_a_pull_the_rows_of_its_batches(
    ctx: study._Context,
) -> None:
    """``n-fetch:2``: worker 0's pull brings the rows of both batches it serves at the pull's
    version; worker 1 (its own caches) computes on one of them and its push moves those rows;
    worker 0 then computes that batch on the rows of its pull, as a real worker between
    pulls does, and tops up none."""
    state = ParameterState(ctx.spec, OPTIMIZERS[MODEL], 0.01, seed=0)
    ctx.begin(state, parse_policy("async"), "n-fetch:2")
    w0, w1 = ctx.workers.worker(0), ctx.workers.worker(1)
    assert w0 is not w1 and w0.caches is not w1.caches
    stream = ctx.data.stream(0, 1, 0)
    version, weights = state.weights()
    x0, y0 = ctx.batch(stream, state, True, 0)
    assert len(w0.queue) == 1  # the second batch the pull serves, drawn ahead
    x1, y1 = w0.queue[0]
    at_pull = {i: state.gather(i, ids) for i, (ids, _) in _rows_of(w0, x1).items()}
    pulled = w0.rows_pulled
    _, grads = ctx.install(state, version, weights, x0, 0)(x0, y0)
    assert w0.rows_pulled == pulled  # the pull brought batch 0's rows too

    _, grads1 = ctx.install(state, version, weights, x1, 1)(x1, y1)  # worker 1, same batch
    _push(state, grads1, version)
    assert state.version == version + 1

    assert ctx.batch(stream, state, False, 0)[0] is x1  # no pull: the batch drawn ahead
    ctx.install(state, version, weights, x1, 0)  # held weights, of the older version
    assert w0.rows_pulled == pulled  # fetched at the pull: fresh enough for its version
    for i, (ids, rows) in _rows_of(w0, x1).items():
        np.testing.assert_array_equal(rows, at_pull[i])
        assert not np.array_equal(rows, state.gather(i, ids))  # worker 1's push moved them
    assert ctx.record()["rows_pulled"] == w0.rows_pulled + w1.rows_pulled


def test_bf16_pulls_give_a_worker_its_batches_rows_rounded_as_the_server_sends_them(
    ctx: study._Context,
) -> None:
    import ml_dtypes

    state = ParameterState(ctx.spec, OPTIMIZERS[MODEL], 0.01, seed=0)
    ctx.begin(state, parse_policy("async"), "bf16")
    stream = ctx.data.stream(0, 1, 0)
    x, _ = ctx.batch(stream, state, True, 0)
    ctx.install(state, *state.weights(), x, 0)
    worker = ctx.workers.worker(0)
    rounded = 0
    for i, (ids, rows) in _rows_of(worker, x).items():
        exact = state.gather(i, ids)
        np.testing.assert_array_equal(rows, exact.astype(ml_dtypes.bfloat16).astype(np.float32))
        rounded += not np.array_equal(rows, exact)
    assert rounded == 2  # the factor tables' random rows; the biases start at 0
    values = sum(int(np.prod(state.gather(t.var, ids).shape)) for t, ids in
                 zip(worker.plan.tables, worker.plan.batch_ids(x), strict=True))  # fmt: skip
    assert worker.row_bytes_pulled < 2.5 * values + 8 * worker.rows_pulled + 2000


def test_a_run_under_each_held_setting_learns_and_an_exact_bound_repeats_every(
    ctx: study._Context,
) -> None:
    """Short runs of 2 workers: ``adaptive`` with a bound every update passes pulls the
    weights through the wire at every step, and so repeats ``every``'s run exactly, rows and
    all; ``n-fetch:2`` pulls on every other step of each worker and still learns."""
    common = dict(policy="async", compress="none", lr=0.01, stop_at_target=False,
                  max_updates=30, max_gradients=60, target=0.99, eval_every=10,
                  apply_units=0.25, grad_s=0.0043, model=MODEL)  # fmt: skip
    runs = {f: study.simulate(study.Job(2, **common, fetch=f))
            for f in ("every", "adaptive:1e-9", "n-fetch:2")}  # fmt: skip
    assert not any("error" in r for r in runs.values()), runs
    every, wired, half = runs["every"], runs["adaptive:1e-9"], runs["n-fetch:2"]
    assert wired["curve"] == every["curve"] and wired["pulls_skipped"] == 0
    assert every["row_bytes_pulled"] > 0
    assert (wired["rows_pulled"], wired["row_bytes_pulled"]) == (
        every["rows_pulled"],
        every["row_bytes_pulled"],
    )
    assert half["pull_requests"] == sum((s + 1) // 2 for s in half["worker_steps"])
    assert half["rows_pulled"] > 0 and half["curve"] != every["curve"]
    assert half["curve"][-1][3] > half["curve"][0][3]  # it learns


def test_study_md_names_dynamic_tables_by_width_not_their_declared_rows() -> None:
    dense = {"parameters": 215306, "dynamic_tables": {}}
    assert study.model_size(dense) == "215,306 parameters"
    hashed = {"parameters": 1092, "dynamic_tables": {"a/embeddings": 16, "b/embeddings": 16}}
    assert study.model_size(hashed) == (
        "1,092 parameters outside 2 dynamic tables of 16-wide rows made on first touch"
    )
