"""``make study``: staleness policies and gradient compression, trained to a held-out target.

The models (``--models``, ``study_models``): ``mnist`` as below; ``clicks``, the fixed-id
recommendation model; and ``clicks-hashed``, the hashed-id one, whose rows live in the
server's dynamic tables. Each recommendation model is trained to its one-process held-out
AUC minus 0.005 under the policy kinds that apply to it (``study_models.POLICY_KINDS``),
with a budget of its own; every ``runs`` row names its ``model``, and speed-ups are over the
same model's 1-worker run.

For 1, 2, 4 and 8 workers, every staleness policy (``async``, ``staleness-aware``,
``bounded:2``, ``ssp:2``, ``sync:K/N`` with K = N - N//4, ``dc-a:2``, ``gap-aware``,
``momentum-aware``, ``lookahead``) and every compression (``none``, ``bf16``,
``topk:0.01``; the last four policies without compression only): the applied updates,
gradients and simulated time to reach 96 % held-out accuracy on the fixed MNIST-5k split
(4,000 train / 1,000 held out, ``downpour.inputs.data.load_mnist_5k``), or the accuracy reached
within a cap, and the wall-clock speed-up over 1 worker. Writes ``study-results.json``
(top-level ``runs``: every run with ``workers``, ``policy``, ``compress``,
``sim_seconds_to_target``, ``speedup`` = 1 worker's simulated seconds over the run's and
``gradients_vs_1w``), ``study.md`` (the tables) and PNG plots into ``--out`` (default
``runs/study``).

How 8 workers run on 2 cores: a deterministic event simulation in one process per run,
built from the classes the real services use. The server is a real ``ParameterState``
(Adam, the compiled XLA apply step, the learning-rate input) and a real ``Policy`` from
``parse_policy``; each simulated worker is a real ``GradientStep`` computation on its own
data order (``batches`` here, seed 100 + i), compressed by its own real
``Compressor`` (error feedback kept per worker), encoded and decoded with ``downpour.wire``
exactly as on the wire and densified as the server does. What is simulated is only *time*:
worker i needs ``speed_i * lognormal(0, 0.2)`` gradient-times per step (``speed_i`` uniform
in [0.85, 1.15], all seeded), the server is a single queue that spends the measured
apply time per applied update (``--shards S``: S queues, one per model shard, each spending
its shard's measured apply time on its part of every push, in arrival order; a push is taken
when the last shard is done with it; the math is one state's, which is what S shards applying
the same pushes in the same order compute), and a worker pulls right after the server has
taken its push (like ``--no-prefetch``), then computes its next gradient from those
weights (``Job.fetch`` varies when workers pull and in what encoding: ``fetch_sim``). Under
``ssp:K`` that pull goes through the policy's ``pull_wait_ms`` (every worker alive): a
worker held there starts its next gradient when the slow ones have caught up. Under
``lookahead`` the pull gets the policy's ``pull_weights`` (the extrapolated weights), as
the server's pull handler serves them. A model with dynamic tables (``clicks-hashed``) has
its simulated workers pull the rows of each batch by id and push them keyed, through the
worker's own row cache and row plan, and is scored from the server's rows as serving scores
it (``study_hashed``). The staleness
of a gradient is therefore what W equally busy machines would produce (about W - 1), not
what two oversubscribed cores produce. A worker of a ``sync:K/N`` server (or of a hybrid
whose dense half is ``sync:K/N``) whose gradient was held waits for the round's update (as
``downpour worker`` does); a dropped gradient's worker
starts again from the current weights (the ``dropped_stale`` refresh). "Simulated seconds"
are that clock times the measured gradient time: the time W such machines would take.
Every run uses one TensorFlow thread, so it is reproducible; runs go two at a time.

A cross-check runs real processes (``downpour server`` with ``--eval-every`` and real
``downpour worker`` processes on 127.0.0.1) for a few set-ups, where staleness comes from
the operating system sharing 2 cores.

The study model is a smaller CNN than the default Deep-MNIST (see ``mnist_cnn``): the
default needs about 4x the compute per gradient and 15x the parameters per apply, and the
grid (4 worker counts x 4 policies x 3 compressions, each to 96 %) would not fit in 30
minutes on 2 cores. Same data, split, batch size (50) and optimizer (Adam, 1e-3).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import heapq
import json
import math
import multiprocessing
import os
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))  # the sibling bench modules
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from study_models import (  # noqa: E402 - the sibling module, on the path just set
    ALL_KINDS,
    AUC_SLACK,
    DATA,
    GRADIENTS_CAPS,
    MODELS,
    OPTIMIZERS,
    POLICY_KINDS,
    SPEC_REFS,
    SPEEDUP_TARGETS,
    budget,
    one_process_auc,
)

MODEL_REF = SPEC_REFS["mnist"]  # importable by spawned services with tests/bench on the path
_T0 = time.monotonic()


def log(msg: str) -> None:
    """A progress line on stderr with the seconds since the study started."""
    print(f"[{time.monotonic() - _T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- the model


def _cnn() -> Any:
    import keras

    layers = keras.layers
    inp = keras.Input((28, 28, 1), name="image")
    x = layers.Conv2D(16, 5, padding="same", activation="relu", name="conv1")(inp)
    x = layers.MaxPool2D(2, name="pool1")(x)
    x = layers.Conv2D(32, 5, padding="same", activation="relu", name="conv2")(x)
    x = layers.MaxPool2D(2, name="pool2")(x)
    x = layers.Flatten(name="flatten")(x)
    x = layers.Dense(128, activation="relu", name="fc1")(x)
    out = layers.Dense(10, name="logits")(x)
    return keras.Model(inp, out, name="study_cnn")


def mnist_cnn() -> Any:
    """The study's model plugin: conv 5x5x16 + pool, conv 5x5x32 + pool, dense 128, dense 10
    (215,306 parameters, 0.86 MB) on MNIST-5k (or ``--data-dir``), batch 50."""
    from downpour.inputs.data import load_mnist
    from downpour.spec import ModelSpec

    return ModelSpec(name="study_cnn", build=_cnn, load_data=load_mnist, batch_size=50)


# ---------------------------------------------------------------- plans


@dataclass(frozen=True)
class Plan:
    """What to run. ``baseline_updates``: 1-worker runs go that far whatever the accuracy
    (the compression deltas compare accuracy at that budget); other runs stop at the target
    or at ``max_updates`` applied updates / ``max_gradients`` computed gradients."""

    name: str
    workers: tuple[int, ...]
    compressions: tuple[str, ...]
    policy_kinds: tuple[str, ...]
    target: float
    eval_every: int
    max_updates: int
    max_gradients: int
    baseline_updates: int
    lr_variants: tuple[float, ...]  # extra runs of lr_variant_policy at the largest worker count
    cross_check: tuple[tuple[int, str], ...]  # real processes: (workers, policy)
    cross_check_updates: int
    jobs: int
    lr: float = 1e-3
    bounded_k: int = 2
    ssp_k: int = 2
    dc: str = "dc-a:2"  # the delay-compensation policy of the grid's "dc" kind
    lookahead: str = "lookahead"  # the look-ahead policy of the grid's "lookahead" kind
    # kinds run without compression only (the compression rows compare the older kinds)
    uncompressed_only: tuple[str, ...] = (
        "dc",
        "gap-aware",
        "momentum-aware",
        "lookahead",
        "hybrid",
    )
    lr_variant_policy: str = "staleness-aware"
    metric: str = "accuracy"  # what the target is of (the model's held-out metric)
    shards: int = 1  # model shards: the server is that many queues, one per shard (--shards)


PLANS = {
    "full": Plan(
        "full",
        (1, 2, 4, 8),
        ("none", "bf16", "topk:0.01"),
        (*ALL_KINDS, "hybrid"),
        0.96,
        20,
        1500,
        3000,
        1200,
        (2e-3, 4e-3, 8e-3),
        ((1, "async"), (4, "async"), (4, "staleness-aware")),
        600,
        2,
    ),
    "quick": Plan(
        "quick",
        (1, 8),
        ("none",),
        (*ALL_KINDS, "hybrid"),
        0.96,
        25,
        800,
        1600,
        400,
        (5e-4, 6e-4),
        ((1, "async"), (2, "momentum-aware"), (2, "lookahead")),
        500,
        2,
        lr_variant_policy="momentum-aware",
    ),
    "smoke": Plan(
        "smoke",
        (1, 2),
        ("none", "bf16"),
        ("sync", "ssp", "lookahead", "hybrid"),
        0.7,
        10,
        30,
        60,
        30,
        (),
        (),
        0,
        1,
    ),
}


def policy_for(kind: str, workers: int, plan: Plan) -> str:
    """The policy text of a kind at a worker count (sync: K = N - N//4, i.e. 25 % backups)."""
    if kind == "bounded":
        return f"bounded:{plan.bounded_k}"
    if kind == "ssp":
        return f"ssp:{plan.ssp_k}"
    if kind == "sync":
        return f"sync:{workers - workers // 4}/{workers}"
    if kind == "hybrid":
        return f"dense=sync:{workers - workers // 4}/{workers},rows=async"
    if kind == "dc":
        return plan.dc
    if kind == "lookahead":
        return plan.lookahead
    return kind


@dataclass(frozen=True)
class Job:
    """One simulated run."""

    workers: int
    policy: str
    compress: str
    lr: float
    stop_at_target: bool
    max_updates: int
    max_gradients: int
    target: float
    eval_every: int
    apply_units: float  # the server's apply time in gradient-times (measured once)
    grad_s: float  # measured seconds per gradient (converts the clock to seconds)
    variant: str = ""  # "" for the grid; e.g. "lr" for the learning-rate variants
    seed: int = 0  # > 0: other data orders and worker speeds (the grid's runs use 0)
    model: str = "mnist"  # a study_models.MODELS name
    fetch: str = "every"  # when workers pull and in what encoding (fetch_sim.parse_fetch)
    # model shards: each shard's apply time in gradient-times (its own queue); () = one server
    # whose apply takes apply_units
    shard_units: tuple[float, ...] = ()

    def label(self) -> str:
        """A short name for logs."""
        extra = f" lr={self.lr:g}" if self.variant else ""
        extra += f" fetch={self.fetch}" if self.fetch != "every" else ""
        extra += f" shards={len(self.shard_units)}" if self.shard_units else ""
        return f"{self.model} {self.workers}w {self.policy} {self.compress}{extra}"


# ---------------------------------------------------------------- the simulation


class _Context:
    """Per process and model: the spec, data (``study_models.Loaded``) and one compiled
    gradient step (reused by runs); for a model with dynamic tables, the workers' row pulls
    and the scoring from the server's rows (``study_hashed.HashedWorkers``)."""

    def __init__(self, model: str) -> None:
        from study_hashed import HashedWorker, HashedWorkers
        from study_models import DYNAMIC_MODELS, LOADERS, SPEC_REFS

        from downpour.model.build import build_model
        from downpour.spec import load_spec
        from downpour.worker.step import GradientStep

        self.spec = load_spec(SPEC_REFS[model])
        self.data = LOADERS[model](self.spec)
        self.rows: HashedWorker | None = None
        self.workers: HashedWorkers | None = None
        if model in DYNAMIC_MODELS:
            self.rows = HashedWorker(self.spec, self.data.element_spec)
            self.workers = HashedWorkers(self.rows, self.data.element_spec)
            self.model, self.step = self.rows.model, self.rows.step
        else:
            self.model = build_model(self.spec, seed=0)
            self.step = GradientStep(self.spec, self.model, self.data.element_spec)

    def begin(self, state: Any, policy: Any, fetch: str = "every") -> None:
        """A run on ``state`` under ``policy`` starts (the row caches start empty)."""
        if self.workers is not None:
            self.workers.begin(state, policy, fetch)

    def batch(
        self, stream: Iterator[tuple[Any, Any]], state: Any, pulled: bool, worker: int = 0
    ) -> tuple[Any, Any]:
        """Worker ``worker``'s next batch from its ``stream`` (``pulled``: it sent a pull for
        this step, which a model with dynamic tables answers with rows too)."""
        if self.workers is not None:
            return self.workers.worker(worker).batch(stream, state, pulled)
        return next(stream)

    def install(self, state: Any, version: int, weights: list[Any], x: Any, worker: int = 0) -> Any:
        """The weights a worker pulled (``version``) into its step, before its gradient on
        features ``x`` (a model with dynamic tables: and the batch's rows from ``state``);
        the step to compute it with."""
        if self.workers is not None:
            return self.workers.worker(worker).install(state, version, weights, x)
        self.step.set_weights(weights)
        return self.step

    def record(self) -> dict[str, int]:
        """The run's row-pull figures (a model with dynamic tables; else none)."""
        return self.workers.record() if self.workers is not None else {}

    def score(self, state: Any) -> float:
        """The held-out metric of ``state``'s weights."""
        if self.rows is not None:
            held, _ = self.data.held_out
            return self.rows.score(state, held)
        return float(state.evaluate(*self.data.held_out))


_CTX: dict[str, _Context] = {}


def _init_process() -> None:
    """One TensorFlow thread per process: reproducible, and two runs share 2 cores."""
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)


def _context(model: str = "mnist") -> _Context:
    if model not in _CTX:
        _CTX[model] = _Context(model)
    return _CTX[model]


# batches trained before a model's costs are timed: a model with dynamic tables, until its
# tables hold about as many rows as a run's (one epoch of 859 batches fills them to ~3/4 of
# it); its apply costs more as the tables fill (a new id is created, the id index is
# larger). Other models' costs do not depend on what was trained.
COST_WARMUP = {"clicks-hashed": 400}


def measure_costs(reps: int = 20, model: str = "mnist", shards: int = 1) -> dict[str, float]:
    """Median seconds of one gradient (one batch) and one apply of a study model (a model
    with dynamic tables: the gradient's time includes pulling its batch's rows); with
    ``shards`` > 1 also each shard's apply of its part (a real shard's ``ParameterState`` fed
    ``Partition.split`` of the same gradients), in gradient-times. Each gradient is of the
    next batch of one worker's stream, on the weights the previous applies made, after
    ``COST_WARMUP`` batches (default 5) trained the same way untimed."""
    from downpour.server.policies.base import parse_policy
    from downpour.server.state import ParameterState

    ctx = _context(model)
    state = ParameterState(ctx.spec, OPTIMIZERS[model], 1e-3, seed=0)
    ctx.begin(state, parse_policy("async"))
    parts = [
        ParameterState(ctx.spec, OPTIMIZERS[model], 1e-3, seed=0, shard=k, num_shards=shards)
        for k in range(shards if shards > 1 else 0)
    ]
    stream = ctx.data.stream(0, 1, 0)
    warmup = COST_WARMUP.get(model, 5)
    grads, ts_g, ts_a = None, [], []
    ts_s: list[list[float]] = [[] for _ in parts]
    for i in range(reps + warmup):
        t = time.perf_counter()
        x, y = ctx.batch(stream, state, True)  # with a dynamic model's rows of the batch
        step = ctx.install(state, *state.weights(), x)
        _, grads = step(x, y)
        tg = time.perf_counter() - t
        t = time.perf_counter()
        state.apply(grads)
        ta = time.perf_counter() - t
        for k, piece in enumerate(parts[0].partition.split(grads) if parts else []):
            t = time.perf_counter()
            parts[k].apply(piece)
            if i >= warmup:
                ts_s[k].append(time.perf_counter() - t)
        if i >= warmup:
            ts_g.append(tg)
            ts_a.append(ta)
    grad_s, apply_s = statistics.median(ts_g), statistics.median(ts_a)
    out: dict[str, Any] = {
        "grad_ms": round(1e3 * grad_s, 2),
        "apply_ms": round(1e3 * apply_s, 2),
        "apply_units": round(apply_s / grad_s, 2),
        "grad_s": grad_s,
        "warmup_batches": warmup,
    }
    if parts:
        shard_s = [statistics.median(ts) for ts in ts_s]
        out["shards"] = shards
        out["shard_apply_ms"] = [round(1e3 * t, 3) for t in shard_s]
        out["shard_apply_units"] = [round(t / grad_s, 3) for t in shard_s]
    return out


def one_process_server_optimizer(model: str, updates: int, lr: float) -> dict[str, Any]:
    """The one-process reference under a row-wise optimizer Keras has no form of
    (``lazy_adam``): the 1-worker run's first ``updates`` batches trained in order in this
    process through the server's own optimizer (``ParameterState``), no wire, no staleness;
    its held-out metric (a model with dynamic tables: each batch's rows pulled from the state
    first, as the simulated workers pull them)."""
    from downpour.server.policies.base import parse_policy
    from downpour.server.state import ParameterState

    started = time.monotonic()
    ctx = _context(model)
    state = ParameterState(ctx.spec, OPTIMIZERS[model], lr, seed=0)
    ctx.begin(state, parse_policy("async"))
    stream = ctx.data.stream(0, 1, 0)
    for _ in range(updates):
        x, y = next(stream)
        ctx.install(state, *state.weights(), x)
        _, grads = ctx.step(x, y)
        state.apply(grads)
    return {
        "auc": round(ctx.score(state), 5),
        "updates": updates,
        "lr": lr,
        "optimizer": OPTIMIZERS[model],
        "seconds": round(time.monotonic() - started, 1),
    }


def _distance(a: list[Any], b: list[Any]) -> float:
    """``||a - b||`` over every array of two weight lists."""
    return math.sqrt(
        sum(float(((x - y).astype("float64") ** 2).sum()) for x, y in zip(a, b, strict=True))
    )


def simulate(job: Job) -> dict[str, Any]:
    """Run one simulated training (see the module docstring); the run's record."""
    import numpy as np
    from fetch_sim import Pulls

    from downpour import wire
    from downpour.server.handlers import check_gradients
    from downpour.server.policies.base import APPLY, HOLD, SyncPolicy, parse_policy
    from downpour.server.state import ParameterState
    from downpour.wire import Message
    from downpour.worker.compress import parse_compression

    started = time.monotonic()
    ctx = _context(job.model)
    spec, data = ctx.spec, ctx.data
    state = ParameterState(spec, OPTIMIZERS[job.model], job.lr, seed=0)
    policy = parse_policy(job.policy)
    policy.layout(state.sparse)  # as the server's handler context: which variables are rows
    ctx.begin(state, policy, job.fetch)  # dynamic tables: what their server refuses, refused
    keep_sparse = not isinstance(policy, SyncPolicy)  # as the server's gradient handler
    w = job.workers
    compressors = [parse_compression(job.compress) for _ in range(w)]
    streams = [data.stream(i, w, job.seed) for i in range(w)]
    rng = np.random.default_rng(1000 + w + 7919 * job.seed)
    speed = rng.uniform(0.85, 1.15, w) if w > 1 else np.ones(1)
    limits = wire.DEFAULT_LIMITS.for_payload(state.payload_bytes)
    names = state.names
    pulls = Pulls(job.fetch, w, names, limits)  # which weights each worker computes on
    refresh: set[int] = set()  # workers held (sync) or dropped: they pull whatever the fetch

    heap: list[tuple[float, int, int, list[bytes]]] = []
    seqs = [0] * w
    order = 0
    gradients = 0
    raw_bytes = sent_bytes = 0
    staleness: list[int] = []
    served: dict[int, tuple[list[Any], list[Any]]] = {}  # lookahead: worker -> (w_v, pulled)
    gaps: list[tuple[float, float]] = []  # lookahead: the two distances to the apply weights

    def start(i: int, t: float) -> None:
        """Worker i pulls the current weights at clock t and computes its next gradient."""
        nonlocal order, gradients, raw_bytes, sent_bytes
        version, weights = state.weights()
        if policy.caps.extrapolates:  # as the server's pull handler: lookahead
            served[i] = (weights, policy.pull_weights(version, weights))
            weights = served[i][1]
        asked = pulls.requests
        version, weights = pulls.take(i, version, weights, i in refresh)
        refresh.discard(i)
        x, y = ctx.batch(streams[i], state, pulls.requests > asked, i)  # and a pull's rows
        step = ctx.install(state, version, weights, x, i)  # dynamic tables: the batch's rows
        _, grads = step(x, y)
        gradients += 1
        comp = compressors[i]
        raw0, sent0 = comp.raw_bytes, comp.sent_bytes
        encoded = comp.compress(grads)
        seqs[i] += 1
        msg = Message(
            wire.PUSH,
            f"w{i}",
            seq=seqs[i],
            base_version=version,
            tensors=dict(zip(names, encoded, strict=True)),
        )
        frames = [bytes(memoryview(f).cast("B")) for f in wire.encode(msg)]  # the network
        n = sum(len(f) for f in frames)
        sent_bytes += n
        raw_bytes += n - (comp.sent_bytes - sent0) + (comp.raw_bytes - raw0)
        order += 1
        heapq.heappush(heap, (t + float(speed[i] * rng.lognormal(0.0, 0.2)), order, i, frames))

    curve: list[list[float]] = []

    def row_bytes() -> int:
        """The bytes of the row pulls so far (a model with dynamic tables; else 0)."""
        return ctx.record().get("row_bytes_pulled", 0)

    def evaluate(clock: float) -> float:
        acc = ctx.score(state)
        curve.append([state.version, gradients, round(clock * job.grad_s, 3), acc])
        return acc

    everyone = {f"w{i}" for i in range(w)}
    ssp_held: list[int] = []  # ssp: workers whose pull the policy holds

    def pull(i: int, t: float) -> None:
        """Worker i's pull at clock t: served (it starts its next gradient) or held."""
        if policy.caps.holds_pulls and policy.pull_wait_ms(f"w{i}", 0, everyone) > 0:
            ssp_held.append(i)
        else:
            start(i, t)

    evaluate(0.0)
    for i in range(w):
        pull(i, 0.0)
    units = job.shard_units or (job.apply_units,)
    shard_free = [0.0] * len(units)  # when each shard's queue is next free

    def take(t: float, charged: bool) -> float:
        """Every shard takes a push that arrived at clock t, in arrival order, applying its
        part (``charged``) or not (held, dropped); when the last shard is done with it."""
        for k, u in enumerate(units):
            shard_free[k] = max(t, shard_free[k]) + (u if charged else 0.0)
        return max(shard_free)

    server_free = 0.0
    waiting: list[int] = []
    reached: dict[str, Any] | None = None
    evaluated = 0  # the version of the last evaluation
    while True:
        t, _, i, frames = heapq.heappop(heap)
        msg = wire.decode(frames, limits)
        grads = check_gradients(msg, state, keep_sparse)  # row gradients stay rows
        if policy.caps.needs_weights:  # as the server's handler: dc, gap-aware
            policy.observe(state.version, state.weights()[1])
        if policy.caps.extrapolates:  # how far from the weights it lands on, pulled vs served
            now = state.weights()[1]
            pulled, extrapolated = served[i]
            gaps.append((_distance(pulled, now), _distance(extrapolated, now)))
        d = policy.offer(grads, msg.base_version, state.version, msg.sender)
        rows_applied = d.rows is not None and d.rows.action == APPLY
        if rows_applied:  # hybrid: its rows half first, one version step of its own
            assert d.rows is not None and d.rows.grads is not None
            state.apply(d.rows.grads, d.rows.lr_scale, d.rows.part)
        if d.action == APPLY:
            assert d.grads is not None
            if d.momentum is not None:  # as the server's apply_decision: momentum-aware
                state.set_momentum(d.momentum)
            state.apply(d.grads, d.lr_scale, d.part)
            staleness.append(d.staleness)
            server_free = take(t, True)
            resume, waiting = [*waiting, i], []
        elif d.action == HOLD:  # sync, or a hybrid's sync dense half: wait for the round
            server_free = take(t, rows_applied)
            waiting.append(i)
            refresh.add(i)
            resume = []
        else:  # dropped: the worker refreshes and goes on
            server_free = take(t, rows_applied)
            refresh.add(i)
            resume = [i]
        stop = False
        if state.version // job.eval_every > evaluated // job.eval_every:
            evaluated = state.version  # a hybrid push may move the version by two
            acc = evaluate(server_free)
            if reached is None and acc >= job.target:
                reached = {"updates": state.version, "gradients": gradients}
                reached["bytes_pulled"] = pulls.bytes_pulled + row_bytes()
                reached["sim_seconds"] = round(server_free * job.grad_s, 3)
                stop = job.stop_at_target
            stop = stop or state.version >= job.max_updates
        if gradients >= job.max_gradients:
            stop = True
        if stop:
            if curve[-1][0] != state.version:
                evaluate(server_free)
            break
        again, ssp_held[:] = list(ssp_held), []
        for j in [*again, *resume]:  # a held pull is asked again once the clocks moved
            pull(j, server_free)
    accs = [c[3] for c in curve]
    tail = accs[-5:]
    return {
        "model": job.model,
        "workers": w,
        "policy": job.policy,
        "compress": job.compress,
        "lr": job.lr,
        "variant": job.variant,
        "seed": job.seed,
        "shards": len(job.shard_units) or 1,
        "kind": "simulated",
        "reached": reached is not None,
        "updates_to_target": reached["updates"] if reached else None,
        "gradients_to_target": reached["gradients"] if reached else None,
        "sim_seconds_to_target": reached["sim_seconds"] if reached else None,
        "updates": state.version,
        "gradients": gradients,
        "final_accuracy": accs[-1],
        "best_accuracy": max(accs),
        "tail_mean_accuracy": round(sum(tail) / len(tail), 4),
        "staleness_mean": round(float(np.mean(staleness)), 3) if staleness else 0.0,
        "staleness_max": int(max(staleness)) if staleness else 0,
        "policy_counters": dict(policy.describe()["counters"]),  # a hybrid's halves too
        "bytes_raw": raw_bytes,
        "bytes_sent": sent_bytes,
        "bytes_ratio": round(raw_bytes / sent_bytes, 2) if sent_bytes else None,
        # lookahead: mean ||w_served - w_apply|| / mean ||w_v - w_apply|| (1: no closer)
        "lookahead_gap_ratio": (
            round(sum(g[1] for g in gaps) / sum(g[0] for g in gaps), 3)
            if gaps and sum(g[0] for g in gaps) > 0
            else None
        ),
        **pulls.record(),
        **ctx.record(),
        "bytes_pulled_to_target": reached["bytes_pulled"] if reached else None,
        "run_seconds": round(time.monotonic() - started, 1),
        "curve": curve,
    }


def _run_job(job: Job) -> dict[str, Any]:
    """Pool entry point: a run, or its error as a record (the study goes on)."""
    try:
        return simulate(job)
    except Exception as exc:  # one broken run must not lose the others
        import traceback

        return {
            **asdict(job),
            "kind": "simulated",
            "error": repr(exc),
            "trace": traceback.format_exc(),
        }


def jobs_for(plan: Plan, costs: dict[str, float], model: str = "mnist") -> list[Job]:
    """The grid of one model: 1-worker runs once per compression (every policy is identical
    with one worker: staleness is always 0), every policy at the other worker counts, and the
    learning-rate variants of staleness-aware at the largest worker count."""
    common = {
        "target": plan.target,
        "eval_every": plan.eval_every,
        "apply_units": costs["apply_units"],
        "grad_s": costs["grad_s"],
        "model": model,
        "shard_units": tuple(costs.get("shard_apply_units", ())),
    }
    out = []
    for c in plan.compressions:
        for w in plan.workers:
            if w == 1:
                out.append(
                    Job(1, "async", c, plan.lr, False, plan.baseline_updates, 10**9, **common)
                )
                continue
            for kind in plan.policy_kinds:
                if c != "none" and kind in plan.uncompressed_only:
                    continue
                out.append(
                    Job(
                        w,
                        policy_for(kind, w, plan),
                        c,
                        plan.lr,
                        True,
                        plan.max_updates,
                        plan.max_gradients,
                        **common,
                    )
                )
    top = max(plan.workers)
    for lr in plan.lr_variants:
        out.append(
            Job(
                top,
                plan.lr_variant_policy,
                "none",
                lr,
                True,
                plan.max_updates,
                plan.max_gradients,
                variant="lr",
                **common,
            )
        )
    return out


def run_grid(n_jobs: int, jobs: list[Job]) -> list[dict[str, Any]]:
    """Every job (longest first: the 8-worker runs, so the processes finish together),
    ``n_jobs`` processes at a time (1: in this process)."""
    results: list[dict[str, Any]] = []
    jobs = sorted(jobs, key=lambda j: -j.workers)

    def note(r: dict[str, Any]) -> None:
        results.append(r)
        if "error" in r:
            log(f"FAILED {r['model']} {r['workers']}w {r['policy']} {r['compress']}: {r['error']}")
            return
        got = f"{r['updates_to_target']} updates" if r["reached"] else "not reached"
        fetch = f" fetch={r['fetch']}" if r.get("fetch", "every") != "every" else ""
        log(
            f"{len(results)}/{len(jobs)} {r['model']} {r['workers']}w {r['policy']} "
            f"{r['compress']} lr={r['lr']:g}{fetch}: target {got}; final {r['final_accuracy']:.3f} "
            f"after {r['updates']} updates / {r['gradients']} gradients ({r['run_seconds']} s)"
        )

    if n_jobs <= 1:
        for job in jobs:
            note(_run_job(job))
        return results
    mp = multiprocessing.get_context("spawn")
    with cf.ProcessPoolExecutor(n_jobs, mp_context=mp, initializer=_init_process) as pool:
        for fut in cf.as_completed([pool.submit(_run_job, j) for j in jobs]):
            note(fut.result())
    return results


# ---------------------------------------------------------------- real processes


def cross_check(plan: Plan, workers: int, policy: str, out: Path) -> dict[str, Any]:
    """Real ``downpour server`` and ``downpour worker`` processes on 127.0.0.1: held-out
    accuracy (the server's ``--eval-every``) against applied updates until the target or
    ``plan.cross_check_updates`` updates."""
    from bench_util import Procs, service_args, start_server

    from downpour.cli.status import fetch_status

    logs = out / "cross-check-logs" / f"{workers}w-{policy}"
    logs.mkdir(parents=True, exist_ok=True)
    with Procs(logs, stop_timeout_s=30.0) as procs:  # stops every process it started on exit
        _server, info = start_server(
            procs,
            "server",
            settings={"model": MODEL_REF, "policy": policy, "eval_every": plan.eval_every},
        )
        status = f"tcp://127.0.0.1:{info['status_port']}"
        steps = math.ceil(plan.cross_check_updates / workers) + plan.eval_every
        started = time.time()
        workers_procs = [
            procs.start(
                service_args(
                    "worker", server=f"127.0.0.1:{info['port']}", model=MODEL_REF, id=f"w{i}",
                    seed=100 + i, steps=steps, log_every=0,
                ),
                f"w{i}",
            )[0]
            for i in range(workers)
        ]  # fmt: skip
        curve: list[list[float]] = []
        reached = None
        first_update: float | None = None
        deadline = time.monotonic() + 900
        done_at: float | None = None  # when the workers finished or the update cap was hit
        last_count = -1
        doc: dict[str, Any] = {}
        while time.monotonic() < deadline:
            doc = fetch_status(status)
            if first_update is None and doc["version"] > 0:
                first_update = time.time()
            ev = doc.get("eval")
            if ev and ev["count"] != last_count:
                last_count = ev["count"]
                at = round(ev["time"] - started, 2)
                curve.append([ev["version"], None, at, ev["accuracy"]])
                if ev["accuracy"] >= plan.target:
                    reached = {"updates": ev["version"], "seconds": at}
                    break
            finished = all(p.poll() is not None for p in workers_procs)
            if done_at is None and (finished or doc["version"] >= plan.cross_check_updates):
                done_at = time.monotonic()
            if done_at is not None and time.monotonic() - done_at > 30:
                break  # the last evaluation has had its time
            time.sleep(0.1)  # polling a status socket at a bounded rate, not a guessed wait
        st = doc.get("staleness") or {}
        return {
            "workers": workers,
            "policy": policy,
            "compress": "none",
            "lr": plan.lr,
            "kind": "processes",
            "reached": reached is not None,
            "updates_to_target": reached["updates"] if reached else None,
            "seconds_to_target": reached["seconds"] if reached else None,
            "startup_seconds": round(first_update - started, 2) if first_update else None,
            "updates": doc.get("version"),
            "final_accuracy": curve[-1][3] if curve else None,
            "best_accuracy": max((c[3] for c in curve), default=None),
            "staleness_mean": round(st.get("mean", 0.0), 3),
            "staleness_max": st.get("max"),
            "policy_counters": (doc.get("policy") or {}).get("counters"),
            "curve": curve,
        }


# ---------------------------------------------------------------- report


def _fmt(v: Any, nd: int = 3) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return str(v)


def _count(counters: dict[str, int], key: str) -> int:
    """A policy counter; a hybrid policy's is the sum of its halves' (``dense_``, ``rows_``)."""
    if key in counters:
        return counters[key]
    return counters.get(f"dense_{key}", 0) + counters.get(f"rows_{key}", 0)


ASYNC_FAMILY_EXCLUDES = ("sync",)  # the kinds reported beside the target, not for it


def target_text(target: float, metric: str) -> str:
    """A target as the tables say it: ``96%`` (accuracy), ``AUC 0.7364``."""
    return f"{target:.0%}" if metric == "accuracy" else f"{metric.upper()} {target:.4f}"


def add_speedups(runs: list[dict[str, Any]], cross: list[dict[str, Any]]) -> None:
    """Every run gets ``speedup`` (1 worker's simulated seconds to the target over this
    run's, same model and compression) and ``gradients_vs_1w`` (gradients to the target over
    1 worker's); None where either run missed the target. Cross-check runs get ``speedup``
    from their seconds to the target against the 1-worker process run."""
    base = {
        (r["model"], r["compress"]): r
        for r in runs
        if "error" not in r and r["workers"] == 1 and not r.get("variant") and r["reached"]
    }
    for r in runs:
        if "error" in r:
            continue
        b = base.get((r["model"], r["compress"]))
        ok = b is not None and r["reached"] and r["sim_seconds_to_target"]
        r["speedup"] = (
            round(b["sim_seconds_to_target"] / r["sim_seconds_to_target"], 3) if ok else None
        )
        r["gradients_vs_1w"] = (
            round(r["gradients_to_target"] / b["gradients_to_target"], 3) if ok else None
        )
    one = next((r for r in cross if "error" not in r and r["workers"] == 1 and r["reached"]), None)
    for r in cross:
        if "error" in r:
            continue
        ok = one is not None and r["reached"] and r["seconds_to_target"]
        r["speedup"] = round(one["seconds_to_target"] / r["seconds_to_target"], 3) if ok else None


def kind_of(policy: str) -> str:
    """The grid's kind of a policy text (``bounded:2`` -> ``bounded``, ``dc-a:2`` -> ``dc``,
    ``momentum-aware+lookahead`` -> ``lookahead``)."""
    if "lookahead" in policy:
        return "lookahead"
    head = policy.split(":")[0]
    return "dc" if head in ("dc", "dc-a") else head


def summarise(plan: Plan, runs: list[dict[str, Any]], model: str = "mnist") -> dict[str, Any]:
    """The headline figures of one model's runs: the 8-worker target (at most 1/x of 1
    worker's simulated time, ``SPEEDUP_TARGETS``, within the gradient cap, ``GRADIENTS_CAPS``)
    and the compression deltas."""
    ok = [r for r in runs if "error" not in r and not r.get("variant") and r["model"] == model]
    speedup_target, cap = SPEEDUP_TARGETS[model], GRADIENTS_CAPS[model]

    def find(w: int, kind: str, c: str) -> dict[str, Any] | None:
        pol = "async" if w == 1 else policy_for(kind, w, plan)
        return next(
            (r for r in ok if r["workers"] == w and r["policy"] == pol and r["compress"] == c),
            None,
        )

    out: dict[str, Any] = {"target": plan.target, "target_speedup": speedup_target}
    if cap is not None:
        out["target_gradients_vs_1w"] = cap
    base = find(1, "async", "none")
    top = max(plan.workers)
    for kind in plan.policy_kinds:
        r = find(top, kind, "none")
        key = f"{top}w_{kind}"
        if r and base and r["reached"] and base["updates_to_target"]:
            out[f"{key}_updates_ratio"] = round(
                r["updates_to_target"] / base["updates_to_target"], 3
            )
        else:
            out[f"{key}_updates_ratio"] = None
    if base:
        out["1w_updates_to_target"] = base["updates_to_target"]
    speedups: dict[str, dict[str, float | None]] = {}
    for r in ok:
        if r["compress"] == "none" and r["workers"] > 1:
            speedups.setdefault(r["policy"], {})[str(r["workers"])] = r.get("speedup")
    out["speedup_none"] = speedups
    family = [
        r
        for r in ok
        if r["workers"] == top
        and r["compress"] == "none"
        and kind_of(r["policy"]) not in ASYNC_FAMILY_EXCLUDES
        and r.get("speedup")
    ]
    eligible = [r for r in family if cap is None or r["gradients_vs_1w"] <= cap]
    best = max(eligible or family, key=lambda r: r["speedup"], default=None)
    if best is not None:
        out[f"{top}w_best_async_family"] = {
            k: best[k] for k in ("policy", "speedup", "gradients_vs_1w", "sim_seconds_to_target")
        }
    out["target_met"] = bool(
        top == 8
        and best is not None
        and best["speedup"] >= speedup_target
        and (cap is None or best["gradients_vs_1w"] <= cap)
    )
    for c in plan.compressions:
        r = find(1, "async", c)
        if r and base and c != "none":
            tag = c.split(":")[0]
            out[f"{tag}_bytes_ratio"] = r["bytes_ratio"]
            # 1 worker, after the same number of updates: the mean of the last 5 evaluations
            out[f"{tag}_accuracy_delta_points"] = round(
                100 * (base["tail_mean_accuracy"] - r["tail_mean_accuracy"]), 2
            )
            out[f"{tag}_1w_updates_to_target"] = r["updates_to_target"]
    variants = [
        r for r in runs if r.get("variant") == "lr" and "error" not in r and r["model"] == model
    ]
    if variants and base and base["updates_to_target"]:
        out[f"{plan.lr_variant_policy}_lr_variants"] = {
            f"{r['lr']:g}": (
                round(r["updates_to_target"] / base["updates_to_target"], 3)
                if r["reached"]
                else None
            )
            for r in sorted(variants, key=lambda r: r["lr"])
        }
    return out


def speedup_table(plan: dict[str, Any], runs: list[dict[str, Any]]) -> list[str]:
    """Markdown lines: per policy (rows) and worker count (columns), no compression, the
    simulated seconds to the target, the speed-up over 1 worker and the gradients x 1w."""
    sims = [r for r in runs if r["kind"] == "simulated" and not r.get("variant")]
    base = next((r for r in sims if r["workers"] == 1 and r["compress"] == "none"), None)
    if base is None:
        return []
    ws = [w for w in plan["workers"] if w > 1]
    lines = [
        "",
        "Wall-clock speed-up, no compression: simulated seconds to "
        f"{target_text(plan['target'], plan.get('metric', 'accuracy'))} (speed-up over 1 worker's "
        f"{_fmt(base['sim_seconds_to_target'], 1)} s, gradients x 1 worker's "
        f"{_fmt(base['gradients_to_target'])}); — = not reached:",
        "",
        "| policy | " + " | ".join(f"{w} workers" for w in ws) + " |",
        "|---|" + "---:|" * len(ws),
    ]
    for kind in plan["policy_kinds"]:
        cells = []
        for w in ws:
            pol = policy_for_text(kind, w, plan)
            r = next(
                (r for r in sims if (r["workers"], r["policy"], r["compress"]) == (w, pol, "none")),
                None,
            )
            if r is None or not r.get("speedup"):
                cells.append("—")
            else:
                cells.append(
                    f"{r['sim_seconds_to_target']:.1f} s ({r['speedup']:.1f}x, "
                    f"{r['gradients_vs_1w']:.2f}x grads)"
                )
        label = "sync:K/N (K = N - N//4)" if kind == "sync" else policy_for_text(kind, 8, plan)
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def model_view(doc: dict[str, Any], model: str) -> dict[str, Any]:
    """One model's part of a results document, shaped as a one-model document: its
    ``plan``, ``costs``, ``model``, ``summary`` ..., its runs and (MNIST) the cross-check."""
    return {
        **doc,
        **doc["models"][model],
        "runs": [r for r in doc["runs"] if r["model"] == model],
        "cross_check": [r for r in doc.get("cross_check") or [] if r["model"] == model],
    }


def by_model(doc: dict[str, Any]) -> dict[str, Any]:
    """A results document in the per-model layout; one written before the study had more
    than the MNIST model becomes its ``mnist`` part."""
    if "models" in doc:
        return doc
    keys = ("model", "data", "plan", "costs", "summary")
    for r in (*doc["runs"], *(doc.get("cross_check") or [])):
        r.setdefault("model", "mnist")
    part = {k: doc[k] for k in keys}
    part["summary"].setdefault("target_speedup", SPEEDUP_TARGETS["mnist"])
    return {**doc, "plan_name": doc["plan"]["name"], "models": {"mnist": part}}


def write_markdown(doc: dict[str, Any], path: Path) -> None:
    """study.md: how it was run, then per model its grid table, the cross-check and the
    headline figures."""
    lines = [
        f"# Convergence study ({doc['plan_name']} plan), {doc['date']}",
        "",
        f"Machine: {doc['machine']['summary']}, no GPU. Command: `{doc['command']}` "
        f"({doc['total_seconds'] / 60:.1f} min). Simulated runs (see `tests/bench/study.py`): "
        "real ParameterState, Policy, GradientStep, Compressor and wire encoding; simulated "
        "time (W parallel machines).",
    ]
    for model in doc["models"]:
        lines += ["", *model_markdown(model_view(doc, model))]
    path.write_text("\n".join(lines))


def model_size(model: dict[str, Any]) -> str:
    """A model's size for study.md: its fixed parameters, and its dynamic tables (rows made
    on first touch, so no declared count) by width."""
    text = f"{model['parameters']:,} parameters"
    tables = model.get("dynamic_tables") or {}
    if tables:
        widths = sorted(set(tables.values()))
        text += (
            f" outside {len(tables)} dynamic table{'s' if len(tables) > 1 else ''} of "
            f"{'/'.join(str(w) for w in widths)}-wide rows made on first touch"
        )
    return text


def model_markdown(doc: dict[str, Any]) -> list[str]:
    """One model's section of study.md (``doc``: its ``model_view``)."""
    plan = doc["plan"]
    metric = plan.get("metric", "accuracy")
    runs = [r for r in doc["runs"] if "error" not in r]
    base = {r["compress"]: r for r in runs if r["workers"] == 1 and not r.get("variant")}
    reference = doc.get("one_process")
    lines = [
        f"## {doc['model']['name']} ({model_size(doc['model'])})",
        "",
        f"Data: {doc['data']}. Server `--optimizer {doc.get('optimizer', 'adam')}`, lr "
        f"{plan['lr']:g}. Target: {target_text(plan['target'], metric)} held-out"
        + (
            f" (one process, the same optimizer: {reference['auc']:.4f} after "
            f"{reference['updates']} updates on the 1-worker run's batches, minus "
            f"{doc['auc_slack']}; Keras Adam in one process: {doc['keras_adam']['auc']:.4f})"
            if reference and "keras_adam" in doc
            else f" (one process: {reference['auc']:.4f} after {reference['updates']} updates "
            f"on the 1-worker run's batches, minus {doc['auc_slack']})"
            if reference
            else f" {metric}"
        )
        + f", evaluated every {plan['eval_every']} applied updates. Measured costs: "
        f"{doc['costs']['grad_ms']} ms per gradient, {doc['costs']['apply_ms']} ms per apply "
        f"({doc['costs']['apply_units']} gradient-times)"
        + (
            f"; {doc['costs']['shards']} model shards, each its own server queue, applying "
            f"their parts in {', '.join(map(str, doc['costs']['shard_apply_ms']))} ms "
            f"({', '.join(map(str, doc['costs']['shard_apply_units']))} gradient-times)."
            if doc["costs"].get("shards")
            else "."
        ),
        "",
        "1 worker: every policy is the same run (staleness is always 0), run to "
        f"{plan['baseline_updates']} updates. Others stop at the target or at "
        f"{plan['max_updates']} updates / {plan['max_gradients']} gradients.",
        "",
        "| workers | policy | compress | updates to target | x 1 worker (same compress) | "
        "gradients | sim. s | speed-up | gradients x 1w | staleness mean/max | dropped/late | "
        f"final {metric} | bytes raw/sent |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in sorted(
        (r for r in runs if r["kind"] == "simulated" and not r.get("variant")),
        key=lambda r: (r["compress"] != "none", r["compress"], r["workers"], r["policy"]),
    ):
        b = base.get(r["compress"])
        ratio = (
            r["updates_to_target"] / b["updates_to_target"]
            if r["reached"] and b and b["updates_to_target"]
            else None
        )
        c = r["policy_counters"]
        pol = "any (all identical)" if r["workers"] == 1 else r["policy"]
        lines.append(
            f"| {r['workers']} | {pol} | {r['compress']} | "
            f"{_fmt(r['updates_to_target']) if r['reached'] else 'not reached'} | "
            f"{_fmt(ratio, 2)} | {_fmt(r['gradients_to_target'] or r['gradients'])} | "
            f"{_fmt(r['sim_seconds_to_target'], 1)} | {_fmt(r.get('speedup'), 2)} | "
            f"{_fmt(r.get('gradients_vs_1w'), 2)} | "
            f"{r['staleness_mean']:.1f}/{r['staleness_max']} | "
            f"{_count(c, 'dropped_stale')}/{_count(c, 'late')} | {r['final_accuracy']:.3f} | "
            f"{_fmt(r['bytes_ratio'], 1)}x |"
        )
    lines += speedup_table(plan, runs)
    variants = [r for r in runs if r.get("variant") == "lr"]
    if variants:
        lines += [
            "",
            f"{plan.get('lr_variant_policy', 'staleness-aware')} with another base learning rate "
            f"({max(plan['workers'])} workers, no compression):",
            "",
            "| base lr | updates to target | x 1 worker | sim. s | speed-up | gradients x 1w | "
            "final acc |",
            "|---:|---:|---:|---:|---:|---:|---:|",
        ]
        b = base.get("none")
        for r in sorted(variants, key=lambda r: r["lr"]):
            ratio = (
                r["updates_to_target"] / b["updates_to_target"]
                if r["reached"] and b and b["updates_to_target"]
                else None
            )
            lines.append(
                f"| {r['lr']:g} | {_fmt(r['updates_to_target']) if r['reached'] else 'not reached'}"
                f" | {_fmt(ratio, 2)} | {_fmt(r['sim_seconds_to_target'], 1)} | "
                f"{_fmt(r.get('speedup'), 2)} | {_fmt(r.get('gradients_vs_1w'), 2)} | "
                f"{r['final_accuracy']:.3f} |"
            )
    cross = doc.get("cross_check") or []
    if cross:
        lines += [
            "",
            "Cross-check with real processes (`downpour server --eval-every` and `downpour "
            "worker` processes sharing the 2 cores; seconds from starting the workers):",
            "",
            "| workers | policy | updates to target | seconds to target | speed-up | "
            "staleness mean/max | final acc |",
            "|---:|---|---:|---:|---:|---:|---:|",
        ]
        for r in cross:
            if "error" in r:
                lines.append(f"| {r['workers']} | {r['policy']} | error: {r['error']} | | | | |")
                continue
            lines.append(
                f"| {r['workers']} | {r['policy']} | "
                f"{_fmt(r['updates_to_target']) if r['reached'] else 'not reached'} | "
                f"{_fmt(r['seconds_to_target'], 1)} | {_fmt(r.get('speedup'), 2)} | "
                f"{r['staleness_mean']:.1f}/"
                f"{_fmt(r['staleness_max'])} | {_fmt(r['final_accuracy'])} |"
            )
    lines += ["", "Headline figures:", "", "```", json.dumps(doc["summary"], indent=2), "```", ""]
    return lines


COLORS = {
    "async": "C0",
    "staleness-aware": "C1",
    "bounded": "C2",
    "sync": "C3",
    "ssp": "C4",
    "dc": "C5",
    "gap-aware": "C6",
    "momentum-aware": "C7",
    "lookahead": "C8",
    "hybrid": "C9",
}


def plot(doc: dict[str, Any], out: Path) -> list[str]:
    """Per model (see ``plot_model``): MNIST's study-curves.png and study-speedup.png, the
    others' study-curves-MODEL.png and study-speedup-MODEL.png."""
    return [
        name
        for model in doc["models"]
        for name in plot_model(model_view(doc, model), out, "" if model == "mnist" else model)
    ]


def plot_model(doc: dict[str, Any], out: Path, tag: str) -> list[str]:
    """study-curves[-tag].png (the held-out metric vs applied updates: a panel per
    compression and worker count, a line per policy) and study-speedup[-tag].png (speed-up
    over 1 worker per policy) of one model (``doc``: its ``model_view``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plan = doc["plan"]
    metric = plan.get("metric", "accuracy")
    suffix = f"-{tag}" if tag else ""
    runs = [r for r in doc["runs"] if "error" not in r and not r.get("variant")]
    ws, cs = plan["workers"], plan["compressions"]
    kinds = plan["policy_kinds"]
    colors = COLORS
    fig, axes = plt.subplots(
        len(cs), len(ws), figsize=(4 * len(ws), 3.2 * len(cs)), squeeze=False, sharey=True
    )
    for row, c in enumerate(cs):
        base = next((r for r in runs if r["workers"] == 1 and r["compress"] == c), None)
        for col, w in enumerate(ws):
            ax = axes[row][col]
            if base is not None:
                xs, ys = zip(*[(p[0], p[3]) for p in base["curve"]], strict=True)
                ax.plot(xs, ys, color="0.6", lw=1.5, label="1 worker")
            if w > 1:
                for kind in kinds:
                    pol = policy_for_text(kind, w, plan)
                    r = next(
                        (
                            r
                            for r in runs
                            if r["workers"] == w and r["policy"] == pol and r["compress"] == c
                        ),
                        None,
                    )
                    if r is not None:
                        xs, ys = zip(*[(p[0], p[3]) for p in r["curve"]], strict=True)
                        ax.plot(xs, ys, color=colors[kind], lw=1.2, label=pol)
            for r in doc.get("cross_check") or []:
                if "error" in r or r["workers"] != w or c != "none" or not r["curve"]:
                    continue
                xs, ys = zip(*[(p[0], p[3]) for p in r["curve"]], strict=True)
                ax.plot(
                    xs,
                    ys,
                    ls=":",
                    color=colors.get(r["policy"], "k"),
                    label=f"{r['policy']} (processes)",
                )
            ax.axhline(plan["target"], color="k", lw=0.6, ls="--")
            ax.set_ylim(max(0.0, plan["target"] - 0.4), 1.0)
            ax.set_title(f"{w} worker{'s' if w > 1 else ''}, {c}", fontsize=9)
            ax.grid(alpha=0.3)
            if row == len(cs) - 1:
                ax.set_xlabel("applied updates")
            if col == 0:
                ax.set_ylabel(f"held-out {metric}")
            ax.legend(fontsize=6, loc="lower right")
    fig.suptitle(
        f"{doc['model']['name']}: held-out {metric} vs applied updates ({doc['date']})",
        fontsize=10,
    )
    fig.tight_layout()
    curves = out / f"study-curves{suffix}.png"
    fig.savefig(curves, dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 3.6))
    width = 0.8 / max(1, len(kinds))
    for k, kind in enumerate(kinds):
        xs, ys = [], []
        for i, w in enumerate(ws):
            pol = "async" if w == 1 else policy_for_text(kind, w, plan)
            r = next(
                (
                    r
                    for r in runs
                    if r["workers"] == w and r["policy"] == pol and r["compress"] == "none"
                ),
                None,
            )
            xs.append(i + (k - (len(kinds) - 1) / 2) * width)
            ys.append(r.get("speedup") or 0.0 if r else 0.0)
        ax.bar(xs, ys, width, color=colors[kind], label=kind)
    speedup_target = doc["summary"]["target_speedup"]
    ax.axhline(speedup_target, color="k", lw=0.6, ls="--")
    ax.set_xticks(range(len(ws)), [f"{w} worker{'s' if w > 1 else ''}" for w in ws])
    ax.set_ylabel(
        f"speed-up to {target_text(plan['target'], metric)} over 1 worker\n"
        "(simulated; 0 = not reached)"
    )
    ax.set_title(
        f"{doc['model']['name']}: wall-clock speed-up (simulated), no compression; "
        f"dashed: {speedup_target:g}x",
        fontsize=10,
    )
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    bars = out / f"study-speedup{suffix}.png"
    fig.savefig(bars, dpi=110)
    plt.close(fig)
    return [curves.name, bars.name]


def policy_for_text(kind: str, workers: int, plan: dict[str, Any]) -> str:
    """``policy_for`` for a plan read back from JSON."""
    if kind == "bounded":
        return f"bounded:{plan['bounded_k']}"
    if kind == "ssp":
        return f"ssp:{plan.get('ssp_k', 2)}"
    if kind == "sync":
        return f"sync:{workers - workers // 4}/{workers}"
    if kind == "hybrid":
        return f"dense=sync:{workers - workers // 4}/{workers},rows=async"
    if kind == "dc":
        return plan.get("dc", "dc-a:2")
    if kind == "lookahead":
        return plan.get("lookahead", "lookahead")
    return kind


# ---------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    """Run the plan; write study-results.json, study.md and the PNGs into --out."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="1 and 8 workers, a few minutes")
    mode.add_argument("--smoke", action="store_true", help="a reduced grid in under a minute")
    p.add_argument("--out", default="runs/study", help="output directory")
    p.add_argument("--jobs", type=int, help="runs at a time (default: the plan's)")
    p.add_argument("--workers", help="worker counts instead of the plan's, e.g. 1,2,4,8")
    p.add_argument("--compressions", help="compressions instead of the plan's, e.g. none,bf16")
    p.add_argument("--kinds", help="policy kinds instead of the plan's, e.g. async,dc")
    p.add_argument(
        "--models",
        default=",".join(MODELS),
        help=f"the models to study (default all: {','.join(MODELS)}); each runs the plan's "
        "kinds that apply to it (study_models.POLICY_KINDS)",
    )
    p.add_argument("--no-cross-check", action="store_true", help="skip the real-process runs")
    p.add_argument(
        "--shards",
        type=int,
        default=1,
        help="model shards: the simulated server is that many queues, each spending its "
        "shard's measured apply time on its part of every push (default 1)",
    )
    p.add_argument(
        "--costs",
        metavar="GRAD_MS,APPLY_MS",
        help="use these costs of one MNIST gradient and one apply (e.g. measured on an idle "
        "machine) instead of measuring them now: a loaded machine inflates the apply's share, "
        "and the simulated server queue with it (the other models' are measured)",
    )
    p.add_argument(
        "--render", metavar="JSON", help="only rewrite study.md and the PNGs from a results file"
    )
    args = p.parse_args(argv)
    if args.render:
        doc = by_model(json.loads(Path(args.render).read_text()))
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        doc["pngs"] = plot(doc, out)
        write_markdown(doc, out / "study.md")
        return 0
    plan = PLANS["smoke" if args.smoke else "quick" if args.quick else "full"]
    for key, value in (
        ("jobs", args.jobs),
        ("workers", args.workers and tuple(int(w) for w in args.workers.split(","))),
        ("compressions", args.compressions and tuple(args.compressions.split(","))),
        ("policy_kinds", args.kinds and tuple(args.kinds.split(","))),
        ("shards", args.shards if args.shards != 1 else None),
    ):
        if value:
            plan = replace(plan, **{key: value})
    if 1 not in plan.workers:
        p.error("--workers must include 1 (the speed-up is over 1 worker)")
    if args.shards < 1 or (args.shards > 1 and args.costs):
        p.error("--shards must be >= 1, and its shards' costs are measured: not with --costs")
    models = tuple(args.models.split(","))
    if unknown := [m for m in models if m not in MODELS]:
        p.error(f"--models: unknown {','.join(unknown)} (known: {','.join(MODELS)})")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    _init_process()
    from bench_util import machine

    host = machine()  # its load average now, before the runs load the machine
    parts, jobs = {}, []
    for model in models:
        parts[model], model_jobs = prepare(plan, model, args.costs)
        jobs += model_jobs
    log(f"{len(jobs)} simulated runs, {plan.jobs} at a time")
    runs = run_grid(plan.jobs, jobs)
    cross: list[dict[str, Any]] = []
    if not args.no_cross_check and "mnist" in models:
        cross = cross_checks(plan, out)
    command = "make study" + {"quick": " QUICK=1", "smoke": " (smoke)", "full": ""}[plan.name]
    overrides = [
        f"--{k} {v}"
        for k, v in (
            ("workers", args.workers),
            ("compressions", args.compressions),
            ("kinds", args.kinds),
            ("models", args.models if models != MODELS else None),
            ("costs", args.costs),
            ("shards", args.shards if args.shards != 1 else None),
        )
        if v
    ]
    if overrides:
        command += f" ARGS='{' '.join(overrides)}'"
    add_speedups(runs, cross)
    for model, part in parts.items():
        part["summary"] = summarise(Plan(**part["plan"]), runs, model)
    doc: dict[str, Any] = {
        "study": "staleness policies and gradient compression",
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "command": command,
        "machine": {**host, "gpu": None},
        "plan_name": plan.name,
        "models": parts,
        "runs": runs,
        "cross_check": cross,
        "summary": {model: part["summary"] for model, part in parts.items()},
    }
    doc["total_seconds"] = round(time.monotonic() - started, 1)
    doc["machine"]["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    doc["pngs"] = plot(doc, out)
    (out / "study-results.json").write_text(json.dumps(doc, indent=1))
    write_markdown(doc, out / "study.md")
    log(f"wrote {out}/study-results.json, study.md, {', '.join(doc['pngs'])}")
    log(f"summary {json.dumps(doc['summary'])}")
    return 1 if any("error" in r for r in runs) else 0


def prepare(plan: Plan, model: str, given_costs: str | None) -> tuple[dict[str, Any], list[Job]]:
    """One model's part of the results (its plan, measured costs, data, and for a recsys
    model the one-process reference its target comes from) and its runs."""
    mplan = model_plan(plan, model)
    log(f"{model}: measuring the costs of one gradient and one apply")
    costs = measure_costs(model=model, shards=plan.shards)
    if given_costs and model == "mnist":
        grad_ms, apply_ms = (float(x) for x in given_costs.split(","))
        costs = {
            "grad_ms": grad_ms,
            "apply_ms": apply_ms,
            "apply_units": round(apply_ms / grad_ms, 2),
            "grad_s": grad_ms / 1e3,
            "given": True,
            "measured_now": costs,
        }
    log(f"{model}: costs {costs}")
    ctx = _context(model)
    from downpour.model.build import dynamic_tables

    tables = dynamic_tables(ctx.model)  # rows created on first touch: not declared parameters
    n_params = sum(
        int(v.numpy().size) for v in ctx.model.trainable_variables if v.path not in tables
    )
    part: dict[str, Any] = {
        "model": {
            "ref": SPEC_REFS[model],
            "name": ctx.spec.name,
            "parameters": n_params,
            "dynamic_tables": {path: t.dim for path, t in tables.items()},
        },
        "data": DATA[model],
        "costs": costs,
        "optimizer": OPTIMIZERS[model],
    }
    if budget(model, plan.name) is not None:  # a recsys model: the target from one process
        keras_adam = one_process_auc(ctx.spec, ctx.data, mplan.baseline_updates, mplan.lr)
        reference = (
            keras_adam
            if OPTIMIZERS[model] == "adam"
            else one_process_server_optimizer(model, mplan.baseline_updates, mplan.lr)
        )
        log(f"{model}: one-process reference {reference} (Keras Adam: {keras_adam['auc']})")
        mplan = replace(mplan, target=round(reference["auc"] - AUC_SLACK, 5))
        part |= {"one_process": reference, "keras_adam": keras_adam, "auc_slack": AUC_SLACK}
    part["plan"] = asdict(mplan)
    return part, jobs_for(mplan, costs, model)


def model_plan(plan: Plan, model: str) -> Plan:
    """``plan`` for one model: the kinds that apply to it, and a recsys model's own budget
    (its target is set from the one-process reference, ``prepare``)."""
    kinds = tuple(k for k in plan.policy_kinds if k in POLICY_KINDS[model])
    b = budget(model, plan.name)
    if b is None:
        return replace(plan, policy_kinds=kinds)
    return replace(
        plan,
        policy_kinds=kinds,
        compressions=tuple(c for c in plan.compressions if c in b.compressions) or ("none",),
        target=math.nan,
        eval_every=b.eval_every,
        max_updates=b.max_updates,
        max_gradients=b.max_gradients,
        baseline_updates=b.baseline_updates,
        lr=b.lr,
        lr_variants=(),
        cross_check=(),
        metric="auc",
    )


def cross_checks(plan: Plan, out: Path) -> list[dict[str, Any]]:
    """The MNIST plan's real-process runs, each failure recorded, not fatal."""
    cross = []
    for w, pol in plan.cross_check:
        log(f"cross-check: {w} worker process(es), {pol}")
        try:
            r = cross_check(plan, w, pol, out)
        except Exception as exc:  # a failed cross-check is reported, not fatal
            r = {"workers": w, "policy": pol, "kind": "processes", "error": repr(exc)}
        keys = ("updates_to_target", "seconds_to_target", "final_accuracy", "error")
        log(f"cross-check {w}w {pol}: { {k: r.get(k) for k in keys} }")
        cross.append({"model": "mnist", **r})
    return cross


if __name__ == "__main__":
    sys.exit(main())
