"""What a hello accepts: a server sends each sender only the encodings and row id widths its
latest hello said it decodes (the baseline when it said nothing), refuses a malformed
``accepts`` as any malformed hello field, and ignores names it does not know. The handlers on
a real ParameterState; ``tests/test_protocol_v1.py`` replays a real older client."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import msgpack
import numpy as np
import pytest
from test_row_pulls import TABLE, frames, make_ctx

from downpour import wire
from downpour.server.handlers import HandlerContext, handle_pull, handle_request
from downpour.wire import Message

IDS = np.array([7, 3, 4999], np.int64)
NEWER = "zstd_rows"  # an encoding this server has never heard of


def hello(ctx: HandlerContext, sender: str, accepts: Any = None) -> Message:
    """``sender``'s hello (``accepts``: an ``Accepts``, a raw map, or None: nothing stated);
    the decoded reply."""
    body = wire.HelloRequest(fingerprint=ctx.state.fingerprint).to_body()
    if accepts is not None:
        body["accepts"] = accepts.to_body() if isinstance(accepts, wire.Accepts) else accepts
    msg = Message(wire.HELLO, sender, body=body)
    return wire.decode(frames(handle_request(frames(msg), ctx).message))


def pull(
    ctx: HandlerContext, sender: str, rows: dict[str, np.ndarray] | None = None, **body: Any
) -> tuple[Message, dict[str, dict[str, Any]]]:
    """``sender``'s pull through the handlers: the decoded reply, and its descriptors by name
    as they travelled."""
    msg = wire.pull_request(sender, wire.PullRequest(**body), rows)
    raw = frames(handle_request(frames(msg), ctx).message)
    return wire.decode(raw), {d["name"]: d for d in msgpack.unpackb(raw[0])["tensors"]}


def rounded(a: np.ndarray) -> np.ndarray:
    return a.astype(ml_dtypes.bfloat16).astype(a.dtype)


@pytest.fixture(scope="module")
def fixed() -> HandlerContext:
    return make_ctx()


@pytest.fixture(scope="module")
def dynamic() -> HandlerContext:
    return make_ctx("tiny_models:dynamic_tensor")


def test_accepts_reads_back_what_a_client_states_and_drops_names_it_does_not_know() -> None:
    stated = wire.HelloRequest(accepts=wire.ACCEPTS_ALL)
    assert wire.HelloRequest.from_body(stated.to_body()) == stated
    assert stated.to_body()["accepts"]["row_ids"] == ["int32", "int64"]  # sorted lists
    assert wire.HelloRequest.from_body({}).accepts is None  # an older client: nothing stated
    assert wire.Accepts.from_body({}) == wire.ACCEPTS_BASELINE  # a list left out: baseline's
    assert wire.ACCEPTS_BASELINE.encodings == wire.BASELINE_ENCODINGS
    assert wire.ACCEPTS_BASELINE.row_ids == {"int64"}
    newer = wire.Accepts.from_body(
        {
            "encodings": ["dense", "sparse", "bf16", "sparse_bf16", NEWER],
            "row_ids": ["int64", "uint16"],
        }
    )
    assert newer == wire.Accepts(frozenset({"dense", "sparse", "bf16", "sparse_bf16"}))
    assert wire.ACCEPTS_ALL.everything and not newer.everything


BAD_ACCEPTS = {
    "not a map": ["dense"],
    "encodings not a list": {"encodings": "dense"},
    "a name not a string": {"encodings": ["dense", "sparse", "bf16", 16]},
    "no dense": {"encodings": ["sparse", "bf16", "sparse_bf16"]},
    "no bf16": {"encodings": ["dense", "sparse"]},
    "no int64 ids": {"row_ids": ["int32"]},
    "too many names": {"encodings": ["dense", "sparse", "bf16", *(f"e{i}" for i in range(62))]},
}


@pytest.mark.parametrize("case", list(BAD_ACCEPTS))
def test_a_malformed_accepts_is_refused_counted_and_enrols_nobody(
    fixed: HandlerContext, case: str
) -> None:
    before = fixed.stats.rejected[wire.R_HEADER]
    reply = hello(fixed, f"bad-{case}", BAD_ACCEPTS[case])
    assert reply.type == wire.ERROR and reply.body["code"] == wire.R_HEADER
    assert "accepts" in reply.body["message"], reply.body["message"]
    assert fixed.stats.rejected[wire.R_HEADER] == before + 1
    assert f"bad-{case}" not in fixed.registry


def test_a_newer_clients_unknown_names_are_ignored_and_it_is_served(fixed: HandlerContext) -> None:
    accepts = {"encodings": ["dense", "sparse", "bf16", "sparse_bf16", NEWER]}
    assert hello(fixed, "newer", accepts).type == wire.HELLO
    _, desc = pull(fixed, "newer", {TABLE: IDS}, encoding=wire.BF16)
    assert desc[TABLE]["encoding"] == wire.SPARSE_BF16  # what it accepts of ours
    assert desc[TABLE]["index_dtype"] == "int64"  # no row_ids stated: the baseline's


# sender -> (its hello's accepts: None = nothing stated, "no hello" = never said hello;
#            the encoding and id dtype of its bf16 row reply)
SENDERS = {
    "old": (None, wire.SPARSE, "int64"),
    "silent": ("no hello", wire.SPARSE, "int64"),
    "today": (wire.ACCEPTS_ALL, wire.SPARSE_BF16, "int32"),
    "narrow-ids": (wire.Accepts(row_ids=frozenset({"int64", "int32"})), wire.SPARSE, "int32"),
    "bf16-rows": (
        wire.Accepts(wire.BASELINE_ENCODINGS | {wire.SPARSE_BF16}),
        wire.SPARSE_BF16,
        "int64",
    ),
}


@pytest.mark.parametrize("sender", list(SENDERS))
def test_each_sender_gets_a_bf16_row_pull_as_its_hello_accepts(
    fixed: HandlerContext, sender: str
) -> None:
    accepts, encoding, index_dtype = SENDERS[sender]
    if accepts != "no hello":
        assert hello(fixed, sender, accepts).type == wire.HELLO
    table = fixed.state.weights()[1][0]
    msg, desc = pull(fixed, sender, {TABLE: IDS}, encoding=wire.BF16)
    assert (desc[TABLE]["encoding"], desc[TABLE]["index_dtype"]) == (encoding, index_dtype)
    rows = msg.tensors[TABLE]
    assert rows.indices.tolist() == sorted(IDS.tolist())
    want = table[np.sort(IDS)]
    np.testing.assert_array_equal(
        rows.values, rounded(want) if encoding == wire.SPARSE_BF16 else want
    )
    for name in fixed.state.names[1:]:  # the whole variables: bf16, which every peer decodes
        assert desc[name]["encoding"] == wire.BF16
    _, plain = pull(fixed, sender, {TABLE: IDS}, rows_only=True)
    assert (plain[TABLE]["encoding"], plain[TABLE]["index_dtype"]) == (wire.SPARSE, index_dtype)


def test_the_latest_hello_decides(fixed: HandlerContext) -> None:
    for accepts, encoding in (
        (None, wire.SPARSE),
        (wire.ACCEPTS_ALL, wire.SPARSE_BF16),
        (None, wire.SPARSE),  # a client restarted as an older one
    ):
        assert hello(fixed, "turncoat", accepts).type == wire.HELLO
        _, desc = pull(fixed, "turncoat", {TABLE: IDS}, encoding=wire.BF16, rows_only=True)
        assert desc[TABLE]["encoding"] == encoding


def test_a_dynamic_tables_bf16_rows_go_only_to_who_accepts_them(dynamic: HandlerContext) -> None:
    ids = np.array([-5, 17, 2**40 + 3], np.int64)
    assert hello(dynamic, "old").type == wire.HELLO  # nothing stated: keyed, its one form
    assert hello(dynamic, "today", wire.ACCEPTS_ALL).type == wire.HELLO
    exact = dynamic.state.gather(0, ids)
    for sender, encoding in (
        ("old", wire.KEYED),
        ("silent", wire.KEYED),
        ("today", wire.KEYED_BF16),
    ):
        msg, desc = pull(dynamic, sender, {TABLE: ids}, encoding=wire.BF16, rows_only=True)
        assert (desc[TABLE]["encoding"], desc[TABLE]["index_dtype"]) == (encoding, "int64")
        want = rounded(exact) if encoding == wire.KEYED_BF16 else exact
        np.testing.assert_array_equal(msg.tensors[TABLE].values, want)
        _, whole = pull(dynamic, sender, encoding=wire.BF16)  # the table's entry, empty
        assert whole[TABLE]["encoding"] == encoding and whole[TABLE]["nnz"] == 0
        assert {d["encoding"] for name, d in whole.items() if name != TABLE} == {wire.BF16}


def test_a_hello_that_cannot_take_a_dynamic_tables_rows_is_refused_by_its_server(
    dynamic: HandlerContext, fixed: HandlerContext
) -> None:
    """keyed is the one form of a dynamic table's rows: a hello whose accepts leave it out
    is refused where a dynamic table is served (counted, nobody enrolled), taken elsewhere."""
    no_keyed = wire.Accepts(wire.BASELINE_ENCODINGS | {wire.SPARSE_BF16})
    reply = hello(dynamic, "fixed-only", no_keyed)
    assert reply.type == wire.ERROR and reply.body["code"] == wire.R_ACCEPTS
    assert TABLE in reply.body["message"] and "keyed" in reply.body["message"]
    assert dynamic.stats.rejected[wire.R_ACCEPTS] == 1 and "fixed-only" not in dynamic.registry
    assert hello(fixed, "fixed-only", no_keyed).type == wire.HELLO


def test_a_sender_that_accepts_everything_gets_the_shared_bf16_weights_uncopied(
    dynamic: HandlerContext,
) -> None:
    """The per-version bf16 list goes out as it is to a sender that accepts everything; a
    baseline sender's reply has its own list, holding the same tensors but the table's."""
    hello(dynamic, "today", wire.ACCEPTS_ALL)
    hello(dynamic, "old")
    shared = dynamic.state.weights_bf16()[1]
    for sender in ("today", "old"):
        reply = handle_pull(
            wire.pull_request(sender, wire.PullRequest(encoding=wire.BF16)), dynamic
        )
        for t, mine in zip(reply.tensors.values(), shared, strict=True):
            assert (t is mine) == (sender == "today" or not wire.is_keyed(mine))
