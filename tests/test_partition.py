"""The shard partition: balance, determinism, exact coverage, and split/join round trips."""

from __future__ import annotations

import numpy as np
import pytest

from downpour.model.partition import make_partition
from downpour.wire import Sparse

# The Deep-MNIST CNN's trainable variables (downpour.models:deep_mnist), without building it.
DEEP_MNIST = [
    ("conv1/kernel", (5, 5, 1, 32)),
    ("conv1/bias", (32,)),
    ("conv2/kernel", (5, 5, 32, 64)),
    ("conv2/bias", (64,)),
    ("fc1/kernel", (3136, 1024)),
    ("fc1/bias", (1024,)),
    ("logits/kernel", (1024, 10)),
    ("logits/bias", (10,)),
]


def part_of(spec: list[tuple[str, tuple[int, ...]]], shards: int, fp: str = "fp"):  # noqa: ANN201
    names = [n for n, _ in spec]
    shapes = [s for _, s in spec]
    return make_partition(names, shapes, ["float32"] * len(spec), shards, fp)


def test_deep_mnist_over_two_shards_splits_the_big_kernel_and_balances_bytes() -> None:
    p = part_of(DEEP_MNIST, 2)
    fc1 = [[q for q in parts if q.name == "fc1/kernel"] for parts in p.shards]
    assert [[(q.start, q.stop) for q in f] for f in fc1] == [[(0, 1568)], [(1568, 3136)]]
    assert fc1[0][0].wire_name == "fc1/kernel[0:1568]"
    loads = p.shard_bytes()
    assert sum(loads) == 3_274_634 * 4  # every parameter is on exactly one shard
    assert max(loads) / min(loads) < 1.05
    # wire order within a shard is variable order
    for parts in p.shards:
        assert [q.var for q in parts] == sorted(q.var for q in parts)


def test_one_shard_is_the_model_itself() -> None:
    p = part_of(DEEP_MNIST, 1)
    assert [q.wire_name for q in p.shards[0]] == [n for n, _ in DEEP_MNIST]
    assert all(q.whole for q in p.shards[0])


def test_digest_is_deterministic_and_depends_on_model_and_shard_count() -> None:
    assert part_of(DEEP_MNIST, 2).digest == part_of(DEEP_MNIST, 2).digest
    assert part_of(DEEP_MNIST, 2).digest != part_of(DEEP_MNIST, 3).digest
    assert part_of(DEEP_MNIST, 2).digest != part_of(DEEP_MNIST, 2, fp="other").digest


@pytest.mark.parametrize("shards", [1, 2, 3, 5])
def test_every_row_of_every_variable_is_held_exactly_once(shards: int) -> None:
    rng = np.random.default_rng(shards)
    spec = [
        (f"v{i}", tuple(int(d) for d in rng.integers(1, 40, rng.integers(1, 4)))) for i in range(12)
    ]
    spec.append(("big", (4000, 30)))  # larger than any share: split over every shard
    p = part_of(spec, shards)
    for i, (_, shape) in enumerate(spec):
        rows = sorted((q.start, q.stop) for parts in p.shards for q in parts if q.var == i)
        covered = [r for a, b in rows for r in range(a, b)]
        assert covered == list(range(shape[0])), (i, rows)
    big = [k for k, parts in enumerate(p.shards) if any(q.name == "big" for q in parts)]
    assert big == list(range(shards))  # one piece per shard


def test_split_gives_row_views_and_join_restores_the_model() -> None:
    rng = np.random.default_rng(0)
    p = part_of(DEEP_MNIST, 3)
    full = [rng.standard_normal(s).astype(np.float32) for _, s in DEEP_MNIST]
    per_shard = p.split(full)
    for parts, arrays in zip(p.shards, per_shard, strict=True):
        for q, a in zip(parts, arrays, strict=True):
            assert a.shape == q.part_shape
            assert np.shares_memory(a, full[q.var])  # a view: pushing a slice copies nothing
            assert a.flags.c_contiguous
    joined = p.join(per_shard, len(full))
    for a, b in zip(joined, full, strict=True):
        np.testing.assert_array_equal(a, b)


def test_sparse_gradient_rows_go_to_the_shard_holding_them() -> None:
    spec = [("embed", (1000, 4)), ("dense", (4, 2))]
    p = part_of(spec, 2)
    g = Sparse(
        np.array([3, 700, 3, 499, 500]), np.arange(20, dtype=np.float32).reshape(5, 4), (1000, 4)
    )
    pieces = [arrays[0] for arrays in p.split([g, np.zeros((4, 2), np.float32)])]
    first, second = p.shards[0][0], p.shards[1][0]
    assert (first.start, first.stop, second.start, second.stop) == (0, 500, 500, 1000)
    assert pieces[0].indices.tolist() == [3, 3, 499] and pieces[0].dense_shape == (500, 4)
    assert pieces[1].indices.tolist() == [200, 0] and pieces[1].dense_shape == (500, 4)
    np.testing.assert_array_equal(pieces[1].values, g.values[[1, 4]])
    dense = np.concatenate([pieces[0].to_dense(), pieces[1].to_dense()])
    np.testing.assert_array_equal(dense, g.to_dense())


def test_more_shards_than_the_model_can_fill_is_refused() -> None:
    with pytest.raises(ValueError, match="leaves shard 2 empty"):
        part_of([("a", (1,)), ("b", (1,))], 3)
    with pytest.raises(ValueError, match="num_shards"):
        part_of(DEEP_MNIST, 0)


def test_describe_lists_every_part() -> None:
    text = part_of(DEEP_MNIST, 2).describe()
    assert "shard 0:" in text and "shard 1:" in text
    assert "fc1/kernel[0:1568]" in text and "fc1/kernel[1568:3136]" in text
