"""What a dynamic table may hold and how it chooses: its row budget, fallback rows and policies.

A ``TablePolicy`` is declared once per table (``downpour.layers.DynamicEmbedding``'s
arguments) and means the same in one process and on the servers:

- ``max_rows``: the table's row budget, its own rows and its fallback rows together, over all
  shards (``None``: its own rows are unbounded; only the servers hold such a table). The
  budget is memory: at ``max_rows`` the table never holds a row more (``shard_rows``).
- ``fallback_rows``: rows shared by hashing, as ``keras.layers.Hashing`` shares its bins, a
  count or a fraction of ``max_rows``, counted in the budget. An id without a row of its own
  reads and trains fallback row ``mix64(id) mod B`` (``fallback_of``), so no id is worse off
  than under plain hashing. ``B`` is kept a multiple of the shard count, and of 840 (which 1
  to 8 all divide) once it is that large, so that a shard holds exactly the fallback rows its
  ids use (``mix64(id) mod S`` routes the id, and ``B mod S == 0``) and a restore onto 1 to 8
  shards gives every id the same fallback row.
- ``evict``: which row a full table gives up, least recently updated (``lru``) or least
  frequently touched by its decayed count (``lfu``).
- ``admission``: what a new id must do to take a row from a full table: beat the victim's
  decayed frequency estimate (``victim``, TinyLFU's filter), or nothing (``always``: a plain
  LRU/LFU cache, which thrashes when the ids that come back are more than the rows).
- ``admit_after``: how many touches an id needs before it may take a row at all (1: at its
  first); until then it trains its fallback row.
- ``admit_init``: what a newly admitted row starts from: its fallback row's current value
  (``fallback``: what the id was reading) or its own initial value (``initial``).

The defaults are the budget study's winner (docs: recommendation.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

EVICT_POLICIES = ("lru", "lfu")
ADMISSIONS = ("victim", "always")
ADMIT_INITS = ("fallback", "initial")
ADMIT_MAX = 255  # a count-min sketch counter saturates there (downpour.tables.sketch)
FALLBACK_MULTIPLE = 840  # lcm(1..8): the shard counts whose restores keep fallback rows


@dataclass(frozen=True)
class TablePolicy:
    """A dynamic table's budget and policies (module docstring)."""

    max_rows: int | None = 1 << 16
    fallback_rows: float = 0.0  # a fraction of max_rows (< 1), or a count (>= 1)
    evict: str = "lru"
    admission: str = "victim"
    admit_after: int = 1
    admit_init: str = "fallback"

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """ValueError naming the setting for one out of range or two that contradict."""
        if self.max_rows is not None and self.max_rows < 1:
            raise ValueError(f"max_rows must be >= 1 (or None: unbounded), got {self.max_rows}")
        if self.evict not in EVICT_POLICIES:
            raise ValueError(f"evict must be one of {EVICT_POLICIES}, got {self.evict!r}")
        if self.admission not in ADMISSIONS:
            raise ValueError(f"admission must be one of {ADMISSIONS}, got {self.admission!r}")
        if self.admit_init not in ADMIT_INITS:
            raise ValueError(f"admit_init must be one of {ADMIT_INITS}, got {self.admit_init!r}")
        if not 1 <= self.admit_after <= ADMIT_MAX:
            raise ValueError(f"admit_after must be in [1, {ADMIT_MAX}], got {self.admit_after}")
        fb = self.fallback_rows
        if fb < 0:
            raise ValueError(f"fallback_rows must be >= 0, got {fb}")
        if 0 < fb < 1 and self.max_rows is None:
            raise ValueError(
                f"fallback_rows {fb}: a fraction of max_rows needs max_rows (a table without a "
                "budget takes a count of fallback rows)"
            )
        if fb >= 1 and fb != int(fb):
            raise ValueError(f"fallback_rows must be a fraction below 1 or a count, got {fb}")
        if self.max_rows is not None and self.requested_fallback() >= self.max_rows:
            raise ValueError(
                f"fallback_rows {fb} leaves no row of its own in max_rows {self.max_rows}"
            )

    def requested_fallback(self) -> int:
        """The fallback rows asked for, before rounding to the shard count."""
        fb = self.fallback_rows
        if fb < 1:
            return 0 if self.max_rows is None else int(round(fb * self.max_rows))
        return int(fb)

    def fallback_total(self, num_shards: int = 1) -> int:
        """B, the fallback rows over all shards: the request rounded up to a multiple of
        ``num_shards`` (and of ``FALLBACK_MULTIPLE`` once at least that many); 0 for none."""
        want = self.requested_fallback()
        if want == 0:
            return 0
        step = FALLBACK_MULTIPLE if want >= FALLBACK_MULTIPLE else 1
        step = step * num_shards // math.gcd(step, num_shards)
        return -(-want // step) * step

    def shard_rows(self, num_shards: int = 1) -> tuple[int | None, int]:
        """(own rows, fallback rows) a shard of ``num_shards`` keeps: the budget less the
        fallback rows, split evenly (rounded up), and its share of B. ValueError when the
        budget leaves a shard no row of its own."""
        fb = self.fallback_total(num_shards)
        if self.max_rows is None:
            return None, fb // num_shards
        own = self.max_rows - fb
        if own < num_shards:
            raise ValueError(
                f"max_rows {self.max_rows} with {fb} fallback rows leaves {own} rows of their own "
                f"for {num_shards} shards: give each shard at least one"
            )
        return -(-own // num_shards), fb // num_shards

    def with_overrides(self, **given: object) -> TablePolicy:
        """This policy with the settings in ``given`` that are not None (a server's flags)."""
        return replace(self, **{k: v for k, v in given.items() if v is not None})

    def describe(self) -> str:
        """One line for logs and status: ``max_rows 65536 (8192 fallback), lru, victim, ...``."""
        rows = "unbounded" if self.max_rows is None else str(self.max_rows)
        fb = self.fallback_total()
        return (
            f"max_rows {rows} ({fb} fallback), evict {self.evict}, admission {self.admission}, "
            f"admit_after {self.admit_after}, admit_init {self.admit_init}"
        )
