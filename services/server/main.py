"""``downpour server``: command-line options and start-up checks for the server service."""

from __future__ import annotations

import argparse
import logging

from downpour.config import PORT, at_least, non_negative, positive
from downpour.logs import setup_logging

log = logging.getLogger("downpour.server")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``downpour server``."""
    p.add_argument(
        "--model",
        default="downpour.models:deep_mnist",
        help="module:function returning a ModelSpec",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback)")
    p.add_argument(
        "--port", type=PORT, default=5570, help="REP port for hello and weights (0 = any)"
    )
    p.add_argument("--push-port", type=PORT, default=5571, help="PULL port for gradients (0 = any)")
    p.add_argument("--status-port", type=PORT, default=5572, help="REP port for status (0 = any)")
    p.add_argument("--optimizer", default="adam", choices=["adam", "adagrad", "sgd"])
    p.add_argument("--lr", type=positive(), default=1e-3, help="learning rate")
    p.add_argument("--seed", type=int, default=0, help="initialisation seed")
    p.add_argument(
        "--policy",
        type=policy_text,
        default="async",
        metavar="POLICY",
        help="what to do with stale gradients: async (apply each as it arrives), "
        "staleness-aware (learning rate / max(1, staleness)), bounded:K (drop staleness > K), "
        "sync:K/N (average the first K fresh gradients of N workers, apply once); see README, "
        "Staleness policies and compression",
    )
    shards = p.add_argument_group("shards (see README, Running on several machines)")
    shards.add_argument(
        "--num-shards",
        type=at_least(1),
        default=1,
        help="servers the model is partitioned over; start one server per shard",
    )
    shards.add_argument(
        "--shard", type=at_least(0), default=0, help="this server's shard index, 0..NUM_SHARDS-1"
    )
    shards.add_argument(
        "--show-partition",
        action="store_true",
        help="print which variables (and row ranges) each shard holds, then exit",
    )
    p.add_argument("--ready-file", help="write bound ports as JSON here once serving")
    p.add_argument(
        "--missing-after",
        type=positive(),
        default=10.0,
        help="seconds of silence before a worker shows as missing",
    )
    p.add_argument(
        "--gone-after",
        type=positive(),
        default=60.0,
        help="seconds of silence before a worker shows as gone",
    )
    p.add_argument(
        "--allow-nonfinite",
        action="store_true",
        help="apply gradients with NaN/Inf (default: reject)",
    )
    p.add_argument(
        "--insecure",
        action="store_true",
        help="allow binding a non-loopback address without authentication",
    )
    p.add_argument(
        "--keys",
        metavar="DIR",
        help="CURVE keys (from `downpour keygen DIR`): server.key_secret, workers/*.key and "
        "readers/*.key; every socket then encrypts and admits only listed keys",
    )
    p.add_argument(
        "--key",
        metavar="FILE",
        help="the server's secret key file, if not DIR/server.key_secret (e.g. a credential)",
    )
    p.add_argument("--state-dir", help="directory for checkpoints; the newest is restored at start")
    p.add_argument(
        "--checkpoint-every",
        type=at_least(0),
        default=500,
        help="updates between checkpoints (0 = off)",
    )
    p.add_argument(
        "--checkpoint-secs",
        type=non_negative(),
        default=60.0,
        help="seconds between checkpoints (0 = off)",
    )
    p.add_argument(
        "--keep-checkpoints", type=at_least(1), default=3, help="how many checkpoints to keep"
    )
    p.add_argument(
        "--drain-timeout",
        type=non_negative(),
        default=10.0,
        help="on SIGTERM, seconds to apply gradients already received",
    )
    obs = p.add_argument_group("observability (see README, Observability)")
    obs.add_argument(
        "--metrics-port",
        type=PORT,
        metavar="PORT",
        help="serve Prometheus metrics on http://METRICS_HOST:PORT/metrics (0 = any port)",
    )
    obs.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        help="address for --metrics-port (plain HTTP, no authentication; default loopback)",
    )
    obs.add_argument("--logdir", metavar="DIR", help="write TensorBoard scalars here")
    obs.add_argument(
        "--summary-secs", type=positive(), default=5.0, help="seconds between TensorBoard points"
    )
    obs.add_argument(
        "--eval-every",
        type=at_least(0),
        default=0,
        metavar="N",
        help="evaluate the held-out set every N updates, off the apply loop (0 = off)",
    )
    obs.add_argument("--data-dir", help="the held-out set for --eval-every: the model's --data-dir")
    obs.add_argument("--log-format", choices=["text", "json"], default="text")
    p.add_argument("--log-level", default="INFO")


def policy_text(text: str) -> str:
    """argparse type of --policy: the canonical text of a valid policy, or a clear error."""
    from downpour.server.policies import parse_policy  # pure Python: no TensorFlow import

    try:
        return parse_policy(text).spec
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def show_partition(model_ref: str, num_shards: int) -> int:
    """Print the partition of the model over ``num_shards`` shards (``--show-partition``)."""
    from downpour.models import build_model, fingerprint
    from downpour.partition import make_partition
    from downpour.spec import load_spec

    variables = build_model(load_spec(model_ref)).trainable_variables
    try:
        part = make_partition(
            [v.path for v in variables],
            [tuple(int(d) for d in v.shape) for v in variables],
            [str(v.dtype) for v in variables],
            num_shards,
            fingerprint(variables),
        )
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    print(part.describe(), flush=True)
    return 0


def run(args: argparse.Namespace) -> int:
    """Check the options, build the server, serve until SIGTERM/SIGINT."""
    setup_logging("server", args.log_level, args.log_format)
    if args.shard >= args.num_shards:
        log.error(
            "--shard must be in 0..%d for --num-shards %d", args.num_shards - 1, args.num_shards
        )
        return 2
    if args.show_partition:
        return show_partition(args.model, args.num_shards)
    if args.num_shards > 1 and args.eval_every:
        log.error("--eval-every needs the whole model; a shard (--num-shards > 1) holds part of it")
        return 2
    from downpour.security import SecurityError, load_server_keys

    keys = None
    if args.key and not args.keys:
        log.error("--key needs --keys DIR (the allow-lists)")
        return 2
    if args.keys:  # before TensorFlow is imported: bad keys fail at once
        try:
            keys = load_server_keys(args.keys, args.key)
        except SecurityError as exc:
            log.error("refusing to start: %s", exc)
            return 2
    from downpour.server.service import Server, ServerConfig, is_loopback

    if keys is None and not is_loopback(args.host) and not args.insecure:
        log.error(
            "refusing to bind %s without authentication: anyone who reaches the port "
            "can change the model. Pass --keys DIR (see `downpour keygen`), or --insecure "
            "to do it anyway.",
            args.host,
        )
        return 2
    if keys is None and not is_loopback(args.host):
        log.warning("serving %s WITHOUT authentication (--insecure)", args.host)
    elif keys is None:
        log.warning(
            "no --keys: serving %s without authentication or encryption; any local process "
            "can push gradients",
            args.host,
        )
    if not 0 < args.missing_after < args.gone_after:
        log.error("--missing-after must be > 0 and < --gone-after")
        return 2
    if args.eval_every < 0 or args.summary_secs <= 0:
        log.error("--eval-every must be >= 0 and --summary-secs > 0")
        return 2
    if args.metrics_port is not None and not is_loopback(args.metrics_host):
        log.warning(
            "serving Prometheus metrics on %s without authentication: anyone who reaches "
            "the port can read worker names, losses and rates",
            args.metrics_host,
        )
    from downpour.spec import load_spec

    config = ServerConfig(
        host=args.host,
        port=args.port,
        push_port=args.push_port,
        status_port=args.status_port,
        optimizer=args.optimizer,
        learning_rate=args.lr,
        seed=args.seed,
        ready_file=args.ready_file,
        missing_after_s=args.missing_after,
        gone_after_s=args.gone_after,
        allow_nonfinite=args.allow_nonfinite,
        keys=keys,
        state_dir=args.state_dir,
        checkpoint_every=args.checkpoint_every,
        checkpoint_secs=args.checkpoint_secs,
        keep_checkpoints=args.keep_checkpoints,
        drain_timeout_s=args.drain_timeout,
        eval_every=args.eval_every,
        data_dir=args.data_dir,
        logdir=args.logdir,
        summary_interval_s=args.summary_secs,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        shard=args.shard,
        num_shards=args.num_shards,
        model_ref=args.model,
        policy=args.policy,
    )
    try:
        server = Server(load_spec(args.model), config)
    except SecurityError as exc:  # e.g. the ZAP authenticator did not start
        log.error("refusing to start: %s", exc)
        return 2
    except (OSError, ValueError) as exc:  # e.g. --metrics-port in use, too many shards
        log.error("cannot start: %s", exc)
        return 2
    server.install_signal_handlers()
    server.run()
    return 0
