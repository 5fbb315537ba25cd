"""``DynamicEmbedding``: an embedding table for ids of any value, a plain Keras layer.

Recommendation ids are 64-bit hashes or strings from an open id space, not indexes in a range
fixed before training. The layer takes int32 or int64 ids of any value (negative and huge
included) or strings, hashed by ``string_ids``. Its table is declared by a
``downpour.tables.policy.TablePolicy``, the same in one process and on the servers:
``max_rows``, the row budget (its own rows and its fallback rows, over all shards); the
fallback rows, shared by hashing as ``keras.layers.Hashing`` shares bins; and how a full table
chooses (``evict``, ``admission``, ``admit_after``, ``admit_init``). An id's initial value is
a function of (seed, the layer's name, id) only (``initial.initial_rows``, drawn by the
layer's initialiser's distribution and scale), so neither the order ids first appear in nor
the process that draws them changes it.

In one process the layer holds its table in a trainable ``(own + fallback, dim)`` variable,
``embeddings``. Which ids hold rows of their own is decided by ``downpour.tables.rowmap``, the
code the servers' tables run: in a training call (``training=True``) the batch's ids are
counted and placed, a full table admits a newcomer against its victim, and an id without a
row of its own reads and trains its fallback row (``mix64(id) mod B``). So ``model.fit`` and a
downpour run differ only by asynchrony (and by the optimizer's slots: Keras's optimizer keeps
an evicted row's slots for the id that takes the row, where a server resets them). Outside
training the layer only reads: an id without a row reads its fallback row, or its initial
value in a table without fallback rows. The graph holds a NumPy call (the placing), so a model
with it runs without XLA (``supports_jit`` is False: Keras's ``jit_compile="auto"`` picks the
graph). The placement is process state, not a variable: a saved Keras model keeps the rows
but not which id holds which; a trained table is served through ``downpour export``.

Under downpour the rows live on the servers (``downpour.server.tables.table``). A worker
builds the model inside ``served(make)``: the layer then holds a bounded cache of rows
(``make(layer)``, an object with ``capacity`` and ``table``, an id -> slot
``MutableHashTable``) that the worker fills with pulled rows before each step, and its lookup
only maps ids to slots: it creates nothing, and its gradient is pushed keyed by id.

Multi-valued inputs (ragged, sparse, padded) and the ``combiner`` are ``downpour.layers.bags``.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from downpour.layers.bags import COMBINERS, as_ids, bag_of, embed, pooled_shape
from downpour.model import initial
from downpour.tables.policy import TablePolicy
from downpour.tables.rowmap import RowMap

__all__ = ["DynamicEmbedding", "served"]

_serving = threading.local()  # .make: the row-cache factory of the build on this thread
LAYERS_OWN = object()  # a call that pools by the layer's own combiner
HELD_ROWS = 1 << 16  # rows a copy of an unbounded table holds (``hold``: a batch's ids)


@contextlib.contextmanager
def served(make: Callable[[DynamicEmbedding], Any]) -> Iterator[None]:
    """Build models inside: each ``DynamicEmbedding`` built on this thread holds the rows of
    the cache ``make(layer)`` gives (``capacity`` rows, ids mapped to slots by its ``table``)
    instead of creating rows itself."""
    _serving.make = make
    try:
        yield
    finally:
        _serving.make = None


@keras.saving.register_keras_serializable(package="downpour")
class DynamicEmbedding(keras.layers.Layer):
    """Rows of ``dim`` values for ids of any value, within a row budget (see the module).

    ``max_rows``: the table's row budget, own and fallback rows over all shards (None:
    unbounded, which only the servers hold). ``fallback_rows``: a count, or a fraction of
    ``max_rows``. ``evict``, ``admission``, ``admit_after``, ``admit_init``: how a full table
    chooses (``downpour.tables.policy``). ``embeddings_initializer``: any initialiser drawn per
    element (uniform, normal, truncated normal, the variance-scaling family, constants); its
    scale is taken for a ``(max_rows, dim)`` table. ``seed``: the run's seed, part of every
    id's initial value."""

    def __init__(
        self,
        dim: int,
        max_rows: int | None = TablePolicy.max_rows,
        embeddings_initializer: Any = "uniform",
        seed: int = 0,
        *,
        fallback_rows: float = TablePolicy.fallback_rows,
        evict: str = TablePolicy.evict,
        admission: str = TablePolicy.admission,
        admit_after: int = TablePolicy.admit_after,
        admit_init: str = TablePolicy.admit_init,
        combiner: str | None = None,
        pad_id: int | None = None,
        **kwargs: Any,
    ) -> None:
        if "capacity" in kwargs:
            raise TypeError(
                "DynamicEmbedding takes max_rows, the table's row budget in one process and over "
                "all shards, in place of capacity (a worker's cache is --row-cache-rows, a "
                "shard's share --table-rows-per-shard)"
            )
        super().__init__(**kwargs)
        if dim < 1:
            raise ValueError(f"dim must be >= 1, got {dim}")
        self.dim = int(dim)
        if combiner is not None and combiner not in COMBINERS:
            raise ValueError(f"combiner must be one of {COMBINERS} or None, got {combiner!r}")
        self.combiner = combiner
        self.pad_id = None if pad_id is None else int(pad_id)
        self.policy = TablePolicy(
            None if max_rows is None else int(max_rows), fallback_rows, evict, admission,
            int(admit_after), admit_init,
        )  # fmt: skip
        self.seed = int(seed)
        self.embeddings_initializer = keras.initializers.get(embeddings_initializer)
        scale_rows = self.policy.max_rows or 1 << 16
        self.rule = initial.rule_of(self.embeddings_initializer, (scale_rows, self.dim), "float32")
        if self.rule.kind == "whole":
            raise ValueError(
                f"DynamicEmbedding {self.name!r}: initialiser "
                f"{type(self.embeddings_initializer).__name__} draws a whole table at once; "
                "give one drawn per element (uniform, normal, truncated normal, Glorot, He, "
                "LeCun, constants)"
            )
        self.supports_jit = False
        self.supports_masking = True  # a mask marks ids that are none (``embed``)
        self._row_cache: Any = None
        self._map: RowMap | None = None
        self._steps = 0

    @property
    def max_rows(self) -> int | None:
        """The table's row budget (``TablePolicy.max_rows``)."""
        return self.policy.max_rows

    @property
    def declared_rows(self) -> int:
        """The rows of the table's declared shape, which the model's fingerprint and the
        partition carry on the servers and workers alike: its budget, or for an unbounded
        table the rows a copy of it holds (``HELD_ROWS``) and its fallback rows."""
        if self.policy.max_rows is not None:
            return self.policy.max_rows
        return HELD_ROWS + self.policy.fallback_total(1)

    def build(self, input_shape: Any = None) -> None:
        make = getattr(_serving, "make", None)
        if make is not None:  # a worker's: rows pulled into a cache of slots
            self._row_cache = make(self)
            self.embeddings = self.add_weight(
                shape=(self._row_cache.capacity, self.dim), initializer="zeros", name="embeddings"
            )
            self.built = True
            return
        if self.policy.max_rows is None:  # rows on the servers: a copy here only holds some
            self.own, self.fallback = HELD_ROWS, self.policy.fallback_total(1)
        else:
            self.own, self.fallback = self.policy.shard_rows(1)
        self.embeddings = self.add_weight(
            shape=(self.own + self.fallback, self.dim), initializer="zeros", name="embeddings"
        )
        if self.fallback:
            numbers = np.arange(self.fallback, dtype=np.int64)
            self.embeddings.assign(
                np.concatenate([np.zeros((self.own, self.dim), np.float32), self._fb_init(numbers)])
            )
        self._map = self._new_map()
        self.built = True

    def _new_map(self) -> RowMap:
        p = self.policy
        return RowMap(
            self.own, self.fallback, evict=p.evict, admission=p.admission,
            admit_after=p.admit_after, seed=self.seed,
        )  # fmt: skip

    def _initial(self, ids: np.ndarray) -> np.ndarray:
        return initial.initial_rows(self.rule, self.seed, self.name, ids, self.dim, "float32")

    def _fb_init(self, numbers: np.ndarray) -> np.ndarray:
        return initial.fallback_initial_rows(
            self.rule, self.seed, self.name, numbers, self.dim, "float32"
        )

    def _rows_of(self, ids: np.ndarray, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(the row each id reads: its own slot or own + its fallback row, -1 for none;
        the initial values of the ids that read none)."""
        rows = slots.copy()
        out = slots < 0
        if self.fallback:
            rows[out] = self.own + self._map.fallback_of(ids[out])
            return rows, np.zeros((0, self.dim), np.float32)
        return rows, self._initial(ids[out])

    def _place(self, ids: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, ...]:
        """A training step's placing (NumPy): the rows the unique ``ids`` read, the initial
        values of those that read none, the rows admitted now, what each starts from (an
        initial value, or its fallback row where ``from_fb`` >= 0)."""
        self._steps += 1
        placed = self._map.place(ids, counts.astype(np.int64), self._steps)
        rows, unknown = self._rows_of(ids, placed.slots)
        new_ids, new_slots = ids[placed.new], placed.slots[placed.new]
        if self.fallback and self.policy.admit_init == "fallback":
            from_fb = self._map.fallback_of(new_ids)
            start = np.zeros((new_ids.size, self.dim), np.float32)
        else:
            from_fb = np.full(new_ids.size, -1, np.int64)
            start = self._initial(new_ids)
        return rows, unknown, new_slots, start, from_fb

    def _read(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """A read's rows of the unique ``ids`` (NumPy; nothing changes)."""
        return self._rows_of(ids, self._map.locate(ids))

    @staticmethod
    def ids(inputs: Any) -> tf.Tensor:
        """The int64 ids of the layer's dense inputs (strings hashed by ``string_ids``)."""
        return as_ids(tf.convert_to_tensor(inputs))

    def real_ids(self, inputs: Any, mask: Any = None) -> tf.Tensor:
        """The ids the layer looks up for ``inputs``, flat (1-D int64): a bag's values, no
        pad or masked position (what a worker pulls and pushes)."""
        bag = bag_of(inputs, self.pad_id, mask)
        return tf.reshape(self.ids(inputs), [-1]) if bag is None else bag.flat_values

    def call(
        self,
        inputs: Any,
        weights: Any = None,
        mask: Any = None,
        combiner: Any = LAYERS_OWN,
        training: bool | None = None,
    ) -> Any:
        """The rows of ``inputs``' ids: per position, or each bag pooled by the layer's
        ``combiner`` (or this call's: None for rows per position; a table shared by a
        pooled and a per-position feature), with per-id ``weights``; ragged, sparse and
        padded (``pad_id``, ``mask``) inputs are bags of their real ids (``embed``)."""
        combiner = self.combiner if combiner is LAYERS_OWN else combiner
        lookup = functools.partial(self._lookup, training=training)
        return embed(inputs, lookup, self.dim, combiner, self.pad_id, weights, mask)

    def _lookup(self, flat: tf.Tensor, training: bool | None) -> tf.Tensor:
        """The rows (len(flat), dim) of the flat int64 ids ``flat``: from the worker's cache,
        or placed (training) or read in one process."""
        if self._row_cache is not None:  # ids -> the slots the worker put their rows in
            slots = self._row_cache.table.lookup(flat)
            slots.set_shape(flat.shape)
            return tf.gather(self.embeddings.value, slots)
        unique, where, counts = tf.unique_with_counts(flat)
        if training and self.policy.max_rows is None:
            raise ValueError(
                f"DynamicEmbedding {self.name!r} has no row budget (max_rows=None): its rows "
                "live on downpour's servers; to train it in one process give max_rows"
            )
        if training:
            rows, unknown, new_slots, start, from_fb = tf.numpy_function(
                self._place,
                [unique, tf.cast(counts, tf.int64)],
                [tf.int64, tf.float32, tf.int64, tf.float32, tf.int64],
                stateful=True,
            )
            start = tf.reshape(start, [-1, self.dim])
            if self.fallback:  # admitted rows start from their fallback rows' values
                fb = tf.gather(self.embeddings.value, self.own + tf.maximum(from_fb, 0))
                start = tf.where(tf.expand_dims(from_fb >= 0, 1), fb, start)
            ready = self.embeddings.value.scatter_update(tf.IndexedSlices(start, new_slots))
            deps = [ready]
        else:
            rows, unknown = tf.numpy_function(
                self._read, [unique], [tf.int64, tf.float32], stateful=True
            )
            deps = []
        with tf.control_dependencies(deps):
            rows = tf.ensure_shape(rows, [None])
            unknown = tf.reshape(unknown, [-1, self.dim])
            held = rows >= 0
            parts = [
                tf.cast(
                    keras.ops.take(self.embeddings, tf.boolean_mask(rows, held), axis=0),
                    self.compute_dtype,
                ),
                tf.cast(unknown, self.compute_dtype),
            ]
            positions = [tf.where(held)[:, 0], tf.where(~held)[:, 0]]
            per_unique = tf.dynamic_stitch([tf.cast(p, tf.int32) for p in positions], parts)
        return tf.gather(per_unique, where)

    def hold(self, ids: np.ndarray, rows: np.ndarray) -> None:
        """Hold exactly ``rows`` for the unique int64 ``ids`` (at most its own rows), nothing
        else: how a copy of the model outside training reads rows pulled from the servers
        (``downpour.serving.scoring``). A built layer that is not a worker's."""
        if self._row_cache is not None:
            raise ValueError(f"DynamicEmbedding {self.name!r}: a worker's rows are its cache's")
        n = int(ids.size)
        if n > self.own:
            raise ValueError(
                f"DynamicEmbedding {self.name!r} holds at most {self.own} ids of its own, not {n}"
            )
        self._map = self._new_map()
        slots = self._map.insert(np.asarray(ids, np.int64), 0)
        self.embeddings.value.scatter_update(
            tf.IndexedSlices(tf.constant(rows, self.embeddings.dtype), tf.constant(slots))
        )

    def compute_output_shape(
        self, input_shape: tuple[int | None, ...], *_: Any, **__: Any
    ) -> tuple[int | None, ...]:
        return pooled_shape(input_shape, self.dim, self.combiner)

    def compute_mask(self, inputs: Any, mask: Any = None) -> None:
        """No mask downstream: the pads are zeros (per position) or pooled away."""
        return None

    def get_config(self) -> dict[str, Any]:
        p = self.policy
        return super().get_config() | {
            "dim": self.dim,
            "max_rows": p.max_rows,
            "embeddings_initializer": keras.initializers.serialize(self.embeddings_initializer),
            "seed": self.seed,
            "fallback_rows": p.fallback_rows,
            "evict": p.evict,
            "admission": p.admission,
            "admit_after": p.admit_after,
            "admit_init": p.admit_init,
            "combiner": self.combiner,
            "pad_id": self.pad_id,
        }
