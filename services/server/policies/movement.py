"""How far the weights moved since a worker's version: the server's side of ``--pull-bound``.

A worker started with ``--pull-bound B`` sends ``B`` with each pull, and the server answers
"unchanged" (no tensors: the worker computes on, from the weights it holds) while the dense
weights it would send moved by at most ``B`` of their norm since the version the worker
holds: ``||w_now - w_have|| / ||w_now||``, over this shard's float variables that are not
row-sparse (tables served by row travel as rows, whose staleness the row cache bounds).

The distance is estimated on a fixed sample of the weights' elements (``sample_plan``):
about ``SAMPLE_ELEMENTS`` in all (every element of a smaller model), spread over the
variables in proportion to their sizes, each variable's share read as runs of
``SAMPLE_BLOCK`` consecutive elements at uniformly drawn, seeded positions (a row gather:
element-by-element gathers of as many cost several times more), small variables whole.
Each sampled element is weighted by its variable's size over its sampled elements, so the
weighted squared norms estimate the full ones (a stratified sample) and their ratio the
relative distance. Samples are taken only for the versions bounded pulls
see: the version a bounded pull is served (the one its worker then holds) and the current
one when a bounded pull is checked against it; one compiled call reads a sample, at most
once per version, and the last ``KEPT_VERSIONS`` are kept. A server whose workers send no
bound samples nothing. A pull whose version has no sample (older than the kept ones, or
served without a bound) is served whole.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import keras

log = logging.getLogger("downpour.server")

SAMPLE_ELEMENTS = 16384  # weights' elements sampled per version (all of them if fewer)
SAMPLE_BLOCK = 64  # consecutive elements per sampled run (four 64-byte lines of float32)
KEPT_VERSIONS = 128  # versions whose samples are kept (16384 float32: 64 KiB each)
SAMPLE_SEED = 0


def sample_plan(
    sizes: Sequence[int], wanted: int = SAMPLE_ELEMENTS, block: int = SAMPLE_BLOCK
) -> list[np.ndarray | None]:
    """Per variable of ``sizes`` elements, the runs of ``block`` consecutive elements to
    sample, as run indices (run ``r``: elements ``r * block`` to ``r * block + block - 1``),
    or None to take it whole. The runs are spread over the variables in proportion to their
    sizes (at least one each), drawn uniformly and seeded; a variable of at most
    ``4 * block`` elements, or of no whole run more than its share, is taken whole."""
    total = sum(sizes)
    if total <= wanted:
        return [None] * len(sizes)
    rng = np.random.default_rng(SAMPLE_SEED)
    runs = wanted // block
    plan: list[np.ndarray | None] = []
    for n in sizes:
        whole_runs = n // block
        share = max(1, round(runs * n / total))
        if n <= 4 * block or whole_runs <= share:
            plan.append(None)
        else:
            plan.append(np.sort(rng.choice(whole_runs, size=share, replace=False)))
    return plan


def _sample_fn(
    variables: Sequence[keras.Variable], plan: Sequence[np.ndarray | None], block: int
) -> Any:
    """One compiled call reading each variable's sample of ``plan`` as one float32 vector:
    whole runs by a row gather of the variable seen as rows of ``block`` (no copy of it)."""
    import tensorflow as tf

    def piece(v: keras.Variable, runs: np.ndarray | None) -> tf.Tensor:
        flat = tf.reshape(v.value, [-1])
        if runs is None:
            return tf.cast(flat, tf.float32)
        n = int(np.prod(v.shape))
        if n % block:  # no rows view without a copy: the runs' elements one by one
            ids = (runs[:, None] * block + np.arange(block)).ravel()
            return tf.cast(tf.gather(flat, tf.constant(ids, tf.int64)), tf.float32)
        rows = tf.reshape(flat, [n // block, block])
        return tf.cast(tf.reshape(tf.gather(rows, tf.constant(runs, tf.int64)), [-1]), tf.float32)

    @tf.function(input_signature=[], jit_compile=True)
    def sample() -> tf.Tensor:
        return tf.concat([piece(v, r) for v, r in zip(variables, plan, strict=True)], axis=0)

    return sample.get_concrete_function()


class Movement:
    """Samples of a shard's dense float weights by version, and the relative distance
    between two. ``variables``: the shard's variables that are not row-sparse (others are
    left out); with no float one nothing can be measured and every bounded pull is served
    whole (``measurable`` is False)."""

    def __init__(
        self,
        variables: Sequence[keras.Variable],
        sample_elements: int = SAMPLE_ELEMENTS,
        kept_versions: int = KEPT_VERSIONS,
    ) -> None:
        self.variables = [v for v in variables if "float" in str(v.dtype)]
        sizes = [int(np.prod(v.shape)) for v in self.variables]
        self.elements = sum(sizes)
        self.plan = sample_plan(sizes, sample_elements)
        # ``scale``: each sampled element stands for size / sampled elements of its variable
        taken = [
            n if r is None else len(r) * SAMPLE_BLOCK for n, r in zip(sizes, self.plan, strict=True)
        ]
        self.sampled = sum(taken)
        self.scale = np.repeat(
            np.array([n / k for n, k in zip(sizes, taken, strict=True)], np.float64), taken
        )
        self.kept_versions = kept_versions
        self.samples: OrderedDict[int, np.ndarray] = OrderedDict()
        self._fn: Any = None  # traced at the first sample
        self.reads = 0  # samples read (at most one per version)
        self.within = 0  # bounded pulls answered "unchanged": moved at most the bound
        self.beyond = 0  # bounded pulls served: moved more, or their version has no sample

    @property
    def measurable(self) -> bool:
        """Whether there is any dense float weight to measure."""
        return self.elements > 0

    def note(self, version: int) -> None:
        """Take the sample of ``version``, the weights now, unless it is kept already;
        forget the oldest beyond ``kept_versions``."""
        if not self.measurable or version in self.samples:
            return
        if self._fn is None:
            self._fn = _sample_fn(self.variables, self.plan, SAMPLE_BLOCK)
            log.info(
                "pull bounds: sampling %d of %d dense weights per version bounded pulls see",
                self.sampled,
                self.elements,
            )
        self.samples[version] = self._fn().numpy()
        self.reads += 1
        while len(self.samples) > self.kept_versions:
            self.samples.popitem(last=False)

    def moved(self, have: int, now: int) -> float | None:
        """The estimated ``||w_now - w_have|| / ||w_now||``; None when either version has
        no sample kept."""
        a, b = self.samples.get(now), self.samples.get(have)
        if a is None or b is None:
            return None
        norm = float(np.sqrt(np.dot(self.scale, np.square(a, dtype=np.float64))))
        dist = float(np.sqrt(np.dot(self.scale, np.square(a - b, dtype=np.float64))))
        if norm == 0.0:
            return 0.0 if dist == 0.0 else float("inf")
        return dist / norm

    def within_bound(self, have: int, now: int, bound: float) -> float | None:
        """For a bounded pull holding ``have`` at current version ``now``: the movement when
        it is at most ``bound`` (the pull is answered "unchanged"), else None (it is served,
        and ``note(now)`` has kept the sample of what it gets)."""
        if not self.measurable:
            self.beyond += 1
            return None
        self.note(now)
        moved = self.moved(have, now)
        if moved is None or moved > bound:
            self.beyond += 1
            return None
        self.within += 1
        return moved

    def describe(self) -> dict[str, Any]:
        """For the status document (``pull_bounds``)."""
        return {
            "sampled": self.sampled if self.reads else 0,
            "dense_elements": self.elements,
            "reads": self.reads,
            "versions_kept": len(self.samples),
            "within": self.within,
            "beyond": self.beyond,
        }
