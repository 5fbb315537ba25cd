"""TensorFlow's own parameter server, as the baseline: one process per task on 127.0.0.1.

``tf_pss.py ps|worker --cluster JSON`` runs a ``tf.distribute.Server`` for that task until it
is terminated (it prints "started" once serving). ``tf_pss.py chief --cluster JSON ...`` is the
coordinator: a ``ParameterServerStrategy`` with a ``ClusterCoordinator`` training the
Deep-MNIST CNN with Adam (1e-3), batch 50, on MNIST-5k, the same model, optimizer and data
as the downpour runs (Keras 3's Adam or the fused kernel, 1 or more steps per ``schedule``).
It prints one JSON line: steps/s per timed window and their median, per variant.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# A task's inter-op pool runs blocking ops (receives from the PS, the iterator's GetNext):
# with a single thread, as a one-core host would pick, the cluster deadlocks. Pinned tasks
# keep their intra-op pool at the core count and get at least this many inter-op threads.
MIN_INTEROP_THREADS = 4
if os.environ.get("TF_NUM_INTEROP_THREADS"):
    os.environ["TF_NUM_INTEROP_THREADS"] = str(
        max(int(os.environ["TF_NUM_INTEROP_THREADS"]), MIN_INTEROP_THREADS)
    )

sys.path.insert(0, str(Path(__file__).resolve().parent))  # fused_adam

import tensorflow as tf  # noqa: E402

for _var, _set in (  # thread pools sized to the cores the bench pinned this task to
    ("TF_NUM_INTRAOP_THREADS", tf.config.threading.set_intra_op_parallelism_threads),
    ("TF_NUM_INTEROP_THREADS", tf.config.threading.set_inter_op_parallelism_threads),
):
    if os.environ.get(_var):
        _set(int(os.environ[_var]))


def serve(cluster: dict[str, list[str]], role: str) -> None:
    """Run the gRPC server of task ``role``:0 until the process is terminated."""
    server = tf.distribute.Server(
        tf.train.ClusterSpec(cluster), job_name=role, task_index=0, protocol="grpc", start=True
    )
    print("started", role, flush=True)
    server.join()


def coordinate(
    cluster: dict[str, list[str]],
    warmup: int,
    window_steps: int,
    windows: int,
    variants: list[tuple[str, int]],
) -> None:
    """Train through the strategy and print {"steps_per_s", "windows", "loss", ...} as JSON.

    ``variants``: (optimizer, steps per ``schedule``) pairs, measured in alternating windows
    on the same model; optimizer "keras" is Keras 3's Adam, "fused" TensorFlow's fused
    ``ResourceApplyAdam`` (the op of ``tf.compat.v1.train.AdamOptimizer``, run on the PS).
    ``steps_per_s`` is the fastest variant's median; each variant's is kept under "variants".
    """
    import keras
    from fused_adam import FusedAdam

    from downpour.inputs.data import load_mnist_5k
    from downpour.model.build import build_model
    from downpour.spec import load_spec

    spec = load_spec("downpour.models:deep_mnist")
    data = load_mnist_5k()
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(cluster), task_type="chief", task_id=0, rpc_layer="grpc"
    )
    strategy = tf.distribute.ParameterServerStrategy(resolver)
    optimizers = {opt for opt, _ in variants}
    with strategy.scope():
        model = build_model(spec, seed=0)
        variables = model.trainable_variables
        optimizer = keras.optimizers.Adam(1e-3)
        if "keras" in optimizers:
            optimizer.build(variables)
        fused = FusedAdam(variables) if "fused" in optimizers else None
    devices = sorted({str(v.value.device) for v in variables})

    def dataset_fn() -> tf.data.Dataset:
        ds = tf.data.Dataset.from_tensor_slices((data.x_train, data.y_train))
        ds = ds.shuffle(len(data.x_train), seed=0).repeat()
        return ds.batch(spec.batch_size, drop_remainder=True).prefetch(2)

    def make_worker_fn(opt: str, steps: int) -> Any:
        def replica_fn(x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
            with tf.GradientTape() as tape:
                loss = spec.loss(y, model(x, training=True))
            grads = tape.gradient(loss, variables)
            if opt == "fused":
                fused.apply(grads)
            else:
                optimizer.apply_gradients(zip(grads, variables, strict=True))
            return loss

        @tf.function
        def worker_fn(iterator: Any) -> Any:
            loss = tf.constant(0.0)
            for _ in tf.range(steps):  # several steps per schedule, as TF's tutorial advises
                x, y = next(iterator)
                loss = strategy.run(replica_fn, args=(x, y))
            return loss

        return worker_fn

    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))
    fns = {(opt, k): make_worker_fn(opt, k) for opt, k in variants}
    rates: dict[str, list[float]] = {f"{opt}:{k}": [] for opt, k in variants}
    loss = None
    for (_opt, k), fn in fns.items():  # warm-up: trace each function, fill the pipelines
        for _ in range(max(1, warmup // k)):
            coordinator.schedule(fn, args=(iterator,))
        coordinator.join()
    for _ in range(windows):
        for (opt, k), fn in fns.items():
            calls = max(1, window_steps // k)
            t0 = time.perf_counter()
            for _ in range(calls):
                loss = coordinator.schedule(fn, args=(iterator,))
            coordinator.join()
            rates[f"{opt}:{k}"].append(calls * k / (time.perf_counter() - t0))
    medians = {name: statistics.median(r) for name, r in rates.items()}
    best = max(medians, key=medians.__getitem__)
    result = {
        "steps_per_s": medians[best],
        "best": best,
        "variants": medians,
        "windows": rates[best],
        "loss": float(loss.fetch()) if loss is not None else None,
        "variable_devices": devices,
    }
    print(json.dumps(result), flush=True)


def main() -> None:
    """Command line: ps | worker | chief."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("role", choices=["ps", "worker", "chief"])
    p.add_argument("--cluster", required=True, help="cluster spec as JSON")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--window-steps", type=int, default=50)
    p.add_argument("--windows", type=int, default=3)
    p.add_argument(
        "--variants",
        default="keras:1",
        help="comma-separated optimizer:steps_per_schedule pairs (optimizer keras or fused)",
    )
    args = p.parse_args()
    cluster = json.loads(args.cluster)
    if args.role == "chief":
        variants = [(v.split(":")[0], int(v.split(":")[1])) for v in args.variants.split(",")]
        coordinate(cluster, args.warmup, args.window_steps, args.windows, variants)
    else:
        serve(cluster, args.role)


if __name__ == "__main__":
    main()
