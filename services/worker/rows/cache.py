"""A bounded row cache in place of a table's full replica (``--row-cache-rows N``).

A worker with ``--row-cache-rows N`` builds the model under ``row_cache_scope(N)``: every
Keras ``Embedding`` of more than N rows built inside it gets an (N, dim) variable, the
cache, instead of its (rows, dim) table, and a lookup that maps the global ids it is given
to cache slots before gathering. The user's model code is unchanged (a plain ``Embedding``);
the layer keeps its variable's name and path, and the worker describes the variable by its
logical shape (``logical_shapes``: the fingerprint, the partition, the wire), so servers see
the same table as from any other worker. Pushed gradients carry global ids
(``RowCache.to_wire``); the first weight pull asks for no row of a cached table.

Ids to slots. One TensorFlow ``MutableHashTable`` (int64 id -> int32 slot, -1: not cached)
per table, looked up inside the compiled step and, eagerly, by the worker for a batch's
unique ids. Its memory follows the N cached ids, not the table's rows: a dense id -> slot
array would cost 4 bytes per row of the table (40 MB at 10M rows, 400 MB at 100M), the one
worker-side cost that would still grow with the table. Beside it, NumPy arrays of N entries
per slot: whether it holds a row, its global id (any int64 for a dynamic table, so no id
value marks a free slot), the shard version it was fetched at, the last batch that used it,
and the last coming batch known to need it.

Eviction. A row placed in the cache takes a free slot or evicts the least recently used row
that no batch from the current one on is known to need. Never evicted: the rows of the
batch about to be computed (``begin_batch``). Rows a look-ahead pull brings, and cached
rows of the batches it serves, are kept until those batches are computed; only a top-up of
the current batch's own rows may evict them (they are pulled again when their batch comes),
and a look-ahead reply that finds no slot left drops the rows it cannot place (its batch's
top-up pulls them). So a batch gathering at most N distinct ids of a table always finds all
of them cached before its step; a batch gathering more than N is refused (``WorkerError``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from downpour.layers import DynamicEmbedding, served
from downpour.model.build import gathered_ids, id_extractor
from downpour.model.partition import Part
from downpour.wire import Keyed, Sparse, pushed_rows
from downpour.worker.errors import WorkerError

_scope = threading.local()  # .capacity: --row-cache-rows of the build running on this thread
_patch_lock = threading.Lock()
_patch_users = 0
_original_build = keras.layers.Embedding.build
_classes: dict[type, type] = {}


class RowCache:
    """The cache of one table: ``capacity`` slots of its ``rows`` x ``dim`` table (see the
    module docstring for the id -> slot map and the eviction rule)."""

    def __init__(self, rows: int, dim: int, capacity: int, keyed: bool = False) -> None:
        """``keyed``: the cache of a dynamic table, whose ids are any int64 and whose
        gradient goes out as ``Keyed`` rows; ``rows`` is then its declared row count."""
        self.keyed = keyed
        self.rows = rows
        self.dim = dim
        self.capacity = capacity
        self.table = tf.lookup.experimental.MutableHashTable(tf.int64, tf.int32, default_value=-1)
        self.slot_ids = np.full(capacity, -1, np.int64)  # global id per slot (where held)
        # which slots hold a row: a dynamic table's ids are any int64, so no id marks "free"
        self.held = np.zeros(capacity, bool)
        self.fetched = np.full(capacity, -1, np.int64)  # shard version it was fetched at
        self.used = np.full(capacity, -1, np.int64)  # last batch that used (or placed) it
        self.needed = np.full(capacity, -1, np.int64)  # last coming batch known to need it
        self.now = 0  # the batch about to be computed
        self._current = np.zeros(capacity, bool)  # slots of that batch: never evicted
        self._fresh = 0  # slots [0, _fresh) have held a row; a slot is never freed
        self.evictions = 0
        self.dropped = 0  # look-ahead rows that found no slot

    @property
    def logical_shape(self) -> tuple[int, int]:
        """The table's shape as the model declares it."""
        return (self.rows, self.dim)

    def slots(self, ids: np.ndarray) -> np.ndarray:
        """The slot of each global id (int32, -1 where not cached)."""
        if not ids.size:
            return np.zeros(0, np.int32)
        return self.table.lookup(tf.constant(ids, tf.int64)).numpy()

    def fetched_at(self, ids: np.ndarray) -> np.ndarray:
        """The version each id was fetched at (-1: not cached, or never fetched)."""
        slots = self.slots(ids)
        return np.where(slots >= 0, self.fetched[np.maximum(slots, 0)], -1)

    def begin_batch(self, ids: np.ndarray, now: int) -> None:
        """Batch ``now`` gathering ``ids`` (unique) is next: its cached rows may not be
        evicted until the next batch begins. WorkerError when it needs more than N rows."""
        if ids.size > self.capacity:
            raise WorkerError(
                f"a batch gathers {ids.size} distinct rows of a {self.rows}-row table, more "
                f"than --row-cache-rows {self.capacity}: raise --row-cache-rows or make "
                "batches smaller"
            )
        self.now = now
        self._current[:] = False
        slots = self.slots(ids)
        slots = slots[slots >= 0]
        self._current[slots] = True
        self.used[slots] = now

    def keep_for(self, ids: np.ndarray, until: int) -> None:
        """The cached ones of ``ids`` are needed by batches up to ``until``: keep them."""
        slots = self.slots(ids)
        slots = slots[slots >= 0]
        self.needed[slots] = np.maximum(self.needed[slots], until)

    def place(self, ids: np.ndarray, until: int, current: bool) -> np.ndarray:
        """Slots for rows ``ids`` (unique global ids) about to be written: their own if
        cached, else free or evicted ones. ``current``: rows of the batch about to be
        computed (may evict rows kept for coming batches; all must be placed); else rows
        for batches up to ``until`` (evicts only rows no batch from now on needs; -1 for
        the rows that found no slot)."""
        slots = self.slots(ids).astype(np.int64)
        new = np.flatnonzero(slots < 0)
        if new.size:
            k = int(new.size)
            fresh = min(k, self.capacity - self._fresh)  # slots that never held a row first
            order = np.arange(self._fresh, self._fresh + fresh)
            self._fresh += fresh
            if fresh < k:
                order = np.concatenate([order, self._victims(k - fresh, current)])
            if current and order.size < k:
                raise WorkerError(
                    f"the row cache of a {self.rows}-row table cannot hold the current batch's "
                    f"rows (--row-cache-rows {self.capacity})"
                )
            take = new[: order.size]
            evicted = self.slot_ids[order[self.held[order]]]
            if evicted.size:
                self.table.remove(tf.constant(evicted, tf.int64))
                self.evictions += int(evicted.size)
            self.table.insert(tf.constant(ids[take], tf.int64), tf.constant(order.astype(np.int32)))
            self.slot_ids[order] = ids[take]
            self.held[order] = True
            self.fetched[order] = -1
            self.needed[order] = -1
            slots[take] = order
            self.dropped += k - int(order.size)
        placed = slots[slots >= 0]
        self.used[placed] = self.now
        if current:
            self._current[placed] = True
        else:
            self.needed[placed] = np.maximum(self.needed[placed], until)
        return slots

    def _victims(self, n: int, current: bool) -> np.ndarray:
        """Up to ``n`` held slots to evict, least recently used first: never the current
        batch's; rows kept for coming batches only for the current batch's rows
        (``current``), and after every other row. Ties in last use go to the lower slot, so
        the keys are distinct (a selection among many equal keys is slow in NumPy)."""
        coming = self.needed >= self.now
        tiers = [~coming & ~self._current]
        if current:
            tiers.append(coming & ~self._current)
        out: list[np.ndarray] = []
        for tier in tiers:
            if n <= 0:
                break
            cand = np.flatnonzero(tier & self.held)
            if cand.size > n:
                key = self.used[cand] * self.capacity + cand
                cand = cand[np.argpartition(key, n - 1)[:n]]
            out.append(cand)
            n -= int(cand.size)
        return np.concatenate(out) if out else np.zeros(0, np.int64)

    def forget(self, part: Part) -> None:
        """The cached rows of ``part`` count as never fetched (its shard restarted)."""
        held = self.held
        mine = np.zeros(self.capacity, bool)
        mine[held] = part.mine(self.slot_ids[held])
        self.fetched[mine] = -1

    def gradient(self, g: Any) -> Sparse:
        """The gradient of the cache variable (rows by slot, ``tf.IndexedSlices``) as the
        table's: rows by global id, of the table's shape, each once (``wire.pushed_rows``;
        a dynamic table's with the lookups each sums)."""
        if not isinstance(g, tf.IndexedSlices):
            raise WorkerError(
                "a cached table's gradient is dense, not row-sparse: --row-cache-rows needs "
                "tables whose gradient touches only the gathered rows"
            )
        slots = g.indices.numpy()
        kind = Keyed if self.keyed else Sparse
        return pushed_rows(kind(self.slot_ids[slots], g.values.numpy(), self.logical_shape))


class _CachedEmbedding:
    """Mixed into an Embedding's class: an (N, dim) variable and an id -> slot lookup."""

    _row_cache: RowCache

    def build(self, input_shape: Any = None) -> None:
        """The cache variable under the table's own name (so the same path)."""
        if self.built:
            return
        self._embeddings = self.add_weight(
            shape=(self._row_cache.capacity, self.output_dim),
            initializer="zeros",  # every row is pulled before a batch reads it
            name="embeddings",
            constraint=self.embeddings_constraint,
            trainable=True,
        )
        self.built = True

    def call(self, inputs: Any) -> Any:
        """Global ids -> slots -> rows. An id not cached has slot -1, which the gather
        refuses: the worker puts every id of a batch in the cache before its step."""
        ids = tf.cast(inputs, tf.int64)
        slots = self._row_cache.table.lookup(ids)
        slots.set_shape(ids.shape)  # the table's lookup leaves the shape unknown
        out = tf.gather(self._embeddings.value, slots)
        return keras.ops.cast(out, dtype=self.compute_dtype)


def _scoped_build(self: keras.layers.Embedding, input_shape: Any = None) -> None:
    """``Embedding.build`` while a scope is active: a table of more than N rows built on the
    scope's thread becomes a cache; any other builds as usual."""
    capacity = getattr(_scope, "capacity", None)
    if capacity is None or self.built or self.input_dim <= capacity:
        return _original_build(self, input_shape)
    if self.quantization_mode or self.lora_rank or self.embeddings_regularizer is not None:
        raise WorkerError(
            f"Embedding {self.name!r}: --row-cache-rows cannot cache a quantized, LoRA or "
            "regularized table"
        )
    cls = type(self)
    cached = _classes.get(cls)
    if cached is None:
        cached = _classes[cls] = type(f"Cached{cls.__name__}", (_CachedEmbedding, cls), {})
    self.__class__ = cached
    self._row_cache = RowCache(int(self.input_dim), int(self.output_dim), capacity)
    return cached.build(self, input_shape)


def _dynamic_cache(capacity: int | None) -> Any:
    """The row-cache factory for a worker's dynamic tables: as many rows as the table
    declares (``DynamicEmbedding.declared_rows``), at most ``capacity`` (``--row-cache-rows``)
    when given."""

    def make(layer: DynamicEmbedding) -> RowCache:
        rows = layer.declared_rows
        held = rows if capacity is None else min(rows, capacity)
        return RowCache(rows, layer.dim, held, keyed=True)

    return make


@contextlib.contextmanager
def row_cache_scope(capacity: int | None) -> Iterator[None]:
    """Build models inside: Embeddings of more than ``capacity`` rows built on this thread
    become row caches (None: Embeddings build as usual), and every ``DynamicEmbedding``
    holds a cache of pulled rows (``downpour.layers.served``)."""
    global _patch_users
    if capacity is None:
        with served(_dynamic_cache(None)):
            yield
        return
    with _patch_lock:
        if _patch_users == 0:
            keras.layers.Embedding.build = _scoped_build
        _patch_users += 1
    _scope.capacity = capacity
    try:
        with served(_dynamic_cache(capacity)):
            yield
    finally:
        _scope.capacity = None
        with _patch_lock:
            _patch_users -= 1
            if _patch_users == 0:
                keras.layers.Embedding.build = _original_build


def _cached_layers(model: keras.Model) -> list[Any]:
    """The model's Embeddings built as row caches (Keras's own layer walk)."""
    return [
        layer
        for layer in model._flatten_layers(include_self=False)
        if isinstance(layer, _CachedEmbedding)
        or (isinstance(layer, DynamicEmbedding) and layer._row_cache is not None)
    ]


def caches_of(model: keras.Model) -> dict[str, RowCache]:
    """The model's row caches by their variable's path."""
    return {layer.embeddings.path: layer._row_cache for layer in _cached_layers(model)}


def logical_shapes(
    variables: Sequence[keras.Variable], caches: dict[str, RowCache]
) -> list[tuple[int, ...]]:
    """Each variable's shape as the model declares it (a cache's is its table's)."""
    return [
        caches[v.path].logical_shape if v.path in caches else tuple(int(d) for d in v.shape)
        for v in variables
    ]


def check_batch(model: keras.Model, caches: dict[str, RowCache], features: Any) -> None:
    """WorkerError when this batch gathers more distinct rows of a cached table than its
    cache holds (checked on the first batch at start, before the worker says hello). A
    model with no graph of layers to extract the ids from is left to the hello's check."""
    layers = _cached_layers(model)
    if not layers:
        return
    try:
        extractor = id_extractor(model, layers)
    except (ValueError, AttributeError, TypeError):
        return
    for layer, ids in zip(layers, gathered_ids(extractor, features), strict=True):
        cache = layer._row_cache
        n = int(tf.size(ids))
        if n > cache.capacity:
            raise WorkerError(
                f"the first batch gathers {n} distinct rows of table {layer.embeddings.path} "
                f"({cache.rows} rows), more than --row-cache-rows {cache.capacity}: raise "
                "--row-cache-rows or make batches smaller"
            )
