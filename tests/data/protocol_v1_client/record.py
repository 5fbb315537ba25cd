"""Record the requests a client of the wire protocol before its first change sends.

Runs the client code of commit d641bbf (``7ef4709~1``, the last commit before replies could
carry ``sparse_bf16`` rows or int32 row ids), never today's: its ``ShardSet`` and
``ShardClient`` say hello and pull over a real ZeroMQ socket, each request encoded by that
commit's own wire module, to a REP socket here that keeps the frames and answers as that
commit's server would. Writes ``requests.json`` next to this file: per request its name,
the server it is meant for (``fixed``: ``tiny_models:embedding``; ``dynamic``:
``tiny_models:dynamic_tensor``, a model the old client cannot build, so it pulls that
table's rows by id without a hello) and its frames in hex. ``tests/test_protocol_v1.py``
replays them against today's server.

How to run it (nothing of the old tree is kept)::

    git worktree add --detach /tmp/old-proto 7ef4709~1
    mkdir -p /tmp/old-shim && ln -sfn /tmp/old-proto/shared /tmp/old-shim/downpour
    PYTHONPATH=/tmp/old-shim:/tmp/old-proto/tests .venv/bin/python \\
        tests/data/protocol_v1_client/record.py
    git worktree remove /tmp/old-proto
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import numpy as np
import zmq

import downpour
from downpour import wire
from downpour.client import PROCESS_TOKEN, ShardClient
from downpour.cluster import ShardSet, partition_of
from downpour.models import build_model
from downpour.spec import load_spec

OUT = Path(__file__).with_name("requests.json")
SENDER = "v1-client"
FIXED_IDS = np.array([7, 3, 7, 4999], np.int64)  # a repeat, unsorted, the last row
DYNAMIC_IDS = np.array([-5, 2**40 + 3, 17], np.int64)  # ids, not row numbers
TABLE = "embed/embeddings"


class Recorder:
    """A REP socket on a thread: keeps each request's frames under the name set before it is
    sent, and answers it as a server of the old protocol would (enough for its client)."""

    def __init__(self, ctx: zmq.Context, shapes: dict[str, tuple[int, ...]]) -> None:
        self.sock = ctx.socket(zmq.REP)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.shapes = shapes
        self.records: list[dict[str, Any]] = []
        self.next: tuple[str, str] = ("", "")
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def expect(self, name: str, server: str) -> None:
        self.next = (name, server)

    def serve(self) -> None:
        while True:
            frames = self.sock.recv_multipart()
            if frames == [b"stop"]:
                self.sock.send(b"")
                self.sock.close(linger=1000)
                return
            name, server = self.next
            self.records.append(
                {"name": name, "server": server, "frames": [f.hex() for f in frames]}
            )
            msg = wire.decode(frames)
            self.sock.send_multipart(wire.encode(self.answer(msg, rows=server == "fixed")))

    def answer(self, msg: wire.Message, rows: bool) -> wire.Message:
        """A hello reply, or a weights reply carrying the rows asked for (zeros; ``rows``
        False: none, as the old client could not decode a dynamic table's)."""
        if msg.type == wire.HELLO:
            body = wire.HelloReply(
                push_port=1,
                incarnation="recorder",
                encodings=tuple(sorted(wire.ENCODINGS)),
                policy="async",
                row_tables=(TABLE,),
            )
            return wire.hello_reply(0, body)
        tensors = {}
        for name, ids in msg.tensors.items() if rows else ():
            ids = np.unique(np.asarray(ids, np.int64))
            shape = self.shapes[name]
            tensors[name] = wire.Sparse(ids, np.zeros((ids.size, *shape[1:]), np.float32), shape)
        body = wire.PullReply("recorder", unchanged=not tensors)
        return wire.weights_reply(0, body, tensors)


def main() -> None:
    assert Path(downpour.__file__).parent / "wire.py" == Path(wire.__file__)  # the old layout
    assert sorted(wire.ENCODINGS) == ["bf16", "dense", "sparse", "topk"], wire.ENCODINGS
    model = build_model(load_spec("tiny_models:embedding"), seed=0)
    variables = model.trainable_variables
    shapes = {v.path: tuple(int(d) for d in v.shape) for v in variables}
    ctx = zmq.Context()
    rec = Recorder(ctx, shapes)
    shards = ShardSet(ctx, [("127.0.0.1", rec.port)], partition_of(variables, 1), sender=SENDER)
    try:
        rec.expect("hello", "fixed")
        shards.hello_all("embedding")
        rec.expect("pull", "fixed")
        shards.pull_all()
        rec.expect("pull_bf16", "fixed")
        shards.pull_all(wire.BF16)
        rec.expect("rows_fixed", "fixed")  # rows only, as the old ShardSet pulls them
        shards.pull_rows(0, FIXED_IDS)
        client = ShardClient(ctx, f"tcp://127.0.0.1:{rec.port}", sender=SENDER)
        rec.expect("rows_fixed_bf16", "fixed")  # as the old worker pulls rows under bf16
        client.pull(wire.PullRequest(encoding=wire.BF16), rows={TABLE: FIXED_IDS})
        rec.expect("rows_dynamic", "dynamic")
        client.pull(wire.PullRequest(rows_only=True), rows={TABLE: DYNAMIC_IDS})
        rec.expect("rows_dynamic_bf16", "dynamic")
        client.pull(wire.PullRequest(encoding=wire.BF16, rows_only=True), rows={TABLE: DYNAMIC_IDS})
        client.close()
    finally:
        shards.close()
    stop = ctx.socket(zmq.REQ)
    stop.connect(f"tcp://127.0.0.1:{rec.port}")
    stop.send(b"stop")
    stop.recv()
    stop.close(linger=0)
    rec.thread.join()
    ctx.term()
    records = {
        "made_by": "tests/data/protocol_v1_client/record.py",
        "commit": "d641bbf (7ef4709~1)",
        "process_token": PROCESS_TOKEN,
        "requests": rec.records,
    }
    OUT.write_text(json.dumps(records, indent=1) + "\n")
    print(f"{len(rec.records)} requests -> {OUT}")


if __name__ == "__main__":
    main()
