"""The hybrid staleness policy: one policy for the dense variables, another for the rows.

``--policy dense=SPEC,rows=SPEC`` (``dense=sync:7/8,rows=async``, ``dense=ssp:2,rows=async``,
``dense=async,rows=bounded:8``; the halves in either order). Each push is split in two
halves by the shard's layout (``Policy.layout``): the row-sparse variables (Embedding tables'
row parts and dynamic tables' ``Keyed`` rows) and the dense ones.

- The rows half is offered to the rows policy, one whose capabilities are ``row_safe``
  (``downpour.config.policy.Capabilities``: ``async``, ``staleness-aware``, ``bounded:K``):
  it decides each push on its own, so rows are applied as they come (or dropped). A policy
  that sums gradients (``sync``) would sum the tables densely, one that reads or
  extrapolates whole weights would copy them, ``ssp`` gates whole pulls and
  ``momentum-aware`` changes the optimizer the dense half shares: none of them is a rows
  policy.
- The dense half is offered to the dense policy, one whose capabilities are ``dense_safe``
  (``async``, ``staleness-aware``, ``bounded:K``, ``ssp:K``, ``sync:K/N``). A sync round
  waits for K *dense* pushes: a push without a dense half (a shard holding only table rows)
  is not offered to it. The compensation policies (``dc``, ``gap-aware``, ``momentum-aware``,
  ``lookahead``) read or change the whole model's optimizer and weights, which the rows
  policy shares: they are refused as a dense half.

Versions. Every apply is one version step, whichever half it updates: a push whose two
halves are applied moves the version by two (rows first, then dense). A row apply must move
the version: a worker's row cache calls a row fresh while ``fetched >= version - K``
(``--row-staleness``), and a pull reply's version is what the worker's next push claims as its
base, so a row changed at an unchanged version would be served as fresh while it is not.
The dense policy, though, must not see the row applies as staleness (a sync round would be
discarded by every row apply under it): it is offered versions counted in dense updates
only. The hybrid keeps the global version each dense update produced (the last
``DENSE_MARKS`` of them) and gives a push with base version ``b`` the dense staleness "dense
updates produced after ``b``" (at least ``DENSE_MARKS`` for a base older than every mark
kept). The rows policy sees the global staleness.

Accounting. Each half's policy keeps its own counters and identities (``offered = applied +
dropped + discarded + held`` per half: for sync, ``offered = aggregated + late + duplicate``
and ``aggregated = applied + discarded + pending``). The hybrid counts pushes (``offered``),
version steps (``updates``) and pushes without a dense half (``no_dense``); its status shows
both halves (``dense``, ``rows``) and their counters prefixed ``dense_`` and ``rows_``. A
worker's record counts each push once, by the fate of its dense half (of its rows half when
it has no dense one): that half's decision is the one the handler returns, the rows half's
rides on it as ``Decision.rows``.
"""

from __future__ import annotations

import bisect
from collections.abc import Collection, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from downpour.config.policy import (
    DENSE_HALF_FORMS,
    ROWS_HALF_FORMS,
    capabilities,
    hybrid_capabilities,
)
from downpour.server.policies.base import APPLY, DENSE, DROP, ROWS, Decision, Policy

DENSE_MARKS = 4096  # dense updates whose global versions are kept (dense staleness)
REASON_NOTHING = "nothing"  # a push with neither half on this shard (nothing to apply)


class HybridPolicy(Policy):
    """A dense policy and a rows policy behind one ``--policy dense=SPEC,rows=SPEC`` (the
    module docstring has the rules)."""

    kind = "hybrid"
    caps = capabilities("dense=SPEC,rows=SPEC")

    def __init__(self, dense: Policy, rows: Policy) -> None:
        """The two halves' policies; ValueError for a dense half whose capabilities are not
        ``dense_safe`` or a rows half whose are not ``row_safe``, naming the forms that are."""
        super().__init__()
        if not dense.caps.dense_safe:
            raise ValueError(
                f"a hybrid's dense half must be one of {', '.join(DENSE_HALF_FORMS)}, got "
                f"{dense.spec}: it reads or changes the weights and optimizer the rows share"
            )
        if not rows.caps.row_safe:
            raise ValueError(
                f"a hybrid's rows half must be one of {', '.join(ROWS_HALF_FORMS)}, got "
                f"{rows.spec}: rows are decided push by push (a policy that sums gradients "
                "sums tables densely; one that reads, extrapolates or gates whole weights "
                "copies them)"
            )
        self.dense = dense
        self.rows = rows
        self.caps = hybrid_capabilities(dense.caps)  # it holds pulls as its dense half does
        self.counters = {"offered": 0, "updates": 0, "no_dense": 0}
        self.dense_updates = 0  # dense updates applied
        # the global version each of the last dense updates made; the first is the version
        # the policy started at, so a push from before it (weights a restored server no
        # longer has) is dense-stale
        self._marks: list[int] = []
        self._row_idx: tuple[int, ...] | None = None
        self._dense_idx: tuple[int, ...] = ()

    @property
    def spec(self) -> str:
        return f"dense={self.dense.spec},rows={self.rows.spec}"

    def layout(self, row_sparse: Sequence[bool]) -> None:
        self._row_idx = tuple(i for i, r in enumerate(row_sparse) if r)
        self._dense_idx = tuple(i for i, r in enumerate(row_sparse) if not r)

    @property
    def dense_version(self) -> int | None:
        """The dense updates made, for pull replies; None on a shard without dense variables
        (nothing there for a worker to wait for)."""
        return self.dense_updates if self._dense_idx else None

    def dense_staleness(self, base_version: int) -> int:
        """Dense updates produced after global version ``base_version`` (at least
        ``DENSE_MARKS`` when the base is older than every mark kept)."""
        return len(self._marks) - bisect.bisect_right(self._marks, base_version)

    def decide(self, grads: Sequence[np.ndarray], tau: int, version: int, worker: str) -> Decision:
        if self._row_idx is None:
            raise RuntimeError("hybrid policy offered a push before the server's layout")
        base = version - tau
        if not self._marks:
            self._marks.append(version)
        rows: Decision | None = None
        if self._row_idx:
            rows = self.rows.offer([grads[i] for i in self._row_idx], base, version, worker)
            rows = replace(rows, part=ROWS)
            if rows.action == APPLY:
                self.counters["updates"] += 1
                version += 1  # the server applies the rows first
        if not self._dense_idx:
            self.counters["no_dense"] += 1
            return rows or Decision(DROP, reason=REASON_NOTHING, staleness=tau, workers=(worker,))
        dense_tau = self.dense_staleness(base)
        dense = self.dense.offer(
            [grads[i] for i in self._dense_idx],
            self.dense_updates - dense_tau,
            self.dense_updates,
            worker,
        )
        if dense.action == APPLY:
            self._dense_applied(version + 1)
        return replace(dense, part=DENSE, rows=rows)

    def _dense_applied(self, made: int) -> None:
        """Count a dense update that will make global version ``made``."""
        self.counters["updates"] += 1
        self.dense_updates += 1
        self._marks.append(made)
        if len(self._marks) > 2 * DENSE_MARKS:
            del self._marks[:DENSE_MARKS]

    def flush(self, version: int) -> Decision | None:
        """At shutdown: the dense policy's partial sync round, if any (rows hold nothing)."""
        decision = self.dense.flush(self.dense_updates)
        if decision is None:
            return None
        if decision.action == APPLY:
            self._dense_applied(version + 1)
        return replace(decision, part=DENSE)

    def pull_wait_ms(self, worker: str, in_flight: int, live: Collection[str]) -> int:
        return self.dense.pull_wait_ms(worker, in_flight, live)

    def describe(self) -> dict[str, Any]:
        dense, rows = self.dense.describe(), self.rows.describe()
        counters = dict(self.counters)
        counters |= {f"dense_{k}": v for k, v in dense["counters"].items()}
        counters |= {f"rows_{k}": v for k, v in rows["counters"].items()}
        return {
            "policy": self.spec,
            "kind": self.kind,
            "counters": counters,
            "dense_version": self.dense_updates,
            "dense": dense,
            "rows": rows,
        }
