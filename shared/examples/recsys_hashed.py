"""The recommendation example with hashed ids: the same factorization model on dynamic tables.

The log is ``downpour.examples.clicks.HASHED``: user and item ids are 64-bit hashes (int64,
negative and huge values included) of a million users and 50,000 items, Zipf-drawn over
240,000 impressions (20,000 held out), so the id space (2**64) is far larger than any table
and most ids are seen once. The model is ``downpour.examples.recsys``'s, its four tables
``downpour.layers.DynamicEmbedding`` layers (``MAX_ROWS`` rows each) instead of
``keras.layers.Embedding``: an id gets its row the first time it is seen, at an initial value
that depends on (seed, layer, id) only.

- **Input**: features ``{"user": ids, "item": ids}`` (int64 hashes), or with
  ``:strings`` the same ids as decimal strings, which the layers hash themselves
  (``downpour.layers.string_ids``); labels the clicks (float32). Without ``--data-dir`` the
  log is generated in memory, as recsys's is; with it, read from the files
  ``downpour data clicks DIR --hashed`` wrote.
- **One process**: ``python -m downpour.examples.recsys_hashed [--epochs 1] [--strings]``
  prints the log's oracle and popularity AUC and the held-out AUC of ``train_one_process``:
  recsys's loop (Adam at lr 0.01, one update per batch of 256) on this model.

Measured on the development machine (2 shared AMD EPYC cores, TensorFlow 2.21, Keras 3.15;
one pass, Adam, lr 0.01), with ``python -m downpour.examples.recsys_hashed``: oracle AUC
0.8478, popularity AUC 0.6578, one process **0.7418** (``--strings``: 0.7427).
"""

from __future__ import annotations

import functools
import sys

import keras

from downpour import ModelSpec
from downpour.examples.clicks import HASHED, ClickConfig
from downpour.examples.recsys import (
    DIM,
    as_strings,
    factor_model,
    make_spec,
    one_process_parser,
    report,
    train_one_process,
)
from downpour.layers import DynamicEmbedding

__all__ = ["MAX_ROWS", "build_model", "hashed_spec", "main", "spec", "strings", "train_one_process"]

MAX_ROWS = 1 << 16  # rows per table: the log has 48,047 distinct users and 23,904 items


def build_model(max_rows: int = MAX_ROWS, dim: int = DIM, strings: bool = False) -> keras.Model:
    """recsys's factorization model on ``DynamicEmbedding`` tables of ``max_rows`` rows, its
    inputs int64 ids, or strings with ``strings``."""
    dtype = "string" if strings else "int64"
    user = keras.Input((), dtype=dtype, name="user")
    item = keras.Input((), dtype=dtype, name="item")
    init = keras.initializers.RandomNormal(stddev=0.05)

    def table(width: int, initializer: object, name: str) -> DynamicEmbedding:
        return DynamicEmbedding(width, max_rows, embeddings_initializer=initializer, name=name)

    u = table(dim, init, "user_factors")(user)
    i = table(dim, init, "item_factors")(item)
    ub = table(1, "zeros", "user_bias")(user)
    ib = table(1, "zeros", "item_bias")(item)
    return factor_model(user, item, (u, i, ub, ib), "recsys_hashed")


def hashed_spec(
    config: ClickConfig = HASHED, *, strings: bool = False, max_rows: int = MAX_ROWS
) -> ModelSpec:
    """The example's ModelSpec for a hashed log of ``config``'s shape: ``max_rows`` rows per
    table, 16 dims; ``strings``: the ids as decimal strings."""
    return make_spec(
        config,
        f"recsys_hashed{'_strings' if strings else ''}",
        build=functools.partial(build_model, max_rows, DIM, strings),
        features=as_strings if strings else None,
    )


def spec() -> ModelSpec:
    """The plugin: ``--model downpour.examples.recsys_hashed:spec`` (int64 ids)."""
    return hashed_spec()


def strings() -> ModelSpec:
    """``--model downpour.examples.recsys_hashed:strings`` (the ids as strings)."""
    return hashed_spec(strings=True)


def main(argv: list[str] | None = None) -> int:
    """``python -m downpour.examples.recsys_hashed``: the log's oracle and popularity AUC, and
    the held-out AUC of the model trained in this one process."""
    p = one_process_parser("python -m downpour.examples.recsys_hashed", __doc__, epochs=1)
    p.add_argument("--strings", action="store_true", help="the ids as strings")
    args = p.parse_args(argv)
    return report(HASHED, hashed_spec(strings=args.strings), args)


if __name__ == "__main__":
    sys.exit(main())
