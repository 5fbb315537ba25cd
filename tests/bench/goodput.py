"""Goodput in the style of ps-lite's benchmark: MB/s of pushes, pulls and both, downpour's
wire and sockets against raw pyzmq multipart of the same bytes on the same socket types.

``goodput.py serve --sizes JSON --ready-file F`` binds a PULL and a REP socket on
127.0.0.1 and answers until terminated. ``goodput.py client --sizes JSON --push-port P
--rep-port R --rounds N`` measures and prints one JSON line. The bench runs the two as
emulated hosts (client on core 0, server on core 1).

Per message, the downpour path is: ``wire.encode`` and ``PushSocket.send`` / the server's
``wire.decode`` (validation, views on the frames) for a push; ``ReqClient.request`` of a
wire PULL, the server's decode of it and ``wire.encode`` of the WEIGHTS reply, the client's
decode for a pull. The raw path sends the same tensor frames behind a 3-byte tag frame (so
the frame count matches) through sockets with the same options, and decodes nothing.

* push: ``n`` pushes, then a sync request answered once the server has received them all;
* pull: ``n`` pulls one after another;
* pushpull: ``n`` times a push and a pull (bytes of both directions count), then a sync.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from downpour import wire
from downpour.net.transport import PushSocket, ReqClient, make_context, tcp
from downpour.wire import Message

RAW = b"raw"
SYNC = b"sync"
TIMEOUT_S = 60.0
OPS = ("push", "pull", "pushpull")


def tensors(shapes: list[list[int]]) -> dict[str, np.ndarray]:
    """Finite float32 arrays of the given shapes, named t0, t1, ..."""
    rng = np.random.default_rng(0)
    return {f"t{i}": rng.standard_normal(s).astype(np.float32) for i, s in enumerate(shapes)}


def payload(ts: dict[str, np.ndarray]) -> int:
    """Bytes of tensor data."""
    return sum(t.nbytes for t in ts.values())


def serve(sizes: dict[str, list[list[int]]], ready_file: Path) -> None:
    """Answer pushes (counted; wire ones decoded), pulls and syncs until terminated."""
    data = {name: tensors(shapes) for name, shapes in sizes.items()}
    limits = wire.DEFAULT_LIMITS.for_payload(max(payload(t) for t in data.values()))
    ctx = make_context()
    pull, rep = ctx.socket(zmq.PULL), ctx.socket(zmq.REP)
    ports = {
        "push_port": pull.bind_to_random_port("tcp://127.0.0.1"),
        "rep_port": rep.bind_to_random_port("tcp://127.0.0.1"),
    }
    ready_file.write_text(json.dumps(ports))
    received = 0
    seq = 0

    def take_push() -> None:
        nonlocal received
        frames = pull.recv_multipart(copy=False)
        if frames[0].bytes != RAW:
            wire.decode(frames, limits)  # what the server does before anything else
        received += 1

    poller = zmq.Poller()
    poller.register(pull, zmq.POLLIN)
    poller.register(rep, zmq.POLLIN)
    while True:
        events = dict(poller.poll())
        if pull in events:
            take_push()
        if rep not in events:
            continue
        frames = rep.recv_multipart(copy=False)
        head = frames[0].bytes
        if head == SYNC:  # reply once every push sent before it has arrived
            want = int(frames[1].bytes)
            deadline = time.monotonic() + TIMEOUT_S
            while received < want and time.monotonic() < deadline:
                if pull.poll(1000, zmq.POLLIN):
                    take_push()
            rep.send_multipart([str(received).encode()])
        elif head == RAW:
            rep.send_multipart([RAW, *data[frames[1].bytes.decode()].values()], copy=False)
        else:
            req = wire.decode(frames, wire.DEFAULT_LIMITS)
            seq += 1
            reply = Message(wire.WEIGHTS, "server", seq=seq, tensors=data[req.body["size"]])
            rep.send_multipart(wire.encode(reply), copy=False)


class Client:
    """Both paths to one server: downpour's (PushSocket, ReqClient) and raw sockets alike."""

    def __init__(self, push_port: int, rep_port: int, limits: wire.Limits) -> None:
        self.ctx = make_context()
        self.limits = limits
        self.push = PushSocket(self.ctx, tcp("127.0.0.1", push_port), timeout_s=TIMEOUT_S)
        self.req = ReqClient(self.ctx, tcp("127.0.0.1", rep_port), timeout_s=TIMEOUT_S, retries=0)
        self.raw_push = self.ctx.socket(zmq.PUSH)  # the same options as PushSocket's
        self.raw_push.setsockopt(zmq.LINGER, 0)
        self.raw_push.setsockopt(zmq.SNDHWM, self.push.sock.getsockopt(zmq.SNDHWM))
        self.raw_push.setsockopt(zmq.SNDTIMEO, int(1000 * TIMEOUT_S))
        self.raw_push.connect(tcp("127.0.0.1", push_port))
        self.raw_req = ReqClient(  # a REQ socket as the worker's, used with raw frames
            self.ctx, tcp("127.0.0.1", rep_port), timeout_s=TIMEOUT_S, retries=0
        )
        self.sent = 0
        self.seq = 0

    def push_msg(self, raw: bool, ts: dict[str, np.ndarray]) -> None:
        """One push of ``ts``."""
        if raw:
            self.raw_push.send_multipart([RAW, *ts.values()], copy=False)
        else:
            self.seq += 1
            msg = Message(wire.PUSH, "goodput", seq=self.seq, tensors=ts)
            self.push.send(wire.encode(msg), deadline_s=TIMEOUT_S)
        self.sent += 1

    def pull_msg(self, raw: bool, size: str) -> None:
        """One pull of the ``size`` tensors."""
        if raw:
            self.raw_req.request_frames([RAW, size.encode()])
        else:
            self.seq += 1
            reply = self.req.request(
                Message(wire.PULL, "goodput", seq=self.seq, body={"size": size}), self.limits
            )
            if not reply.tensors:
                raise RuntimeError("pull reply without tensors")

    def sync(self) -> None:
        """Wait until the server has received every push sent so far."""
        got = int(self.raw_req.request_frames([SYNC, str(self.sent).encode()])[0].bytes)
        if got < self.sent:
            raise RuntimeError(f"server received {got} of {self.sent} pushes")

    def close(self) -> None:
        """Close every socket and the context."""
        self.push.close()
        self.req.sock.close(linger=0)
        self.raw_req.sock.close(linger=0)
        self.raw_push.close(linger=0)
        self.ctx.term()


def mb_per_s(
    client: Client, op: str, raw: bool, size: str, ts: dict[str, np.ndarray], n: int
) -> float:
    """MB/s (1e6 bytes) of ``n`` operations ``op`` with ``size`` messages."""
    t0 = time.perf_counter()
    for _ in range(n):
        if op in ("push", "pushpull"):
            client.push_msg(raw, ts)
        if op in ("pull", "pushpull"):
            client.pull_msg(raw, size)
    if op != "pull":
        client.sync()
    moved = n * payload(ts) * (2 if op == "pushpull" else 1)
    return moved / (time.perf_counter() - t0) / 1e6


def measure(
    sizes: dict[str, list[list[int]]], push_port: int, rep_port: int, rounds: int
) -> dict[str, Any]:
    """Median MB/s per size, operation and path over ``rounds`` interleaved rounds; ratios."""
    data = {name: tensors(shapes) for name, shapes in sizes.items()}
    limits = wire.DEFAULT_LIMITS.for_payload(max(payload(t) for t in data.values()))
    client = Client(push_port, rep_port, limits)
    samples: dict[str, list[float]] = {}
    memcpy: dict[str, list[float]] = {}
    try:
        for name, ts in data.items():
            n = max(2, int(32e6 / payload(ts)))  # about 32 MB per sample
            dst = {k: np.empty_like(t) for k, t in ts.items()}
            for r in range(rounds + 1):  # round 0 warms up (connections, caches)
                for op in OPS:
                    for raw in (True, False) if r % 2 else (False, True):
                        rate = mb_per_s(client, op, raw, name, ts, n)
                        if r:
                            samples.setdefault(
                                f"{name}/{op}/{'raw' if raw else 'downpour'}", []
                            ).append(rate)
                t0 = time.perf_counter()
                for k, t in ts.items():
                    np.copyto(dst[k], t)
                memcpy.setdefault(name, []).append(payload(ts) / (time.perf_counter() - t0) / 1e6)
    finally:
        client.close()
    med = {k: statistics.median(v) for k, v in samples.items()}
    out: dict[str, Any] = {
        "mb_per_s": med,
        "sizes_mb": {n: payload(t) / 1e6 for n, t in data.items()},
    }
    for op in OPS:
        ratios = {n: med[f"{n}/{op}/downpour"] / med[f"{n}/{op}/raw"] for n in data}
        out[f"{op}_ratio_to_raw_per_size"] = ratios
        out[f"{op}_ratio_to_raw"] = min(ratios.values())  # the worse size is the figure
        out[f"{op}_ratio_to_memcpy_per_size"] = {
            n: med[f"{n}/{op}/downpour"] / statistics.median(memcpy[n]) for n in data
        }
        for n in data:
            out[f"{op}_{n}_mb_per_s"] = med[f"{n}/{op}/downpour"]
            out[f"{op}_{n}_raw_mb_per_s"] = med[f"{n}/{op}/raw"]
    out["memcpy_mb_per_s"] = {n: statistics.median(v) for n, v in memcpy.items()}
    out["rounds"] = rounds
    return out


def main() -> None:
    """Command line: serve | client."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("role", choices=["serve", "client"])
    p.add_argument("--sizes", required=True, help='JSON: {"name": [shape, ...], ...}')
    p.add_argument("--ready-file", type=Path)
    p.add_argument("--push-port", type=int, default=0)
    p.add_argument("--rep-port", type=int, default=0)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    sizes = json.loads(args.sizes)
    if args.role == "serve":
        serve(sizes, args.ready_file)
    else:
        print(json.dumps(measure(sizes, args.push_port, args.rep_port, args.rounds)), flush=True)


if __name__ == "__main__":
    main()
