"""A client of protocol version 1 as first published still gets only what it decodes.

Replies gained encodings and row id widths under the same ``PROTOCOL_VERSION`` (docs/wire.md's
changelog). ``tests/data/protocol_v1_client/requests.json`` holds the requests a client of
the protocol before those changes sends. ``record.py`` beside it made them by running the
client code of commit d641bbf (``7ef4709~1``, the last commit before the first change): its
``ShardSet`` and ``ShardClient`` over a real socket, each frame encoded by that commit's wire
module. They are a hello that states nothing of what the client accepts, a whole pull, a
bf16 pull, a fixed table's rows by id (rows only, and under bf16 with the whole variables),
and a dynamic table's rows by id, dense and bf16 (without a hello: that commit cannot build a
model holding a dynamic table).

Here they are replayed, byte for byte, against today's server (in process, real sockets), and
every reply is read by that commit's decode rules, copied below as data (``V1_*``, from its
``shared/wire.py``, ``shared/codecs.py`` and ``shared/payloads.py``): only the encodings it
had, the dtypes it allowed, and int64 row ids, as its spec promised ("sorted, int64"). A
dynamic table's rows have no form in those encodings: they come as ``keyed``, float32 values
by int64 id, as they always have to a client that states nothing. Today's client, which
states everything it decodes, still gets ``sparse_bf16`` rows and int32 ids.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import ml_dtypes
import msgpack
import numpy as np
import pytest
import zmq
from inproc import InprocServer, serving

from downpour import wire
from downpour.net.client import ShardClient
from downpour.net.transport import make_context

DATA = Path(__file__).parent / "data" / "protocol_v1_client" / "requests.json"
TABLE = "embed/embeddings"
FIXED_IDS = [3, 7, 4999]  # the recorded row requests' ids, unique and sorted
DYNAMIC_IDS = [-5, 17, 2**40 + 3]

# The decode rules of commit d641bbf, as data: its codecs (frames per tensor), its
# ALLOWED_DTYPES, INDEX_DTYPES and BF16_DTYPES, and the row ids its spec promised in replies.
V1_FRAMES = {"dense": 1, "bf16": 1, "sparse": 2, "topk": 2}
V1_DTYPES = frozenset(
    {"float16", "float32", "float64", "bool", "int8", "int16", "int32", "int64"}
    | {"uint8", "uint16", "uint32", "uint64"}
)
V1_INDEX_DTYPES = frozenset({"int32", "int64"})
V1_BF16_DTYPES = frozenset({"float16", "float32", "float64"})
V1_ROW_IDS = "int64"


class V1Refused(Exception):
    """What the v1 client's decode raises: the reply is not one it can read."""


def v1_decode(frames: list[bytes]) -> tuple[dict[str, Any], dict[str, tuple[str, Any]]]:
    """(header, {name: (encoding, tensor)}) of a reply as the v1 client reads it, checking
    what its decode checks (encoding, dtype, nbytes, frame lengths, index bounds); a dense or
    bf16 tensor is an array, a sparse one (index dtype, ids, values). V1Refused otherwise."""
    header = msgpack.unpackb(frames[0], raw=False, strict_map_key=True)
    if header["version"] != 1:
        raise V1Refused(f"protocol version {header['version']}")
    tensors: dict[str, tuple[str, Any]] = {}
    i = 1
    for d in header["tensors"]:
        enc, name = d["encoding"], d["name"]
        if enc not in V1_FRAMES:
            raise V1Refused(f"unknown encoding {enc!r} for {name!r}")
        if d["dtype"] not in V1_DTYPES:
            raise V1Refused(f"dtype {d['dtype']!r} is not allowed")
        dtype, shape = np.dtype(d["dtype"]).newbyteorder("<"), tuple(d["shape"])
        parts, i = frames[i : i + V1_FRAMES[enc]], i + V1_FRAMES[enc]
        if enc == "dense":
            assert d["nbytes"] == len(parts[0]) == math.prod(shape) * dtype.itemsize
            tensors[name] = (enc, np.frombuffer(parts[0], dtype).reshape(shape))
        elif enc == "bf16":
            assert d["dtype"] in V1_BF16_DTYPES
            assert d["nbytes"] == len(parts[0]) == math.prod(shape) * 2
            bits = np.frombuffer(parts[0], np.dtype("<u2")).view(ml_dtypes.bfloat16)
            tensors[name] = (enc, bits.astype(dtype).reshape(shape))
        else:
            if d["index_dtype"] not in V1_INDEX_DTYPES:
                raise V1Refused(f"index dtype {d['index_dtype']!r}")
            ids = np.frombuffer(parts[0], np.dtype(d["index_dtype"]).newbyteorder("<"))
            entry = shape[1:] if enc == "sparse" else ()
            assert ids.shape == (d["nnz"],) and d["nbytes"] == len(parts[1])
            values = np.frombuffer(parts[1], dtype).reshape((d["nnz"], *entry))
            bound = shape[0] if enc == "sparse" else math.prod(shape)
            if ids.size and (ids.min() < 0 or ids.max() >= bound):
                raise V1Refused(f"{name!r}: {enc} index out of range")
            tensors[name] = (enc, (d["index_dtype"], ids, values))
    assert i == len(frames), "the header describes other frames than came"
    return header, tensors


def rounded(a: np.ndarray) -> np.ndarray:
    return a.astype(ml_dtypes.bfloat16).astype(a.dtype)


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, InprocServer]]:
    with (
        serving("tiny_models:embedding", optimizer="sgd") as fixed,
        serving("tiny_models:dynamic_tensor", optimizer="sgd") as dynamic,
    ):
        yield {"fixed": fixed, "dynamic": dynamic}


def replay(server: InprocServer, frames: list[bytes]) -> list[bytes]:
    """The reply frames of today's server to ``frames``, sent as they are."""
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, 30_000)
        sock.connect(server.rep)
        sock.send_multipart(frames)
        return sock.recv_multipart()
    finally:
        ctx.destroy(linger=0)


@contextmanager
def client(server: InprocServer) -> Iterator[ShardClient]:
    """Today's client of ``server``, closed after."""
    ctx = make_context()
    c = ShardClient(ctx, server.rep, sender="today", timeout_s=30)
    try:
        yield c
    finally:
        c.close()
        ctx.term()


def test_every_reply_to_a_v1_client_is_one_it_decodes(servers: dict[str, InprocServer]) -> None:
    recorded = json.loads(DATA.read_text())
    assert recorded["commit"].startswith("d641bbf")
    replies = {}
    for r in recorded["requests"]:  # in the recorded order: the hello first
        replies[r["name"]] = replay(servers[r["server"]], [bytes.fromhex(f) for f in r["frames"]])
    assert list(replies) == [
        "hello",
        "pull",
        "pull_bf16",
        "rows_fixed",
        "rows_fixed_bf16",
        "rows_dynamic",
        "rows_dynamic_bf16",
    ]

    hello, none = v1_decode(replies["hello"])
    assert hello["type"] == wire.HELLO and none == {} and hello["body"]["push_port"] > 0

    _, whole = v1_decode(replies["pull"])
    assert {enc for enc, _ in whole.values()} == {"dense"}
    table = whole[TABLE][1]
    assert table.shape == (5000, 8)

    _, whole16 = v1_decode(replies["pull_bf16"])
    assert {enc for enc, _ in whole16.values()} == {"bf16"}  # every variable is float32
    for name, (_, a) in whole.items():
        np.testing.assert_array_equal(whole16[name][1], rounded(a))

    for name in ("rows_fixed", "rows_fixed_bf16"):
        _, got = v1_decode(replies[name])
        enc, (index_dtype, ids, values) = got[TABLE]
        assert (enc, index_dtype) == ("sparse", V1_ROW_IDS), name
        assert ids.tolist() == FIXED_IDS
        np.testing.assert_array_equal(values, table[FIXED_IDS])  # float32, not rounded
    assert list(got) == list(whole)  # under bf16 the other variables came too, as bf16
    assert {enc for name, (enc, _) in got.items() if name != TABLE} == {"bf16"}

    # A dynamic table's rows have no v1 form: keyed, as to any client that states nothing,
    # with float32 values (not keyed_bf16) by int64 id.
    with client(servers["dynamic"]) as today:
        dense = today.pull(wire.PullRequest(rows_only=True), rows={TABLE: np.array(DYNAMIC_IDS)})
    for name in ("rows_dynamic", "rows_dynamic_bf16"):
        with pytest.raises(V1Refused, match="unknown encoding 'keyed'"):
            v1_decode(replies[name])
        (desc,) = msgpack.unpackb(replies[name][0])["tensors"]
        assert (desc["encoding"], desc["index_dtype"], desc["dtype"]) == (
            "keyed",
            "int64",
            "float32",
        )
        rows = wire.decode(replies[name]).tensors[TABLE]
        assert rows.indices.tolist() == DYNAMIC_IDS
        np.testing.assert_array_equal(rows.values, dense.tensors[TABLE].values)


def test_todays_client_still_gets_bf16_rows_and_int32_ids(
    servers: dict[str, InprocServer],
) -> None:
    server = servers["fixed"]
    with client(server) as today:
        today.hello(wire.HelloRequest(fingerprint=server.server.state.fingerprint))
        exact = today.pull(wire.PullRequest(rows_only=True), rows={TABLE: np.array([7, 3])})
        rows16 = today.pull(wire.PullRequest(encoding=wire.BF16), rows={TABLE: np.array([7, 3])})
    for w in (exact, rows16):
        assert w.tensors[TABLE].indices.dtype == np.int32
    np.testing.assert_array_equal(
        rows16.tensors[TABLE].values, rounded(exact.tensors[TABLE].values)
    )
    assert not np.array_equal(rows16.tensors[TABLE].values, exact.tensors[TABLE].values)

    server = servers["dynamic"]
    ids = np.array(DYNAMIC_IDS)
    with client(server) as today:
        today.hello(wire.HelloRequest(fingerprint=server.server.state.fingerprint))
        exact = today.pull(wire.PullRequest(rows_only=True), rows={TABLE: ids})
        rows16 = today.pull(wire.PullRequest(encoding=wire.BF16, rows_only=True), rows={TABLE: ids})
    assert wire.is_keyed(rows16.tensors[TABLE])
    np.testing.assert_array_equal(
        rows16.tensors[TABLE].values, rounded(exact.tensors[TABLE].values)
    )
