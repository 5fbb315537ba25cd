"""Scoring the model the servers hold, from a copy of it outside training.

The copy loads the weights pulled whole; a dynamic table's rows cannot come whole (the
servers create them on first touch, for ids nobody can list), so before each held-out batch
the copy pulls the rows of that batch's ids from the shards that own them and holds exactly
those (``DynamicEmbedding.hold``). An id no shard holds reads its initial value, as it does
for a worker. ``Evaluator`` scores the held-out set this way for ``downpour run-local``, the
chief and the evaluator of a job.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import keras
import numpy as np

from downpour.model.build import dynamic_tables, gathered_ids, id_extractor
from downpour.net import security
from downpour.net.cluster import ShardSet, connected
from downpour.net.transport import tcp


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


class Evaluator:
    """Holds a local copy of the model to score the server's weights on the held-out set
    (the spec's ``held_out_fn``, or its Dataset's)."""

    def __init__(self, model_ref: str, data_dir: str | None, device: str = "auto") -> None:
        from downpour.inputs.pipeline import (
            build_dataset,
            context,
            resolve_inputs,
            training_features,
        )
        from downpour.model.build import batchnorm_layers, build_model
        from downpour.runtime.device import configure_device
        from downpour.spec import load_spec

        configure_device(device)  # before any op: memory growth, so the GPU is shared
        self.spec = load_spec(model_ref)
        self.inputs = resolve_inputs(self.spec, data_dir)
        if self.inputs.held_out is None:
            raise ValueError(f"model {model_ref} has no held-out set (give it a held_out_fn)")
        self.data_dir = data_dir
        ctx = context(self.spec, data_dir)
        self.held_out = build_dataset(self.inputs.held_out, ctx, "held_out_fn")
        self.model = build_model(self.spec)
        # BatchNorm statistics are recomputed from the first training batches
        self.bn_batches = (
            training_features(self.inputs.train, ctx, 20) if batchnorm_layers(self.model) else []
        )
        self.names = [v.path for v in self.model.trainable_variables]

    def score(
        self, host: str, port: int | list[int], keys: security.ClientKeys | None = None
    ) -> tuple[int, float]:
        """(server version, held-out metric) with the server's current weights; ``port`` is
        a list of the shards' ports in shard order for a sharded server (version: shard 0's)."""
        ports = port if isinstance(port, list) else [port]
        endpoints = [tcp(host, p) for p in ports]
        versions, metric = self.score_at(endpoints, keys, "run-local-eval")
        return versions[0], metric

    def score_at(
        self, endpoints: list[str], keys: security.ClientKeys | None, sender: str
    ) -> tuple[list[int], float]:
        """(each shard's version, held-out metric) with the weights of the shards whose REP
        ``endpoints`` (tcp://host:port) are given in shard order."""
        from downpour.model.build import evaluate, recalibrate_batchnorm

        def score(batches: Any) -> float:
            recalibrate_batchnorm(self.model, self.bn_batches)  # no-op without BatchNorm
            return evaluate(self.spec, self.model, batches)

        return load_and_score(endpoints, self.model, score, self.held_out, keys, sender)
