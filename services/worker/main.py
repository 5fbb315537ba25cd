"""``downpour worker``: command-line options for the worker service."""

from __future__ import annotations

import argparse
import json
import logging

from downpour.config import PORT, at_least, positive
from downpour.logs import setup_logging

log = logging.getLogger("downpour.worker")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``downpour worker``."""
    p.add_argument(
        "--server",
        type=endpoint_list,
        default="127.0.0.1:5570",
        help="HOST:PORT of the server's REP port; with shards, every shard's, comma-separated "
        "in shard order (HOST0:PORT0,HOST1:PORT1,...)",
    )
    p.add_argument("--id", default="", help="worker id (default hostname-pid)")
    p.add_argument(
        "--model",
        default="downpour.models:deep_mnist",
        help="module:function returning a ModelSpec",
    )
    p.add_argument(
        "--graph",
        choices=GRAPHS,
        default="tf2",
        help="tf2: a compiled tf.function; tf1: the model's tf.compat.v1 graph in a Session, "
        "loss and all gradients in one sess.run (the spec's tf1_graph)",
    )
    p.add_argument(
        "--data-dir",
        help="directory with the standard MNIST IDX files (default: embedded MNIST-5k)",
    )
    p.add_argument("--steps", type=at_least(1), help="steps to train (overrides --epochs)")
    p.add_argument("--epochs", type=positive(), default=1.0, help="passes over the training set")
    p.add_argument("--n-fetch", type=at_least(1), default=1, help="pull weights every N steps")
    p.add_argument(
        "--n-push", type=at_least(1), default=1, help="push gradients every N steps (averaged)"
    )
    p.add_argument("--seed", type=int, help="data-order seed (default from the worker id)")
    p.add_argument(
        "--compress",
        type=compression_text,
        default="none",
        metavar="MODE",
        help="gradient compression: none, bf16 (half the bytes) or topk:RATIO (the largest "
        "RATIO of each gradient's entries, the rest carried to the next push: error feedback)",
    )
    p.add_argument(
        "--pull-compress",
        choices=PULL_COMPRESSIONS,
        default="none",
        help="bf16: ask for the weights in bfloat16 (half the bytes of every pull; the server "
        "keeps and updates float32, the worker computes at the rounded weights, as mixed "
        "precision training does)",
    )
    p.add_argument(
        "--sync-wait",
        type=positive(),
        default=5.0,
        help="with a sync:K/N server: longest wait, in seconds, for the next version after a "
        "push (a second gradient from the same weights would be dropped)",
    )
    p.add_argument(
        "--request-timeout", type=positive(), default=10.0, help="seconds to wait for one reply"
    )
    p.add_argument(
        "--server-timeout",
        type=positive(),
        default=120.0,
        help="give up after the server is away this long",
    )
    p.add_argument(
        "--push-timeout",
        type=positive(),
        default=1.0,
        help="send timeout of one push at the high-water mark",
    )
    p.add_argument(
        "--push-endpoint",
        type=endpoint,
        metavar="HOST:PORT",
        help="send gradients here instead of the port the server announces (NAT, port "
        "mappings, proxies)",
    )
    p.add_argument(
        "--no-prefetch",
        dest="prefetch",
        action="store_false",
        help="pull weights synchronously instead of overlapping the pull with computation",
    )
    p.add_argument(
        "--heartbeat", type=positive(), default=2.0, help="seconds of silence before a heartbeat"
    )
    p.add_argument(
        "--key",
        metavar="FILE",
        help="this worker's CURVE secret key (clients/NAME.key_secret from downpour keygen); "
        "the default --id is its NAME",
    )
    p.add_argument(
        "--server-key", metavar="FILE", help="the server's CURVE public key (server.key)"
    )
    p.add_argument("--log-every", type=at_least(0), default=50, help="steps between log lines")
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--log-format", choices=["text", "json"], default="text")


PULL_COMPRESSIONS = ("none", "bf16")  # --pull-compress
GRAPHS = ("tf2", "tf1")  # --graph


def compression_text(text: str) -> str:
    """argparse type of --compress: the canonical text of a valid mode, or a clear error."""
    from downpour.worker.compress import parse_compression  # NumPy only: no TensorFlow

    try:
        return parse_compression(text).spec
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_server(s: str) -> tuple[str, int]:
    """HOST:PORT (or tcp://HOST:PORT, [v6]:PORT) -> (host, port)."""
    s = s.removeprefix("tcp://")
    host, sep, port = s.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"--server must be HOST:PORT, got {s!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


def endpoint(s: str) -> str:
    """argparse type of --server and --push-endpoint: HOST:PORT with a port in 0..65535."""
    try:
        PORT(parse_server(s)[1])
    except (ValueError, argparse.ArgumentTypeError):
        raise argparse.ArgumentTypeError(
            f"{s!r} is not HOST:PORT with a port in 0..65535"
        ) from None
    return s


def endpoint_list(s: str) -> str:
    """argparse type of --server: one HOST:PORT or a comma-separated list of them."""
    for part in s.split(","):
        endpoint(part.strip())
    return s


def parse_servers(s: str) -> tuple[tuple[str, int], ...]:
    """``--server`` -> ((host, port), ...) in shard order."""
    return tuple(parse_server(part.strip()) for part in s.split(","))


def run(args: argparse.Namespace) -> int:
    """Build the worker, train, print a one-line JSON summary on stdout."""
    setup_logging("worker", args.log_level, args.log_format)
    from downpour.security import SecurityError, client_keys_from_args, may_speak_as

    try:  # before TensorFlow is imported: bad keys fail at once
        keys = client_keys_from_args(args.key, args.server_key)
    except SecurityError as exc:
        log.error("refusing to start: %s", exc)
        return 2
    if keys is not None and not args.id:
        args.id = keys.keypair.name  # the server binds pushes to the key's name
    elif keys is not None and not may_speak_as(keys.keypair.name, args.id):
        log.warning(
            "--id %s is neither the key's name %s nor NAME/INSTANCE: the server refuses a "
            "worker id that is not the name its key is listed under",
            args.id,
            keys.keypair.name,
        )
    from downpour.spec import load_spec
    from downpour.worker.service import Worker, WorkerConfig, WorkerError

    servers = parse_servers(args.server)
    config = WorkerConfig(
        host=servers[0][0],
        port=servers[0][1],
        servers=servers,
        worker_id=args.id,
        steps=args.steps,
        epochs=args.epochs,
        n_fetch=args.n_fetch,
        n_push=args.n_push,
        seed=args.seed,
        request_timeout_s=args.request_timeout,
        server_timeout_s=args.server_timeout,
        push_timeout_s=args.push_timeout,
        push_endpoint=parse_server(args.push_endpoint) if args.push_endpoint else None,
        prefetch=args.prefetch,
        heartbeat_s=args.heartbeat,
        log_every=args.log_every,
        keys=keys,
        compress=args.compress,
        pull_compress=args.pull_compress,
        sync_wait_s=args.sync_wait,
        graph=args.graph,
    )
    spec = load_spec(args.model)
    try:
        worker = Worker(spec, config, spec.load_data(args.data_dir))
    except (WorkerError, ValueError) as exc:  # e.g. more shards than the model can be split into
        log.error("%s", exc)
        return 2
    worker.install_signal_handlers()
    try:
        summary = worker.run()
    except WorkerError as exc:
        log.error("%s", exc)
        return 3
    finally:
        worker.close()
    log.info(
        "worker %s done: %d steps in %.1f s (%.2f steps/s), %d pushes, last loss %.4f",
        summary["worker"],
        summary["steps"],
        summary["seconds"],
        summary["steps_per_s"],
        summary["pushes"],
        summary["loss"],
    )
    print(json.dumps({"summary": summary}), flush=True)
    return 0
