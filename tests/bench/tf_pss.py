"""TensorFlow's own parameter server, as the baseline: one process per task on 127.0.0.1.

``tf_pss.py ps|worker --cluster JSON`` runs a ``tf.distribute.Server`` for that task until it
is terminated (it prints "started" once serving). ``tf_pss.py chief --cluster JSON ...`` is the
coordinator: a ``ParameterServerStrategy`` with a ``ClusterCoordinator`` training the
Deep-MNIST CNN with Adam (1e-3), batch 50, on MNIST-5k, the same model, optimizer and data
as the downpour runs. It prints one JSON line: steps/s per timed window and their median.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402


def serve(cluster: dict[str, list[str]], role: str) -> None:
    """Run the gRPC server of task ``role``:0 until the process is terminated."""
    server = tf.distribute.Server(
        tf.train.ClusterSpec(cluster), job_name=role, task_index=0, protocol="grpc", start=True
    )
    print("started", role, flush=True)
    server.join()


def coordinate(cluster: dict[str, list[str]], warmup: int, window_steps: int, windows: int) -> None:
    """Train through the strategy and print {"steps_per_s", "windows", "loss"} as JSON."""
    import keras

    from downpour.data import load_mnist_5k
    from downpour.models import build_model
    from downpour.spec import load_spec

    spec = load_spec("downpour.models:deep_mnist")
    data = load_mnist_5k()
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(cluster), task_type="chief", task_id=0, rpc_layer="grpc"
    )
    strategy = tf.distribute.ParameterServerStrategy(resolver)
    with strategy.scope():
        model = build_model(spec, seed=0)
        optimizer = keras.optimizers.Adam(1e-3)
        optimizer.build(model.trainable_variables)
    devices = sorted({str(v.value.device) for v in model.trainable_variables})

    def dataset_fn() -> tf.data.Dataset:
        ds = tf.data.Dataset.from_tensor_slices((data.x_train, data.y_train))
        ds = ds.shuffle(len(data.x_train), seed=0).repeat()
        return ds.batch(spec.batch_size, drop_remainder=True).prefetch(2)

    @tf.function
    def worker_fn(iterator: Any) -> Any:
        def replica_fn(x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
            with tf.GradientTape() as tape:
                loss = spec.loss(y, model(x, training=True))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
            return loss

        x, y = next(iterator)
        return strategy.run(replica_fn, args=(x, y))

    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))
    for _ in range(warmup):
        coordinator.schedule(worker_fn, args=(iterator,))
    coordinator.join()
    rates = []
    loss = None
    for _ in range(windows):
        t0 = time.perf_counter()
        for _ in range(window_steps):
            loss = coordinator.schedule(worker_fn, args=(iterator,))
        coordinator.join()
        rates.append(window_steps / (time.perf_counter() - t0))
    result = {
        "steps_per_s": statistics.median(rates),
        "windows": rates,
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
    args = p.parse_args()
    cluster = json.loads(args.cluster)
    if args.role == "chief":
        coordinate(cluster, args.warmup, args.window_steps, args.windows)
    else:
        serve(cluster, args.role)


if __name__ == "__main__":
    main()
