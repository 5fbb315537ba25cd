"""Gradient compression: the worker's compressors (``services/worker/compress.py``) and the
``bf16`` / ``topk`` / ``sparse_bf16`` encodings of the wire protocol (``shared/wire/__init__.py``).

Frames are turned into plain ``bytes`` before decoding, which is what a peer receives.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ml_dtypes
import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from downpour.memory.buffers import is_private
from downpour.wire import (
    BF16,
    DEFAULT_LIMITS,
    PUSH,
    R_DTYPE,
    R_NBYTES,
    R_SHAPE,
    R_TOO_LARGE,
    R_TRUNCATED,
    SPARSE_BF16,
    TOPK,
    BFloat16,
    FlatSparse,
    Keyed,
    KeyedBF16,
    Limits,
    Message,
    ProtocolError,
    Sparse,
    SparseBF16,
    as_bf16,
    counted_rows,
    decode,
    densify,
    encode,
)
from downpour.wire.codecs import widen_bf16
from downpour.worker.compress import (
    COMPRESSION_FORMS,
    COMPRESSIONS,
    BF16Compression,
    NoCompression,
    TopKCompression,
    parse_compression,
    payload_bytes,
)

# The Deep-MNIST CNN's trainable variables: 3,274,634 float32 parameters, 13.1 MB.
DEEP_MNIST_SHAPES = [
    (5, 5, 1, 32),
    (32,),
    (5, 5, 32, 64),
    (64,),
    (3136, 1024),
    (1024,),
    (1024, 10),
    (10,),
]


def as_bytes(frames: list[Any]) -> list[bytes]:
    """What the peer receives: every frame as the raw bytes ZeroMQ would carry."""
    return [
        np.ascontiguousarray(f).tobytes() if isinstance(f, np.ndarray) else bytes(f) for f in frames
    ]


def frames_bytes(frames: list[Any]) -> int:
    return sum(len(b) for b in as_bytes(frames))


def push(tensors: list[Any]) -> Message:
    return Message(PUSH, "w0", 1, 0, tensors={f"v{i}": t for i, t in enumerate(tensors)})


def roundtrip(tensors: list[Any], limits: Limits = DEFAULT_LIMITS) -> list[Any]:
    return list(decode(as_bytes(encode(push(tensors))), limits).tensors.values())


def unpack(frame: bytes) -> Any:
    return msgpack.unpackb(frame, raw=False)


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def mutate(frames: list[bytes], fn: Callable[[dict[str, Any]], Any]) -> list[bytes]:
    header = unpack(frames[0])
    fn(header)
    return [pack(header), *frames[1:]]


def rejects(frames: list[Any], code: str, limits: Limits = DEFAULT_LIMITS) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        decode(frames, limits)
    assert info.value.code == code, info.value
    return info.value


def rng_grads(shapes: list[tuple[int, ...]], seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(np.float32) for s in shapes]


# ---------------------------------------------------------------- protocol: bf16


@pytest.mark.parametrize("shape", [(), (0,), (7,), (2, 3, 4)])
def test_bf16_roundtrip_and_descriptor(shape: tuple[int, ...]) -> None:
    a = (np.arange(math.prod(shape), dtype=np.float32) * 0.37 - 1.1).reshape(shape)
    frames = as_bytes(encode(push([BFloat16.from_array(a)])))
    assert len(frames) == 2
    (desc,) = unpack(frames[0])["tensors"]
    n = math.prod(shape)
    assert desc == {
        "name": "v0",
        "dtype": "float32",
        "shape": list(shape),
        "encoding": BF16,
        "nbytes": 2 * n,
    }
    assert len(frames[1]) == 2 * n
    assert frames[1] == a.astype(ml_dtypes.bfloat16).view("<u2").tobytes()
    (out,) = decode(frames).tensors.values()
    assert isinstance(out, np.ndarray)
    assert out.dtype == np.float32 and out.shape == shape
    assert not out.flags.writeable
    np.testing.assert_array_equal(out, a.astype(ml_dtypes.bfloat16).astype(np.float32))


def test_bf16_rounds_to_nearest_even_and_keeps_specials() -> None:
    a = np.array(
        [1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-8 + 2**-20, -2.5, 0.0, -0.0, np.inf, -np.inf, np.nan],
        np.float32,
    )
    (out,) = roundtrip([BFloat16.from_array(a)])
    np.testing.assert_array_equal(out[:6], [1.0, 1 + 2**-6, 1 + 2**-7, -2.5, 0.0, 0.0])
    assert np.signbit(out[5]) and not np.signbit(out[4])
    assert out[6] == np.inf and out[7] == -np.inf and np.isnan(out[8])


def test_bf16_widens_every_bit_pattern_exactly_into_private_memory() -> None:
    bits = np.arange(1 << 16, dtype="<u2")  # every bfloat16: zeros, subnormals, inf, NaNs
    for dtype in (np.float32, np.float64, np.float16):
        with np.errstate(over="ignore", invalid="ignore"):  # float16 holds few of them
            out = widen_bf16(memoryview(bits.tobytes()), np.dtype(dtype), (256, 256))
            expected = bits.view(ml_dtypes.bfloat16).astype(dtype).reshape(256, 256)
        assert out.dtype == dtype and not out.flags.writeable
        unsigned = f"u{out.itemsize}"  # bit for bit: NaN payloads and the sign of zero too
        np.testing.assert_array_equal(out.view(unsigned), expected.view(unsigned))
        assert is_private(out)  # a worker may hand it to TensorFlow without a copy
    (dense,) = roundtrip([np.ones((64, 64), np.float32)])
    assert not is_private(dense)  # a view on the received frame never is


def test_bf16_decodes_to_its_logical_dtype() -> None:
    a = np.linspace(-3, 3, 11)
    (out,) = roundtrip([BFloat16.from_array(a)])
    assert out.dtype == np.float64
    np.testing.assert_array_equal(out, a.astype(ml_dtypes.bfloat16).astype(np.float64))


def test_bf16_rejects_non_float_arrays() -> None:
    with pytest.raises(ValueError, match="bf16"):
        BFloat16.from_array(np.arange(3))


def test_bf16_malformed_frames() -> None:
    good = as_bytes(encode(push([BFloat16.from_array(np.ones((4, 5), np.float32))])))
    rejects([good[0], good[1][:-2]], R_TRUNCATED)
    rejects([good[0], good[1] + b"\0\0"], R_TRUNCATED)
    rejects([good[0]], R_TRUNCATED)
    rejects(mutate(good, lambda h: h["tensors"][0].__setitem__("nbytes", 80)), R_NBYTES)
    rejects(mutate(good, lambda h: h["tensors"][0].__setitem__("dtype", "int16")), R_DTYPE)
    rejects(mutate(good, lambda h: h["tensors"][0].__setitem__("dtype", "bfloat16")), R_DTYPE)


def test_bf16_counts_its_decoded_size_against_the_limit() -> None:
    """Decode makes a float32 array of twice the wire size: that is what the limit bounds."""
    frames = as_bytes(encode(push([BFloat16.from_array(np.ones(1000, np.float32))])))
    assert len(decode(frames, Limits(max_total_bytes=4000)).tensors) == 1
    rejects(frames, R_TOO_LARGE, Limits(max_total_bytes=3999))


# ---------------------------------------------------------------- protocol: sparse_bf16


def bf16_rows(n: int, dtype: Any = np.float32, rows: int = 50) -> tuple[Sparse, SparseBF16]:
    """``n`` rows of a (rows, 3) table, and the same rows as ``as_bf16`` sends them."""
    values = (np.arange(n * 3, dtype=dtype).reshape(n, 3) * 0.37 - 1.1).astype(dtype)
    s = Sparse(np.arange(n, dtype=np.int64) * 2, values, (rows, 3))
    t = as_bf16(s)
    assert isinstance(t, SparseBF16)
    return s, t


@pytest.mark.parametrize("n", [0, 1, 7])
def test_sparse_bf16_roundtrip_and_descriptor(n: int) -> None:
    s, t = bf16_rows(n)
    frames = as_bytes(encode(push([t])))
    assert len(frames) == 3
    (desc,) = unpack(frames[0])["tensors"]
    assert desc == {
        "name": "v0",
        "dtype": "float32",
        "shape": [50, 3],
        "encoding": SPARSE_BF16,
        "nbytes": n * 3 * 2,
        "nnz": n,
        "index_dtype": "int64",
    }
    assert frames[1] == s.indices.tobytes()
    assert frames[2] == s.values.astype(ml_dtypes.bfloat16).view("<u2").tobytes()
    (out,) = decode(frames).tensors.values()
    assert isinstance(out, Sparse) and out.dense_shape == (50, 3)
    assert out.values.dtype == np.float32 and not out.values.flags.writeable
    np.testing.assert_array_equal(out.indices, s.indices)
    np.testing.assert_array_equal(
        out.values, s.values.astype(ml_dtypes.bfloat16).astype(np.float32)
    )
    np.testing.assert_array_equal(densify(t), out.to_dense())


def test_sparse_bf16_decodes_to_its_logical_dtype_and_as_bf16_keeps_float16_rows() -> None:
    s, t = bf16_rows(4, np.float64)
    (out,) = roundtrip([t])
    assert out.values.dtype == np.float64
    np.testing.assert_array_equal(
        out.values, s.values.astype(ml_dtypes.bfloat16).astype(np.float64)
    )
    half = Sparse(s.indices, s.values.astype(np.float16), s.dense_shape)
    assert as_bf16(half) is half  # float16 rows: as many bytes and more precise as they are


def test_sparse_bf16_malformed_frames() -> None:
    good = as_bytes(encode(push([bf16_rows(4)[1]])))
    header, ids, values = good
    rejects([header, ids, values[:-2]], R_TRUNCATED)
    rejects([header, ids, values + b"\0\0"], R_TRUNCATED)
    rejects([header, ids[:-8], values], R_TRUNCATED)
    rejects([header, ids], R_TRUNCATED)
    rejects(mutate(good, lambda h: h["tensors"][0].__setitem__("nbytes", 4 * 3 * 4)), R_NBYTES)
    rejects(mutate(good, lambda h: h["tensors"][0].__setitem__("dtype", "int16")), R_DTYPE)
    rejects(mutate(good, lambda h: h["tensors"][0].__setitem__("shape", [50])), R_NBYTES)
    rejects(mutate(good, lambda h: h["tensors"][0].__setitem__("shape", [6, 3])), R_SHAPE)
    rejects(mutate(good, lambda h: h["tensors"][0].__setitem__("shape", [])), R_SHAPE)
    with pytest.raises(ValueError, match="bf16"):
        encode(push([SparseBF16(np.zeros(1, np.int64), np.zeros((1, 3), np.float32), (2, 3))]))


def test_sparse_bf16_counts_its_decoded_size_against_the_limit() -> None:
    """Decode makes float32 values of twice the wire size, and reads int64 ids: both count."""
    frames = as_bytes(encode(push([bf16_rows(10)[1]])))
    needed = 10 * 8 + 10 * 3 * 4
    assert len(decode(frames, Limits(max_total_bytes=needed)).tensors) == 1
    rejects(frames, R_TOO_LARGE, Limits(max_total_bytes=needed - 1))


# ---------------------------------------------------------------- protocol: topk


@pytest.mark.parametrize("index_dtype", ["int32", "int64"])
def test_topk_roundtrip_and_descriptor(index_dtype: str) -> None:
    idx = np.array([0, 5, 11, 23], dtype=index_dtype)
    vals = np.array([1.5, -2.0, 3.25, 4.0], np.float32)
    frames = as_bytes(encode(push([FlatSparse(idx, vals, (2, 3, 4))])))
    assert len(frames) == 3
    (desc,) = unpack(frames[0])["tensors"]
    assert desc == {
        "name": "v0",
        "dtype": "float32",
        "shape": [2, 3, 4],
        "encoding": TOPK,
        "nbytes": 16,
        "nnz": 4,
        "index_dtype": index_dtype,
    }
    assert frames[1] == idx.tobytes() and frames[2] == vals.tobytes()
    (out,) = decode(frames).tensors.values()
    assert isinstance(out, FlatSparse)
    assert out.dense_shape == (2, 3, 4) and out.dtype == np.float32
    assert out.indices.dtype.name == index_dtype
    expected = np.zeros(24, np.float32)
    expected[[0, 5, 11, 23]] = vals
    np.testing.assert_array_equal(out.to_dense(), expected.reshape(2, 3, 4))
    np.testing.assert_array_equal(densify(out), expected.reshape(2, 3, 4))


def test_topk_nnz_zero_and_full() -> None:
    (empty,) = roundtrip([FlatSparse(np.zeros(0, np.int32), np.zeros(0, np.float32), (3, 2))])
    assert isinstance(empty, FlatSparse)
    np.testing.assert_array_equal(empty.to_dense(), np.zeros((3, 2)))
    full = FlatSparse(
        np.arange(6, dtype=np.int32)[::-1].copy(), np.arange(6, dtype=np.float32), (3, 2)
    )
    (out,) = roundtrip([full])
    np.testing.assert_array_equal(
        out.to_dense(), np.arange(6, dtype=np.float32)[::-1].reshape(3, 2)
    )
    (scalar,) = roundtrip([FlatSparse(np.array([0], np.int64), np.array([7.0], np.float32), ())])
    assert scalar.to_dense().shape == () and float(scalar.to_dense()) == 7.0


def test_topk_repeated_positions_are_summed_and_out_is_reused() -> None:
    (out,) = roundtrip(
        [FlatSparse(np.array([2, 2, 0], np.int32), np.array([1.0, 10.0, 5.0], np.float32), (4,))]
    )
    buf = np.full(4, 99.0, np.float32)
    dense = out.to_dense(buf)
    assert dense is buf
    np.testing.assert_array_equal(buf, [5.0, 0.0, 11.0, 0.0])
    with pytest.raises(ValueError, match="C-contiguous"):
        out.to_dense(np.zeros(5, np.float32))


def _topk_frames(
    idx: list[int] | np.ndarray, n: int = 10, index_dtype: str = "int32"
) -> list[bytes]:
    i = np.asarray(idx, dtype=index_dtype)
    return as_bytes(encode(push([FlatSparse(i, np.ones(i.size, np.float32), (n,))])))


def test_topk_out_of_range_indices_are_rejected() -> None:
    decode(_topk_frames([0, 9]))  # the bounds themselves are fine
    rejects(_topk_frames([0, 10]), R_SHAPE)
    rejects(_topk_frames([-1, 3]), R_SHAPE)
    rejects(_topk_frames([2**40], n=10, index_dtype="int64"), R_SHAPE)
    rejects(_topk_frames([-(2**63)], n=10, index_dtype="int64"), R_SHAPE)


def test_topk_nnz_larger_than_the_tensor_is_rejected_before_frames_are_read() -> None:
    frames = _topk_frames([1, 2, 3], n=3)
    bad = mutate(frames, lambda h: h["tensors"][0].update(nnz=4, nbytes=16, shape=[3]))
    rejects([bad[0], b"\0" * 16, b"\0" * 16], R_SHAPE)
    huge = mutate(frames, lambda h: h["tensors"][0].update(nnz=2**40, nbytes=2**42))
    rejects(huge, R_SHAPE)


def test_topk_malformed_frames() -> None:
    good = _topk_frames([1, 4, 7])
    decode(good)
    rejects([good[0], good[1][:-4], good[2]], R_TRUNCATED)  # index frame short
    rejects([good[0], good[1] + b"\0" * 4, good[2]], R_TRUNCATED)
    rejects([good[0], good[1], good[2][:-1]], R_TRUNCATED)  # value frame short
    rejects([good[0], good[1], good[2] + b"\0" * 4], R_TRUNCATED)
    rejects([good[0], good[1]], R_TRUNCATED)  # a frame missing
    rejects(mutate(good, lambda h: h["tensors"][0].__setitem__("nbytes", 16)), R_NBYTES)
    rejects(mutate(good, lambda h: h["tensors"][0].__setitem__("index_dtype", "uint8")), R_DTYPE)
    rejects(mutate(good, lambda h: h["tensors"][0].__setitem__("dtype", "object")), R_DTYPE)
    # int64 indices declared over an int32 frame: lengths disagree
    rejects(
        mutate(good, lambda h: h["tensors"][0].__setitem__("index_dtype", "int64")), R_TRUNCATED
    )


def test_topk_index_bytes_count_against_the_limit() -> None:
    frames = _topk_frames(list(range(10)), n=50)  # 40 index + 40 value bytes
    assert decode(frames, Limits(max_total_bytes=80)).tensors
    rejects(frames, R_TOO_LARGE, Limits(max_total_bytes=79))


def test_densify_every_kind() -> None:
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert densify(a) is a
    np.testing.assert_array_equal(
        densify(Sparse(np.array([1]), a[:1], (2, 3))), [[0, 0, 0], [0, 1, 2]]
    )
    np.testing.assert_array_equal(densify(BFloat16.from_array(a)), a)  # small ints are exact
    out = np.empty(6, np.float32)
    got = densify(FlatSparse(np.array([5], np.int32), np.array([2.0], np.float32), (6,)), out)
    assert got is out
    np.testing.assert_array_equal(out, [0, 0, 0, 0, 0, 2])


MUTABLE_KEYS = ["dtype", "shape", "encoding", "nbytes", "nnz", "index_dtype"]
FUZZ_VALUES = st.one_of(
    st.integers(-3, 40),
    st.sampled_from(
        [2**31, 2**40, 2**63 - 1, None, "", "float32", "int64", "bf16", "topk", "sparse", "dense"]
    ),
    st.lists(st.integers(-1, 6), max_size=3),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    base=st.sampled_from(["topk", "bf16", "both"]),
    changes=st.lists(
        st.tuples(st.integers(0, 1), st.sampled_from(MUTABLE_KEYS), FUZZ_VALUES), max_size=3
    ),
    cut=st.sampled_from([None, 0, 1, 2, 3]),
    trim=st.integers(0, 5),
)
def test_fuzz_compressed_frames_decode_or_protocol_error(
    base: str, changes: list[tuple[int, str, Any]], cut: int | None, trim: int
) -> None:
    """Mutated compressed headers and frames: a ProtocolError or a valid decode, never a crash."""
    tensors: list[Any] = []
    if base in ("topk", "both"):
        tensors.append(FlatSparse(np.array([0, 3, 5], np.int32), np.ones(3, np.float32), (2, 3)))
    if base in ("bf16", "both"):
        tensors.append(BFloat16.from_array(np.ones((3, 2), np.float32)))
    frames = as_bytes(encode(push(tensors)))
    header = unpack(frames[0])
    for i, key, value in changes:
        header["tensors"][i % len(header["tensors"])][key] = value
    try:
        frames[0] = pack(header)
    except (TypeError, ValueError, OverflowError):
        assume(False)
    if cut is not None and cut < len(frames) - 1:
        frames[cut + 1] = frames[cut + 1][: max(0, len(frames[cut + 1]) - trim)]
    try:
        msg = decode(frames)
    except ProtocolError:
        return
    for t in msg.tensors.values():  # whatever decoded is well-formed enough to densify
        dense = densify(t)
        assert dense.shape == tuple(t.dense_shape if not isinstance(t, np.ndarray) else t.shape)


# ---------------------------------------------------------------- compressors


@pytest.mark.parametrize(
    ("text", "cls", "spec"),
    [
        ("none", NoCompression, "none"),
        ("BF16", BF16Compression, "bf16"),
        ("bf16:Dense", BF16Compression, "bf16:dense"),
        ("topk:0.01", TopKCompression, "topk:0.01"),
        (" topk:1 ", TopKCompression, "topk:1"),
        ("topk:1e-3", TopKCompression, "topk:0.001"),
    ],
)
def test_parse_compression(text: str, cls: type, spec: str) -> None:
    c = parse_compression(text)
    assert type(c) is cls
    assert c.spec == spec == str(c)
    assert parse_compression(c.spec).spec == spec


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("topk:0", r"\(0, 1\]"),
        ("topk:-0.1", r"\(0, 1\]"),
        ("topk:1.5", r"\(0, 1\]"),
        ("topk:nan", r"\(0, 1\]"),
        ("topk:inf", r"\(0, 1\]"),
        ("topk:abc", r"number"),
        ("topk", r"compression 'topk': expected topk:RATIO with a number RATIO in \(0, 1\]"),
        ("gzip", r"unknown compression 'gzip'.*none, bf16, bf16:dense, topk:RATIO"),
        ("bf16:rows", r"unknown compression 'bf16:rows'"),
    ],
)
def test_parse_compression_errors(text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_compression(text)


def test_a_topk_range_error_is_the_constructors_prefixed_with_the_text() -> None:
    with pytest.raises(ValueError, match=r"\(0, 1\]") as direct:
        TopKCompression(1.5)
    with pytest.raises(ValueError) as parsed:
        parse_compression("topk:1.5")
    assert str(parsed.value) == f"compression 'topk:1.5': {direct.value}"


def test_every_compression_form_parses_is_listed_and_is_the_docs_table() -> None:
    examples = {
        "none": "none",
        "bf16": "bf16",
        "bf16:dense": "bf16:dense",
        "topk:RATIO": "topk:0.01",
    }
    assert list(COMPRESSIONS.forms) == list(examples)
    for form, text in examples.items():
        assert parse_compression(text).spec == text
        assert form in COMPRESSION_FORMS
    assert parse_compression("").spec == "none"
    docs = (Path(__file__).resolve().parents[1] / "docs" / "policies.md").read_text()
    assert COMPRESSIONS.table() in docs, (
        "docs/policies.md's table of compressions differs from:\n" + COMPRESSIONS.table()
    )


def test_none_passes_everything_through() -> None:
    g = rng_grads([(3, 4), (4,)])
    c = NoCompression()
    out = c.compress(g)
    assert all(a is b for a, b in zip(out, g, strict=True))
    assert c.raw_bytes == c.sent_bytes == 64
    assert c.compression_ratio == 1.0


def test_bf16_halves_the_bytes_within_bf16_precision() -> None:
    g = rng_grads(DEEP_MNIST_SHAPES[:4] + DEEP_MNIST_SHAPES[5:])  # all but the 12.8 MB kernel
    raw = sum(a.nbytes for a in g)
    c = BF16Compression()
    out = c.compress(g)
    assert all(isinstance(t, BFloat16) for t in out)
    assert (c.raw_bytes, c.sent_bytes) == (raw, raw // 2)
    assert c.compression_ratio == 2.0
    frames = encode(push(out))
    dense_frames = encode(push(g))
    assert frames_bytes(frames[1:]) == frames_bytes(dense_frames[1:]) // 2
    decoded = list(decode(as_bytes(frames)).tensors.values())
    for a, d in zip(g, decoded, strict=True):
        assert d.dtype == np.float32 and d.shape == a.shape
        rel = np.abs(d - a) / np.abs(a)
        assert rel.max() <= 2.0**-8  # round to nearest with 8 significant bits
        assert rel.max() > 2.0**-12  # and it did round


def test_bf16_passes_integers_and_float16_through() -> None:
    i = np.arange(4, dtype=np.int32)
    h = np.ones(3, np.float16)
    hs = Sparse(np.array([1]), np.ones((1, 2), np.float16), (3, 2))
    for c in (BF16Compression(), BF16Compression(rows=False)):
        out = c.compress([i, h, hs])
        assert out[0] is i and out[1] is h and out[2] is hs


@pytest.mark.parametrize("keyed", [False, True])
def test_bf16_rounds_rows_and_bf16_dense_sends_them_in_float32(keyed: bool) -> None:
    rng = np.random.default_rng(3)
    kind = Keyed if keyed else Sparse
    ids = np.array([7, 2**40, 11] if keyed else [0, 4, 9], np.int64)
    s = kind(ids, rng.standard_normal((3, 16)).astype(np.float32), (10, 16))
    d = rng.standard_normal((4, 4)).astype(np.float32)
    rows = parse_compression("bf16")  # the default form rounds rows
    out = rows.compress([s, d])
    assert isinstance(out[0], KeyedBF16 if keyed else SparseBF16)
    assert isinstance(out[1], BFloat16)
    index_bytes, values = 3 * 8, 3 * 16 * 4
    assert rows.raw_bytes == index_bytes + values + d.nbytes
    assert rows.sent_bytes == index_bytes + values // 2 + d.nbytes // 2
    assert rows.encodings == {"bf16", "sparse_bf16"}
    assert rows.keyed_encoding == "keyed_counted_bf16"
    (got, _) = decode(as_bytes(encode(push(out)))).tensors.values()
    assert type(got) is kind and got.values.dtype == np.float32
    assert np.array_equal(got.indices, ids) and got.dense_shape == (10, 16)
    rel = np.abs(got.values - s.values) / np.abs(s.values)
    assert 2.0**-12 < rel.max() <= 2.0**-8

    dense_only = parse_compression("bf16:dense")
    out = dense_only.compress([s, d])
    assert out[0] is s and isinstance(out[1], BFloat16)
    assert dense_only.sent_bytes == index_bytes + values + d.nbytes // 2
    assert dense_only.encodings == {"bf16"} and dense_only.keyed_encoding == "keyed_counted"
    assert dense_only.spec == "bf16:dense"


@pytest.mark.parametrize("form", ["bf16", "bf16:dense", "none", "topk:0.5"])
def test_a_dynamic_tables_counted_rows_keep_their_counts_in_every_form(form: str) -> None:
    """A push carries a dynamic table's rows each id once with the lookups each sums: every
    form sends the counts (4 bytes a row) and the server decodes them."""
    values = np.random.default_rng(4).standard_normal((3, 16)).astype(np.float32)
    k = counted_rows(Keyed(np.array([2**40, 5, 2**40], np.int64), values, (10, 16)))
    assert k.indices.tolist() == [5, 2**40] and k.counts.tolist() == [1, 2]
    c = parse_compression(form)
    (out,) = c.compress([k])
    rounds = form == "bf16"
    assert type(out) is (KeyedBF16 if rounds else Keyed)
    assert out.counts.tolist() == [1, 2]
    assert c.raw_bytes == 2 * 8 + 2 * 16 * 4 + 2 * 4
    assert c.sent_bytes == 2 * 8 + 2 * 16 * (2 if rounds else 4) + 2 * 4
    (got,) = roundtrip([out])
    assert type(got) is Keyed and got.counts.tolist() == [1, 2]
    np.testing.assert_allclose(got.values, k.values, rtol=2.0**-8 if rounds else 0)


@pytest.mark.parametrize(
    ("ratio", "size", "k"), [(0.01, 1000, 10), (0.01, 10, 1), (0.1, 95, 10), (0.25, 7, 2)]
)
def test_topk_sends_exactly_k_largest(ratio: float, size: int, k: int) -> None:
    rng = np.random.default_rng(size)
    signs = rng.choice(np.array([-1, 1], np.float32), size)
    g = rng.permutation(np.arange(1, size + 1, dtype=np.float32) * signs)
    c = TopKCompression(ratio)
    assert c.k(size) == k
    (t,) = c.compress([g])
    assert isinstance(t, FlatSparse)
    assert t.indices.size == t.values.size == k
    assert t.indices.dtype == np.int32
    assert np.all(np.diff(t.indices) > 0)  # ascending, no repeats
    expected = np.sort(np.argsort(-np.abs(g))[:k])  # |g| are distinct: the top k are unique
    np.testing.assert_array_equal(t.indices, expected)
    np.testing.assert_array_equal(t.values, g[expected])
    r = c.residual(0)
    assert r is not None
    np.testing.assert_array_equal(r[expected], 0.0)
    kept = np.ones(size, bool)
    kept[expected] = False
    np.testing.assert_array_equal(r[kept], g[kept])
    assert c.sent_bytes == 8 * k and c.raw_bytes == 4 * size


def test_topk_keeps_the_shape_and_uses_the_residual_next_step() -> None:
    c = TopKCompression(0.25)  # k = 2 of 8
    g1 = np.array([[8, 1, 2, 3], [4, 5, 6, 7]], np.float32)
    (t1,) = c.compress([g1])
    assert t1.dense_shape == (2, 4)
    np.testing.assert_array_equal(t1.to_dense(), [[8, 0, 0, 0], [0, 0, 0, 7]])
    g2 = np.array([[0, 0, 0, 0], [0, 0, 0, 1]], np.float32)  # v = [[0,1,2,3],[4,5,6,1]]
    (t2,) = c.compress([g2])
    np.testing.assert_array_equal(t2.to_dense(), [[0, 0, 0, 0], [0, 5, 6, 0]])
    np.testing.assert_array_equal(c.residual(0), [0, 1, 2, 3, 4, 0, 0, 1])
    c.reset()
    assert c.residual(0) is None


def test_topk_error_feedback_conserves_the_gradient_sum_exactly() -> None:
    """Integer-valued gradients: every float32 sum is exact, so the identity is exact."""
    shapes = [(6, 7), (13,), (1,)]
    rng = np.random.default_rng(3)
    c = TopKCompression(0.1)
    total = [np.zeros(s, np.float64) for s in shapes]
    sent = [np.zeros(s, np.float64) for s in shapes]
    for _ in range(25):
        g = [rng.integers(-1000, 1000, s).astype(np.float32) for s in shapes]
        for i, t in enumerate(c.compress(g)):
            total[i] += g[i]
            sent[i] += densify(t)
    for i, s in enumerate(shapes):
        r = c.residual(i)
        assert r is not None
        np.testing.assert_array_equal(sent[i] + r.reshape(s), total[i])
    assert np.abs(c.residual(0)).max() > 0  # something is still held back
    np.testing.assert_array_equal(c.residual(2), 0.0)  # size 1: k = 1, all of it sent


def test_topk_error_feedback_conserves_random_gradients_up_to_float32_rounding() -> None:
    c = TopKCompression(0.05)
    rng = np.random.default_rng(4)
    total = np.zeros(500, np.float64)
    sent = np.zeros(500, np.float64)
    for _ in range(40):
        g = rng.standard_normal(500).astype(np.float32)
        (t,) = c.compress([g])
        total += g
        sent += densify(t)
    r = c.residual(0)
    assert r is not None
    np.testing.assert_allclose(sent + r, total, rtol=0, atol=40 * 4 * np.finfo(np.float32).eps * 10)


def test_topk_with_ratio_one_half_or_more_sends_dense_and_clears_the_residual() -> None:
    g = rng_grads([(4, 5)])[0]
    for ratio in (0.5, 1.0):
        c = TopKCompression(ratio)
        (t,) = c.compress([g])
        assert isinstance(t, np.ndarray) and t.dtype == np.float32 and t.shape == (4, 5)
        np.testing.assert_array_equal(t, g)
        np.testing.assert_array_equal(c.residual(0), 0.0)
        assert c.sent_bytes == c.raw_bytes == 80


def test_topk_outputs_are_not_the_residual() -> None:
    """ZeroMQ may still hold a sent array while the next step runs: it must not change."""
    c = TopKCompression(0.2)
    g = rng_grads([(50,)])[0]
    (t,) = c.compress([g])
    before = (t.indices.copy(), t.values.copy())
    c.compress([g * 3])
    np.testing.assert_array_equal(t.indices, before[0])
    np.testing.assert_array_equal(t.values, before[1])
    dense = TopKCompression(1.0)
    (d,) = dense.compress([g])
    r = dense.residual(0)
    assert r is not None and not np.shares_memory(d, r)


def test_topk_passes_sparse_through() -> None:
    s = Sparse(np.array([0, 2]), np.ones((2, 3), np.float32), (4, 3))
    c = TopKCompression(0.01)
    (out,) = c.compress([s])
    assert out is s
    assert c.raw_bytes == c.sent_bytes == 2 * 8 + 24


def test_topk_001_sends_40x_fewer_bytes_on_the_deep_mnist_gradients() -> None:
    g = rng_grads(DEEP_MNIST_SHAPES)
    assert sum(a.size for a in g) == 3_274_634
    dense_frames = encode(push(g))
    raw = frames_bytes(dense_frames)
    assert raw > 13_098_536  # 13.1 MB of payload and the header
    c = TopKCompression(0.01)
    tensors = c.compress(g)
    frames = encode(push(tensors))
    sent = frames_bytes(frames)
    assert raw / sent >= 40, (raw, sent)
    k_total = sum(c.k(a.size) for a in g)
    assert k_total == 32_750  # ceil(1% of each variable), at least 1
    assert sum(t.values.size for t in tensors) == k_total
    assert c.sent_bytes == sum(payload_bytes(t) for t in tensors) == 8 * k_total  # int32 + f32
    # the server's side: decode and densify give the sent entries and zeros elsewhere
    decoded = decode(as_bytes(frames), DEFAULT_LIMITS.for_payload(13_098_536)).tensors
    for a, t in zip(g, decoded.values(), strict=True):
        dense = densify(t)
        assert dense.shape == a.shape
        nz = dense != 0
        assert nz.sum() == c.k(a.size)
        np.testing.assert_array_equal(dense[nz], a[nz])


def test_topk_refuses_a_list_whose_shapes_changed() -> None:
    """Residuals are kept by position: a different variable there is a wiring bug."""
    c = TopKCompression(0.1)
    c.compress([np.ones(20, np.float32)])
    with pytest.raises(ValueError, match="residual"):
        c.compress([np.ones(21, np.float32)])


def test_topk_sends_a_nonfinite_gradient_as_it_is_and_keeps_the_residual_clean() -> None:
    """A NaN/Inf gradient goes out dense (the server refuses and counts it) and never enters
    the residual: otherwise every later push would carry it and be refused too."""
    c = TopKCompression(0.25)  # k = 1 of 4
    (t1,) = c.compress([np.array([4, 1, 2, 3], np.float32)])
    np.testing.assert_array_equal(t1.to_dense(), [4, 0, 0, 0])
    before = c.residual(0).copy()
    for bad in (np.nan, np.inf):
        g = np.array([1, bad, 1, 1], np.float32)
        (t,) = c.compress([g])
        assert isinstance(t, np.ndarray) and t is g  # dense, as it is: refused by the server
        np.testing.assert_array_equal(c.residual(0), before)  # untouched
    (t3,) = c.compress([np.array([0, 0, 0, 1], np.float32)])  # v = [0, 1, 2, 4]
    np.testing.assert_array_equal(t3.to_dense(), [0, 0, 0, 4])
    np.testing.assert_array_equal(c.residual(0), [0, 1, 2, 0])
    assert np.all(np.isfinite(c.residual(0)))
