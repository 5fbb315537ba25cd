"""Scoring the model the servers hold, from a copy of it outside training.

The copy loads the weights pulled whole; a dynamic table's rows cannot come whole (the
servers create them on first touch, for ids nobody can list), so before each held-out batch
the copy pulls the rows of that batch's ids from the shards that own them and holds exactly
those (``DynamicEmbedding.hold``). An id no shard holds reads its initial value, as it does
for a worker. ``downpour run-local`` scores the held-out set this way.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import keras
import numpy as np

from downpour.model.build import dynamic_tables, gathered_ids, id_extractor
from downpour.net import security
from downpour.net.cluster import ShardSet, connected


def with_table_rows(
    shards: ShardSet, model: keras.Model, batches: Iterable[tuple[Any, Any]]
) -> Iterator[tuple[Any, Any]]:
    """``(features, labels)`` batches, each handed on once ``model``'s dynamic tables hold
    the rows of its ids, pulled from ``shards``."""
    layers = dynamic_tables(model)
    paths = list(layers)
    var = {v.path: i for i, v in enumerate(model.trainable_variables)}
    extractor = id_extractor(model, [layers[p] for p in paths])
    for x, y in batches:
        for path, ids in zip(paths, gathered_ids(extractor, x), strict=True):
            got, rows, _ = shards.pull_rows(var[path], ids.numpy())
            layers[path].hold(got, rows)
        yield x, y


def load_and_score(
    endpoints: Sequence[str],
    model: keras.Model,
    score: Any,
    batches: Iterable[tuple[Any, Any]],
    keys: security.ClientKeys | None = None,
    sender: str = "scoring",
) -> tuple[list[int], Any]:
    """(each shard's version, ``score(batches)``) with ``model`` holding the servers' weights:
    variables pulled whole, dynamic tables' rows pulled batch by batch."""
    variables = model.trainable_variables
    dynamic = dynamic_tables(model)
    with connected(endpoints, variables, keys, sender=sender, dynamic=dynamic) as shards:
        versions = [w.version for w in shards.pull_all()]
        for v, a in zip(variables, shards.join(), strict=True):
            if a is not None:
                v.assign(np.asarray(a))
        if dynamic:
            batches = with_table_rows(shards, model, batches)
        return versions, score(batches)
