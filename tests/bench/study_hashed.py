"""The study's simulated workers and scoring for a model with dynamic tables (``clicks-hashed``).

A server holds a ``DynamicEmbedding``'s rows in its shard's ``DynamicTable``, created on first
touch: no worker gets the table whole, and the server's state cannot evaluate the model.
``HashedWorker`` does, in the study's one process, what a real worker and server do for
such a model, with their own classes:

- The model is built under ``row_cache_scope`` (``downpour.worker.rows.cache``): every dynamic
  table is a keyed ``RowCache`` of slots, and ``GradientStep`` pushes its gradient as
  ``Keyed`` rows (global ids). The worker's ``RowPlan`` (``downpour.worker.rows.plan``) gives each
  batch's unique ids per table (its compiled id extractor) and the ones not fetched at the
  version the worker computes on (row staleness 0, the worker's default).
- Those ids are served as the server's pull handler serves a row request: ``check_rows``,
  then ``ParameterState.gather`` (an id the table does not hold reads its initial value) into
  a ``Keyed`` tensor; the plan installs them into the cache (``RowPlan.install``, the step's
  ``scatter_rows``), and the step's fixed variables get the pulled weights (``set_some``).
- Each simulated worker has its own ``HashedWorker`` (model, row caches, plan, step), as
  ``HashedWorkers`` keeps them: under the fetch settings of ``fetch_sim`` (``n-fetch:K``,
  ``bf16``, ``adaptive:B``) a worker computes on weights it holds, and its row pulls are its
  own under every setting. A pull (``batch`` with ``pulled``) brings, as the real worker's
  look-ahead does, the rows of the batches it serves (the next K, drawn from the worker's
  stream ahead of time) that were fetched before the state's current version; before each
  step the rows of its batch fetched before the version the worker holds are topped up from
  the state as it is then (``RowPuller.ensure``). Under ``every`` a worker pulls before each
  step, so it computes on the server's rows of the current version, exactly. Rows go through
  the wire as the server sends them (``keyed``; ``keyed_bf16`` under ``bf16``, which the
  worker's decode widens), and their reply's bytes are counted. An "unchanged" answer to an
  adaptive pull keeps the fixed weights and still brings the rows, as the server's row reply
  does.

Scoring (``score``) is ``downpour.serving.scoring``'s: a copy of the model built as serving builds
it holds the state's fixed weights, and before each held-out batch exactly the rows of that
batch's ids (``with_table_rows``, here pulled from the state instead of over sockets).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any

import numpy as np


class _StateShards:
    """``downpour.net.cluster.ShardSet.pull_rows`` answered by one unsharded state, as its row
    pull handler answers a rows-only request (``check_rows``, then ``gather``)."""

    def __init__(self, state: Any) -> None:
        self.state = state

    def pull_rows(self, var: int, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """(unique ids, their rows, [the state's version]) of the model's variable ``var``."""
        from downpour.server.handlers import check_rows

        state = self.state
        ((_, part),) = state.partition.parts_of(var)
        ((i, got),) = check_rows({part.wire_name: ids}, state).items()
        return got, state.gather(i, got), [state.version]


class HashedWorker:
    """One simulated worker's model, row caches and row pulls for a spec with dynamic tables,
    and the scoring of a state's rows (see the module docstring)."""

    def __init__(self, spec: Any, element_spec: Any, scoring: bool = True) -> None:
        """Build the worker's model (row caches), its step, and (``scoring``) the scoring
        copy."""
        from downpour.model.build import build_model
        from downpour.worker.rows.cache import caches_of, row_cache_scope
        from downpour.worker.step import GradientStep, batch_signature

        self.spec = spec
        with row_cache_scope(None):  # every DynamicEmbedding: a keyed cache of pulled rows
            self.model = build_model(spec, seed=0)
        self.caches = caches_of(self.model)
        if not any(c.keyed for c in self.caches.values()):
            raise ValueError(f"model {spec.name!r} has no dynamic table")
        self.step = GradientStep(spec, self.model, element_spec, self.caches)
        self.features_spec = batch_signature(tuple(element_spec))[0]
        # holds the rows of one held-out batch at a time
        self.scorer = build_model(spec, seed=0) if scoring else None
        self.plan: Any = None  # the worker's RowPlan, made from the first state's partition
        self.fixed: tuple[int, ...] = ()  # the variables pulled whole (not dynamic tables)
        self.mode: Any = None  # the run's fetch setting (fetch_sim.FetchMode)
        self.queue: deque[tuple[Any, Any]] = deque()  # batches drawn ahead for a pull's rows
        self.batches = 0  # batches computed: the row caches' clock
        self.rows_pulled = 0
        self.row_bytes_pulled = 0

    def begin(self, state: Any, policy: Any, fetch: str) -> None:
        """A run (or reference) on ``state`` starts: refuse what a server with dynamic tables
        refuses (``validate_server`` given the model's facts); every cached row counts as
        never fetched (the versions count anew) and no batch is drawn ahead."""
        from fetch_sim import parse_fetch

        from downpour.server.settings import ModelFacts, ServerConfig, validate_server
        from downpour.worker.rows.plan import RowPlan

        config = ServerConfig(optimizer=state.optimizer_name, policy=policy.spec)
        validate_server(config, ModelFacts(tuple(state.tables)))
        self.mode = parse_fetch(fetch)
        if self.plan is None:
            served = [n for n, sparse in zip(state.names, state.sparse, strict=True) if sparse]
            self.plan = RowPlan.build(
                self.model, state.partition, [served], self.features_spec, 0, self.caches
            )
            if self.plan is None:
                raise ValueError(f"model {self.spec.name!r}: no table to pull by row")
            self.fixed = tuple(i for i, d in enumerate(state.dynamic) if not d)
        self.plan.forget(0)
        self.queue.clear()
        self.rows_pulled = self.row_bytes_pulled = 0

    def batch(self, stream: Iterator[tuple[Any, Any]], state: Any, pulled: bool) -> tuple[Any, Any]:
        """The worker's next batch from ``stream``. ``pulled``: the worker sent a pull for
        this step, so the rows of the batches that pull serves, this one and the next K - 1
        (``n-fetch:K``), come with it at the state's version, as the real worker's
        look-ahead asks them."""
        if pulled:
            while len(self.queue) < self.mode.n_fetch:
                self.queue.append(next(stream))
            plan = self.plan
            ids = plan.union([x for x, _ in self.queue])
            plan.keep_for(ids, self.batches + len(self.queue))
            (wanted,) = plan.wanted(ids, [state.version])
            self._pull_rows(state, wanted, current=False)
        return self.queue.popleft() if self.queue else next(stream)

    def install(self, state: Any, version: int, weights: list[Any], x: Any) -> Any:
        """Before a gradient on features ``x``: the pulled ``weights`` (of ``version``) into
        the fixed variables, and the batch's rows fetched before ``version`` pulled from
        ``state`` as it is now into the row caches. The step to compute the gradient with."""
        plan = self.plan
        ids = plan.batch_ids(x)
        self.batches += 1
        plan.begin_batch(ids, self.batches)
        (wanted,) = plan.wanted(ids, [version])
        self._pull_rows(state, wanted, current=True)
        self.step.set_some(self.fixed, [weights[i] for i in self.fixed])
        return self.step

    def _pull_rows(self, state: Any, wanted: dict[str, np.ndarray], current: bool) -> None:
        """The rows ``wanted`` (by wire name) served as the server's row reply serves them
        (``check_rows``, ``gather``; ``keyed_bf16`` under ``bf16``) at the state's version,
        through the wire into the caches: for the batch about to be computed (``current``)
        or the ones a pull's look-ahead drew. The reply's bytes are counted."""
        from downpour import wire
        from downpour.server.handlers import check_rows
        from downpour.wire import Keyed

        asked = {name: rows for name, rows in wanted.items() if rows.size}
        if not asked:
            return
        tensors: dict[str, Any] = {}
        for i, rows in check_rows(asked, state).items():
            t = Keyed(rows, state.gather(i, rows), state.shapes[i])
            tensors[state.names[i]] = wire.as_bf16(t) if self.mode.bf16 else t
        msg = wire.weights_reply(state.version, wire.PullReply("sim"), tensors)
        frames = [bytes(memoryview(f).cast("B")) for f in wire.encode(msg)]
        self.row_bytes_pulled += sum(len(f) for f in frames)
        limits = wire.DEFAULT_LIMITS.for_payload(state.payload_bytes)
        for name, reply in wire.decode(frames, limits).tensors.items():
            n, _ = self.plan.install(
                name, reply, state.version, self.step.scatter_rows, current=current
            )
            self.rows_pulled += n

    def score(self, state: Any, held: list[tuple[Any, Any]]) -> float:
        """The spec's metric of ``state``'s weights on the held-out batches ``held``, scored
        as ``downpour.serving.scoring`` scores the servers' model."""
        from downpour.model.build import evaluate
        from downpour.serving.scoring import with_table_rows

        if self.scorer is None:
            raise ValueError("this HashedWorker was built without its scoring copy")
        _, arrays = state.weights()
        variables = self.scorer.trainable_variables
        for v, a, dynamic in zip(variables, arrays, state.dynamic, strict=True):
            if not dynamic:
                v.assign(a)
        return float(
            evaluate(
                self.spec, self.scorer, with_table_rows(_StateShards(state), self.scorer, held)
            )
        )

    def record(self) -> dict[str, int]:
        """The run's row-pull figures."""
        return {"rows_pulled": self.rows_pulled, "row_bytes_pulled": self.row_bytes_pulled}


class HashedWorkers:
    """The simulated workers of a run on a model with dynamic tables, one ``HashedWorker``
    each (the first is ``first``), built as they are first needed and kept for later runs in
    this process (see the module docstring)."""

    def __init__(self, first: HashedWorker, element_spec: Any) -> None:
        self.pool = [first]
        self.element_spec = element_spec
        self.args: tuple[Any, Any, str] | None = None  # the run's (state, policy, fetch)
        self._begun = 0  # the run's workers begun: pool[:_begun]

    def begin(self, state: Any, policy: Any, fetch: str) -> None:
        """A run starts: its first worker begins now (refusing what it must), the others
        when first asked for."""
        self.pool[0].begin(state, policy, fetch)
        self.args = (state, policy, fetch)
        self._begun = 1

    def worker(self, i: int) -> HashedWorker:
        """Worker ``i``'s."""
        first = self.pool[0]
        while len(self.pool) <= i:
            self.pool.append(HashedWorker(first.spec, self.element_spec, scoring=False))
        assert self.args is not None
        while self._begun <= i:
            self.pool[self._begun].begin(*self.args)
            self._begun += 1
        return self.pool[i]

    def record(self) -> dict[str, int]:
        """The run's row-pull figures, summed over its workers."""
        mine = [w.record() for w in self.pool[: self._begun]]
        return {k: sum(r[k] for r in mine) for k in ("rows_pulled", "row_bytes_pulled")}
