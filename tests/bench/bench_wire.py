"""Section 1, the wire: one push of the gradient list against the memcpy floor.

The floor is ``np.copyto`` of every gradient into a pre-allocated array. The push is what a
worker and the server do: ``wire.encode``, a ZeroMQ PUSH sent with ``copy=False`` over
tcp://127.0.0.1 to a PULL received with ``copy=False``, and ``wire.decode`` back to arrays.
For comparison it also times the same frames through raw pyzmq (no encode/decode: what the
protocol costs), the protocol over ipc:// (what the TCP loopback costs), over CURVE (what
encryption costs), and with ``--compress bf16`` (the worker rounds to bfloat16, the server's
decode widens back to float32: half the bytes on the wire, both conversions timed).
"""

from __future__ import annotations

import tempfile
from typing import Any

import numpy as np
import zmq
from bench_util import median, percentile, time_ms

from downpour import wire
from downpour.model.build import build_model
from downpour.net.transport import make_context
from downpour.spec import ModelSpec
from downpour.wire import Message
from downpour.worker.compress import BF16Compression

RECV_TIMEOUT_MS = 10_000


def gradient_list(shapes: list[tuple[int, ...]], seed: int = 0) -> list[np.ndarray]:
    """Small random float32 gradients of the given shapes (finite, realistic magnitudes)."""
    rng = np.random.default_rng(seed)
    return [(1e-3 * rng.standard_normal(s)).astype(np.float32) for s in shapes]


def model_gradients(
    spec: ModelSpec,
) -> tuple[list[str], list[tuple[int, ...]], list[np.ndarray]]:
    """The variable paths and shapes of ``spec``'s model and a gradient list of those shapes
    (``gradient_list``): what the wire, server and shards sections send."""
    model = build_model(spec, seed=0)
    names = [v.path for v in model.trainable_variables]
    shapes = [tuple(int(d) for d in v.shape) for v in model.trainable_variables]
    return names, shapes, gradient_list(shapes)


class Loopback:
    """A PUSH -> PULL pair with the project's context settings, over tcp://127.0.0.1.

    ``ipc=True`` uses a Unix domain socket instead (for comparison only: the project's
    services talk TCP).
    """

    def __init__(self, ipc: bool = False, curve: bool = False) -> None:
        self.ctx = make_context()
        self.pull = self.ctx.socket(zmq.PULL)
        self.push = self.ctx.socket(zmq.PUSH)
        if curve:  # what --keys costs: every byte encrypted (no ZAP: the cipher is the cost)
            server_public, server_secret = zmq.curve_keypair()
            client_public, client_secret = zmq.curve_keypair()
            self.pull.curve_server = True
            self.pull.curve_secretkey = server_secret
            self.push.curve_serverkey = server_public
            self.push.curve_publickey = client_public
            self.push.curve_secretkey = client_secret
        self.tmp: tempfile.TemporaryDirectory[str] | None = None
        if ipc:
            self.tmp = tempfile.TemporaryDirectory(prefix="downpour-bench-")
            endpoint = f"ipc://{self.tmp.name}/wire"
            self.pull.bind(endpoint)
        else:
            port = self.pull.bind_to_random_port("tcp://127.0.0.1")
            endpoint = f"tcp://127.0.0.1:{port}"
        self.push.connect(endpoint)

    def roundtrip(self, frames: list[Any]) -> list[zmq.Frame]:
        """Send frames (copy=False) and receive them (copy=False); bounded wait."""
        self.push.send_multipart(frames, copy=False)
        if not self.pull.poll(RECV_TIMEOUT_MS, zmq.POLLIN):
            raise TimeoutError("loopback message not received within 10 s")
        return self.pull.recv_multipart(copy=False)

    def close(self) -> None:
        """Close both sockets and the context."""
        self.push.close(linger=0)
        self.pull.close(linger=0)
        self.ctx.term()
        if self.tmp is not None:
            self.tmp.cleanup()


def run(names: list[str], grads: list[np.ndarray], reps: int) -> dict[str, Any]:
    """memcpy_ms, push_decode_ms (medians over ``reps``) and their ratio."""
    payload = sum(g.nbytes for g in grads)
    limits = wire.DEFAULT_LIMITS.for_payload(payload)
    dst = [np.empty_like(g) for g in grads]

    def memcpy() -> None:
        for d, g in zip(dst, grads, strict=True):
            np.copyto(d, g)

    links = {"tcp": Loopback(), "ipc": Loopback(ipc=True), "curve": Loopback(curve=True)}
    seq = [0]

    bf16 = BF16Compression()

    def push_decode(link: Loopback, compress: bool = False) -> None:
        seq[0] += 1
        tensors = bf16.compress(grads) if compress else grads
        msg = Message(
            wire.PUSH,
            "bench",
            seq=seq[0],
            body={"loss": 0.0, "batch_size": 50, "steps": seq[0]},
            tensors=dict(zip(names, tensors, strict=True)),
        )
        out = wire.decode(link.roundtrip(wire.encode(msg)), limits)
        if len(out.tensors) != len(grads):
            raise RuntimeError("decoded message lost tensors")
        if out.tensors[names[0]].dtype != np.float32:
            raise RuntimeError("decode did not hand back float32")

    def raw_tcp() -> None:
        links["tcp"].roundtrip(grads)

    variants = {
        "memcpy": memcpy,
        "push_decode": lambda: push_decode(links["tcp"]),
        "raw_tcp": raw_tcp,
        "ipc_push_decode": lambda: push_decode(links["ipc"]),
        "curve_push_decode": lambda: push_decode(links["curve"]),
        "bf16_push_decode": lambda: push_decode(links["tcp"], compress=True),
        "curve_bf16_push_decode": lambda: push_decode(links["curve"], compress=True),
    }
    samples: dict[str, list[float]] = {k: [] for k in variants}
    try:
        for fn in variants.values():
            time_ms(fn, 0, warmup=3)
        for _ in range(reps):  # interleaved, so that machine noise hits all alike
            for k, fn in variants.items():
                samples[k] += time_ms(fn, 1, warmup=0)
    finally:
        for link in links.values():
            link.close()
    m = {k: median(v) for k, v in samples.items()}
    return {
        "payload_bytes": payload,
        "memcpy_ms": m["memcpy"],
        "memcpy_gb_per_s": payload / m["memcpy"] / 1e6,
        "push_decode_ms": m["push_decode"],
        "push_decode_p90_ms": percentile(samples["push_decode"], 90),
        "wire_gb_per_s": payload / m["push_decode"] / 1e6,
        "ratio_to_memcpy": m["push_decode"] / m["memcpy"],
        # for comparison: the same frames without encode/decode, and the same path over ipc://
        "raw_zmq_tcp_ms": m["raw_tcp"],
        "raw_zmq_tcp_ratio_to_memcpy": m["raw_tcp"] / m["memcpy"],
        "ipc_push_decode_ms": m["ipc_push_decode"],
        "ipc_ratio_to_memcpy": m["ipc_push_decode"] / m["memcpy"],
        "curve_push_decode_ms": m["curve_push_decode"],
        "bf16_push_decode_ms": m["bf16_push_decode"],
        "bf16_ratio_to_memcpy": m["bf16_push_decode"] / m["memcpy"],
        "curve_bf16_push_decode_ms": m["curve_bf16_push_decode"],
        "reps": reps,
    }


def bf16_pulls(spec: ModelSpec, reps: int) -> dict[str, Any]:
    """What a whole pull in bfloat16 (the default ``--pull-compress bf16``) costs each side,
    side by side in this process, medians over ``reps`` interleaved samples.

    Server, per version (each sample after an apply, so that the version is new): the
    variables rounded by ``ParameterState.weights_bf16`` (one compiled call) against
    ``wire.as_bf16`` of the float32 snapshot (``weights``), the NumPy rounding that the
    lookahead policy's extrapolated arrays take. Worker, per pull: decoding the reply's
    frames and making tensors of them (``GradientStep.prepare``: widened bf16 weights are
    adopted without a copy) for a bf16 reply against a float32 one.
    """
    from downpour.memory.tensors import to_tensor
    from downpour.server.state import ParameterState  # TensorFlow: not at import

    state = ParameterState(spec, "adam", 1e-3)
    grads = gradient_list(state.shapes)
    version, arrays = state.weights()
    replies = {
        enc: [bytes(f) for f in wire.encode(wire.weights_reply(version, wire.PullReply(), t))]
        for enc, t in (
            ("bf16", dict(zip(state.names, state.weights_bf16()[1], strict=True))),
            ("float32", dict(zip(state.names, arrays, strict=True))),
        )
    }
    limits = wire.DEFAULT_LIMITS.for_payload(sum(a.nbytes for a in arrays))

    def install(enc: str) -> None:
        out = wire.decode(replies[enc], limits)
        tensors = [to_tensor(a, adopt=True) for a in out.tensors.values()]
        if len(tensors) != len(arrays):
            raise RuntimeError("decoded reply lost tensors")

    def rounded(tf_rounding: bool) -> float:
        state.apply(grads)
        if tf_rounding:
            return time_ms(state.weights_bf16, 1, warmup=0)[0]
        return time_ms(lambda: [wire.as_bf16(a) for a in state.weights()[1]], 1, warmup=0)[0]

    samples: dict[str, list[float]] = {k: [] for k in ("tf", "numpy", "bf16", "float32")}
    for _ in range(3):  # warm-up: traces, allocator
        rounded(True)
        rounded(False)
        install("bf16")
        install("float32")
    for _ in range(reps):
        samples["tf"].append(rounded(True))
        samples["numpy"].append(rounded(False))
        samples["bf16"] += time_ms(lambda: install("bf16"), 1, warmup=0)
        samples["float32"] += time_ms(lambda: install("float32"), 1, warmup=0)
    m = {k: median(v) for k, v in samples.items()}
    return {
        "server_round_ms": m["tf"],
        "server_round_numpy_ms": m["numpy"],
        "server_speedup": m["numpy"] / m["tf"],
        "worker_install_bf16_ms": m["bf16"],
        "worker_install_float32_ms": m["float32"],
        "worker_bf16_vs_float32": m["bf16"] / m["float32"],
        "reps": reps,
    }


def bf16_pushes(spec: ModelSpec, reps: int) -> dict[str, Any]:
    """What producing a ``--compress bf16`` push costs the worker, per step, side by side in
    this process (medians over ``reps`` interleaved samples, one batch of the model's data):

    - ``step_round_tf_ms``: ``GradientStep(round_bf16=True)``, the compiled step rounding its
      dense float32 gradients (what a worker with ``--n-push 1`` runs);
    - ``step_round_numpy_ms``: the plain step, then ``wire.as_bf16`` of every gradient (what
      ``--n-push`` above 1 and ``--graph tf1`` do at the push);
    - ``step_float32_ms``: the plain step alone (``--compress none``), the floor.
    """
    from downpour.worker.step import GradientStep  # TensorFlow: not at import

    data = spec.load_data(None)
    model = build_model(spec, seed=0)
    x, y = data.x_train[: spec.batch_size], data.y_train[: spec.batch_size]
    plain = GradientStep(spec, model, data.x_train[:1])
    fused = GradientStep(spec, model, data.x_train[:1], round_bf16=True)

    def numpy_rounding() -> None:
        _, grads = plain(x, y)
        [wire.as_bf16(g) for g in grads]

    timed = {
        "tf": lambda: fused(x, y),
        "numpy": numpy_rounding,
        "float32": lambda: plain(x, y),
    }
    samples: dict[str, list[float]] = {k: [] for k in timed}
    for fn in timed.values():  # warm-up: traces, allocator
        time_ms(fn, 0, warmup=3)
    for _ in range(reps):
        for k, fn in timed.items():
            samples[k] += time_ms(fn, 1, warmup=0)
    m = {k: median(v) for k, v in samples.items()}
    return {
        "step_round_tf_ms": m["tf"],
        "step_round_numpy_ms": m["numpy"],
        "step_float32_ms": m["float32"],
        "numpy_vs_tf": m["numpy"] / m["tf"],
        "reps": reps,
    }
