"""Requests over the server's size limit (``wire.REQUEST_MAX_BYTES``). Hello announces the
limit, and a client that knows it refuses a bigger request at once with a clear error. The
server refuses one it receives with ERROR ``oversize`` and counts it. Its REP socket's ZeroMQ
MAXMSGSIZE, ``wire.REQUEST_DROP_FACTOR`` times the limit, drops the connection of anything
bigger still: such a request gets no reply, and the client's timeout says it was too large.
Real sockets, a server in this process."""

from __future__ import annotations

import pytest
from inproc import serving

from downpour import wire
from downpour.client import ShardClient
from downpour.transport import Refused, RemoteError, ReqClient, RequestTimeout, make_context
from downpour.wire import Message

BIG = wire.REQUEST_MAX_BYTES + 1024  # over the limit, under the socket's drop size
HUGE = wire.REQUEST_MAX_BYTES * wire.REQUEST_DROP_FACTOR + 1024  # dropped unread


def oversize_request(payload: int = BIG) -> list[bytes]:
    """A heartbeat carrying a frame of ``payload`` bytes (what a misbehaving caller sends)."""
    header = bytes(memoryview(wire.encode(Message(wire.HEARTBEAT, "w0"))[0]))
    return [header, bytes(payload)]


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


def test_the_server_refuses_an_oversize_request_with_a_reason_and_counts_it() -> None:
    """A client that never said hello does not know the limit and sends: the server answers
    ERROR oversize, counts it, and its parameters do not change."""
    with serving() as server:
        ctx = make_context()
        req = ReqClient(ctx, server.rep, timeout_s=10.0, retries=0)  # no hello: limit unknown
        try:
            before = server.server.state.version
            reply = wire.decode(req.request_frames(oversize_request()), wire.DEFAULT_LIMITS)
            assert reply.type == wire.ERROR
            err = wire.ErrorReply.from_body(reply.body)
            assert err.code == wire.R_OVERSIZE
            assert f"{BIG + len(oversize_request()[0])} bytes" in err.message
            assert f"({wire.REQUEST_MAX_BYTES} bytes)" in err.message
            with pytest.raises(RemoteError) as again:  # the typed call says the same
                req.request(Message(wire.HEARTBEAT, "w0", body={"pad": bytes(BIG)}))
            assert again.value.code == wire.R_OVERSIZE
            assert server.server.stats.rejected[wire.R_OVERSIZE] == 2
            assert req.request(Message(wire.PULL, "w0")).type == wire.WEIGHTS  # serves on
            assert server.server.state.version == before
            assert req.recreated == 0  # answered every time: no timeout, no new socket
        finally:
            req.close()
            ctx.term()


def test_a_request_past_the_drop_size_times_out_and_says_it_was_too_large() -> None:
    with serving() as server:
        ctx = make_context()
        req = ReqClient(ctx, server.rep, timeout_s=2.0, retries=0)  # no hello: limit unknown
        try:
            with pytest.raises(RequestTimeout) as err:
                req.request_frames(oversize_request(HUGE))
            assert "larger than the server accepts" in str(err.value)
            assert f"{HUGE + len(oversize_request()[0])} bytes" in str(err.value)
            assert server.server.stats.rejected[wire.R_OVERSIZE] == 0  # dropped unread
            # the server dropped that connection and serves on
            reply = req.request(Message(wire.PULL, "w0"))
            assert reply.type == wire.WEIGHTS
        finally:
            req.close()
            ctx.term()


def test_a_request_between_the_limit_and_the_drop_size_blames_no_size_on_timeout() -> None:
    """Below the drop size the server answers, so a timeout there is not the size's fault."""
    ctx = make_context()
    req = ReqClient(ctx, "tcp://127.0.0.1:9", timeout_s=0.5, retries=0)  # nobody there
    try:
        with pytest.raises(RequestTimeout) as err:
            req.request_frames(oversize_request())
        assert "larger" not in str(err.value)
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
