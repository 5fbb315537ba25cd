"""How far the weights moved since a worker's version: the server's side of ``--pull-bound``.

A worker started with ``--pull-bound B`` sends ``B`` with each pull, and the server answers
"unchanged" (no tensors: the worker computes on, from the weights it holds) while the dense
weights it would send moved by at most ``B`` of their norm since the version the worker
holds: ``||w_now - w_have|| / ||w_now||``, over this shard's variables that are not
row-sparse (tables served by row travel as rows, whose staleness the row cache bounds).

The distance is estimated on a fixed sample of the weights' elements (``SAMPLE_ELEMENTS``,
drawn uniformly once over every element of those variables, seeded): after every apply one
compiled call gathers them (a few hundred microseconds, whatever the model's size), and the
samples of the last ``KEPT_VERSIONS`` versions are kept. Over a uniform sample both squared
norms scale by the same factor in expectation, so the ratio of the sampled norms estimates
the ratio of the full ones; with a sample of thousands of elements its error is a few
percent of the bound. Nothing is sampled until the first pull that carries a bound, so a
server whose workers never ask pays nothing. A pull whose version is not kept (older than
the kept ones, or from before sampling began) is served whole.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import keras
    import tensorflow as tf

log = logging.getLogger("downpour.server")

SAMPLE_ELEMENTS = 16384  # weights' elements sampled per version (all of them if fewer)
KEPT_VERSIONS = 128  # versions whose samples are kept (16384 float32: 64 KiB each)
SAMPLE_SEED = 0


def _sample_fn(
    variables: Sequence[keras.Variable], positions: Sequence[np.ndarray]
) -> tf.types.experimental.ConcreteFunction:
    """One compiled call gathering the flat ``positions`` of each variable, as float32."""
    import tensorflow as tf

    picks = [tf.constant(p, tf.int64) for p in positions]

    @tf.function(input_signature=[])
    def sample() -> tf.Tensor:
        return tf.concat(
            [
                tf.cast(tf.gather(tf.reshape(v.value, [-1]), p), tf.float32)
                for v, p in zip(variables, picks, strict=True)
            ],
            axis=0,
        )

    return sample.get_concrete_function()


class Movement:
    """Samples of the dense weights by version, and the relative distance between two.

    ``variables``: the shard's dense (not row-sparse) float variables. With none, nothing
    can be measured: every bounded pull is served whole (``measurable`` is False).
    """

    def __init__(
        self,
        variables: Sequence[keras.Variable],
        sample_elements: int = SAMPLE_ELEMENTS,
        kept_versions: int = KEPT_VERSIONS,
    ) -> None:
        self.variables = [v for v in variables if "float" in str(v.dtype)]
        self.sample_elements = sample_elements
        self.kept_versions = kept_versions
        self.samples: OrderedDict[int, np.ndarray] = OrderedDict()
        self.elements = sum(int(np.prod(v.shape)) for v in self.variables)
        self._fn: tf.types.experimental.ConcreteFunction | None = None
        self.within = 0  # bounded pulls answered "unchanged": moved at most the bound
        self.beyond = 0  # bounded pulls served: moved more, or their version not kept

    @property
    def measurable(self) -> bool:
        """Whether there is any dense float weight to measure."""
        return self.elements > 0

    @property
    def started(self) -> bool:
        """Whether samples are being taken (since the first bounded pull)."""
        return self._fn is not None

    def start(self, version: int) -> None:
        """Trace the sampling call and take the first sample (``version``, the current)."""
        rng = np.random.default_rng(SAMPLE_SEED)
        n = min(self.sample_elements, self.elements)
        flat = np.sort(rng.choice(self.elements, size=n, replace=False))
        bounds = np.cumsum([0, *(int(np.prod(v.shape)) for v in self.variables)])
        positions = [
            flat[(flat >= lo) & (flat < hi)] - lo
            for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)
        ]
        self._fn = _sample_fn(self.variables, positions)
        log.info("pull bounds: sampling %d of %d dense weights after every apply", n, self.elements)
        self.record(version)

    def record(self, version: int) -> None:
        """Take the sample of ``version`` (the weights now), if sampling; forget the oldest
        beyond ``kept_versions``."""
        if self._fn is None:
            return
        self.samples[version] = self._fn().numpy()
        while len(self.samples) > self.kept_versions:
            self.samples.popitem(last=False)

    def moved(self, have: int, now: int) -> float | None:
        """The estimated ``||w_now - w_have|| / ||w_now||``; None when either version's
        sample is not kept."""
        a, b = self.samples.get(now), self.samples.get(have)
        if a is None or b is None:
            return None
        norm = float(np.linalg.norm(a))
        dist = float(np.linalg.norm(a - b))
        if norm == 0.0:
            return 0.0 if dist == 0.0 else float("inf")
        return dist / norm

    def within_bound(self, have: int, now: int, bound: float) -> float | None:
        """The movement from ``have`` to ``now`` when it is at most ``bound`` (the pull is
        answered "unchanged"), else None (it is served); starts sampling at the first ask."""
        if not self.measurable:
            self.beyond += 1
            return None
        if not self.started:
            self.start(now)
        moved = self.moved(have, now)
        if moved is None or moved > bound:
            self.beyond += 1
            return None
        self.within += 1
        return moved

    def describe(self) -> dict[str, Any]:
        """For the status document (``pull_bounds``)."""
        return {
            "sampling": self.started,
            "sampled": min(self.sample_elements, self.elements) if self.started else 0,
            "dense_elements": self.elements,
            "versions_kept": len(self.samples),
            "within": self.within,
            "beyond": self.beyond,
        }
