"""A count-min sketch of id touches in bounded memory: the admission count of a dynamic table.

``depth`` rows of ``width`` saturating uint8 counters (``depth x width`` bytes); row ``j``
counts id ``x`` in bucket ``mix64(x ^ salt_j) mod width``, and an id's estimate is the
minimum over the rows. An estimate is never below the id's true count (while the counters
neither saturate nor age) and exceeds it only through collisions. ``for_error`` sizes the
sketch the textbook way: with ``width = e / epsilon`` and ``depth = ln(1 / delta)``, an
estimate is within ``epsilon x`` (the mass counted) of the truth with probability
``1 - delta``.

Ageing: the counters halve each time ``window`` touches have been counted since the last
halving (TinyLFU's reset), so the mass in the sketch stays below ``2 x window`` however many
ids flood it, and an id must collect its touches within about a window to be admitted.

False admissions: an id with ``c`` true touches passes ``n`` when every row's bucket holds at
least ``k = n - c`` touches of other ids. With ``lam`` = (mass in the sketch) / ``width``
other touches per bucket, a bucket's share is about Poisson(``lam``), so the rate is
``false_admit_rate(lam, k, depth) = P(Poisson(lam) >= k) ** depth``. With the defaults
(width 2**20, depth 4, window = width / 2) ``lam`` stays in [0.5, 1] under a flood of
unique ids: an id one touch short (``k = 1``) is admitted early with probability 0.024 to
0.16 (0.078 at ``lam`` = 0.75), two touches short 7e-5 to 0.005; a lighter load gives less.
"""

from __future__ import annotations

import math

import numpy as np

from downpour.model.hashing import mix64

SATURATE = 255  # a uint8 counter stops here
_SALTS = np.array(
    [0x243F6A8885A308D3, 0x13198A2E03707344, 0xA4093822299F31D0, 0x082EFA98EC4E6C89,
     0x452821E638D01377, 0xBE5466CF34E90C6C, 0xC0AC29B7C97C50DD, 0x3F84D5B5B5470917],
    np.uint64,
)  # fmt: skip


def false_admit_rate(lam: float, k: int, depth: int) -> float:
    """The chance an id short of ``k`` touches is admitted anyway: every one of ``depth``
    buckets holds ``k`` or more touches of other ids, each bucket's share Poisson(``lam``)."""
    below = sum(math.exp(-lam) * lam**i / math.factorial(i) for i in range(k))
    return (1.0 - below) ** depth


class CountMinSketch:
    """Counts touches of int64 ids; ``add`` returns each id's estimate after counting."""

    def __init__(self, width: int = 1 << 20, depth: int = 4, window: int | None = None) -> None:
        if width < 1 or width & (width - 1):
            raise ValueError(f"width must be a power of two, got {width}")
        if not 1 <= depth <= _SALTS.size:
            raise ValueError(f"depth must be in [1, {_SALTS.size}], got {depth}")
        self.width, self.depth = width, depth
        self.window = window if window is not None else max(1, width // 2)
        self.counters = np.zeros((depth, width), np.uint8)
        self.mass = 0  # touches counted since the last halving

    @classmethod
    def for_error(cls, epsilon: float, delta: float) -> CountMinSketch:
        """A sketch whose estimate is within ``epsilon`` x the counted mass of the truth with
        probability ``1 - delta`` (width rounded up to a power of two)."""
        width = 1 << max(0, math.ceil(math.e / epsilon) - 1).bit_length()
        return cls(width, max(1, math.ceil(math.log(1.0 / delta))))

    @property
    def nbytes(self) -> int:
        return self.counters.nbytes

    def _buckets(self, ids: np.ndarray) -> np.ndarray:
        """(depth, len(ids)) bucket of each id in each row."""
        keys = np.asarray(ids, np.int64).view(np.uint64)[None, :] ^ _SALTS[: self.depth, None]
        return (mix64(keys) & np.uint64(self.width - 1)).astype(np.int64)

    def estimate(self, ids: np.ndarray) -> np.ndarray:
        """Each id's estimated count (int64), without counting it."""
        b = self._buckets(ids)
        return self.counters[np.arange(self.depth)[:, None], b].min(axis=0).astype(np.int64)

    def add(self, ids: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """Count ``counts`` touches of each id (ids unique), then return the estimates."""
        counts = np.asarray(counts, np.int64)
        est = np.full(len(ids), SATURATE, np.int64)
        for j, b in enumerate(self._buckets(ids)):
            u, inv = np.unique(b, return_inverse=True)
            summed = np.bincount(inv, weights=counts, minlength=u.size).astype(np.int64)
            new = np.minimum(self.counters[j, u].astype(np.int64) + summed, SATURATE)
            self.counters[j, u] = new
            np.minimum(est, new[inv], out=est)
        self.mass += int(counts.sum())
        if self.mass >= self.window:
            self.counters >>= 1
            self.mass = 0
        return est
