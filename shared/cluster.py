"""Client-side helpers for a server that may be sharded: the partition a model gets over S
shards, and the whole model's weights pulled from every shard at once.

Used by ``run-local``'s evaluator, the tests and the benchmarks; workers keep their own
long-lived sockets (services/worker/service.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from downpour import security, wire
from downpour.models import fingerprint
from downpour.partition import Partition, make_partition
from downpour.transport import ReqClient, make_context


def partition_of(variables: Sequence[Any], num_shards: int) -> Partition:
    """The partition of a model's trainable variables over ``num_shards`` shards."""
    return make_partition(
        [v.path for v in variables],
        [tuple(int(d) for d in v.shape) for v in variables],
        [str(v.dtype) for v in variables],
        num_shards,
        fingerprint(variables),
    )


def pull_full(
    endpoints: Sequence[str],
    variables: Sequence[Any],
    keys: security.ClientKeys | None = None,
    timeout_s: float = 30.0,
    sender: str = "probe",
) -> tuple[list[int], list[np.ndarray]]:
    """(each shard's version, the whole model's weights in variable order), pulled from every
    shard concurrently. ``endpoints`` are the shards' REP endpoints in shard order."""
    part = partition_of(variables, len(endpoints))
    ctx = make_context()

    def pull(i: int) -> wire.Message:
        client = ReqClient(
            ctx,
            endpoints[i],
            timeout_s=timeout_s,
            retries=1,
            configure=security.curve_client(keys),
        )
        try:
            return client.request(wire.Message(wire.PULL, sender), wire.DEFAULT_LIMITS)
        finally:
            client.close()

    try:
        with ThreadPoolExecutor(len(endpoints)) as pool:
            replies = list(pool.map(pull, range(len(endpoints))))
    finally:
        ctx.term()
    for i, (parts, reply) in enumerate(zip(part.shards, replies, strict=True)):
        want = [p.wire_name for p in parts]
        if list(reply.tensors) != want:
            raise ValueError(
                f"shard {i} at {endpoints[i]} sent {list(reply.tensors)[:3]}..., expected "
                f"{want[:3]}...: the endpoints are not this model's shards in shard order"
            )
    arrays = part.join([list(r.tensors.values()) for r in replies], len(variables))
    return [r.base_version for r in replies], [np.array(a) for a in arrays]
