"""Staleness policies: what the server does with a gradient computed from old weights.

A gradient pushed with ``base_version`` arrives when the server is at ``version``; its
staleness is ``tau = version - base_version`` (0: computed from the current weights). The
gradient handler (``downpour.server.handlers``) hands every valid, deduplicated push to
``policy.offer(...)`` and acts on the ``Decision``::

    apply   apply decision.grads once (one version step) with the learning rate
            multiplied by decision.lr_scale
    drop    the push was well-formed but is not applied (reason: why); not an error
    hold    the policy kept a copy of the gradient (sync aggregation); nothing to apply yet

Policies (``parse_policy`` text, ``downpour server --policy``; the forms, their parameters and
their capabilities are ``downpour.config.policy``'s table), each rule exactly:

- ``async`` (the default): apply every gradient as it arrives with learning rate ``lr``.
  Downpour SGD: Dean et al., "Large Scale Distributed Deep Networks", NIPS 2012.
- ``staleness-aware``: apply every gradient with learning rate ``lr / max(1, tau)`` (tau 0
  and 1: ``lr``; tau 5: ``lr / 5``). Zhang, Gupta, Lian, Liu, "Staleness-aware Async-SGD for
  Distributed Deep Learning", IJCAI 2016, eq. 4 (``alpha = alpha0 / tau``).
- ``bounded:K``: drop a gradient with ``tau > K`` (reason ``stale``), apply the others with
  ``lr``; ``bounded:0`` applies only gradients from the current weights. Bounded staleness:
  Ho et al., "More Effective Distributed ML via a Stale Synchronous Parallel Parameter
  Server", NIPS 2013 (SSP makes a fast worker wait, as ``ssp:K`` does; ``bounded:K`` makes
  nobody wait and enforces a bound where gradients arrive).
- ``sync:K/N``: hold gradients with ``tau = 0`` until K different workers have given one,
  apply their mean once with ``lr``; drop a gradient with ``tau > 0`` (``late``) and a second
  one from the same worker in a round (``duplicate``); N - K workers are backups, and N is
  reported, not enforced. Synchronous SGD with backup workers: Chen, Pan, Monga, Bengio,
  Jozefowicz, "Revisiting Distributed Synchronous SGD", 2016 (TensorFlow's
  ``SyncReplicasOptimizer``).
- ``ssp:K``: stale synchronous parallel. Apply every gradient as it arrives with ``lr`` (as
  ``async``), and hold a worker's *pull* while it is more than K clocks ahead of the slowest
  live worker (a clock is one accepted push); the held worker is told to ask again and does
  not compute meanwhile, so the fast worker waits for the slow one. Ho et al., "More
  Effective Distributed ML via a Stale Synchronous Parallel Parameter Server", NIPS 2013
  (Petuum Bösen). Unlike ``bounded:K`` nothing is dropped: the bound is kept by waiting.

- ``dc:L`` / ``dc-a:L`` (delay compensation), ``gap-aware`` (damping by the parameter gap),
  ``momentum-aware[:B]`` (Adam's beta_1 lowered as staleness grows) and ``lookahead[:A]``
  (pulls served extrapolated weights; ``momentum-aware[:B]+lookahead[:A]`` combines the
  two): their rules, sources and memory cost are ``downpour.server.policies.compensation``'s
  docstring.

What the server does around a policy follows its ``caps`` (``downpour.config.policy``'s
``Capabilities``, the table's for its form). A policy that holds pulls (``holds_pulls``:
``ssp``) also answers ``pull_wait_ms`` for each pull from an enrolled worker: 0 to serve the
weights, otherwise how long the worker should wait before asking again. A policy that
``extrapolates`` (``lookahead``) chooses the weights a whole pull is served
(``pull_weights``); one that ``needs_weights`` is shown each version's weights (``observe``).

Pure Python and NumPy: no sockets, no TensorFlow. Not thread-safe (the loop is the caller).

Applying ``lr_scale``: the learning rate, not the gradient
----------------------------------------------------------
Multiplying the gradient by ``lr_scale`` scales an SGD step exactly, but not an Adam or
Adagrad step: they divide by accumulated gradient magnitudes (a gradient times 0.2 gives
Adam the same first step as the gradient itself) and the scaled gradient would also skew
their accumulators. The server therefore scales the *learning rate*:
``optimizer.learning_rate`` of a Keras 3 optimizer built with a float is a variable (a
``keras.Variable`` backed by a ``tf.ResourceVariable``) that the traced apply step reads on
every call, so

    opt.learning_rate.assign(base_lr * decision.lr_scale)   # eager

before ``state.apply(grads)`` takes effect on the next call of the already-traced,
``jit_compile=True`` step, without retracing: for a constant gradient Adam's step is
``-lr * sign(g)`` up to epsilon, and it follows every value assigned eagerly, from inside
another jit-compiled function, or with ``opt.learning_rate = x``, while the step's trace count
stays 1. ``ParameterState`` avoids an eager assign per update: its apply step takes the rate
as one more input, ``tf.TensorSpec((), tf.float32)``, and assigns it inside the step before
``apply_gradients`` (still traced once; the step follows the input).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from downpour.config.policy import PLAIN, Capabilities, capabilities

APPLY = "apply"
DROP = "drop"
HOLD = "hold"

# Which variables an applied decision's gradients are for (``ParameterState.apply``'s part):
# all of them, or one half of a hybrid policy's push.
ALL = "all"
DENSE = "dense"
ROWS = "rows"
ApplyPart = Literal["all", "dense", "rows"]

# Decision reasons: a stable vocabulary for logs and status counters.
REASON_FRESH = "fresh"  # applied, tau == 0
REASON_STALE_APPLIED = "stale_applied"  # applied although tau > 0
REASON_STALE = "stale"  # bounded: tau > K, dropped
REASON_LATE = "late"  # sync: computed from an older version than the one being aggregated
REASON_DUPLICATE = "duplicate_worker"  # sync: this worker already gave to this round
REASON_BUFFERED = "buffered"  # sync: held in the aggregation buffer
REASON_AGGREGATED = "aggregated"  # sync: the K-th gradient completed the round
REASON_FLUSH = "flush"  # sync: a partial round applied at shutdown

COUNTER_KEYS = (
    "offered",  # every gradient offered
    "updates",  # apply decisions: version steps
    "applied",  # gradients that reached the weights (sync: K per update)
    "scaled",  # staleness-aware: applied with lr_scale < 1
    "dropped_stale",  # bounded: tau > K
    "late",  # sync: base_version older than the round's version
    "duplicate",  # sync: a second gradient from one worker in one round
    "aggregated",  # sync: gradients added to the aggregation buffer
    "discarded",  # sync: held gradients thrown away because the version moved under them
    "held_pulls",  # ssp: pulls answered "wait" (the puller was more than K clocks ahead)
)

SSP_RETRY_MS = 20  # ssp: a held pull is asked again after this (a wait reply carries no weights)


@dataclass(frozen=True)
class Decision:
    """What to do with one offered gradient list.

    ``grads`` is set for ``apply`` only. For ``sync`` it is the policy's own buffer: valid
    until the next ``offer``/``flush``, so apply it (the server's apply copies it) before that.
    ``workers`` are the senders whose gradients the update contains (one, or K for sync).
    ``momentum``, when set, is the optimizer's ``beta_1`` to use from this update on.
    ``part`` names the variables ``grads`` are for (``all``; a hybrid policy's ``dense`` or
    ``rows`` half). ``rows``, set by a hybrid policy only, is the decision about the same
    push's row-sparse half: the server applies it (when it says ``apply``) before this one.
    """

    action: Literal["apply", "drop", "hold"]
    grads: list[np.ndarray] | None = None
    lr_scale: float = 1.0
    reason: str = ""
    staleness: int = 0
    workers: tuple[str, ...] = ()
    momentum: float | None = None  # momentum-aware: Adam's beta_1 for this update (None: keep)
    part: ApplyPart = ALL
    rows: Decision | None = None  # hybrid: the push's row-sparse half, applied first


class Policy(ABC):
    """A staleness policy. ``offer`` decides per gradient; ``counters`` count the decisions.

    ``offer`` is the one entry: it counts the offer and hands the gradient's staleness to the
    policy's own rule, ``decide``."""

    kind: str = ""
    # what the server does around it (downpour.config.policy's table, for the policy's form):
    # holds_pulls: asks pull_wait_ms before serving a worker's pull; needs_weights: calls
    # observe(version, weights) before each offer; extrapolates: a whole pull is served
    # pull_weights(version, snapshot); sets_beta_1: decisions carry the optimizer's beta_1
    caps: Capabilities = PLAIN

    def __init__(self) -> None:
        self.counters: dict[str, int] = dict.fromkeys(COUNTER_KEYS, 0)

    @property
    @abstractmethod
    def spec(self) -> str:
        """The canonical text: ``parse_policy(p.spec)`` builds an equal policy."""

    def offer(
        self, grads: Sequence[np.ndarray], base_version: int, version: int, worker: str
    ) -> Decision:
        """Decide about one push: dense gradients in variable order (read-only views are fine:
        a policy that keeps them copies them), the version they were computed from, the
        server's current version and the sender. ``base_version <= version``: the gradient
        handler refuses a push from a future version before any policy sees it."""
        self.counters["offered"] += 1
        return self.decide(grads, version - base_version, version, worker)

    @abstractmethod
    def decide(self, grads: Sequence[np.ndarray], tau: int, version: int, worker: str) -> Decision:
        """The policy's rule for one offered push of staleness ``tau >= 0`` (``offer``'s
        arguments otherwise; the push's base version is ``version - tau``)."""

    def layout(self, row_sparse: Sequence[bool]) -> None:
        """The shard's variables in order, True for a row-sparse one (an Embedding's table
        or a dynamic table): the server tells every policy once, before any offer; only a
        hybrid policy, which splits each push in two halves, uses it."""
        return None

    def observe(self, version: int, weights: Sequence[np.ndarray]) -> None:
        """The server's current weights (an immutable snapshot) before an offer; only
        policies whose ``caps`` say ``needs_weights`` are told
        (``downpour.server.policies.compensation``)."""
        return None

    def pull_weights(
        self,
        version: int,
        weights: Sequence[np.ndarray],
        skip: Collection[int] = (),
    ) -> list[np.ndarray]:
        """The weights a pull of ``version`` is served (``weights``: its snapshot; the
        arrays at indices ``skip``, e.g. row-sparse tables, are served as they are). Only
        policies whose ``caps`` say ``extrapolates`` are asked (``lookahead``: where the server
        is expected to be when the puller's gradient lands); the others serve the snapshot
        itself."""
        return list(weights)

    def flush(self, version: int) -> Decision | None:
        """At shutdown: an update made of held gradients, or None (only sync holds any)."""
        return None

    def pull_wait_ms(self, worker: str, in_flight: int, live: Collection[str]) -> int:
        """Before serving ``worker``'s pull: 0 to serve it, else milliseconds to wait before
        asking again. ``in_flight``: pushes it sent that were not yet taken; ``live``: the
        workers the registry calls alive. Only policies that ``holds_pulls`` hold pulls."""
        return 0

    @property
    def dense_version(self) -> int | None:
        """What every pull reply carries as ``dense_version``: the dense updates made, where
        they differ from the versions (a hybrid on a shard with dense variables); else None."""
        return None

    def describe(self) -> dict[str, Any]:
        """For the status document: the policy, its parameters and counters."""
        return {"policy": self.spec, "kind": self.kind, "counters": dict(self.counters)}

    def __str__(self) -> str:
        return self.spec

    def _apply(
        self,
        grads: Sequence[np.ndarray],
        tau: int,
        worker: str,
        scale: float = 1.0,
        momentum: float | None = None,
    ) -> Decision:
        self.counters["updates"] += 1
        self.counters["applied"] += 1
        return Decision(
            APPLY,
            list(grads),
            lr_scale=scale,
            reason=REASON_FRESH if tau == 0 else REASON_STALE_APPLIED,
            staleness=tau,
            workers=(worker,),
            momentum=momentum,
        )


class AsyncPolicy(Policy):
    """Downpour SGD: apply every gradient as it arrives, whatever its staleness, scale 1.

    Dean et al., "Large Scale Distributed Deep Networks", NIPS 2012 (Downpour SGD).
    """

    kind = "async"
    caps = capabilities("async")

    @property
    def spec(self) -> str:
        return "async"

    def decide(self, grads: Sequence[np.ndarray], tau: int, version: int, worker: str) -> Decision:
        return self._apply(grads, tau, worker)


class StalenessAwarePolicy(Policy):
    """Apply every gradient with the learning rate divided by its staleness.

    Zhang, Gupta, Lian, Liu, "Staleness-aware Async-SGD for Distributed Deep Learning",
    IJCAI 2016, eq. 4: ``alpha = alpha0 / tau`` for ``tau != 0``, ``alpha0`` for ``tau == 0``.
    Here exactly: ``lr_scale = 1 / max(1, tau)``, ``tau = version - base_version``; so tau 0
    and 1 give 1.0, tau 5 gives 0.2. The scale multiplies the learning rate, not the gradient
    (which would not change an Adam step; see the module docstring).
    """

    kind = "staleness-aware"
    caps = capabilities("staleness-aware")

    @property
    def spec(self) -> str:
        return "staleness-aware"

    @staticmethod
    def scale(tau: int) -> float:
        """``1 / max(1, tau)``."""
        return 1.0 / max(1, tau)

    def decide(self, grads: Sequence[np.ndarray], tau: int, version: int, worker: str) -> Decision:
        scale = self.scale(tau)
        if scale < 1.0:
            self.counters["scaled"] += 1
        return self._apply(grads, tau, worker, scale)


class BoundedPolicy(Policy):
    """Bounded staleness: drop a gradient with ``tau > K``; apply the others with scale 1.

    Ho et al., "More Effective Distributed ML via a Stale Synchronous Parallel Parameter
    Server", NIPS 2013 (SSP). SSP bounds staleness by making a worker that is K clocks ahead
    wait (``ssp:K``, ``SSPPolicy``); ``bounded:K`` makes nobody wait and enforces a bound at
    the other end: a gradient older than K versions is dropped (counted ``dropped_stale``), and
    the worker's next pull brings it back within the bound. ``bounded:0`` applies only
    gradients computed from the current weights.
    """

    kind = "bounded"
    caps = capabilities("bounded:K")

    def __init__(self, max_staleness: int) -> None:
        super().__init__()
        if max_staleness < 0:
            raise ValueError(
                f"bounded:K needs K >= 0 (the largest staleness applied), got K={max_staleness}"
            )
        self.max_staleness = max_staleness

    @property
    def spec(self) -> str:
        return f"bounded:{self.max_staleness}"

    def decide(self, grads: Sequence[np.ndarray], tau: int, version: int, worker: str) -> Decision:
        if tau > self.max_staleness:
            self.counters["dropped_stale"] += 1
            return Decision(DROP, reason=REASON_STALE, staleness=tau, workers=(worker,))
        return self._apply(grads, tau, worker)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "max_staleness": self.max_staleness}


class SSPPolicy(Policy):
    """Stale synchronous parallel: a worker more than K clocks ahead of the slowest live
    worker waits, inside its pull, until the slowest catches up; every gradient is applied.

    Ho et al., "More Effective Distributed ML via a Stale Synchronous Parallel Parameter
    Server", NIPS 2013 (Petuum Bösen). A worker's clock is its count of pushes offered to
    this policy (this server's incarnation). Its pull is held (``pull_wait_ms`` > 0) while
    ``clock + in_flight - slowest > K``, where ``slowest`` is the smallest clock among the
    *other* live workers and ``in_flight`` counts its pushes sent but not yet taken (the
    pull and the push travel on different sockets). The slowest worker is never held, so
    the wait always ends: by the slow worker's progress, or by it going missing, since a
    worker the registry does not call alive is forgotten and stops holding the others
    back. A worker that appears (first pull or push, or back after being forgotten) starts
    at the slowest live clock, so a late or restarted worker neither waits for the others
    nor holds them back. With one pull before each push (``--n-fetch`` = ``--n-push`` = 1,
    the defaults) a worker's lead over the slowest live one stays at most K + 1.
    """

    kind = "ssp"
    caps = capabilities("ssp:K")

    def __init__(self, max_lead: int, retry_ms: int = SSP_RETRY_MS) -> None:
        super().__init__()
        if max_lead < 0:
            raise ValueError(f"ssp:K needs K >= 0 (max clocks ahead), got K={max_lead}")
        self.max_lead = max_lead
        self.retry_ms = retry_ms
        self.clocks: dict[str, int] = {}

    @property
    def spec(self) -> str:
        return f"ssp:{self.max_lead}"

    def _join(self, worker: str) -> int:
        """The clock of ``worker``; a newcomer starts at the slowest known clock."""
        clock = self.clocks.get(worker)
        if clock is None:
            clock = self.clocks[worker] = min(self.clocks.values(), default=0)
        return clock

    def decide(self, grads: Sequence[np.ndarray], tau: int, version: int, worker: str) -> Decision:
        self.clocks[worker] = self._join(worker) + 1
        return self._apply(grads, tau, worker)

    def lead(self, worker: str, in_flight: int = 0) -> int:
        """How many clocks ``worker`` (with ``in_flight`` pushes still travelling) is ahead
        of the slowest other known worker (0 when alone)."""
        mine = self._join(worker)
        others = [c for w, c in self.clocks.items() if w != worker]
        return mine + max(0, in_flight) - min(others) if others else 0

    def pull_wait_ms(self, worker: str, in_flight: int, live: Collection[str]) -> int:
        for w in [w for w in self.clocks if w != worker and w not in live]:
            del self.clocks[w]  # missing or gone: it holds nobody back, and rejoins anew
        mine = self._join(worker)
        others = [c for w, c in self.clocks.items() if w != worker]
        if not others or mine <= min(others):  # the slowest is never held
            return 0
        if self.lead(worker, in_flight) <= self.max_lead:
            return 0
        self.counters["held_pulls"] += 1
        return self.retry_ms

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "max_lead": self.max_lead, "clocks": dict(self.clocks)}


@dataclass
class _Round:
    """The sync aggregation buffer: float32 sums per variable, refilled each version."""

    sums: list[np.ndarray] = field(default_factory=list)
    dtypes: list[np.dtype] = field(default_factory=list)  # the gradients' own dtypes
    version: int = -1
    workers: list[str] = field(default_factory=list)


class SyncPolicy(Policy):
    """Synchronous SGD with backup workers: one update per version, the mean of K gradients.

    Chen, Pan, Monga, Bengio, Jozefowicz, "Revisiting Distributed Synchronous SGD", 2016
    (TensorFlow's ``SyncReplicasOptimizer``): N workers compute gradients from the same
    weights; the first K to arrive are averaged and applied once, the N - K slowest (backup
    workers) are discarded. Here a gradient with ``base_version == version`` is summed into
    a preallocated float32 buffer (``hold``) until K distinct workers have given one; the K-th
    returns ``apply`` with their mean and scale 1, and the next version starts a new round.
    A gradient computed from an older version is dropped as ``late``; a second one from the
    same worker in a round as ``duplicate_worker`` (so the mean is over K workers, as in the
    paper). N is the number of workers expected; it is reported, the rule needs only K.
    With fewer than K live workers no update happens: that is synchronous SGD.
    """

    kind = "sync"
    caps = capabilities("sync:K/N")

    def __init__(self, aggregate: int, workers: int) -> None:
        super().__init__()
        if workers < 1:
            raise ValueError(f"sync:K/N needs N >= 1 workers, got N={workers}")
        if not 1 <= aggregate <= workers:
            raise ValueError(
                f"sync:K/N needs 1 <= K <= N (K gradients averaged out of N workers), "
                f"got K={aggregate}, N={workers}"
            )
        self.aggregate = aggregate
        self.expected_workers = workers
        self._round = _Round()

    @property
    def spec(self) -> str:
        return f"sync:{self.aggregate}/{self.expected_workers}"

    @property
    def pending(self) -> int:
        """Gradients held for the current round."""
        return len(self._round.workers)

    def _buffers(self, grads: Sequence[np.ndarray]) -> list[np.ndarray]:
        """The preallocated sums (made at the first offer); the shapes must never change."""
        r = self._round
        if not r.sums:
            r.sums = [np.empty(np.shape(g), _sum_dtype(g.dtype)) for g in grads]
            r.dtypes = [np.dtype(g.dtype) for g in grads]
        if len(grads) != len(r.sums) or any(
            np.shape(g) != s.shape for g, s in zip(grads, r.sums, strict=False)
        ):
            raise ValueError("sync: gradient shapes differ from the first offer's")
        return r.sums

    def decide(self, grads: Sequence[np.ndarray], tau: int, version: int, worker: str) -> Decision:
        r = self._round
        if r.version != version:  # a new round: what is held was for a version now gone
            self.counters["discarded"] += len(r.workers)
            r.version, r.workers = version, []
        if tau > 0:
            self.counters["late"] += 1
            return Decision(DROP, reason=REASON_LATE, staleness=tau, workers=(worker,))
        if worker in r.workers:
            self.counters["duplicate"] += 1
            return Decision(DROP, reason=REASON_DUPLICATE, staleness=tau, workers=(worker,))
        sums = self._buffers(grads)
        first = not r.workers
        for s, g in zip(sums, grads, strict=True):
            if first:  # the copy: incoming arrays are views of network buffers soon freed
                np.copyto(s, g, casting="same_kind")
            else:
                np.add(s, g, out=s, casting="same_kind")
        r.workers.append(worker)
        self.counters["aggregated"] += 1
        if len(r.workers) < self.aggregate:
            return Decision(HOLD, reason=REASON_BUFFERED, staleness=tau, workers=(worker,))
        return self._take(tau, REASON_AGGREGATED)

    def _take(self, tau: int, reason: str) -> Decision:
        """The mean of the round's sums, in place; the round ends (next offer starts anew)."""
        r = self._round
        n = len(r.workers)
        for s in r.sums:
            np.multiply(s, 1.0 / n, out=s)
        # in the gradients' dtype: float32 and float64 need no copy, float16 one
        out = [s.astype(d, copy=False) for s, d in zip(r.sums, r.dtypes, strict=True)]
        workers = tuple(r.workers)
        r.workers = []
        r.version = -1
        self.counters["updates"] += 1
        self.counters["applied"] += n
        return Decision(APPLY, out, 1.0, reason, staleness=tau, workers=workers)

    def flush(self, version: int) -> Decision | None:
        """At shutdown: the mean of what the current round holds (fewer than K), or None."""
        if not self._round.workers or self._round.version != version:
            return None
        return self._take(0, REASON_FLUSH)

    def describe(self) -> dict[str, Any]:
        return {
            **super().describe(),
            "aggregate": self.aggregate,
            "expected_workers": self.expected_workers,
            "pending": self.pending,
            "round_version": self._round.version if self._round.workers else None,
        }


def _sum_dtype(dtype: np.dtype) -> np.dtype:
    """float32 sums (float64 for float64 gradients: no precision lost)."""
    return np.dtype(np.float64 if np.dtype(dtype) == np.float64 else np.float32)


def parse_policy(text: str) -> Policy:
    """A fresh Policy from its text, one of ``downpour.config.policy.POLICIES``'s forms
    (``async``, ``bounded:K``, ``sync:K/N``, ``lookahead[:A]`` ...; case and surrounding
    spaces ignored). Raises ValueError saying what was expected for anything else: a text
    that is no form, a parameter out of its range (the constructor's message), a hybrid's
    half that cannot be that half; each prefixed with the text."""
    from downpour.server.policies.forms import build_policy  # it imports this module

    return build_policy(text)
