"""Every checkpoint is one version: weights and optimizer slots equal a replay of exactly the
first ``version`` accepted pushes, though pushes keep arriving while it is written.

A server runs its real loop in-process (``InprocServer``) and takes a deterministic stream of
pushes from one PUSH socket (applied in order: one sender, one connection, the async policy
applies each). Checkpoints fall due every few updates and each write is slowed down
(``DOWNPOUR_TEST_CHECKPOINT_DELAY_S``), so the loop applies further pushes while a snapshot
is still being written. Each checkpoint is then restored into a fresh state and compared, bit
for bit, with a fresh state that applied the stream's first ``version`` gradients.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq
from conftest import wait_until
from inproc import InprocServer

from downpour import wire
from downpour.checkpoints.store import CheckpointStore
from downpour.cli.status import fetch_status
from downpour.server.checkpointing.capture import capture
from downpour.server.checkpointing.restore import restore
from downpour.server.state import ParameterState
from downpour.spec import load_spec
from downpour.wire import Message, Sparse

PUSHES = 60
LR = 0.01


def _gradients(state: ParameterState, step: int) -> dict[str, Any]:
    """Push ``step``'s gradients: rows of a row-sparse table, dense arrays for the rest."""
    rng = np.random.default_rng(step)
    out: dict[str, Any] = {}
    for name, shape, dtype, sparse in zip(
        state.names, state.shapes, state.dtypes, state.sparse, strict=True
    ):
        if sparse:
            rows = np.unique(rng.integers(0, shape[0], 30)).astype(np.int64)
            values = rng.standard_normal((len(rows), *shape[1:])).astype(dtype)
            out[name] = Sparse(rows, values, shape)
        else:
            out[name] = rng.standard_normal(shape).astype(dtype)
    return out


@pytest.mark.parametrize(
    ("model", "optimizer"),
    [
        ("tiny_models:embedding", "adam"),  # a row-sparse table (Keras's Adam) and a dense layer
        ("tiny_models:embedding", "lazy_adam"),  # the table updated row-wise (rows.py)
        ("tiny_models:tiny", "adam"),  # dense only: the XLA-compiled step
    ],
)
def test_each_checkpoint_equals_a_replay_of_its_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, model: str, optimizer: str
) -> None:
    monkeypatch.setenv("DOWNPOUR_TEST_CHECKPOINT_DELAY_S", "0.02")
    spec = load_spec(model)
    state_dir = tmp_path / "state"
    server = InprocServer(
        model,
        optimizer=optimizer,
        learning_rate=LR,
        state_dir=str(state_dir),
        checkpoint_every=4,
        checkpoint_secs=0.0,
        keep_checkpoints=PUSHES,
    )
    replay = ParameterState(spec, optimizer, LR, seed=0)
    pushes = [_gradients(replay, step) for step in range(PUSHES)]
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    try:
        sock.connect(server.push)
        for seq, tensors in enumerate(pushes, start=1):
            msg = Message(wire.PUSH, "w0", seq=seq, base_version=0, tensors=tensors)
            sock.send_multipart(wire.encode(msg), copy=False)
        doc = wait_until(
            lambda: (d := fetch_status(server.status))["version"] >= PUSHES and d,
            120,
            "every push applied",
        )
        assert doc["version"] == PUSHES and doc["rejected_total"] == 0
    finally:
        sock.close(linger=0)
        ctx.term()
        server.stop()  # the final checkpoint, of version PUSHES

    versions = [v for v, _ in CheckpointStore(state_dir, PUSHES).list()]
    assert versions[0] < PUSHES and versions[-1] == PUSHES  # one taken mid-stream at least
    for version in versions:
        while replay.version < version:
            grads = pushes[replay.version]
            replay.apply([grads[name] for name in replay.names])
        ckpt = CheckpointStore.read(state_dir / f"ckpt-{version:012d}.npz")
        restored = ParameterState(spec, optimizer, LR, seed=99)  # other initial weights
        restore(restored, ckpt)
        assert restored.version == version
        want, got = capture(replay), capture(restored)
        assert set(got) == set(want)
        assert sum(k.startswith("optimizer/") for k in want) >= 2 * len(replay.names)  # m, v
        for key in want:
            if key != "optimizer/learning_rate":
                assert got[key].tobytes() == want[key].tobytes(), (version, key)
