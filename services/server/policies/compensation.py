"""Staleness policies that use *how* the weights moved, not only how many versions passed.

``downpour.server.policies.base`` holds the rule-by-count policies and ``parse_policy``; the ones
here correct or damp a stale gradient, or tune the optimizer to the staleness measured:

- ``dc:L`` (delay compensation, DC-ASGD): apply ``g + L * g * g * (w_now - w_base)``
  (element-wise), a first-order Taylor correction of the stale gradient ``g`` towards the
  gradient at the current weights, with ``g * g`` as a cheap diagonal approximation of the
  Hessian. Zheng, Meng, Wang, Chen, Yu, Ma, Liu, "Asynchronous Stochastic Gradient Descent
  with Delay Compensation", ICML 2017, eq. 9 (DC-ASGD-c, constant lambda).
  ``dc-a:L`` is their adaptive form (DC-ASGD-a): ``L`` is divided element-wise by
  ``sqrt(m) + 1e-7``, ``m`` the running mean of ``g * g`` (decay 0.95), so ``L`` needs no
  tuning to the gradients' scale.
- ``gap-aware``: apply with ``lr_scale = 1 / max(1, gap / step)``, ``gap = ||w_now -
  w_base||`` (L2 over every variable of the server) and ``step`` the running mean of one
  update's ``||w_v - w_{v-1}||``: the penalty follows how far the parameters moved while the
  gradient was in flight, not the count of versions. Barkai, Hakimi, Schuster, "Gap Aware
  Mitigation of Gradient Staleness", ICLR 2020 (the paper divides each coordinate's gradient
  by its own gap; for Adam, which undoes gradient scaling, the server scales the learning rate
  by the global ratio instead).
- ``momentum-aware[:B]``: asynchrony acts as momentum ``1 - 1/M`` for M workers (Mitliagkas,
  Zhang, Hadjis, Ré, "Asynchrony begets Momentum, with an Application to Deep Learning",
  2016). With mean staleness ``s`` (a running mean over the last 100 gradients) the implicit
  momentum is ``s / (s + 1)`` (``M = s + 1``), and the optimizer's own momentum is set to
  ``beta_1 = max(0, B - s / (s + 1))`` (``B`` default 0.9, Adam's), rounded to 0.001:
  ``Decision.momentum``, which the server assigns to Adam's ``beta_1`` before the update
  (``ParameterState.set_momentum``). One worker keeps ``B``; 8 workers (s = 7) get 0.025.
  Needs an optimizer with ``beta_1`` (adam).
- ``lookahead[:A]`` (look-ahead pulls): a whole pull of version ``v`` is served
  ``w_v + A * (w_v - w_{v-k})`` instead of ``w_v``, with ``k = round(s)`` (``s`` the running
  mean staleness over the last 100 gradients, as momentum-aware's; ``A`` default 1): the
  server is expected to move about as far in the ``k`` updates a gradient is in flight as in
  the last ``k``, so the worker computes its gradient near the weights it will be applied
  to. Every gradient is applied as ``async`` does. Worker-side look-ahead of Hakimi, Barkai,
  Gabel, Schuster, "Taming Momentum in a Distributed Asynchronous Environment" (DANA), 2019,
  which extrapolates with the optimizer's momentum; here with the weights' own recent motion,
  which includes Adam's normalisation and the other workers' updates.
  ``momentum-aware[:B]+lookahead[:A]`` also lowers ``beta_1`` as momentum-aware does. With
  one worker (``k`` = 0) the weights are served as they are. Only whole pulls are
  extrapolated, and only their float, non-row-sparse variables; a row pull (Embedding
  tables) is served the weights as they are.

``dc`` and ``gap-aware`` need ``w_base``, the weights a gradient was computed from, and
``lookahead`` needs ``w_{v-k}``: the server hands each policy that ``needs_weights`` the
current snapshot (``observe(version, weights)``) before each offer (``lookahead`` also
records the version it extrapolates), and the policy keeps the last ``R`` versions in a
``WeightRing`` (default R = 32: ``--policy dc:L`` with 8 workers sees staleness up to about
16; ``lookahead``'s ``k`` is at most R - 1). The ring
holds references to the server's per-version snapshots (immutable arrays), so its memory cost
is up to ``R`` x the model's (shard's) bytes: 32 x 0.86 MB for the study's CNN, 32 x 13 MB
for Deep-MNIST. ``lookahead`` adds one extrapolated copy of the model per version (made
at the first pull of the version, shared by every pull of it, replaced at the next
version). A gradient whose base version has left the ring (or from before a restart) is
applied as ``async`` would, counted ``uncompensated``. Row-sparse gradients (``Sparse``, an
Embedding's) are compensated on the rows they touch only (repeated rows summed first); the
gap is measured over the whole dense weights.

Pure Python and NumPy, as the policies module.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence
from typing import Any

import numpy as np

from downpour.config.policy import capabilities
from downpour.server.policies.base import Decision, Policy
from downpour.wire import Sparse, dedupe_rows, densify, is_rows

DEFAULT_RING = 32  # versions of weights kept for dc / gap-aware / lookahead
MOMENTUM_WINDOW = 100  # gradients in the running mean of staleness (momentum-aware)
DC_DECAY = 0.95  # dc-a: decay of the running mean square of the gradient
DC_EPS = 1e-7
DEFAULT_BETA_1 = 0.9  # momentum-aware's B when the text gives none: Adam's own beta_1


class WeightRing:
    """The weights of the last ``size`` versions observed, by version (oldest dropped first).

    Holds references, not copies: the arrays must not change afterwards (the server's
    snapshots never do)."""

    def __init__(self, size: int = DEFAULT_RING) -> None:
        if size < 1:
            raise ValueError(f"weight ring size must be >= 1, got {size}")
        self.size = size
        self._ring: OrderedDict[int, list[np.ndarray]] = OrderedDict()

    def record(self, version: int, weights: Sequence[np.ndarray]) -> bool:
        """Keep ``weights`` as ``version``'s; False (nothing kept) if it is already there."""
        if version in self._ring:
            return False
        self._ring[version] = list(weights)
        while len(self._ring) > self.size:
            self._ring.popitem(last=False)
        return True

    def get(self, version: int) -> list[np.ndarray] | None:
        """The weights of ``version``, or None if not (or no longer) kept."""
        return self._ring.get(version)

    def __len__(self) -> int:
        return len(self._ring)

    @property
    def nbytes(self) -> int:
        """Bytes the kept versions reference."""
        return sum(a.nbytes for ws in self._ring.values() for a in ws)


def _gap(a: Sequence[np.ndarray], b: Sequence[np.ndarray]) -> float:
    """``||a - b||``: the L2 norm over every array of the two lists."""
    return float(
        np.sqrt(
            sum(
                float(np.sum(np.square(x.astype(np.float64) - y)))
                for x, y in zip(a, b, strict=True)
            )
        )
    )


class WeightAwarePolicy(Policy):
    """A policy that needs the weights of past versions (``observe`` before each ``offer``).

    Keeps the ring and the running mean of one update's step ``||w_v - w_{v-1}||``."""

    def __init__(self, ring: int = DEFAULT_RING) -> None:
        super().__init__()
        self.ring = WeightRing(ring)
        self.counters["uncompensated"] = 0  # base version no longer (or never) in the ring
        self.step_mean = 0.0
        self._steps = 0

    def observe(self, version: int, weights: Sequence[np.ndarray]) -> None:
        """The server's weights at ``version`` (its current version), before an offer."""
        if self.ring.record(version, weights) and (prev := self.ring.get(version - 1)) is not None:
            self._steps += 1
            a = 1.0 / min(self._steps, MOMENTUM_WINDOW)
            self.step_mean += a * (_gap(weights, prev) - self.step_mean)

    def _pair(
        self, base_version: int, version: int
    ) -> tuple[list[np.ndarray], list[np.ndarray]] | None:
        """(w_now, w_base), or None (counted ``uncompensated``) if either is not kept."""
        now, base = self.ring.get(version), self.ring.get(base_version)
        if now is None or base is None:
            self.counters["uncompensated"] += 1
            return None
        return now, base

    def describe(self) -> dict[str, Any]:
        return {
            **super().describe(),
            "ring_versions": len(self.ring),
            "ring_size": self.ring.size,
            "ring_bytes": self.ring.nbytes,
            "step_mean": self.step_mean,
        }


class DelayCompensatedPolicy(WeightAwarePolicy):
    """DC-ASGD: apply ``g + L * g * g * (w_now - w_base)`` (adaptive: ``L / (sqrt(m) +
    1e-7)``, ``m`` the running mean of ``g * g``). Zheng et al., ICML 2017. A fresh gradient
    (tau 0) is applied unchanged; see the module docstring for the ring and sparse rows."""

    kind = "dc"
    caps = capabilities("dc:L")

    def __init__(self, lam: float, adaptive: bool = False, ring: int = DEFAULT_RING) -> None:
        super().__init__(ring)
        if not (np.isfinite(lam) and lam >= 0):
            form = "dc-a" if adaptive else "dc"
            raise ValueError(f"{form}:L needs a finite number L >= 0 (lambda), got L={lam:g}")
        self.lam = float(lam)
        self.adaptive = adaptive
        if adaptive:
            self.caps = capabilities("dc-a:L")
        self.counters["compensated"] = 0
        self._meansq: list[np.ndarray] | None = None  # dc-a: running mean of g*g (dense)

    @property
    def spec(self) -> str:
        return f"{'dc-a' if self.adaptive else 'dc'}:{self.lam:g}"

    def _lams(self, grads: Sequence[np.ndarray | Sparse]) -> list[Any]:
        """Per variable: the factor multiplying ``g * g * (w_now - w_base)``."""
        if not self.adaptive:
            return [self.lam] * len(grads)
        dense = [densify(g) for g in grads]
        if self._meansq is None:
            self._meansq = [np.square(g, dtype=np.float32) for g in dense]
        else:
            for m, g in zip(self._meansq, dense, strict=True):
                m *= DC_DECAY
                m += (1.0 - DC_DECAY) * np.square(g, dtype=np.float32)
        return [self.lam / (np.sqrt(m) + DC_EPS) for m in self._meansq]

    def decide(self, grads: Sequence[np.ndarray], tau: int, version: int, worker: str) -> Decision:
        lams = self._lams(grads)
        pair = self._pair(version - tau, version) if tau > 0 else None
        if pair is None:
            return self._apply(grads, tau, worker)
        now, base = pair
        out: list[Any] = []
        for g, lam, a, b in zip(grads, lams, now, base, strict=True):
            if is_rows(g):
                rows, vals = dedupe_rows(  # fresh arrays: compensated in place below
                    np.asarray(g.indices), np.asarray(g.values, dtype=np.float32)
                )
                lam_rows = lam if np.isscalar(lam) else lam[rows]
                vals += lam_rows * vals * vals * (a[rows] - b[rows])
                out.append(Sparse(rows, vals.astype(g.values.dtype, copy=False), g.dense_shape))
            else:
                g = np.asarray(g)
                comp = g + lam * g * g * (a - b)
                out.append(comp.astype(g.dtype, copy=False))
        self.counters["compensated"] += 1
        return self._apply(out, tau, worker)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "lambda": self.lam, "adaptive": self.adaptive}


class GapAwarePolicy(WeightAwarePolicy):
    """Gap-aware damping: ``lr_scale = 1 / max(1, ||w_now - w_base|| / step)``, ``step`` the
    running mean of one update's size. Barkai, Hakimi, Schuster, ICLR 2020."""

    kind = "gap-aware"
    caps = capabilities("gap-aware")

    def __init__(self, ring: int = DEFAULT_RING) -> None:
        super().__init__(ring)

    @property
    def spec(self) -> str:
        return "gap-aware"

    def scale(self, gap: float) -> float:
        """``1 / max(1, gap / step)``; 1 before any step has been measured."""
        if self.step_mean <= 0.0:
            return 1.0
        return 1.0 / max(1.0, gap / self.step_mean)

    def decide(self, grads: Sequence[np.ndarray], tau: int, version: int, worker: str) -> Decision:
        pair = self._pair(version - tau, version) if tau > 0 else None
        scale = self.scale(_gap(*pair)) if pair is not None else 1.0
        if scale < 1.0:
            self.counters["scaled"] += 1
        return self._apply(grads, tau, worker, scale)


class StalenessMean:
    """The mean staleness of the gradients offered so far: the plain mean over the first
    ``window``, then an exponential one with weight ``1 / window`` (momentum-aware and
    lookahead follow it)."""

    def __init__(self, window: int = MOMENTUM_WINDOW) -> None:
        self.window = window
        self.n = 0
        self.value = 0.0

    def add(self, tau: int) -> float:
        """The mean with ``tau`` counted in."""
        self.n += 1
        self.value += (tau - self.value) / min(self.n, self.window)
        return self.value


class MomentumAwarePolicy(Policy):
    """Asynchrony-aware momentum: ``beta_1 = max(0, B - s / (s + 1))`` for mean staleness
    ``s``. Mitliagkas et al., 2016. Every gradient is applied with ``lr``."""

    kind = "momentum-aware"
    caps = capabilities("momentum-aware[:B]")

    def __init__(self, beta_1: float = DEFAULT_BETA_1, window: int = MOMENTUM_WINDOW) -> None:
        super().__init__()
        if not 0.0 <= beta_1 < 1.0:
            raise ValueError(f"momentum-aware:B needs 0 <= B < 1 (Adam's beta_1), got B={beta_1:g}")
        self.beta_1 = float(beta_1)
        self.staleness = StalenessMean(window)

    @property
    def spec(self) -> str:
        if self.beta_1 == DEFAULT_BETA_1:
            return "momentum-aware"
        return f"momentum-aware:{self.beta_1:g}"

    @property
    def mean_staleness(self) -> float:
        return self.staleness.value

    def momentum(self, mean_staleness: float) -> float:
        """``max(0, B - s / (s + 1))``, rounded to 0.001."""
        s = max(0.0, mean_staleness)
        return round(max(0.0, self.beta_1 - s / (s + 1.0)), 3)

    def decide(self, grads: Sequence[np.ndarray], tau: int, version: int, worker: str) -> Decision:
        return self._apply(grads, tau, worker, momentum=self.momentum(self.staleness.add(tau)))

    def describe(self) -> dict[str, Any]:
        return {
            **super().describe(),
            "beta_1_target": self.beta_1,
            "mean_staleness": self.mean_staleness,
            "beta_1": self.momentum(self.mean_staleness),
        }


class LookaheadPolicy(WeightAwarePolicy):
    """Look-ahead pulls: serve ``w_v + A * (w_v - w_{v-k})``, ``k = round(s)`` for mean
    staleness ``s``, so a gradient is computed near where the server will be when it lands.
    Hakimi, Barkai, Gabel, Schuster, "Taming Momentum in a Distributed Asynchronous
    Environment" (DANA), 2019. Every gradient is applied with ``lr``; with ``beta_1`` set,
    also with momentum-aware's ``beta_1`` (``momentum-aware+lookahead``)."""

    kind = "lookahead"
    caps = capabilities("lookahead[:A]")

    def __init__(
        self,
        scale: float = 1.0,
        beta_1: float | None = None,
        ring: int = DEFAULT_RING,
        window: int = MOMENTUM_WINDOW,
    ) -> None:
        super().__init__(ring)
        if not (np.isfinite(scale) and scale >= 0):
            raise ValueError(f"lookahead:A needs a finite number A >= 0, got A={scale:g}")
        if beta_1 is not None and not 0.0 <= beta_1 < 1.0:
            raise ValueError(
                f"momentum-aware:B+lookahead needs 0 <= B < 1 (Adam's beta_1), got B={beta_1:g}"
            )
        self.scale = float(scale)
        self.momentum_policy = None if beta_1 is None else MomentumAwarePolicy(beta_1, window)
        if beta_1 is not None:
            self.caps = capabilities("momentum-aware[:B]+lookahead[:A]")
        self.staleness = StalenessMean(window)
        self._cache: tuple[int, list[np.ndarray]] | None = None
        self.counters["extrapolated"] = 0  # versions served extrapolated
        self.counters["not_extrapolated"] = 0  # ... served as they are (no w_{v-k} kept yet)

    @property
    def spec(self) -> str:
        tail = "" if self.scale == 1.0 else f":{self.scale:g}"
        if self.momentum_policy is None:
            return f"lookahead{tail}"
        return f"{self.momentum_policy.spec}+lookahead{tail}"

    @property
    def mean_staleness(self) -> float:
        return self.staleness.value

    def horizon(self) -> int:
        """``k = round(s)``: the versions the server is expected to move while a gradient
        computed now is in flight (0: nothing to extrapolate)."""
        return min(int(round(self.mean_staleness)), self.ring.size - 1)

    def decide(self, grads: Sequence[np.ndarray], tau: int, version: int, worker: str) -> Decision:
        s = self.staleness.add(tau)
        momentum = None if self.momentum_policy is None else self.momentum_policy.momentum(s)
        return self._apply(grads, tau, worker, momentum=momentum)

    def pull_weights(
        self,
        version: int,
        weights: Sequence[np.ndarray],
        skip: Collection[int] = (),
    ) -> list[np.ndarray]:
        """``w_v + A * (w_v - w_{v-k})`` for every float array not in ``skip``; computed once
        per version and shared by every pull of it. Served as they are while ``k`` is 0 or
        ``w_{v-k}`` is not kept."""
        if self._cache is not None and self._cache[0] == version:
            return self._cache[1]
        self.observe(version, weights)
        k = self.horizon()
        base = self.ring.get(version - k) if k > 0 and self.scale > 0 else None
        if base is None:
            self.counters["not_extrapolated"] += 1
            out = list(weights)
        else:
            self.counters["extrapolated"] += 1
            out = []
            for i, (w, b) in enumerate(zip(weights, base, strict=True)):
                if i in skip or not np.issubdtype(w.dtype, np.floating):
                    out.append(w)
                    continue
                e = (w + self.scale * (w - b)).astype(w.dtype, copy=False)  # a fresh array
                e.setflags(write=False)  # shared by every pull of this version, as a snapshot
                out.append(e)
        self._cache = (version, out)
        return out

    def describe(self) -> dict[str, Any]:
        out = {
            **super().describe(),
            "scale": self.scale,
            "mean_staleness": self.mean_staleness,
            "horizon": self.horizon(),
        }
        if self.momentum_policy is not None:
            out["beta_1"] = self.momentum_policy.momentum(self.mean_staleness)
        return out
