"""Bad input sent with raw sockets, not through the worker: each message is rejected, counted
by reason, the parameters stay bitwise unchanged and the server keeps serving.

Each test runs against a server in this process (fast tier) and a server process (slow tier).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgpack  # tests may craft raw headers; the services never import msgpack
import numpy as np
import zmq
from conftest import pull_weights, wait_until
from inproc import Services, settle

from downpour import wire
from downpour.cli.status import fetch_status
from downpour.net.transport import ReqClient, make_context
from downpour.wire import Message

NAMES = ["hidden/kernel", "hidden/bias", "logits/kernel", "logits/bias"]


def push(tensors: list[np.ndarray], seq: int, names: list[str] = NAMES) -> list[Any]:
    """Frames of a push from "attacker" with these tensors."""
    return wire.encode(
        Message(wire.PUSH, "attacker", seq=seq, tensors=dict(zip(names, tensors, strict=True)))
    )


def edit_header(frames: list[Any], change: Callable[[dict], None]) -> list[Any]:
    """The same frames with the msgpack header modified by ``change``."""
    header = msgpack.unpackb(frames[0])
    change(header)
    return [msgpack.packb(header), *frames[1:]]


def test_every_kind_of_bad_gradient_is_rejected_and_changes_nothing(services: Services) -> None:
    server = services.server()
    version0, w = pull_weights(server.rep)
    zeros = [np.zeros_like(a) for a in w]

    def desc(i: int, **kv: Any) -> Callable[[dict], None]:
        return lambda h: h["tensors"][i].update(kv)

    bad: dict[str, list[Any]] = {
        "truncated": push(zeros, 1)[:-1],
        "bad_header": [b"\xc1 not msgpack", *push(zeros, 2)[1:]],
        "version": edit_header(push(zeros, 3), lambda h: h.update(version=99)),
        "unknown_type": edit_header(push(zeros, 4), lambda h: h.update(type="bogus")),
        "count": push(zeros[:1], 5, NAMES[:1]),
        "name": push(zeros, 6, [f"t{i}" for i in range(4)]),
        "shape": push([a.T.copy() if a.ndim == 2 else a for a in zeros], 7),
        "dtype": push([a.astype(np.float64) for a in zeros], 8),
        "nonfinite": push([np.full_like(a, np.nan) for a in zeros], 9),
        "nbytes": edit_header(push(zeros, 10), desc(0, nbytes=4)),
        # 2^32 elements claimed: refused from the header alone, nothing allocated
        "too_large": edit_header(push(zeros, 11), desc(0, shape=[65536, 65536], nbytes=1 << 34)),
        "wrong_socket": edit_header(push(zeros, 12), lambda h: h.update(type="hello")),
    }
    inf = [a.copy() for a in zeros]
    inf[2][0, 0] = np.inf
    valid = push(zeros, 20)

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.connect(f"tcp://127.0.0.1:{server.info['push_port']}")
    try:
        for frames in bad.values():
            sock.send_multipart(frames)
        sock.send_multipart(push(inf, 13))  # one Inf among zeros is found too
        sock.send_multipart(valid)
        sock.send_multipart(valid)  # the same (worker, seq) again: a replay

        def seen_all() -> dict | None:
            doc = fetch_status(server.status)
            return doc if doc["pushes_received"] >= len(bad) + 3 else None

        doc = wait_until(seen_all, 30, "the server to process every message")
        expected = {reason: 1 for reason in bad}
        expected["nonfinite"] = 2
        expected["duplicate"] = 1
        assert doc["rejected"] == expected
        version1, after = pull_weights(server.rep)
        # only the valid zero gradient was applied; Adam's step for a zero gradient is zero
        assert version1 == version0 + 1
        for a, b in zip(w, after, strict=True):
            assert a.tobytes() == b.tobytes()
    finally:
        sock.close(0)
        ctx.term()


def test_oversize_message_is_cut_off_before_allocation(services: Services) -> None:
    server = services.server()
    version0, w = pull_weights(server.rep)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.connect(f"tcp://127.0.0.1:{server.info['push_port']}")
    try:
        # 64 MB: far more than this 4-variable model could ever need; ZMQ's MAXMSGSIZE on the
        # gradient socket drops the connection before the server process sees or allocates it
        sock.send_multipart([push([np.zeros_like(a) for a in w], 1)[0], bytes(64 << 20)])
        settle(server.status, services.train(server.info["port"], steps=10))
        doc = wait_until(
            lambda: (d := fetch_status(server.status))["version"] >= version0 + 10 and d,
            30,
            "the honest worker's updates",
        )
        assert doc["version"] == version0 + 10  # the honest worker's updates, nothing else
        assert doc["workers"].keys() == {"w0"}
        assert doc["bytes_in"] < 32 << 20  # the 64 MB never reached the server's loop
    finally:
        sock.close(0)
        ctx.term()


def test_bad_requests_get_an_error_reply_and_a_counter(services: Services) -> None:
    server = services.server()
    ctx = make_context()
    client = ReqClient(ctx, server.rep, timeout_s=10, retries=0)
    try:
        cases = {
            "bad_header": [b"\xc1"],
            "version": edit_header(
                wire.encode(Message(wire.PULL, "x")), lambda h: h.update(version=0)
            ),
            "wrong_socket": wire.encode(Message(wire.STATUS, "x")),
        }
        for code, frames in cases.items():
            reply = wire.decode(client.request_frames(frames))
            assert reply.type == wire.ERROR and reply.body["code"] == code
            assert reply.body["message"]
        doc = wait_until(
            lambda: (d := fetch_status(server.status))["rejected_total"] >= 3 and d, 10, "counters"
        )
        assert doc["rejected"] == {code: 1 for code in cases}
    finally:
        client.close()
        ctx.term()
