"""``downpour.receive``: whole messages within a bound of frames and bytes, on real loopback
sockets; a message past it is received, dropped and reported, and the next one is intact.
Also the two refusals the wire spec names from the header alone: row ids in another encoding
than dense (``bad_header``) and a message on a socket that does not serve its type
(``wrong_socket``), before any tensor is looked at."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import zmq
from inproc import serving

from downpour import wire
from downpour.receive import Bound, Oversize, recv_bounded
from downpour.wire import Message

BOUND = Bound(frames=4, nbytes=1000)


@pytest.fixture
def pair() -> Iterator[tuple[zmq.Socket, zmq.Socket]]:
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    push = ctx.socket(zmq.PUSH)
    for s in (pull, push):
        s.setsockopt(zmq.LINGER, 0)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push.connect(f"tcp://127.0.0.1:{port}")
    try:
        yield push, pull
    finally:
        push.close()
        pull.close()
        ctx.term()


def receive(pull: zmq.Socket) -> list | Oversize:
    assert pull.poll(10_000), "no message within 10 s"
    return recv_bounded(pull, BOUND)


@pytest.mark.parametrize(
    ("parts", "expected"),
    [
        ([b"h"] * 4, None),  # at the frame bound
        ([b"h", bytes(999)], None),  # at the byte bound
        ([b"h"] * 5, Oversize(5, 5)),  # one frame too many
        ([b"h"] * 300, Oversize(300, 300)),  # many small frames: drained to the end
        ([bytes(1001)], Oversize(1, 1001)),  # one frame too large
        ([b"h", bytes(600), bytes(600), b"x"], Oversize(4, 1202)),  # too many bytes in all
    ],
)
def test_a_message_is_kept_within_its_bound_and_dropped_past_it(
    pair: tuple[zmq.Socket, zmq.Socket], parts: list[bytes], expected: Oversize | None
) -> None:
    push, pull = pair
    push.send_multipart(parts)
    push.send_multipart([b"next", b"message"])
    got = receive(pull)
    if expected is None:
        assert [bytes(f.buffer) for f in got] == parts
    else:
        assert got == expected
    assert [bytes(f.buffer) for f in receive(pull)] == [b"next", b"message"]  # intact after


def test_no_message_waiting_raises_again(pair: tuple[zmq.Socket, zmq.Socket]) -> None:
    with pytest.raises(zmq.Again):
        recv_bounded(pair[1], BOUND, zmq.NOBLOCK)


def _pull_with_ids(encoding: str) -> Message:
    ids = np.arange(4, dtype=np.float32)
    tensor = wire.BFloat16.from_array(ids) if encoding == wire.BF16 else ids.astype(np.int64)
    return Message(wire.PULL, "w0", tensors={"embed/embeddings": tensor})


def test_row_ids_in_another_encoding_are_a_bad_header() -> None:
    frames = [bytes(memoryview(f)) for f in wire.encode(_pull_with_ids(wire.BF16))]
    with pytest.raises(wire.ProtocolError) as err:
        wire.decode(frames)
    assert err.value.code == wire.R_HEADER and "must be dense" in err.value.message


def test_a_pull_with_a_large_tensor_on_the_gradient_socket_is_wrong_socket() -> None:
    """The header says pull: refused as wrong_socket before its tensor's size is weighed
    (a pull's tensors are row ids, limited to max_pull_rows: not what this socket checks)."""
    with serving("tiny_models:embedding") as server:
        ctx = server.server.handler_ctx
        many = np.zeros(ctx.request_limits.max_pull_rows + 1, np.int64)
        msg = Message(wire.PULL, "w0", tensors={"embed/embeddings": many})
        frames = [bytes(memoryview(f)) for f in wire.encode(msg)]
        from downpour.server.handlers import handle_gradients

        out = handle_gradients(frames, ctx)
    assert out.rejection is not None and out.rejection.code == wire.R_WRONG_SOCKET
    assert ctx.stats.rejected == {wire.R_WRONG_SOCKET: 1}
