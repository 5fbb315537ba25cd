"""Gradient compression between a server and a worker (``downpour worker --compress``),
in-process (fast tier) and as real processes (slow tier), through the ``services`` fixture.

``tiny_models:wide`` (8.5 MB of float32 gradients per push, cheap to compute) makes the
message headers negligible, so the byte ratios are those of the payload: bf16 about 2x,
``topk:0.01`` about 50x (4-byte index + 4-byte value for 1 % of the entries). The server
decodes both and trains; the held-out accuracy of the pulled weights must be well above
chance (0.25).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np
import pytest
import zmq
from conftest import Cluster, pull_weights, wait_until
from inproc import Services, make_worker, serving, settle, train
from tiny_models import embedding_form

from downpour import wire
from downpour.cli.status import fetch_status
from downpour.wire import Message

WIDE = "tiny_models:wide"


def wide_accuracy(arrays: list[np.ndarray]) -> float:
    """The wide MLP (dense relu, dense relu, dense) on the held-out blobs, in NumPy."""
    from tiny_models import blobs

    data = blobs()
    h = data.x_test
    for i in range(0, len(arrays), 2):
        h = h @ arrays[i] + arrays[i + 1]
        if i + 2 < len(arrays):
            h = np.maximum(h, 0.0)
    return float(np.mean(np.argmax(h, axis=1) == data.y_test))


def test_topk_sends_over_40x_fewer_bytes_and_trains(services: Services) -> None:
    server = services.server(WIDE)
    (s,) = services.train(server.port, 1, WIDE, steps=30, compress="topk:0.01")
    settle(server.status, [s])
    assert s["compress"] == "topk:0.01" and s["pushes"] == 30
    ratio = s["bytes_raw"] / s["bytes_sent"]
    assert ratio >= 40, ratio
    assert s["bytes_raw"] >= 30 * 8_400_000  # what 30 dense pushes would have taken

    doc = fetch_status(server.status)
    assert doc["version"] == 30 and doc["rejected_total"] == 0
    rep = doc["workers"]["w0"]["reported"]  # sent with the pushes (the last one lags a push)
    assert rep["bytes_raw"] / rep["bytes_sent"] >= 40
    # the server received the compressed messages, not the dense ones
    assert doc["bytes_in"] < s["bytes_sent"] + 200_000
    assert wide_accuracy(pull_weights(server.rep)[1]) > 0.8


def test_bf16_halves_the_bytes_and_trains_on_two_shards(services: Services) -> None:
    from downpour.serving.scoring import Evaluator

    shards = [services.server(WIDE, num_shards=2, shard=i) for i in range(2)]
    ports = [sh.port for sh in shards]
    (s,) = services.train(ports, 1, WIDE, steps=30, compress="bf16")
    for sh in shards:
        settle(sh.status, [s])
    evaluator = Evaluator(WIDE, None)
    assert s["compress"] == "bf16" and s["pushes"] == 30
    assert 1.95 <= s["bytes_raw"] / s["bytes_sent"] <= 2.0
    docs = [fetch_status(sh.status) for sh in shards]
    for doc in docs:  # each shard decoded its slice of every push
        assert doc["version"] == 30 and doc["rejected_total"] == 0
    # the shards together received about half of what the dense gradients take
    received = sum(doc["bytes_in"] for doc in docs)
    assert received < 0.52 * s["bytes_raw"]
    version, acc = evaluator.score("127.0.0.1", ports)
    assert version == 30 and acc > 0.8


def test_bf16_pulls_halve_the_weight_bytes_and_train(services: Services) -> None:
    """``--pull-compress bf16``: the server rounds its float32 weights to bfloat16 for the
    pull (once per version), the worker widens them back and computes there."""
    import ml_dtypes

    from downpour.net.transport import RemoteError

    server = services.server(WIDE)
    (s,) = services.train(server.port, 1, WIDE, steps=30, compress="bf16", pull_compress="bf16")
    settle(server.status, [s])
    assert s["pull_compress"] == "bf16" and s["pushes"] == 30
    doc = fetch_status(server.status)
    assert doc["version"] == 30 and doc["rejected_total"] == 0
    # every pull that carried weights (all of them from this worker) went in bfloat16
    assert doc["pulls_bf16"] >= 2 and doc["pulls_bf16"] == doc["pulls"] - doc["pulls_unchanged"]

    def bytes_out_after(pulls: int) -> int:
        """The server's bytes_out once its published status counts ``pulls`` pulls."""
        return wait_until(
            lambda: (d := fetch_status(server.status))["pulls"] >= pulls and d,
            10,
            f"the status to count {pulls} pulls",
        )["bytes_out"]

    pulls = doc["pulls"]
    before = bytes_out_after(pulls)
    version, dense = pull_weights(server.rep)
    middle = bytes_out_after(pulls + 1)
    version_bf16, rounded = pull_weights(server.rep, "bf16")
    after = bytes_out_after(pulls + 2)
    assert version == version_bf16 == 30
    assert after - middle < 0.51 * (middle - before)  # half the bytes of the float32 pull
    for a, b in zip(dense, rounded, strict=True):
        assert b.dtype == a.dtype == np.float32  # widened back on decode
        np.testing.assert_array_equal(b, a.astype(ml_dtypes.bfloat16).astype(np.float32))
    assert wide_accuracy(dense) > 0.8  # trained at bf16 weights as well as the others

    # an encoding the server does not offer: a clear error, counted, nothing changed
    with pytest.raises(RemoteError) as err:
        pull_weights(server.rep, "fp8")
    assert err.value.code == wire.R_HEADER and "fp8" in err.value.message
    doc = wait_until(
        lambda: (d := fetch_status(server.status))["rejected_total"] == 1 and d,
        10,
        "the refusal to be counted",
    )
    assert doc["rejected"] == {wire.R_HEADER: 1} and doc["version"] == 30
    np.testing.assert_array_equal(pull_weights(server.rep)[1][0], dense[0])


@pytest.fixture
def old_server() -> Iterator[int]:
    """A REP socket answering hello like a server that decodes dense and sparse tensors only."""
    ctx = zmq.Context()
    rep = ctx.socket(zmq.REP)
    rep.setsockopt(zmq.LINGER, 0)
    port = rep.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            if not rep.poll(100):
                continue
            msg = wire.decode(rep.recv_multipart())
            body = {
                "push_port": 1,
                "incarnation": "old",
                "last_seq": 0,
                "encodings": ["dense", "sparse"],
            }
            rep.send_multipart(wire.encode(Message(msg.type, "server", body=body)))

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield port
    finally:
        stop.set()
        t.join(timeout=5)
        rep.close(0)
        ctx.term()


@pytest.mark.parametrize(
    ("settings", "encoding"),
    [
        ({"compress": "topk:0.01"}, "topk encoding"),
        ({}, "bf16, sparse_bf16 encodings"),
        ({"compress": "bf16:dense"}, "bf16 encoding"),
    ],
)
def test_worker_refuses_a_compression_the_server_cannot_decode(
    old_server: int, settings: dict, encoding: str
) -> None:
    """Also the default (bf16): a server without it is named, and the way round it."""
    from downpour.worker.service import WorkerError

    worker = make_worker(old_server, steps=5, **settings)
    try:
        with pytest.raises(WorkerError, match=f"cannot decode the {encoding} that") as err:
            worker.run()
    finally:
        worker.close()
    assert "--compress none" in str(err.value)


@pytest.mark.parametrize(
    ("compress", "encodings"),
    [("bf16", "bf16, keyed_counted_bf16, sparse_bf16 encodings"), ("none", "keyed_counted")],
)
def test_a_dynamic_tables_worker_refuses_a_server_without_counted_rows(
    old_server: int, compress: str, encodings: str
) -> None:
    """A dynamic table's rows go each id once with their lookups, in every form: a server
    that cannot decode that is named, and no flag is offered as the way round."""
    from downpour.worker.service import WorkerError

    worker = make_worker(
        old_server, embedding_form("tensor", dynamic=True), steps=5, compress=compress
    )
    try:
        with pytest.raises(WorkerError, match=f"cannot decode the {encodings}") as err:
            worker.run()
    finally:
        worker.close()
    assert "upgrade the server" in str(err.value) and "or use --compress" not in str(err.value)


@pytest.mark.slow
def test_worker_process_refuses_a_compression_the_server_cannot_decode(
    cluster: Cluster, old_server: int
) -> None:
    w = cluster.worker(old_server, "--steps", "5", "--compress", "topk:0.01")
    assert w.wait(timeout=120) == 3
    log = w.log_text()
    assert "cannot decode the topk encoding" in log and "--compress none" in log


@pytest.mark.parametrize(
    ("settings", "in_step", "warned"),
    [
        ({}, True, None),  # the default: bf16, rounded in the step
        ({"compress": "bf16"}, True, None),
        ({"n_push": 2}, False, "--n-push 2 averages"),
        ({"compress": "bf16", "n_push": 2}, False, "--n-push 2 averages"),
        ({"compress": "bf16:dense"}, True, None),
        ({"compress": "bf16:dense", "n_push": 2}, False, "--compress bf16:dense: gradients"),
        ({"compress": "none"}, False, None),
        ({"compress": "topk:0.01"}, False, None),
    ],
)
def test_the_step_rounds_bf16_pushes_of_one_step_and_says_when_it_cannot(
    settings: dict, in_step: bool, warned: str | None, caplog: pytest.LogCaptureFixture
) -> None:
    """``--compress bf16`` rounds in the compiled step; with ``--n-push`` above 1 the mean
    is rounded at the push instead, and a warning says why. Nothing is sent to build one."""
    caplog.set_level("WARNING", logger="downpour.worker")
    worker = make_worker(1, WIDE, steps=1, **settings)
    try:
        assert worker.step_fn.round_bf16 is in_step
    finally:
        worker.close()
    said = [r.getMessage() for r in caplog.records if "compiled step" in r.getMessage()]
    if warned is None:
        assert said == []
    else:
        assert len(said) == 1 and warned in said[0] and "rounded in NumPy" in said[0]


def test_a_bf16_push_rounded_in_numpy_is_a_notice_in_the_servers_status(
    services: Services,
) -> None:
    """The slow bf16 path is not silent: the worker's pushes carry its notice, the server's
    status lists it under the worker and ``downpour status`` prints it. A worker on the
    fast path reports none."""
    from downpour.cli.status import render

    server = services.server(WIDE)
    (slow,) = services.train(server.port, 1, WIDE, ids=["slow"], steps=4, compress="bf16", n_push=2)
    (fast,) = services.train(server.port, 1, WIDE, ids=["fast"], steps=2, compress="bf16")
    (notice,) = slow["notices"]
    assert "rounded in NumPy" in notice and "--n-push 2" in notice
    assert fast["notices"] == []
    doc = fetch_status(server.status)
    assert doc["workers"]["slow"]["notices"] == [notice]
    assert doc["workers"]["fast"]["notices"] == []
    warned = [line for line in render(doc).splitlines() if line.startswith("WARNING: worker")]
    assert warned == [f"WARNING: worker slow: {notice}"]


@pytest.mark.parametrize("pull_compress", ["bf16", "none"])
def test_bytes_received_counts_the_pull_replies_as_they_travelled(pull_compress: str) -> None:
    """``bytes_pulled`` counts the pulled tensors once widened to float32; ``bytes_received``
    the replies' frames: half of that under bf16 pulls, all of it under float32, plus one
    header per pull (an "unchanged" reply is a header alone)."""
    with serving() as server:
        s = train(server.port, steps=12, worker_id="w", n_fetch=1, pull_compress=pull_compress)
    share = 0.5 if pull_compress == "bf16" else 1.0
    tensors = share * s["bytes_pulled"]
    assert s["bytes_pulled"] > 0 and s["pulls"] >= 12
    assert tensors < s["bytes_received"] <= tensors + 1024 * s["pulls"]
