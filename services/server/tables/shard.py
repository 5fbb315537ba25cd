"""A shard's dynamic tables together, as its ``ParameterState`` holds them.

One ``DynamicTable`` per ``DynamicEmbedding`` the shard holds, built within the layer's
declared policy and the server's overrides (``TableOptions``), split over the partition's
shards; addressed by the wire index of its variable. ``ShardTables`` applies an update's
rows at its version (then evicts the rows idle too long), gathers rows for row pulls and
reports the tables' bytes and status.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from downpour.config.settings import ConfigError
from downpour.layers import DynamicEmbedding
from downpour.server.tables.optim import RowOptimizer
from downpour.server.tables.table import DynamicTable
from downpour.tables.policy import TablePolicy
from downpour.wire import Sparse, is_keyed


@dataclass(frozen=True)
class TableOptions:
    """The server's overrides of its dynamic tables' declared policies, each applied to
    every table when set (None: the layer's ``TablePolicy`` holds): ``--table-rows-per-shard``,
    ``--fallback-rows``, ``--evict-policy``, ``--admission``, ``--admit-after``,
    ``--admit-init``; and ``--evict-idle-versions`` (``downpour.server.tables.table``)."""

    shard_rows: int | None = None
    fallback_rows: float | None = None
    evict: str | None = None
    admission: str | None = None
    admit_after: int | None = None
    admit_init: str | None = None
    idle_versions: int | None = None

    def policy(self, declared: TablePolicy) -> TablePolicy:
        """``declared`` (a layer's) with these overrides."""
        return declared.with_overrides(
            fallback_rows=self.fallback_rows, evict=self.evict, admission=self.admission,
            admit_after=self.admit_after, admit_init=self.admit_init,
        )  # fmt: skip


class ShardTables:
    """Shard ``shard`` of ``num_shards``' dynamic tables, trained by ``optimizer``.

    ``tables`` holds them by variable path (a restore replaces them there, so a table is
    looked up on each use); ``path_of`` is the path of each wire index that is a dynamic
    table; ``layers`` are the tables' layers by path. ConfigError when a layer's budget
    does not fit this server's settings."""

    def __init__(
        self,
        layers: Mapping[str, DynamicEmbedding],
        path_of: Mapping[int, str],
        optimizer: RowOptimizer,
        options: TableOptions,
        shard: int,
        num_shards: int,
    ) -> None:
        self.path_of = dict(path_of)
        self.optimizer = optimizer
        self.options = options
        self.shard = shard
        self.num_shards = num_shards
        self.tables = {path: self._new_table(layers[path]) for path in self.path_of.values()}

    def _new_table(self, layer: DynamicEmbedding) -> DynamicTable:
        """This shard's empty store of ``layer``'s rows, within the layer's policy and the
        server's overrides."""
        config = {"optimizer": self.optimizer, "rule": layer.rule, "seed": layer.seed}
        try:
            config |= self._split(self.options.policy(layer.policy))
            return DynamicTable(layer.name, layer.dim, **config)
        except ValueError as exc:  # the layer's budget with this server's settings
            raise ConfigError(f"dynamic table {layer.name!r}: {exc}") from None

    def _split(self, policy: TablePolicy) -> dict[str, object]:
        """How ``DynamicTable`` takes ``policy`` on this shard of this partition."""
        return {
            "policy": policy,
            "num_shards": self.num_shards,
            "shard": self.shard,
            "shard_rows": self.options.shard_rows,
        }

    def config(self, path: str) -> dict[str, object]:
        """The keyword arguments that rebuild table ``path`` (``DynamicTable.from_state``)."""
        table = self.tables[path]
        config = {"optimizer": table.opt, "rule": table.rule, "seed": table.seed}
        return config | self._split(table.policy)

    def apply(
        self,
        grads: Sequence[np.ndarray | Sparse | None],
        keyed: Sequence[int],
        lr: float,
        version: int,
        step: int,
    ) -> None:
        """The dynamic tables ``keyed``' rows of this update (``Keyed``: checked by the
        gradient handler), at ``version``; then the rows idle too long are evicted."""
        for i in keyed:
            g, path = grads[i], self.path_of[i]
            assert is_keyed(g), path
            table = self.tables[path]
            ids, values, counts = np.asarray(g.indices), np.asarray(g.values), g.lookups()
            table.apply(ids, values, lr, version, step, counts)
            idle = self.options.idle_versions
            if idle is not None and version % max(1, idle // 8) == 0:
                table.evict_idle(version, idle)

    def gather(self, i: int, ids: np.ndarray) -> np.ndarray:
        """Rows ``ids`` (any int64) of the table of wire index ``i``, as a fresh array; an id
        the table does not hold reads its initial value."""
        return self.tables[self.path_of[i]].gather(ids)

    def held_bytes(self) -> tuple[int, int]:
        """(row bytes, slot bytes) of the tables' live rows."""
        stats = [t.stats() for t in self.tables.values()]
        return sum(s["bytes_rows"] for s in stats), sum(s["bytes_slots"] for s in stats)

    def status(self) -> dict[str, dict[str, object]]:
        """Per dynamic table (by path): its live rows, bytes, counters and settings."""
        return {
            path: t.stats()
            | {
                "optimizer": t.opt.kind,
                "capacity": t.capacity,
                "max_rows": t.policy.max_rows,
                "admit_after": t.policy.admit_after,
                "evict_policy": t.policy.evict,
                "admission": t.policy.admission,
                "admit_init": t.policy.admit_init,
                "evict_idle_versions": self.options.idle_versions,
            }
            for path, t in self.tables.items()
        }
