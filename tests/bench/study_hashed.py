"""The study's simulated workers and scoring for a model with dynamic tables (``clicks-hashed``).

A server holds a ``DynamicEmbedding``'s rows in its shard's ``DynamicTable``, created on first
touch: no worker gets the table whole, and the server's state cannot evaluate the model.
``HashedWorker`` does, in the study's one process, what a real worker and server do for
such a model, with their own classes:

- The model is built under ``row_cache_scope`` (``downpour.worker.row_cache``): every dynamic
  table is a keyed ``RowCache`` of slots, and ``GradientStep`` pushes its gradient as
  ``Keyed`` rows (global ids). The worker's ``RowPlan`` (``downpour.worker.rows``) gives each
  batch's unique ids per table (its compiled id extractor) and the ones not fetched at the
  version the worker computes on (row staleness 0, the worker's default).
- Those ids are served as the server's pull handler serves a row request: ``check_rows``,
  then ``ParameterState.gather`` (an id the table does not hold reads its initial value) into
  a ``Keyed`` tensor; the plan installs them into the cache (``RowPlan.install``, the step's
  ``scatter_rows``), and the step's fixed variables get the pulled weights (``set_some``).
- The simulation computes each worker's gradient right when it pulls, on the state's current
  version, so the rows a worker computes on are exactly the server's rows at that version.
  One model and cache therefore serve every simulated worker: before each gradient the rows
  of its batch that were fetched at another version are pulled again, so no worker reads
  another's stale row. Fetch settings that compute on older weights (``n-fetch``, adaptive,
  bf16 pulls) would need each worker's own cache and are refused.

Scoring (``score``) is ``downpour.scoring``'s: a copy of the model built as serving builds
it holds the state's fixed weights, and before each held-out batch exactly the rows of that
batch's ids (``with_table_rows``, here pulled from the state instead of over sockets).
"""

from __future__ import annotations

from typing import Any

import numpy as np


class _StateShards:
    """``downpour.cluster.ShardSet.pull_rows`` answered by one unsharded state, as its row
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
    """The simulated workers' model, row caches and row pulls for a spec with dynamic tables,
    and the scoring of a state's rows (see the module docstring)."""

    def __init__(self, spec: Any, element_spec: Any) -> None:
        """Build the worker's model (row caches), its step, and the scoring copy."""
        from downpour.models import build_model
        from downpour.worker.row_cache import caches_of, row_cache_scope
        from downpour.worker.step import GradientStep, batch_signature

        self.spec = spec
        with row_cache_scope(None):  # every DynamicEmbedding: a keyed cache of pulled rows
            self.model = build_model(spec, seed=0)
        self.caches = caches_of(self.model)
        if not any(c.keyed for c in self.caches.values()):
            raise ValueError(f"model {spec.name!r} has no dynamic table")
        self.step = GradientStep(spec, self.model, element_spec, self.caches)
        self.features_spec = batch_signature(tuple(element_spec))[0]
        self.scorer = build_model(spec, seed=0)  # holds the rows of one held-out batch at a time
        self.plan: Any = None  # the worker's RowPlan, made from the first state's partition
        self.fixed: tuple[int, ...] = ()  # the variables pulled whole (not dynamic tables)
        self.batches = 0  # batches computed: the row caches' clock
        self.rows_pulled = 0
        self.row_bytes_pulled = 0

    def begin(self, state: Any, policy: Any, fetch: str) -> None:
        """A run (or reference) on ``state`` starts: refuse what a server with dynamic tables
        refuses (``check_dynamic``) and fetch settings other than ``every``; every cached row
        counts as never fetched (the versions count anew)."""
        from downpour.server.service import check_dynamic
        from downpour.server.settings import ServerConfig
        from downpour.worker.rows import RowPlan

        check_dynamic(state, policy, ServerConfig(optimizer=state.optimizer_name))
        if fetch != "every":
            raise ValueError(
                f"fetch {fetch!r}: the study computes {self.spec.name}'s gradients on the rows "
                "of the server's current version only (fetch 'every')"
            )
        if self.plan is None:
            served = [n for n, sparse in zip(state.names, state.sparse, strict=True) if sparse]
            self.plan = RowPlan.build(
                self.model, state.partition, [served], self.features_spec, 0, self.caches
            )
            if self.plan is None:
                raise ValueError(f"model {self.spec.name!r}: no table to pull by row")
            self.fixed = tuple(i for i, d in enumerate(state.dynamic) if not d)
        self.plan.forget(0)
        self.rows_pulled = self.row_bytes_pulled = 0

    def install(self, state: Any, version: int, weights: list[Any], x: Any) -> None:
        """Before a gradient on features ``x``: the pulled ``weights`` (of ``version``) into
        the fixed variables, and the batch's rows not fetched at ``version`` pulled from
        ``state`` (which must be at ``version``) into the row caches."""
        from downpour.server.handlers import check_rows
        from downpour.wire import Keyed

        if version != state.version:
            raise ValueError(f"rows of version {version} asked of a state at {state.version}")
        plan = self.plan
        ids = plan.batch_ids(x)
        self.batches += 1
        plan.begin_batch(ids, self.batches)
        (wanted,) = plan.wanted(ids, [version])
        asked = {name: rows for name, rows in wanted.items() if rows.size}
        for i, rows in check_rows(asked, state).items():
            reply = Keyed(rows, state.gather(i, rows), state.shapes[i])
            n, nbytes = plan.install(
                state.names[i], reply, version, self.step.scatter_rows, current=True
            )
            self.rows_pulled += n
            self.row_bytes_pulled += nbytes
        self.step.set_some(self.fixed, [weights[i] for i in self.fixed])

    def score(self, state: Any, held: list[tuple[Any, Any]]) -> float:
        """The spec's metric of ``state``'s weights on the held-out batches ``held``, scored
        as ``downpour.scoring`` scores the servers' model."""
        from downpour.models import evaluate
        from downpour.scoring import with_table_rows

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
