"""``--compress bf16`` rounds row-sparse gradients too, and ``bf16:dense`` sends them in float32.

In-process servers and workers on real loopback sockets, for a fixed table and a dynamic one,
in several input forms, through one shard and two, with and without a row cache. Each case
trains the same batches under both forms. What every push carried is recorded as it leaves
the compressor, and the byte counts are checked against it: a row's values in half the bytes
under ``bf16``, exactly as many as the float32 ones under ``bf16:dense``; each row once, a
fixed table's by int32 row number, a dynamic table's by id with the lookups it sums. Every
push is applied by every shard.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

import numpy as np
import pytest
from conftest import wait_until
from inproc import make_worker, serving
from tiny_models import embedding_form

from downpour.cli.status import fetch_status
from downpour.wire import BFloat16, Keyed, KeyedBF16, Sparse, SparseBF16

STEPS = 8


def run(spec: Any, shards: int, compress: str, **config: Any) -> tuple[dict[str, Any], list[Any]]:
    """Train ``STEPS`` steps under ``compress``; the worker's summary and every tensor its
    compressors sent, in order."""
    sent: list[Any] = []
    with ExitStack() as stack:
        servers = [
            stack.enter_context(
                serving(spec, optimizer="sgd", learning_rate=0.1, shard=k, num_shards=shards)
            )
            for k in range(shards)
        ]
        worker = make_worker(
            [s.port for s in servers], spec, steps=STEPS, compress=compress, **config
        )
        for comp in worker.pusher.compressors:
            inner = comp.compress

            def spy(grads: list[Any], inner: Any = inner) -> list[Any]:
                out = inner(grads)
                sent.extend(out)
                return out

            comp.compress = spy  # type: ignore[method-assign]
        try:
            summary = worker.run()
        finally:
            worker.close()
        for s in servers:
            doc = wait_until(
                lambda s=s: (d := fetch_status(s.status))["version"] == STEPS and d,
                30,
                "every push applied",
            )
            assert doc["rejected_total"] == 0, doc["rejected"]
    return summary, sent


def rows_of(sent: list[Any]) -> list[Any]:
    return [t for t in sent if isinstance(t, Sparse | SparseBF16)]


@pytest.mark.parametrize(
    ("form", "dynamic", "shards", "cache"),
    [
        ("tensor", False, 1, None),
        ("dict", False, 2, None),
        ("list", False, 1, 200),
        ("dict", True, 1, None),
        ("nested", True, 2, None),
    ],
)
def test_bf16_halves_the_rows_values_and_bf16_dense_keeps_them(
    form: str, dynamic: bool, shards: int, cache: int | None
) -> None:
    spec = embedding_form(form, dynamic=dynamic)
    config: dict[str, Any] = {"row_cache_rows": cache} if cache else {}
    rounded, sent = run(spec, shards, "bf16", **config)
    exact, sent_exact = run(spec, shards, "bf16:dense", **config)

    rows, rows_exact = rows_of(sent), rows_of(sent_exact)
    assert len(rows) == len(rows_exact) >= STEPS  # a table's rows in every push
    assert all(type(t) is (KeyedBF16 if dynamic else SparseBF16) for t in rows)
    assert all(type(t) is (Keyed if dynamic else Sparse) for t in rows_exact)
    assert all(t.values.dtype == np.float32 for t in rows_exact)
    for a, b in zip(rows, rows_exact, strict=True):  # the same batches: the same rows
        assert np.array_equal(a.indices, b.indices) and a.values.shape == b.values.shape
        assert np.unique(a.indices).size == a.indices.size  # each row once
        if not dynamic:  # a fixed table's by int32 row number
            assert a.indices.dtype == np.int32
        else:  # a dynamic table's by int64 id, with the lookups each sums
            assert a.indices.dtype == np.int64 and np.array_equal(a.counts, b.counts)
            assert a.counts.dtype == np.int32 and a.counts.min() >= 1
    if dynamic:  # every lookup counted once: 20 examples of 6 ids a batch
        assert sum(int(t.counts.sum()) for t in rows) == STEPS * 20 * 6
        assert sum(t.indices.size for t in rows) < STEPS * 20 * 6  # repeats went once
    dense = [t for t in sent if not isinstance(t, Sparse | SparseBF16)]
    assert dense and all(isinstance(t, BFloat16) for t in dense)  # dense: rounded in both

    # bytes_raw - bytes_sent is what compression saved of the payload: the dense gradients'
    # halves in both runs, and 2 of the 4 bytes of every row value under bf16 alone
    saved = rounded["bytes_raw"] - rounded["bytes_sent"]
    saved_exact = exact["bytes_raw"] - exact["bytes_sent"]
    assert saved_exact == sum(t.values.size * 2 for t in dense)
    assert saved - saved_exact == 2 * sum(t.values.size for t in rows)
    assert rounded["held_out"] is not None and exact["held_out"] is not None
