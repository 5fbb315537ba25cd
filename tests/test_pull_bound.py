"""``--pull-bound B``: a worker takes new weights only when they moved by more than B of
their norm since the version it holds (``downpour.server.policies.movement``).

The estimate against the exact relative distance, the pull handler's answers (whole and
row pulls, another incarnation, bad bounds), and workers training with a bound in the
forms users write: one input, a list and a dict; a fixed and a dynamic table; one shard
and two; and under sync, where the bound is off and a notice says so.
"""

from __future__ import annotations

import contextlib
from typing import Any

import keras
import numpy as np
import pytest
from conftest import wait_until
from inproc import Services, WorkerThread, make_worker, serving
from test_server_handlers import grads, hello, make_ctx, offer, push, request
from tiny_models import embedding_form

from downpour import wire
from downpour.cli.status import fetch_status, render
from downpour.server.policies.movement import Movement
from downpour.spec import load_spec
from downpour.wire import Message


def test_the_sampled_distance_estimates_the_relative_distance() -> None:
    """Over a uniform sample of the elements the ratio of the sampled norms is within a few
    percent of the exact ``||w_now - w_have|| / ||w_now||``, whatever variable moved."""
    rng = np.random.default_rng(1)
    shapes = [(300, 200), (200,), (200, 50), (7,)]
    variables = [keras.Variable(rng.normal(size=s).astype(np.float32)) for s in shapes]
    movement = Movement(variables, sample_elements=8192, kept_versions=4)
    assert movement.measurable and movement.reads == 0
    movement.note(0)
    before = [v.numpy() for v in variables]
    for version, scale in enumerate((0.01, 0.05, 0.2), start=1):
        for v in variables:
            v.assign(v.numpy() + scale * rng.normal(size=v.shape).astype(np.float32))
        movement.note(version)
        movement.note(version)  # once per version
        now = [v.numpy() for v in variables]
        flat = np.concatenate([a.ravel() for a in now])
        exact = np.linalg.norm(flat - np.concatenate([b.ravel() for b in before])) / (
            np.linalg.norm(flat)
        )
        got = movement.moved(0, version)
        assert got == pytest.approx(exact, rel=0.05), (version, got, exact)
    assert movement.moved(3, 3) == 0.0
    assert movement.reads == 4
    movement.note(4)  # four kept: version 0 is forgotten
    assert movement.moved(0, 4) is None and movement.moved(1, 4) is not None
    assert movement.describe()["versions_kept"] == 4


@pytest.mark.parametrize("moving", [0, 1, 2])
def test_the_estimate_holds_when_one_variable_moves_alone(moving: int) -> None:
    """Each sampled element stands for its variable's share of the weights (a stratified
    sample): a small variable taken whole and a large one read in runs weigh as they do
    in the full norms, whichever of them moved."""
    rng = np.random.default_rng(2)
    shapes = [(500, 128), (200,), (65, 70)]  # runs by rows; whole; runs element by element
    variables = [keras.Variable(rng.normal(size=s).astype(np.float32)) for s in shapes]
    movement = Movement(variables, sample_elements=4096)
    assert [p is None for p in movement.plan] == [False, True, False]
    assert movement.sampled <= 4096 + 200  # the runs, and the small variable whole
    movement.note(0)
    before = np.concatenate([v.numpy().ravel() for v in variables])
    v = variables[moving]
    v.assign(v.numpy() + 0.3 * rng.normal(size=v.shape).astype(np.float32))
    movement.note(1)
    now = np.concatenate([v.numpy().ravel() for v in variables])
    exact = np.linalg.norm(now - before) / np.linalg.norm(now)
    assert movement.moved(0, 1) == pytest.approx(exact, rel=0.1), (moving, exact)


def test_nothing_to_measure_means_every_bounded_pull_is_served() -> None:
    ints = Movement([keras.Variable(np.zeros(4, np.int32))])
    assert not ints.measurable
    assert ints.within_bound(0, 3, 1.0) is None and ints.reads == 0
    assert ints.describe()["beyond"] == 1


def _pull(ctx: Any, have: int | None, bound: float | None, **kw: Any) -> Message:
    body = wire.PullRequest(have, ctx.incarnation if have is not None else None, bound=bound, **kw)
    return request(ctx, Message(wire.PULL, "w0", body=body.to_body()))


def test_the_pull_handler_keeps_the_held_version_while_the_weights_moved_within_the_bound() -> None:
    ctx = make_ctx(load_spec("tiny_models:tiny"))
    assert hello(ctx).type == wire.HELLO
    assert fetch_doc(ctx)["reads"] == 0
    for seq in (1, 2):
        assert offer(ctx, push(ctx, seq, tensors=grads(ctx, 0.01))).decision is not None
    first = _pull(ctx, 0, 1.0)  # no sample of version 0 (served without a bound): served
    assert not first.body.get("unchanged") and first.tensors and first.base_version == 2
    assert fetch_doc(ctx)["reads"] == 1 and fetch_doc(ctx)["beyond"] == 1
    assert offer(ctx, push(ctx, 3, tensors=grads(ctx, 0.01))).decision is not None
    held = _pull(ctx, 2, 1.0)  # moved a little since version 2: keep it
    assert held.body["unchanged"] and not held.tensors and held.base_version == 3
    assert 0 < held.body["moved"] <= 1.0
    tight = _pull(ctx, 2, held.body["moved"] / 2)  # moved more than this bound: served
    assert not tight.body.get("unchanged") and len(tight.tensors) == len(ctx.state.names)
    assert "moved" not in tight.body
    other = wire.PullRequest(2, "another-incarnation", bound=1.0)
    served = request(ctx, Message(wire.PULL, "w0", body=other.to_body()))
    assert served.tensors  # a version of another incarnation is never kept
    plain = _pull(ctx, 2, None)
    assert plain.tensors and "moved" not in plain.body
    doc = fetch_doc(ctx)
    assert (doc["within"], doc["beyond"], doc["versions_kept"]) == (1, 2, 2)  # measured ones
    assert doc["reads"] == 2  # versions 2 and 3, each once


def fetch_doc(ctx: Any) -> dict[str, Any]:
    from downpour.server.status_doc import build_status

    return build_status(ctx, now=0.0, started=0.0, started_wall=0.0)["pull_bounds"]


@pytest.mark.parametrize("bound", [-0.5, float("nan"), float("inf"), "0.1"])
def test_a_bad_bound_is_refused_as_bad_header(bound: Any) -> None:
    ctx = make_ctx(load_spec("tiny_models:tiny"))
    body = {"have": 0, "incarnation": ctx.incarnation, "bound": bound}
    reply = request(ctx, Message(wire.PULL, "w0", body=body))
    assert reply.type == wire.ERROR and reply.body["code"] == wire.R_HEADER
    assert "bound" in reply.body["message"]
    assert ctx.stats.rejected == {wire.R_HEADER: 1} and ctx.movement.reads == 0


def test_a_row_pull_within_the_bound_brings_the_rows_and_not_the_dense_variables() -> None:
    spec = embedding_form("tensor")
    ctx = make_ctx(spec)
    assert hello(ctx).type == wire.HELLO
    state = ctx.state
    table = next(n for n, s in zip(state.names, state.sparse, strict=True) if s)
    rows = {table: np.array([1, 5], np.int64)}
    sparse = np.zeros(state.shapes[state.index[table]], np.float32)
    sparse[5] = 0.1
    tensors = {
        n: np.full(s, 0.01, np.float32) for n, s in zip(state.names, state.shapes, strict=True)
    }
    tensors[table] = sparse

    def pull(have: int, bound: float | None) -> Message:
        body = wire.PullRequest(have, ctx.incarnation, bound=bound)
        return request(ctx, wire.pull_request("w0", body, rows))

    assert offer(ctx, push(ctx, 1, tensors=tensors)).decision is not None
    first = pull(0, 10.0)  # no sample of version 0: served, and version 1 sampled
    assert not first.body.get("unchanged") and set(first.tensors) == set(state.names)
    assert offer(ctx, push(ctx, 2, tensors=tensors)).decision is not None
    reply = pull(1, 10.0)
    assert reply.body["unchanged"] and 0 < reply.body["moved"] <= 10.0
    assert set(reply.tensors) == {table}  # the rows travel, the dense variables stay held
    np.testing.assert_array_equal(reply.tensors[table].indices, [1, 5])
    assert set(pull(1, None).tensors) == set(state.names)


FORMS = [
    ("tensor", False, 1),
    ("list", False, 2),
    ("dict", True, 1),
]


@pytest.mark.parametrize(
    ("form", "dynamic", "shards"),
    FORMS,
    ids=["tensor-fixed-1-shard", "list-fixed-2-shards", "dict-dynamic-1-shard"],
)
def test_a_worker_with_a_bound_computes_on_held_weights_and_still_learns(
    form: str, dynamic: bool, shards: int
) -> None:
    """With ``--pull-bound`` a worker's pulls come back "unchanged" while the weights moved
    less than the bound, so it computes on older weights, its tables' rows still travel,
    and the model learns: 4 classes, 0.68-0.77 held out here against 0.70-0.91 taking
    every version (the bound's cost, measured in docs/policies.md)."""
    spec = embedding_form(form, dynamic=dynamic)
    config = {"optimizer": "sgd", "learning_rate": 0.5}
    steps = 60
    with contextlib.ExitStack() as stack:
        servers = [
            stack.enter_context(serving(spec, num_shards=shards, shard=k, **config))
            for k in range(shards)
        ]
        ports = [s.port for s in servers]
        bounded = WorkerThread(
            make_worker(ports, spec, worker_id="w0", steps=steps, pull_bound=0.05)
        ).result(120)
        docs = [
            wait_until(
                lambda s=s: (d := fetch_status(s.status))["version"] == steps and d,
                30,
                "every push applied",
            )
            for s in servers
        ]
    assert bounded["pulls_within_bound"] > 0 and bounded["notices"] == []
    assert bounded["pulls_within_bound"] < bounded["pulls"]  # it moved past the bound too
    assert sum(d["pull_bounds"]["within"] for d in docs) > 0
    for doc in docs:  # a shard with dense weights samples them; one with rows only cannot
        bounds = doc["pull_bounds"]
        assert (bounds["reads"] > 0) == (bounds["dense_elements"] > 0) and bounds["beyond"] > 0
    assert bounded["held_out"] is not None and bounded["held_out"] > 0.6, bounded


def test_without_a_bound_nothing_is_sampled() -> None:
    spec = embedding_form("tensor")
    with serving(spec, optimizer="sgd", learning_rate=0.5) as server:
        s = WorkerThread(make_worker(server.port, spec, worker_id="w0", steps=10)).result(120)
        doc = fetch_status(server.status)
    assert s["pulls_within_bound"] == 0
    assert doc["pull_bounds"]["reads"] == 0 and doc["pull_bounds"]["within"] == 0


@pytest.mark.parametrize(
    ("policy", "why"),
    [
        ("sync:1/1", "counts versions"),
        ("ssp:2", "counts versions"),
        ("dense=sync:1/1,rows=async", "counts versions"),
        ("lookahead", "serves extrapolated weights"),
    ],
)
def test_where_the_bound_does_not_fit_it_is_off_and_a_notice_says_so(policy: str, why: str) -> None:
    spec = embedding_form("tensor")
    with serving(spec, policy=policy, optimizer="sgd", learning_rate=0.5) as server:
        s = WorkerThread(
            make_worker(server.port, spec, worker_id="w0", steps=6, pull_bound=0.5)
        ).result(120)
        doc = wait_until(
            lambda: (d := fetch_status(server.status))["workers"]["w0"]["notices"] and d,
            30,
            "the notice in the server's status",
        )
    (notice,) = s["notices"]
    assert notice == f"--pull-bound 0.5 is off: {policy} {why}; every new version is taken"
    assert doc["workers"]["w0"]["notices"] == [notice]
    assert s["pulls_within_bound"] == 0 and doc["pull_bounds"]["reads"] == 0
    assert s["sync_wait_timeouts"] == 0


def test_a_bounded_worker_process_and_its_server_agree_on_the_pulls_kept(
    services: Services,
) -> None:
    """``downpour worker --pull-bound`` against a server, in this process and as real
    processes: the worker's kept pulls are the server's ``within`` answers."""
    model = "tiny_models:embedding"
    server = services.server(model, optimizer="sgd", learning_rate=0.5)
    (s,) = services.train(server.port, 1, model, steps=60, pull_bound=0.05)
    doc = wait_until(
        lambda: (
            (d := fetch_status(server.status))["pull_bounds"]["within"] >= s["pulls_within_bound"]
            and d
        ),
        30,
        "the server's count of kept pulls",
    )
    assert s["pulls_within_bound"] > 0 and s["notices"] == []
    # a prefetched reply still in flight at the worker's stop is the server's only extra
    assert s["pulls_within_bound"] <= doc["pull_bounds"]["within"] <= s["pulls_within_bound"] + 1
    assert doc["workers"]["w0"]["reported"]["pulls_within_bound"] <= s["pulls_within_bound"]
    (line,) = [x for x in render(doc).splitlines() if x.startswith("pull bounds: ")]
    assert f"{doc['pull_bounds']['within']} pulls kept the held weights" in line


def test_a_refresh_after_a_stale_drop_and_a_row_top_up_carry_no_bound() -> None:
    """After the policy dropped a gradient as stale the worker takes the current weights
    whatever they moved, and a top-up asks for rows only: neither carries the bound."""
    spec = embedding_form("tensor")
    with serving(spec) as server:
        worker = make_worker(server.port, spec, worker_id="w0", steps=1, pull_bound=0.25)
        try:
            puller, shard = worker.puller, worker.shards.shards[0]
            assert puller.request(shard, -1).bound == 0.25  # the server keeps its sample
            assert puller.request(shard, 3).bound == 0.25
            assert puller.request(shard, 3, rows_only=True).bound is None
            puller._refresh = True
            assert puller.request(shard, 3).bound is None
        finally:
            worker.close()
