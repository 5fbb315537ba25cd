"""The model of the bench's ``sparse`` and ``tables`` sections: one big embedding table and a
small dense head.

``--model sparse_model:rows_1m`` (``rows_20k``, ``rows_100k``, ``rows_1m``, ``rows_4m``): an
``Embedding(rows, 16)`` gathers ``FEATURES`` ids per example, a mean over them feeds
``Dense(32, relu)`` and ``Dense(2)`` logits. Only the table grows with ``rows``; the head is the
same few kB at every size, so a worker's step costs the same at every size unless something in
the pull path grows with the table.

Ids are Zipf-distributed (exponent ``EXPONENT``) over the whole table, hot ids scattered by a
seeded permutation (``downpour.examples.clicks.zipf_ids``, fixed seed: the same arrays in every
process). The label is planted in the ids (whether most of an example's ids are even), so the
model has something to learn; the bench measures speed and bytes, not accuracy.

The ``tables`` section's tables are 64 columns wide, as ``tiny_models:ten_million_embedding``'s:
``rows_1m_x64`` (256 MB) and ``rows_10m_x64`` (2.56 GB); its servers only start, so their ids
are never drawn.
"""

from __future__ import annotations

import functools

import keras
import numpy as np

from downpour import ModelSpec
from downpour.examples.clicks import zipf_ids
from downpour.inputs.data import Dataset

DIM = 16  # float32 columns of the table: 64 bytes a row
FEATURES = 8  # ids gathered per example
BATCH_SIZE = 256  # 2,048 ids a batch, fewer distinct ones (Zipf)
EXAMPLES = 16_384  # training examples (64 batches an epoch), plus 1,024 held out
HELD_OUT = 1_024
EXPONENT = 1.1
SEED = 7


def name(rows: int, dim: int = DIM) -> str:
    """The model's name: ``sparse_ROWS``, ``sparse_ROWSxDIM`` for another width than ``DIM``."""
    return f"sparse_{rows}" if dim == DIM else f"sparse_{rows}x{dim}"


def build(rows: int, dim: int = DIM) -> keras.Model:
    """The ``rows`` x ``dim`` table and the dense head (see the module)."""
    ids = keras.Input((FEATURES,), dtype="int32", name="ids")
    e = keras.layers.Embedding(rows, dim, name="embed")(ids)
    h = keras.layers.GlobalAveragePooling1D(name="pool")(e)
    h = keras.layers.Dense(32, activation="relu", name="hidden")(h)
    out = keras.layers.Dense(2, name="logits")(h)
    return keras.Model(ids, out, name=name(rows, dim))


@functools.cache
def data(rows: int) -> Dataset:
    """Zipf ids over ``rows`` and the planted labels, the same in every process."""
    rng = np.random.default_rng([SEED, rows])
    n = EXAMPLES + HELD_OUT
    x = zipf_ids(rng, rows, EXPONENT, n * FEATURES).reshape(n, FEATURES).astype(np.int32)
    y = ((x % 2 == 0).sum(axis=1) > FEATURES // 2).astype(np.int64)
    return Dataset(x[:EXAMPLES], y[:EXAMPLES], x[EXAMPLES:], y[EXAMPLES:])


def table(rows: int, dim: int = DIM) -> ModelSpec:
    """The section's model with a ``rows`` x ``dim`` table."""
    return ModelSpec(
        name=name(rows, dim),
        build=functools.partial(build, rows, dim),
        load_data=lambda _data_dir: data(rows),
        batch_size=BATCH_SIZE,
    )


def rows_20k() -> ModelSpec:
    """20,000 rows (1.3 MB): the smoke plan's size."""
    return table(20_000)


def rows_100k() -> ModelSpec:
    """100,000 rows (6.4 MB)."""
    return table(100_000)


def rows_1m() -> ModelSpec:
    """1,000,000 rows (64 MB)."""
    return table(1_000_000)


def rows_4m() -> ModelSpec:
    """4,000,000 rows (256 MB)."""
    return table(4_000_000)


def rows_1m_x64() -> ModelSpec:
    """1,000,000 x 64 (256 MB): the ``tables`` section's smoke plan's size."""
    return table(1_000_000, 64)


def rows_10m_x64() -> ModelSpec:
    """10,000,000 x 64 (2.56 GB): the ``tables`` section's table."""
    return table(10_000_000, 64)
