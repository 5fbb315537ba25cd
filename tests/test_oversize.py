"""Requests over the server's size limit: the server's REP socket (ZeroMQ MAXMSGSIZE) drops
the connection of a request larger than ``wire.REQUEST_MAX_BYTES``, so such a request gets no
reply. Hello announces the limit; the client then refuses a bigger request at once with a
clear error, and one that times out before the limit was announced says it was too large.
Real sockets, a server in this process."""

from __future__ import annotations

import pytest
from inproc import serving

from downpour import wire
from downpour.client import ShardClient
from downpour.transport import Refused, ReqClient, RequestTimeout, make_context
from downpour.wire import Message

BIG = wire.REQUEST_MAX_BYTES + 1024


def oversize_request() -> list[bytes]:
    """A heartbeat carrying a frame over the limit (the bytes a misbehaving caller sends)."""
    header = bytes(memoryview(wire.encode(Message(wire.HEARTBEAT, "w0"))[0]))
    return [header, bytes(BIG)]


def test_hello_announces_the_limit_and_a_bigger_request_is_refused_at_once() -> None:
    with serving() as server:
        ctx = make_context()
        client = ShardClient(ctx, server.rep, sender="w0", timeout_s=10.0)
        try:
            state = server.server.state
            hello = client.hello(wire.HelloRequest(state.fingerprint, "tiny"))
            assert hello.reply.max_request_bytes == wire.REQUEST_MAX_BYTES
            with pytest.raises(Refused) as err:
                client.req.request_frames(oversize_request())
            assert err.value.code == wire.R_OVERSIZE
            assert "larger than the server accepts" in str(err.value)
            assert f"{wire.REQUEST_MAX_BYTES} bytes" in str(err.value)
            assert client.pull().version == 0  # nothing was sent: the client goes on
            assert client.recreated == 0
        finally:
            client.close()
            ctx.term()


def test_an_oversize_request_that_times_out_says_it_was_too_large() -> None:
    with serving() as server:
        ctx = make_context()
        req = ReqClient(ctx, server.rep, timeout_s=2.0, retries=0)  # no hello: limit unknown
        try:
            with pytest.raises(RequestTimeout) as err:
                req.request_frames(oversize_request())
            assert "larger than the server accepts" in str(err.value)
            assert f"{BIG + len(oversize_request()[0])} bytes" in str(err.value)
            # the server dropped that connection and serves on
            reply = req.request(Message(wire.PULL, "w0"))
            assert reply.type == wire.WEIGHTS
        finally:
            req.close()
            ctx.term()


def test_a_request_within_the_limit_that_times_out_blames_no_size() -> None:
    ctx = make_context()
    req = ReqClient(ctx, "tcp://127.0.0.1:9", timeout_s=0.5, retries=0)  # nobody there
    try:
        with pytest.raises(RequestTimeout) as err:
            req.request(Message(wire.PULL, "w0"))
        assert "larger" not in str(err.value)
    finally:
        req.close()
        ctx.term()
