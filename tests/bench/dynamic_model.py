"""The model of the bench's ``dynamic`` section: one dynamic table fed int64 ids, a Dense head.

``--model dynamic_model:live_1m`` (``live_100k``, ``live_400k``, ``live_1m``, ``live_5m``,
``live_20m``): a ``DynamicEmbedding(DIM)`` named ``LAYER``, without a row budget (the servers
hold every id) and with admission and fallback rows on (``admit_after`` 2, ``FALLBACK_ROWS``:
every touch counted in the admission sketch on each apply), gathers ``FEATURES`` int64 ids per
example, a mean over them feeds ``Dense(32, relu)`` and ``Dense(2)`` logits. The model is the
same at every size (one fingerprint, one checkpoint format); the size says which ids the data
draws from: a table of ``n`` live rows holds ``fresh_ids(0, n)`` (``live_id`` of 0 .. n-1), and
every example draws its ids uniformly over them (``data``), so every id a worker pulls or
pushes exists on the server and the accesses are random over the whole table.

``EXAMPLES`` is more examples than a timed run takes steps x ``BATCH_SIZE``, so every batch
is a fresh draw. The label is planted in the draws (whether most of an example's row indices
are even), so the model has something to learn; the bench measures speed, not accuracy.
"""

from __future__ import annotations

import functools

import keras
import numpy as np

from downpour import ModelSpec
from downpour.inputs.data import Dataset
from downpour.layers import DynamicEmbedding
from downpour.model.hashing import mix64

DIM = 16  # float32 columns: 64 bytes a row, 64 more for its Adagrad slot; 20M rows fit
LAYER = "table"  # the layer's name: it keys the rows' initial values
FEATURES = 8  # ids gathered per example
BATCH_SIZE = 256  # 2,048 ids a batch, nearly all distinct at every size
EXAMPLES = 131_072  # 512 batches
HELD_OUT = 1_024
FALLBACK_ROWS = 4096
ADMIT_AFTER = 2
SEED = 11


def live_id(index: np.ndarray) -> np.ndarray:
    """The id of live row ``index`` (``mix64``, a bijection: distinct ids over all of int64)."""
    return mix64(np.asarray(index, np.uint64)).view(np.int64)


def fresh_ids(start: int, stop: int) -> np.ndarray:
    """The ids of live rows ``start`` .. ``stop - 1``."""
    return live_id(np.arange(start, stop, dtype=np.uint64))


def build() -> keras.Model:
    """The table and the dense head (see the module)."""
    ids = keras.Input((FEATURES,), dtype="int64", name="ids")
    e = DynamicEmbedding(  # a worker caches 65,536 + 4,096 rows of it; a batch needs 2,048
        DIM, None, fallback_rows=FALLBACK_ROWS, admit_after=ADMIT_AFTER, name=LAYER
    )(ids)
    h = keras.layers.GlobalAveragePooling1D(name="pool")(e)
    h = keras.layers.Dense(32, activation="relu", name="hidden")(h)
    out = keras.layers.Dense(2, name="logits")(h)
    return keras.Model(ids, out, name="dynamic_bench")


@functools.cache
def data(rows: int) -> Dataset:
    """Examples of ids drawn uniformly over the ``rows`` live ids, and the planted labels."""
    rng = np.random.default_rng([SEED, rows])
    n = EXAMPLES + HELD_OUT
    index = rng.integers(0, rows, (n, FEATURES), dtype=np.int64)
    y = ((index % 2 == 0).sum(axis=1) > FEATURES // 2).astype(np.int64)
    x = live_id(index)
    return Dataset(x[:EXAMPLES], y[:EXAMPLES], x[EXAMPLES:], y[EXAMPLES:])


def live(rows: int) -> ModelSpec:
    """The section's model, its data drawn over a table of ``rows`` live rows."""
    return ModelSpec(
        name="dynamic_bench",
        build=build,
        load_data=lambda _data_dir: data(rows),
        batch_size=BATCH_SIZE,
    )


def live_100k() -> ModelSpec:
    """Ids over 100,000 live rows (the smoke plan's smallest)."""
    return live(100_000)


def live_400k() -> ModelSpec:
    """Ids over 400,000 live rows (the smoke plan's largest)."""
    return live(400_000)


def live_1m() -> ModelSpec:
    """Ids over 1,000,000 live rows."""
    return live(1_000_000)


def live_5m() -> ModelSpec:
    """Ids over 5,000,000 live rows."""
    return live(5_000_000)


def live_20m() -> ModelSpec:
    """Ids over 20,000,000 live rows."""
    return live(20_000_000)
