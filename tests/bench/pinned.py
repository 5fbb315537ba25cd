"""The bench's pinned child processes: each runs on the cores its parent gave it (taskset).

``pinned.py MODE [options]`` prints one JSON line with its figures:

* ``compute``, three figures measured in alternating windows on the same core:
  single-process training with Keras Adam (one step per call) and with the fused
  ``ResourceApplyAdam`` kernel, ``--fused-k`` steps per compiled call (the faster is the
  local figure); and the worker's bare gradient step (``GradientStep``: loss and the whole
  gradient list copied out as NumPy, as a worker sends them), the limit of a worker that
  only computes.
* ``bare-apply``: the server's compiled apply (``ParameterState.apply``) on received frames,
  interleaved with a memcpy of the gradient list, on this process's cores.
* ``flood``: pre-encoded gradient pushes to a real server's PULL socket, kept ``in_flight``
  ahead of its applied version; applies/s from its status socket over timed windows.
* ``receive`` and ``send``: the floor under the flooded server's overhead. ``receive`` is the
  least server there is: a PULL socket with the server's receive-buffer setting, and a loop
  that takes a push, decodes it, stages it (``ParameterState.stage``: the copy into the
  aligned buffers TensorFlow needs, with the NaN/Inf check) and applies it
  (``ParameterState.apply``), nothing else: no policy, registry, statistics or status.
  ``send`` (another process, on another core) keeps it fed with the pre-encoded pushes
  ``flood`` sends. Its figure is milliseconds per apply over timed windows.
* ``least-worker``: the floor under the pinned worker's overhead, the least worker there is
  against a real server (``--server-port``): one thread that asks for the weights in bf16 a
  step ahead, computes the gradient step (``GradientStep``, rounding to bf16 inside it as
  the worker's default ``--compress bf16`` does), pushes the gradients, takes the reply and
  loads it into the model (``GradientStep.prepare`` and ``set_weights``), nothing else: no
  input pipeline, fetcher thread, statistics, heartbeats, checks or retries. Its figure is
  steps/s over timed windows.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

# Thread pools sized to this process's cores (the parent sets the variables from its CPU set)
for _var, _set in (
    ("TF_NUM_INTRAOP_THREADS", tf.config.threading.set_intra_op_parallelism_threads),
    ("TF_NUM_INTEROP_THREADS", tf.config.threading.set_inter_op_parallelism_threads),
):
    if os.environ.get(_var):
        _set(int(os.environ[_var]))

from bench_util import cpu_seconds, median  # noqa: E402

from downpour.inputs.data import load_mnist_5k  # noqa: E402
from downpour.model.build import build_model  # noqa: E402
from downpour.spec import load_spec  # noqa: E402

SPEC = "downpour.models:deep_mnist"


def _windows(step: Any, warmup: int, window_steps: int, windows: int) -> list[float]:
    """Steps/s of ``windows`` windows of ``window_steps`` calls of ``step`` (each returns a
    tensor that is read at the window's end, so the last step is waited for)."""
    out = None
    for _ in range(warmup):
        out = step()
    float(out)
    rates = []
    for _ in range(windows):
        t0 = time.perf_counter()
        for _ in range(window_steps):
            out = step()
        float(out)
        rates.append(window_steps / (time.perf_counter() - t0))
    return rates


def compute(args: argparse.Namespace) -> dict[str, Any]:
    """Keras Adam one step per call, fused Adam ``fused_k`` steps per call, and the bare
    gradient step, in alternating windows."""
    import keras
    from bench_e2e import batches
    from fused_adam import FusedAdam

    from downpour.worker.step import GradientStep

    spec = load_spec(SPEC)
    data = load_mnist_5k()
    model = build_model(spec, seed=0)
    variables = list(model.trainable_variables)
    keras_adam = keras.optimizers.Adam(1e-3)
    keras_adam.build(variables)
    fused = FusedAdam(variables)
    k = args.fused_k
    x_spec = tf.TensorSpec((None, *data.x_train.shape[1:]), tf.as_dtype(data.x_train.dtype))

    @tf.function(input_signature=[x_spec, tf.TensorSpec((None,), spec.label_dtype)])
    def keras_step(x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as tape:
            loss = spec.loss(y, model(x, training=True))
        keras_adam.apply_gradients(zip(tape.gradient(loss, variables), variables, strict=True))
        return loss

    stacked = [
        tf.TensorSpec((k, *x_spec.shape), x_spec.dtype),
        tf.TensorSpec((k, None), spec.label_dtype),
    ]

    @tf.function(input_signature=stacked)
    def fused_steps(xs: tf.Tensor, ys: tf.Tensor) -> tf.Tensor:
        loss = tf.constant(0.0)
        for i in tf.range(k):
            with tf.GradientTape() as tape:
                loss = spec.loss(ys[i], model(xs[i], training=True))
            fused.apply(tape.gradient(loss, variables))
        return loss

    it = batches(data, spec.batch_size, seed=0)

    def one() -> tf.Tensor:
        return keras_step(*next(it))

    def many() -> tf.Tensor:
        xs, ys = zip(*(next(it) for _ in range(k)), strict=True)
        return fused_steps(
            tf.constant(np.stack(xs), x_spec.dtype), tf.constant(np.stack(ys), spec.label_dtype)
        )

    step = GradientStep(spec, build_model(spec, seed=0), data.x_train[:1])

    def grad_only() -> tf.Tensor:
        loss, _grads = step(*next(it))  # the gradients are copied out, as a worker's are
        return tf.constant(loss)

    rates: dict[str, list[float]] = {"keras": [], "fused": [], "grad": []}
    warm = {"keras": args.warmup, "fused": max(1, args.warmup // k), "grad": args.warmup}
    cpu0, wall0 = cpu_seconds(), time.perf_counter()
    for _ in range(args.windows):  # alternating, so that noise hits all alike
        rates["keras"] += _windows(one, warm["keras"], args.window_steps, 1)
        fused_windows = _windows(many, warm["fused"], max(1, args.window_steps // k), 1)
        rates["fused"] += [k * r for r in fused_windows]
        rates["grad"] += _windows(grad_only, warm["grad"], args.window_steps, 1)
        warm = {"keras": 1, "fused": 1, "grad": 1}
    keras_rate, fused_rate = median(rates["keras"]), median(rates["fused"])
    return {
        "local_steps_per_s": max(keras_rate, fused_rate),
        "keras_adam_steps_per_s": keras_rate,
        "fused_steps_per_s": fused_rate,
        "fused_steps_per_call": k,
        "grad_only_steps_per_s": median(rates["grad"]),
        "grad_traces": step.traces,
        # CPU time over wall time: how much of its core the process got (1.0: all of it)
        "cpu_cores": (cpu_seconds() - cpu0) / (time.perf_counter() - wall0),
        "windows": rates,
    }


def _gradients() -> tuple[list[str], list[Any]]:
    from bench_wire import gradient_list

    model = build_model(load_spec(SPEC), seed=0)
    names = [v.path for v in model.trainable_variables]
    shapes = [tuple(int(d) for d in v.shape) for v in model.trainable_variables]
    return names, gradient_list(shapes)


def bare_apply(args: argparse.Namespace) -> dict[str, Any]:
    """The compiled apply and a memcpy of the gradient list, interleaved, on this core."""
    from bench_server import BareApply, received_views

    names, grads = _gradients()
    views, frames = received_views(names, grads)
    bare = BareApply(load_spec(SPEC), views)
    bare.measure(args.reps)
    out = bare.result()
    del frames
    return out


def flood(args: argparse.Namespace) -> dict[str, Any]:
    """Applies/s of the server at ``--status-port`` while this process floods its PULL port."""
    from bench_server import Flood, rate_window, sample, wait_for

    names, grads = _gradients()
    endpoint = f"tcp://127.0.0.1:{args.status_port}"
    pusher = Flood(args.push_port, names, grads, args.in_flight)
    pusher.start()
    rates: list[float] = []
    try:
        wait_for(endpoint, pusher, 5, 120.0)  # the first apply compiles
        end = time.monotonic() + args.warmup_s
        while time.monotonic() < end:
            sample(endpoint, pusher)
            time.sleep(0.05)
        cpu0, wall0 = cpu_seconds(), time.monotonic()
        for _ in range(args.windows):
            rate, doc = rate_window(endpoint, pusher, args.window_s)
            rates.append(rate)
        pusher_cores = (cpu_seconds() - cpu0) / (time.monotonic() - wall0)
    finally:
        pusher.stop()
    if doc.get("rejected_total"):
        raise RuntimeError(f"server rejected flood messages: {doc.get('rejected')}")
    return {
        "applies_per_s": median(rates),
        "windows": rates,
        "pusher_cpu_cores": pusher_cores,
        "server_reported_apply_ms": doc.get("apply_ms"),
        "pusher_blocked": pusher.blocked,
    }


def send(args: argparse.Namespace) -> dict[str, Any]:
    """Push ``--count`` copies of one encoded gradient push to ``--push-port``, then wait
    (bounded) until they are delivered."""
    import zmq
    from bench_server import push_frames

    from downpour.net.transport import make_context, tcp

    names, grads = _gradients()
    frames = push_frames(dict(zip(names, grads, strict=True)), seq=1, sender="bench-floor")
    ctx = make_context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, 4)
    sock.setsockopt(zmq.SNDTIMEO, 60_000)
    sock.connect(tcp("127.0.0.1", args.push_port))
    t0 = time.perf_counter()
    for _ in range(args.count):
        sock.send_multipart(frames, copy=False)
    sock.close(linger=60_000)
    ctx.term()
    return {"sent": args.count, "seconds": time.perf_counter() - t0}


def receive(args: argparse.Namespace) -> dict[str, Any]:
    """The least server: receive, decode, stage and apply, in a loop; see the module
    docstring."""
    import zmq

    from downpour import wire
    from downpour.net.receive import keep_receive_buffers
    from downpour.net.transport import make_context
    from downpour.server.state import ParameterState

    names, grads = _gradients()
    payload = sum(g.nbytes for g in grads)
    keep_receive_buffers(max(g.nbytes for g in grads), 4 * payload)  # as the server does
    state = ParameterState(load_spec(SPEC), "adam", 1e-3, seed=0)
    ctx = make_context(2)
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, 2 * payload)
    sock.setsockopt(zmq.RCVTIMEO, 60_000)
    # a short queue: libzmq's I/O thread receives while the first apply compiles, and pushes
    # received then would be taken in the timed windows without their receive
    sock.setsockopt(zmq.RCVHWM, 2)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    ready = Path(args.ready_file)
    ready.with_suffix(".tmp").write_text(json.dumps({"push_port": port}))
    ready.with_suffix(".tmp").replace(ready)  # whole, for the parent's wait_ready

    def take() -> None:
        msg = wire.decode(sock.recv_multipart(copy=False), wire.DEFAULT_LIMITS)
        staged, bad = state.stage(list(msg.tensors.values()))
        if bad is not None:
            raise ValueError(f"the bench's gradients are finite, not {bad}")
        state.apply(staged)

    for _ in range(args.warmup):  # the first apply compiles
        take()
    ms = []
    for _ in range(args.windows):
        wall0 = time.perf_counter()
        for _ in range(args.window_msgs):
            take()
        ms.append(1e3 * (time.perf_counter() - wall0) / args.window_msgs)
    sock.close()
    ctx.term()
    return {"ms_per_apply": median(ms), "windows_ms": ms}


def least_worker(args: argparse.Namespace) -> dict[str, Any]:
    """The least worker; see the module docstring."""
    import zmq
    from bench_e2e import batches

    from downpour import wire
    from downpour.model.build import fingerprint
    from downpour.net.client import ShardClient
    from downpour.net.transport import make_context, tcp
    from downpour.worker.step import GradientStep

    spec = load_spec(SPEC)
    data = load_mnist_5k()
    model = build_model(spec, seed=0)
    names = [v.path for v in model.trainable_variables]
    step = GradientStep(spec, model, data.x_train[:1], round_bf16=True)
    sender, server = "bench-least-worker", tcp("127.0.0.1", args.server_port)
    ctx = make_context()
    body = wire.HelloRequest(fingerprint(model.trainable_variables), spec.name)
    client = ShardClient(ctx, server, sender=sender, timeout_s=60.0)
    hello = client.hello(body)
    client.close()
    req = ctx.socket(zmq.REQ)
    push = ctx.socket(zmq.PUSH)
    for sock in (req, push):
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, 60_000)
        sock.setsockopt(zmq.SNDTIMEO, 60_000)
    req.connect(server)
    push.connect(tcp("127.0.0.1", hello.reply.push_port))
    held = {"version": -1, "incarnation": None, "seq": 0, "pulled": 0}

    def ask() -> None:
        have = held["version"] if held["version"] >= 0 else None
        body = wire.PullRequest(have, held["incarnation"], wire.BF16)
        req.send_multipart(wire.encode(wire.pull_request(sender, body)), copy=False)

    def take() -> None:
        msg = wire.decode(req.recv_multipart(copy=False), wire.DEFAULT_LIMITS)
        reply = wire.PullReply.from_body(msg.body)
        if reply.unchanged:
            return
        step.set_weights(step.prepare(list(msg.tensors.values())))
        held.update(version=msg.base_version, incarnation=reply.incarnation)
        held["pulled"] += 1

    it = batches(data, spec.batch_size, seed=0)

    def one() -> float:
        ask()  # a step ahead, as the worker's fetcher asks
        loss, grads = step(*next(it))
        held["seq"] += 1
        body = wire.PushBody(loss=loss, batch_size=spec.batch_size, steps=held["seq"])
        msg = wire.push_message(
            sender, held["seq"], held["version"], body, dict(zip(names, grads, strict=True))
        )
        push.send_multipart(wire.encode(msg), copy=False)
        take()
        return loss

    ask()
    take()  # the initial weights
    rates = _windows(one, args.warmup, args.window_steps, args.windows)
    steps = held["seq"]
    pulled = held["pulled"]
    req.close()
    push.close()
    ctx.term()
    return {
        "steps_per_s": median(rates),
        "windows": rates,
        "steps": steps,
        "pulls_with_weights": pulled,
        "grad_traces": step.traces,
    }


def main() -> None:
    """Command line: one mode, its options; one JSON line on stdout."""
    p = argparse.ArgumentParser(description=__doc__)
    modes = {
        "compute": compute,
        "bare-apply": bare_apply,
        "flood": flood,
        "receive": receive,
        "send": send,
        "least-worker": least_worker,
    }
    p.add_argument("mode", choices=list(modes))
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--window-steps", type=int, default=50)
    p.add_argument("--windows", type=int, default=3)
    p.add_argument("--fused-k", type=int, default=10)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--push-port", type=int, default=0)
    p.add_argument("--status-port", type=int, default=0)
    p.add_argument("--in-flight", type=int, default=16)
    p.add_argument("--warmup-s", type=float, default=2.0)
    p.add_argument("--window-s", type=float, default=2.0)
    p.add_argument("--count", type=int, default=100, help="send: pushes to send")
    p.add_argument("--window-msgs", type=int, default=20, help="receive: messages per window")
    p.add_argument("--ready-file", help="receive: where to write the bound port")
    p.add_argument("--server-port", type=int, default=0, help="least-worker: the server's")
    args = p.parse_args()
    result = modes[args.mode](args)
    result["cpus"] = sorted(os.sched_getaffinity(0))
    result["tf_threads"] = [
        tf.config.threading.get_intra_op_parallelism_threads(),
        tf.config.threading.get_inter_op_parallelism_threads(),
    ]
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
