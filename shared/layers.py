"""``DynamicEmbedding``: an embedding table for ids of any value, a plain Keras layer.

Recommendation ids are 64-bit hashes or strings from an open id space, not indexes in a range
fixed before training. The layer takes int32 or int64 ids of any value (negative and huge
included) or strings, hashed by ``string_ids``. It holds at most ``capacity`` rows in a
trainable ``(capacity, dim)`` variable, ``embeddings``, and maps each id it holds to its row
with a TensorFlow hash table; an id seen for the first time gets the next free row, set to its
initial value: a function of (seed, the layer's name, id) only (``initial.initial_rows``,
drawn by the layer's initialiser's distribution and scale), so neither the order ids first
appear in nor the process that draws them changes it. The output gathers the rows, so the
gradient of ``embeddings`` is an ``IndexedSlices`` of the rows a batch touched.

In one process the layer trains like a Keras ``Embedding`` until ``capacity`` distinct ids have
been seen; the next new id fails the step with an error naming the layer and its capacity.
Its graph holds a hash table and a NumPy call (the initial rows), so a model with it runs
without XLA (``supports_jit`` is False: Keras's ``jit_compile="auto"`` picks the graph).

Under downpour the rows live on the servers (``downpour.server.tables.table``). A worker builds the
model inside ``served(make)``: the layer then holds a bounded cache of rows (``make(layer)``,
an object with ``capacity`` and ``table``, an id -> slot ``MutableHashTable``) that the worker
fills with pulled rows before each step, and its lookup only maps ids to slots: it creates
nothing, and its gradient is pushed keyed by id.

``string_ids``: the little-endian int64 of FarmHash Fingerprint64 of each string, as
``tf.fingerprint`` gives it: stable across processes, machines and TensorFlow versions.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from downpour.model import initial

__all__ = ["DynamicEmbedding", "served", "string_ids"]

_serving = threading.local()  # .make: the row-cache factory of the build on this thread


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


def string_ids(strings: tf.Tensor) -> tf.Tensor:
    """int64 ids of a string tensor of any shape: each string's FarmHash Fingerprint64 (the
    8 bytes ``tf.fingerprint`` gives, read as a little-endian int64), same shape."""
    flat = tf.reshape(strings, [-1])
    ids = tf.bitcast(tf.fingerprint(flat), tf.int64)  # x86 and ARM: little-endian
    return tf.reshape(ids, tf.shape(strings))


@keras.saving.register_keras_serializable(package="downpour")
class DynamicEmbedding(keras.layers.Layer):
    """Rows of ``dim`` values for ids of any value, created on first touch (see the module).

    ``capacity``: how many distinct ids the layer holds. ``embeddings_initializer``: any
    initialiser drawn per element (uniform, normal, truncated normal, the variance-scaling
    family, constants); its scale is taken for a ``(capacity, dim)`` table. ``seed``: the
    run's seed, part of every id's initial value."""

    def __init__(
        self,
        dim: int,
        capacity: int = 1 << 16,
        embeddings_initializer: Any = "uniform",
        seed: int = 0,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if dim < 1 or capacity < 1:
            raise ValueError(f"dim and capacity must be >= 1, got {dim} and {capacity}")
        self.dim = int(dim)
        self.capacity = int(capacity)
        self.seed = int(seed)
        self.embeddings_initializer = keras.initializers.get(embeddings_initializer)
        self.rule = initial.rule_of(
            self.embeddings_initializer, (self.capacity, self.dim), "float32"
        )
        if self.rule.kind == "whole":
            raise ValueError(
                f"DynamicEmbedding {self.name!r}: initialiser "
                f"{type(self.embeddings_initializer).__name__} draws a whole table at once; "
                "give one drawn per element (uniform, normal, truncated normal, Glorot, He, "
                "LeCun, constants)"
            )
        self.supports_jit = False
        self._row_cache: Any = None

    def build(self, input_shape: Any = None) -> None:
        make = getattr(_serving, "make", None)
        if make is not None:  # a worker's: rows pulled into a cache of slots
            self._row_cache = make(self)
            self.embeddings = self.add_weight(
                shape=(self._row_cache.capacity, self.dim), initializer="zeros", name="embeddings"
            )
            self.built = True
            return
        self.embeddings = self.add_weight(
            shape=(self.capacity, self.dim), initializer="zeros", name="embeddings"
        )
        self.rows_used = self.add_weight(
            shape=(), initializer="zeros", dtype="int64", trainable=False, name="rows_used"
        )
        self.index = tf.lookup.experimental.MutableHashTable(
            key_dtype=tf.int64, value_dtype=tf.int64, default_value=-1
        )
        self.built = True

    def _initial(self, ids: np.ndarray) -> np.ndarray:
        return initial.initial_rows(self.rule, self.seed, self.name, ids, self.dim, "float32")

    def _slots(self, ids: tf.Tensor) -> tf.Tensor:
        """The rows of ``ids`` (1-D int64, unique), giving each new id the next free row set
        to its initial value."""
        slots = tf.ensure_shape(self.index.lookup(ids), [None])
        new = tf.boolean_mask(ids, slots < 0)
        n = tf.size(new, out_type=tf.int64)
        used = tf.convert_to_tensor(self.rows_used)
        tf.debugging.assert_less_equal(
            used + n,
            tf.constant(self.capacity, tf.int64),
            message=f"DynamicEmbedding {self.name!r} holds at most {self.capacity} ids "
            "(capacity): a batch brought more new ids than it has rows left",
        )
        fresh = used + tf.range(n, dtype=tf.int64)
        rows = tf.numpy_function(self._initial, [new], tf.float32, stateful=False)
        rows = tf.reshape(rows, [-1, self.dim])
        with tf.control_dependencies([self.index.insert(new, fresh)]):
            self.embeddings.value.scatter_update(tf.IndexedSlices(rows, fresh))
            self.rows_used.assign_add(n)
            return tf.ensure_shape(self.index.lookup(ids), [None])

    @staticmethod
    def ids(inputs: Any) -> tf.Tensor:
        """The int64 ids of the layer's inputs (strings hashed by ``string_ids``)."""
        inputs = tf.convert_to_tensor(inputs)
        if inputs.dtype == tf.string:
            return string_ids(inputs)
        return tf.cast(inputs, tf.int64)

    def call(self, inputs: Any) -> tf.Tensor:
        ids = self.ids(inputs)
        if self._row_cache is not None:  # ids -> the slots the worker put their rows in
            slots = self._row_cache.table.lookup(ids)
            slots.set_shape(ids.shape)
            return tf.gather(self.embeddings.value, slots)
        flat = tf.reshape(ids, [-1])
        unique, where = tf.unique(flat)
        slots = tf.gather(self._slots(unique), where)
        rows = keras.ops.take(self.embeddings, slots, axis=0)
        return tf.reshape(rows, tf.concat([tf.shape(ids), [self.dim]], 0))

    def hold(self, ids: np.ndarray, rows: np.ndarray) -> None:
        """Hold exactly ``rows`` for the unique int64 ``ids`` (at most ``capacity``), nothing
        else: how a copy of the model outside training reads rows pulled from the servers
        (``downpour.serving.scoring``). A built layer that is not a worker's."""
        if self._row_cache is not None:
            raise ValueError(f"DynamicEmbedding {self.name!r}: a worker's rows are its cache's")
        n = int(ids.size)
        if n > self.capacity:
            raise ValueError(
                f"DynamicEmbedding {self.name!r} holds at most {self.capacity} ids, not {n}"
            )
        self.index.remove(self.index.export()[0])
        self.index.insert(tf.constant(ids, tf.int64), tf.range(n, dtype=tf.int64))
        self.embeddings.value.scatter_update(
            tf.IndexedSlices(tf.constant(rows, self.embeddings.dtype), tf.range(n))
        )
        self.rows_used.assign(n)

    def compute_output_shape(self, input_shape: tuple[int | None, ...]) -> tuple[int | None, ...]:
        return (*input_shape, self.dim)

    def get_config(self) -> dict[str, Any]:
        return super().get_config() | {
            "dim": self.dim,
            "capacity": self.capacity,
            "embeddings_initializer": keras.initializers.serialize(self.embeddings_initializer),
            "seed": self.seed,
        }
