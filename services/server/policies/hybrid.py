"""The hybrid staleness policy: one policy for the dense variables, another for the rows.

``--policy dense=SPEC,rows=SPEC`` (``dense=sync:7/8,rows=async``, ``dense=ssp:2,rows=async``,
``dense=async,rows=bounded:8``; the halves in either order). Each push is split in two
halves by the shard's layout (``Policy.layout``): the row-sparse variables (Embedding tables'
row parts and dynamic tables' ``Keyed`` rows) and the dense ones.

- The rows half is offered to the rows policy, one of ``async``, ``staleness-aware`` and
  ``bounded:K``: they decide each push on its own, so rows are applied as they come (or
  dropped). A policy that sums gradients (``sync``) would sum the tables densely, one that
  reads or extrapolates whole weights would copy them, and ``ssp`` gates whole pulls: none of
  them is a rows policy.
- The dense half is offered to the dense policy, one of ``async``, ``staleness-aware``,
  ``bounded:K``, ``ssp:K`` and ``sync:K/N``. A sync round waits for K *dense* pushes: a push
  without a dense half (a shard holding only table rows) is not offered to it. The
  compensation policies (``dc``, ``gap-aware``, ``momentum-aware``, ``lookahead``) read or
  change the whole model's optimizer and weights, which the rows policy shares: they are
  refused as a dense half.

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

from downpour.server.policies.base import (
    APPLY,
    DENSE,
    DROP,
    ROWS,
    AsyncPolicy,
    BoundedPolicy,
    Decision,
    Policy,
    SSPPolicy,
    StalenessAwarePolicy,
    SyncPolicy,
)

ROW_POLICIES = (AsyncPolicy, StalenessAwarePolicy, BoundedPolicy)  # decide each push alone
DENSE_POLICIES = (*ROW_POLICIES, SSPPolicy, SyncPolicy)
DENSE_MARKS = 4096  # dense updates whose global versions are kept (dense staleness)
REASON_NOTHING = "nothing"  # a push with neither half on this shard (nothing to apply)


def _names(kinds: Sequence[type[Policy]]) -> str:
    forms = {
        AsyncPolicy: "async",
        StalenessAwarePolicy: "staleness-aware",
        BoundedPolicy: "bounded:K",
        SSPPolicy: "ssp:K",
        SyncPolicy: "sync:K/N",
    }
    return ", ".join(forms[k] for k in kinds)


class HybridPolicy(Policy):
    """A dense policy and a rows policy behind one ``--policy dense=SPEC,rows=SPEC`` (the
    module docstring has the rules)."""

    kind = "hybrid"

    def __init__(self, dense: Policy, rows: Policy) -> None:
        super().__init__()
        if not isinstance(dense, DENSE_POLICIES):
            raise ValueError(
                f"a hybrid's dense half must be one of {_names(DENSE_POLICIES)}, got "
                f"{dense.spec}: it reads or changes the weights and optimizer the rows share"
            )
        if not isinstance(rows, ROW_POLICIES):
            raise ValueError(
                f"a hybrid's rows half must be one of {_names(ROW_POLICIES)}, got {rows.spec}: "
                "rows are decided push by push (a policy that sums gradients sums tables "
                "densely; one that reads, extrapolates or gates whole weights copies them)"
            )
        self.dense = dense
        self.rows = rows
        self.gates_pulls = dense.gates_pulls
        self.counters = {"offered": 0, "updates": 0, "no_dense": 0}
        self.dense_updates = 0  # dense updates applied
        # the global version each of the last dense updates made; the first is the version
        # the policy started at, so a push from before it (weights a restored server no
        # longer has) is dense-stale
        self._marks: list[int] = []
        self._row_idx: tuple[int, ...] | None = None
        self._dense_idx: tuple[int, ...] = ()

    @classmethod
    def from_text(cls, text: str) -> HybridPolicy:
        """``dense=SPEC,rows=SPEC`` (either order; each SPEC a policy text) -> the policy;
        ValueError naming what is wrong: an unknown or repeated key, a missing half, a half
        that is itself hybrid or that cannot be that half."""
        from downpour.server.policies.base import parse_policy

        halves: dict[str, str] = {}
        for item in text.split(","):
            key, sep, spec = (s.strip() for s in item.partition("="))
            if not sep or key not in (DENSE, ROWS):
                raise ValueError(
                    f"a hybrid policy is dense=SPEC,rows=SPEC; {item.strip()!r} is not "
                    "dense=SPEC nor rows=SPEC"
                )
            if key in halves:
                raise ValueError(f"a hybrid policy names its {key} half once, got it twice")
            if "=" in spec:
                raise ValueError(f"a hybrid's {key} half is one policy, not {spec!r}")
            halves[key] = spec
        missing = [k for k in (DENSE, ROWS) if k not in halves]
        if missing:
            raise ValueError(
                f"a hybrid policy is dense=SPEC,rows=SPEC; the {missing[0]} half is missing"
            )
        return cls(parse_policy(halves[DENSE]), parse_policy(halves[ROWS]))

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
