"""``downpour.net.receive``: whole messages within a bound of frames and bytes, on real loopback
sockets; a message past it is received, dropped and reported, and the next one is intact.
Also the two refusals the wire spec names from the header alone: row ids in another encoding
than dense (``bad_header``) and a message on a socket that does not serve its type
(``wrong_socket``), before any tensor is looked at. And ``keep_receive_buffers``: received
frames' buffers reused by the next messages instead of faulted in afresh."""

from __future__ import annotations

import logging
import platform
from collections.abc import Iterator

import numpy as np
import pytest
import zmq
from conftest import isolated_json
from inproc import serving

from downpour import wire
from downpour.net.receive import (
    MAX_MMAP_THRESHOLD,
    Bound,
    Oversize,
    keep_receive_buffers,
    recv_bounded,
)
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


# In a fresh interpreter (the allocator's settings are process-wide): rounds of ``k`` frames
# of ``size`` bytes over tcp loopback, all held, then dropped; the page faults of each round.
FAULTS_PROBE = """
import json, resource, sys
import numpy as np, zmq
from downpour.net.receive import keep_receive_buffers
keep, size, k, rounds = json.loads(sys.argv[1])
heap = keep_receive_buffers(size, k * size) if keep else None
ctx = zmq.Context()
pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
push.connect(f"tcp://127.0.0.1:{pull.bind_to_random_port('tcp://127.0.0.1')}")
payload = np.ones(size // 4, np.float32)
faults = []
for _ in range(rounds):
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(k):
        push.send(payload, copy=False)
    frames = [pull.recv(copy=False) for _ in range(k)]
    assert all(len(f) == size for f in frames)
    del frames
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
push.close(); pull.close(); ctx.term()
print(json.dumps({"faults": faults, "heap": heap and heap.reused_frame_bytes}))
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the settings are glibc's")
def test_kept_receive_buffers_are_reused_by_the_next_messages_without_page_faults() -> None:
    size, k, rounds = 12_845_056, 4, 5  # Deep-MNIST's largest gradient, four at a time
    pages = k * size // 4096
    kept = isolated_json(FAULTS_PROBE, [True, size, k, rounds])
    assert kept["heap"] >= size
    assert kept["faults"][0] >= pages // 2  # the first round brings the heap's pages in
    # every later round reuses them (without the setting glibc maps and faults them anew)
    unset = isolated_json(FAULTS_PROBE, [False, size, k, rounds])["faults"]
    assert sum(kept["faults"][1:]) < pages // 100, (kept["faults"], unset)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the settings are glibc's")
def test_frames_larger_than_the_heap_keeps_are_named_at_warning_level(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, "downpour.net.receive"):
        small = keep_receive_buffers(1 << 20, 1 << 22)
    assert small.problem is None and small.reused_frame_bytes >= 1 << 20
    assert small.retained_bytes == 1 << 22 and not caplog.records
    with caplog.at_level(logging.WARNING, "downpour.net.receive"):
        big = keep_receive_buffers(MAX_MMAP_THRESHOLD * 2, 1 << 22)
    assert big.reused_frame_bytes < MAX_MMAP_THRESHOLD  # capped at what glibc keeps
    assert "mapped afresh on every receive" in caplog.text


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


def test_a_server_keeps_buffers_for_its_largest_whole_tensor_not_its_row_sparse_table() -> None:
    """``tiny_models:embedding``: the Embedding table travels as rows; the largest tensor a
    push carries whole is the 8 x 4 float32 logits kernel."""
    from downpour.server.service import largest_dense_frame

    with serving("tiny_models:embedding") as server:
        state, heap = server.server.state, server.server.receive_heap
        assert state.sparse[state.index["embed/embeddings"]]
        assert largest_dense_frame(state) == 8 * 4 * 4
        doc = server.server.snapshot()
        if platform.libc_ver()[0] == "glibc":
            assert heap.problem is None and heap.reused_frame_bytes >= 8 * 4 * 4
            assert doc["receive_heap"] == {
                "reused_frame_bytes": heap.reused_frame_bytes,
                "retained_bytes": heap.retained_bytes,
            }
        else:  # said in status (and at warning level in the log)
            assert doc["receive_heap"] == heap.problem
