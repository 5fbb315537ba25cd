"""The payload types' own methods (``shared/wire/payloads.py``): what each kind says it is,
its dense view, its bytes, its rows and shard pieces, sums and scaling, bfloat16 rounding
and widening, and the functions that take an array or a payload alike. Each is checked
against the plain NumPy it stands for, for every dtype a kind carries, and at the empty
and scalar shapes where a kind has them."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from downpour import wire
from downpour.wire import (
    BFloat16,
    FlatSparse,
    Keyed,
    KeyedBF16,
    Payload,
    Sparse,
    SparseBF16,
    as_bf16,
    densify,
    encode,
    is_keyed,
    is_rows,
    logical_dtype,
    logical_shape,
    row_range,
    rows_of,
    unique_rows,
    values_of,
)
from downpour.worker.compress import payload_bytes

VALUE_DTYPES = ["float16", "float32", "float64", "int32", "int64"]
BF16_LOGICAL = ["float16", "float32", "float64"]
INDEX_DTYPES = ["int32", "int64"]


def sparse(dtype: str = "float32", index: str = "int64", rows: int = 6) -> Sparse:
    """Three rows of a (rows, 2) table, row 1 twice."""
    values = np.arange(6, dtype=dtype).reshape(3, 2) + 1
    return Sparse(np.array([4, 1, 1], index), values, (rows, 2))


def keyed(dtype: str = "float32", counts: bool = True) -> Keyed:
    values = np.arange(6, dtype=dtype).reshape(3, 2) + 1
    c = np.array([2, 1, 3], np.int32) if counts else None
    return Keyed(np.array([2**40, -7, 2**40], np.int64), values, (10, 2), c)


def frame_bytes(t: wire.WireTensor) -> int:
    """What ``encode`` puts in the tensor frames: the bytes a payload says it takes."""
    frames = encode(wire.Message(wire.PUSH, tensors={"t": t}))
    return sum(memoryview(f).nbytes for f in frames[1:])


# ---------------------------------------------------------------- what each kind is


@pytest.mark.parametrize(
    ("t", "rows", "keyed_", "bf16"),
    [
        (sparse(), True, False, False),
        (keyed(), True, True, False),
        (FlatSparse(np.array([0]), np.ones(1, np.float32), (2,)), False, False, False),
        (BFloat16.from_array(np.ones(2, np.float32)), False, False, True),
        (SparseBF16.from_sparse(sparse()), True, False, True),
        (KeyedBF16.from_sparse(keyed()), True, True, True),
        (np.ones(3, np.float32), False, False, False),
    ],
    ids=["sparse", "keyed", "flat", "bf16", "sparse_bf16", "keyed_bf16", "array"],
)
def test_each_kind_says_what_it_is(
    t: wire.WireTensor, rows: bool, keyed_: bool, bf16: bool
) -> None:
    assert (is_rows(t), is_keyed(t)) == (rows, keyed_)
    assert isinstance(t, Payload) == (not isinstance(t, np.ndarray))
    if isinstance(t, Payload):
        assert (t.row_sparse, t.keyed, t.bf16) == (rows, keyed_, bf16)


def test_none_is_no_rows() -> None:
    assert not is_rows(None) and not is_keyed(None)


# ---------------------------------------------------------------- dtype, shape, bytes


@pytest.mark.parametrize("dtype", VALUE_DTYPES)
@pytest.mark.parametrize("index", INDEX_DTYPES)
def test_sparse_dtype_and_bytes(dtype: str, index: str) -> None:
    s = sparse(dtype, index)
    assert s.dtype == logical_dtype(s) == np.dtype(dtype)
    assert logical_shape(s) == (6, 2)
    assert s.nbytes == s.logical_nbytes == s.indices.nbytes + s.values.nbytes
    assert s.nbytes == frame_bytes(s) == payload_bytes(s)


def test_sparse_narrow_indices_count_as_the_int64_frame_they_travel_in() -> None:
    s = Sparse(np.array([0, 2], np.int16), np.ones((2, 3), np.float32), (4, 3))
    assert s.nbytes == 2 * 8 + 24 == frame_bytes(s)


@pytest.mark.parametrize("counts", [True, False])
def test_keyed_bytes_count_the_counts_frame(counts: bool) -> None:
    k = keyed(counts=counts)
    assert k.nbytes == 3 * 8 + 24 + (3 * 4 if counts else 0) == frame_bytes(k)


@pytest.mark.parametrize("dtype", BF16_LOGICAL)
@pytest.mark.parametrize("shape", [(), (0,), (3, 2)])
def test_bfloat16_dtype_shape_and_bytes(dtype: str, shape: tuple[int, ...]) -> None:
    a = np.full(shape, 1.5, dtype)
    b = BFloat16.from_array(a)
    assert (b.dtype, b.dense_shape, logical_shape(b)) == (np.dtype(dtype), shape, shape)
    assert b.nbytes == a.size * 2 == frame_bytes(b)
    assert b.logical_nbytes == a.nbytes


@pytest.mark.parametrize("dtype", BF16_LOGICAL)
@pytest.mark.parametrize("make", [sparse, keyed], ids=["sparse", "keyed"])
def test_sparse_bf16_bytes(dtype: str, make: object) -> None:
    rows = make(dtype)  # type: ignore[operator]
    r = (KeyedBF16 if rows.keyed else SparseBF16).from_sparse(rows)
    assert r.dtype == logical_dtype(r) == np.dtype(dtype)
    assert r.nbytes == rows.nbytes - r.values.size * (np.dtype(dtype).itemsize - 2)
    assert r.nbytes == frame_bytes(r)
    assert r.logical_nbytes == rows.nbytes


@pytest.mark.parametrize("dtype", ["float32", "float64", "int32"])
@pytest.mark.parametrize("shape", [(), (0,), (2, 3)])
def test_flat_sparse_dtype_shape_and_bytes(dtype: str, shape: tuple[int, ...]) -> None:
    n = min(1, int(np.prod(shape)))
    f = FlatSparse(np.zeros(n, np.int32), np.ones(n, dtype), shape)
    assert (f.dtype, logical_shape(f)) == (np.dtype(dtype), shape)
    assert f.nbytes == f.logical_nbytes == n * (4 + np.dtype(dtype).itemsize) == frame_bytes(f)


@pytest.mark.parametrize("shape", [(), (0,), (2, 3)])
def test_an_array_has_its_own_shape_dtype_and_bytes(shape: tuple[int, ...]) -> None:
    a = np.ones(shape, np.float64)
    assert (logical_shape(a), logical_dtype(a), payload_bytes(a)) == (shape, a.dtype, a.nbytes)
    assert values_of(a) is a


# ---------------------------------------------------------------- dense views


@pytest.mark.parametrize("dtype", VALUE_DTYPES)
def test_sparse_to_dense_sums_repeats_and_fills_out(dtype: str) -> None:
    s = sparse(dtype)
    want = np.zeros((6, 2), dtype)
    np.add.at(want, s.indices, s.values)
    np.testing.assert_array_equal(s.to_dense(), want)
    out = np.full((6, 2), 9, dtype)
    assert s.to_dense(out) is out
    np.testing.assert_array_equal(out, want)
    assert densify(s).dtype == np.dtype(dtype)


def test_an_empty_table_densifies_to_zero_rows() -> None:
    s = Sparse(np.zeros(0, np.int32), np.zeros((0, 3), np.float32), (0, 3))
    assert s.to_dense().shape == (0, 3)
    ids, values = rows_of(s)
    assert ids.shape == (0,) and values.shape == (0, 3)


@pytest.mark.parametrize(
    "t",
    [sparse(), BFloat16.from_array(np.ones((6, 2), np.float32)), SparseBF16.from_sparse(sparse())],
    ids=["sparse", "bf16", "sparse_bf16"],
)
def test_to_dense_refuses_an_out_of_another_shape(t: Payload) -> None:
    with pytest.raises(ValueError, match="out must be"):
        t.to_dense(np.zeros((5, 2), np.float32))
    with pytest.raises(ValueError, match="out must be"):
        t.to_dense(np.zeros((2, 6), np.float32).T)  # not C-contiguous


@pytest.mark.parametrize("dtype", BF16_LOGICAL)
@pytest.mark.parametrize("shape", [(), (0,), (3, 2)])
def test_bfloat16_to_dense_widens_exactly(dtype: str, shape: tuple[int, ...]) -> None:
    a = np.full(shape, 0.1, dtype)
    b = BFloat16.from_array(a)
    want = a.astype(ml_dtypes.bfloat16).astype(dtype)
    got = b.to_dense()
    assert got.dtype == np.dtype(dtype) and got.shape == shape
    np.testing.assert_array_equal(got, want)
    out = np.empty(shape, dtype)
    assert b.to_dense(out) is out
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(densify(b), want)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("shape", [(), (0,), (2, 3)])
def test_flat_sparse_to_dense(dtype: str, shape: tuple[int, ...]) -> None:
    size = int(np.prod(shape))
    idx = np.zeros(2 if size else 0, np.int64)  # a repeated position is summed
    f = FlatSparse(idx, np.ones(idx.size, dtype), shape)
    want = np.zeros(size, dtype)
    np.add.at(want, idx, 1)
    np.testing.assert_array_equal(f.to_dense(), want.reshape(shape))
    out = np.full(shape, 5, dtype)
    np.testing.assert_array_equal(densify(f, out), want.reshape(shape))


@pytest.mark.parametrize("dtype", BF16_LOGICAL)
def test_sparse_bf16_widens_to_the_rows_it_stands_for(dtype: str) -> None:
    s = sparse(dtype)
    r = SparseBF16.from_sparse(s)
    w = r.widened()
    assert type(w) is Sparse and w.values.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(w.indices, s.indices)
    np.testing.assert_array_equal(w.values, s.values)  # small integers are exact in bf16
    np.testing.assert_array_equal(r.to_dense(), s.to_dense())
    ids, values = r.rows()
    assert ids is r.indices and values.dtype == ml_dtypes.bfloat16
    ids, values = r.unique_rows()
    np.testing.assert_array_equal(ids, [1, 4])
    assert values.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(values, s.unique_rows()[1])


def test_keyed_bf16_widens_to_keyed_rows_with_their_counts() -> None:
    k = keyed()
    w = KeyedBF16.from_sparse(k).widened()
    assert type(w) is Keyed
    np.testing.assert_array_equal(w.counts, k.counts)
    np.testing.assert_array_equal(w.values, k.values)


@pytest.mark.parametrize("t", [keyed(), KeyedBF16.from_sparse(keyed())], ids=["keyed", "bf16"])
def test_a_dynamic_tables_rows_have_no_dense_form(t: Payload) -> None:
    with pytest.raises(ValueError, match="no dense form"):
        t.to_dense()
    with pytest.raises(ValueError, match="no dense form"):
        densify(t)


# ---------------------------------------------------------------- rows


@pytest.mark.parametrize("index", INDEX_DTYPES)
def test_rows_of_rows_are_their_arrays(index: str) -> None:
    s = sparse(index=index)
    ids, values = rows_of(s)
    assert ids is s.indices and values is s.values
    assert values_of(s) is s.values


@pytest.mark.parametrize("dtype", VALUE_DTYPES)
@pytest.mark.parametrize("shape", [(0,), (0, 2), (4,), (4, 2)])
def test_rows_of_an_array_are_every_row_without_a_copy(dtype: str, shape: tuple[int, ...]) -> None:
    a = np.ones(shape, dtype)
    for ids, values in (rows_of(a), unique_rows(a)):
        assert ids.dtype == np.int64
        np.testing.assert_array_equal(ids, np.arange(shape[0]))
        assert values is a


@pytest.mark.parametrize("dtype", VALUE_DTYPES)
@pytest.mark.parametrize("index", INDEX_DTYPES)
def test_unique_rows_sum_repeats_in_row_order(dtype: str, index: str) -> None:
    ids, values = unique_rows(sparse(dtype, index))
    assert ids.dtype == np.int64 and values.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(ids, [1, 4])
    np.testing.assert_array_equal(values, np.array([[3 + 5, 4 + 6], [1, 2]], dtype))


def test_kinds_without_rows_say_so() -> None:
    for t in (FlatSparse(np.array([0]), np.ones(1), (2,)), BFloat16.from_array(np.ones(2))):
        with pytest.raises(TypeError, match="has no rows"):
            rows_of(t)


@pytest.mark.parametrize("index", INDEX_DTYPES)
def test_sparse_row_range_renumbers_the_rows_inside(index: str) -> None:
    s = sparse(index=index)
    part = row_range(s, 1, 4)
    assert type(part) is Sparse and part.dense_shape == (3, 2)
    assert part.indices.dtype == np.dtype(index)
    np.testing.assert_array_equal(part.indices, [0, 0])
    np.testing.assert_array_equal(part.to_dense(), s.to_dense()[1:4])
    empty = s.row_range(5, 6)
    assert empty.indices.shape == (0,) and empty.values.shape == (0, 2)


@pytest.mark.parametrize("dtype", BF16_LOGICAL)
def test_bfloat16_row_range_is_a_view_of_its_bits(dtype: str) -> None:
    b = BFloat16.from_array(np.arange(8, dtype=dtype).reshape(4, 2))
    part = row_range(b, 1, 3)
    assert type(part) is BFloat16 and part.dtype == np.dtype(dtype)
    assert np.shares_memory(part.values, b.values)
    np.testing.assert_array_equal(part.to_dense(), b.to_dense()[1:3])


def test_an_arrays_row_range_is_a_view() -> None:
    a = np.arange(12.0).reshape(6, 2)
    part = row_range(a, 2, 5)
    assert np.shares_memory(part, a)
    np.testing.assert_array_equal(part, a[2:5])


def test_kinds_without_row_ranges_refuse_them() -> None:
    with pytest.raises(TypeError, match="keyed by id"):
        keyed().row_range(0, 1)
    with pytest.raises(TypeError, match="cannot be split by rows"):
        FlatSparse(np.array([0]), np.ones(1), (2,)).row_range(0, 1)


@pytest.mark.parametrize("counts", [True, False])
def test_select_keeps_the_kind_and_the_counts(counts: bool) -> None:
    k = keyed(counts=counts)
    keep = np.array([True, False, True])
    got = k.select(keep)
    assert type(got) is Keyed and got.dense_shape == k.dense_shape
    np.testing.assert_array_equal(got.indices, k.indices[keep])
    np.testing.assert_array_equal(got.values, k.values[keep])
    if counts:
        np.testing.assert_array_equal(got.counts, [2, 3])
    else:
        assert got.counts is None
    s = sparse().select(keep)
    assert type(s) is Sparse and s.indices.tolist() == [4, 1]


# ---------------------------------------------------------------- pushes and the accumulator


@pytest.mark.parametrize("dtype", VALUE_DTYPES)
def test_sparse_pushed_sums_repeats_by_int32_row_number(dtype: str) -> None:
    s = sparse(dtype)
    p = s.pushed()
    assert type(p) is Sparse and p.indices.dtype == np.int32
    np.testing.assert_array_equal(p.indices, [1, 4])
    np.testing.assert_array_equal(p.to_dense(), s.to_dense())
    assert wire.pushed_rows(s).indices.tolist() == [1, 4]


def test_keyed_pushed_counts_the_lookups_of_each_id() -> None:
    p = keyed(counts=False).pushed()
    assert type(p) is Keyed
    np.testing.assert_array_equal(p.indices, [-7, 2**40])
    np.testing.assert_array_equal(p.counts, [1, 2])
    np.testing.assert_array_equal(p.values, [[3, 4], [1 + 5, 2 + 6]])


@pytest.mark.parametrize(
    "t",
    [BFloat16.from_array(np.ones(3)), FlatSparse(np.array([0]), np.ones(1), (3,))],
    ids=["bf16", "flat"],
)
def test_kinds_without_merges_push_as_they_are(t: Payload) -> None:
    assert t.pushed() is t


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_plus_concatenates_rows_and_takes_a_dense_one_as_every_row(dtype: str) -> None:
    s, d = sparse(dtype), np.ones((6, 2), dtype)
    for got in (s.plus(sparse(dtype)), s.plus(d), Sparse.every_row(d).plus(s)):
        assert type(got) is Sparse and got.values.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(s.plus(s).to_dense(), 2 * s.to_dense())
    np.testing.assert_array_equal(s.plus(d).to_dense(), s.to_dense() + d)
    both = Sparse.every_row(d).plus(s)
    np.testing.assert_array_equal(both.indices[:6], np.arange(6))  # the first one's rows first
    np.testing.assert_array_equal(both.to_dense(), d + s.to_dense())


def test_keyed_plus_keyed_carries_the_lookups_of_each_row() -> None:
    a, b = keyed(counts=True), keyed(counts=False)
    got = a.plus(b)
    assert type(got) is Keyed
    np.testing.assert_array_equal(got.counts, [2, 1, 3, 1, 1, 1])
    np.testing.assert_array_equal(got.pushed().counts, [1 + 1, 2 + 3 + 1 + 1])


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_scaled_keeps_the_dtype_and_the_counts(dtype: str) -> None:
    k = keyed(dtype)
    got = k.scaled(0.5)
    assert type(got) is Keyed and got.values.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(got.values, k.values * np.asarray(0.5, dtype))
    assert got.counts is k.counts
    assert sparse(dtype).scaled(2.0).values.dtype == np.dtype(dtype)


def test_rounded_and_flat_gradients_are_not_accumulated() -> None:
    b = BFloat16.from_array(np.ones(3, np.float32))
    f = FlatSparse(np.array([0]), np.ones(1, np.float32), (3,))
    for t in (b, f):
        with pytest.raises(TypeError, match="cannot be accumulated"):
            t.plus(np.ones(3, np.float32))
        with pytest.raises(TypeError, match="cannot be scaled"):
            t.scaled(0.5)


# ---------------------------------------------------------------- rounding to bfloat16


@pytest.mark.parametrize("dtype", VALUE_DTYPES)
@pytest.mark.parametrize("make", [sparse, keyed], ids=["sparse", "keyed"])
def test_rows_round_to_bf16_where_that_halves_them(dtype: str, make: object) -> None:
    rows = make(dtype)  # type: ignore[operator]
    got = rows.as_bf16()
    assert as_bf16(rows).nbytes == got.nbytes
    if dtype in ("float32", "float64"):
        assert type(got) is (KeyedBF16 if rows.keyed else SparseBF16)
        assert got.dtype == np.dtype(dtype) and got.values.dtype == ml_dtypes.bfloat16
        if rows.keyed:
            assert got.counts is rows.counts
    else:  # float16 (as many bytes) and integers go as they are
        assert got is rows


@pytest.mark.parametrize("dtype", VALUE_DTYPES)
@pytest.mark.parametrize("shape", [(), (0,), (2, 3)])
def test_arrays_round_to_bf16_where_that_halves_them(dtype: str, shape: tuple[int, ...]) -> None:
    a = np.ones(shape, dtype)
    got = as_bf16(a)
    if dtype in ("float32", "float64"):
        assert type(got) is BFloat16 and got.dense_shape == shape
    else:
        assert got is a


def test_kinds_that_cannot_be_rounded_say_so() -> None:
    for t in (BFloat16.from_array(np.ones(2)), FlatSparse(np.array([0]), np.ones(1), (2,))):
        with pytest.raises(TypeError, match="cannot be rounded"):
            as_bf16(t)  # type: ignore[arg-type]
