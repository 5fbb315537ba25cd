"""``downpour server``: command-line options and start-up checks for the server service."""

from __future__ import annotations

import argparse
import logging

from shared.logs import setup_logging

log = logging.getLogger("downpour.server")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``downpour server``."""
    p.add_argument(
        "--model", default="shared.models:deep_mnist", help="module:function returning a ModelSpec"
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback)")
    p.add_argument(
        "--port", type=int, default=5570, help="REP port for hello and weights (0 = any)"
    )
    p.add_argument("--push-port", type=int, default=5571, help="PULL port for gradients (0 = any)")
    p.add_argument("--status-port", type=int, default=5572, help="REP port for status (0 = any)")
    p.add_argument("--optimizer", default="adam", choices=["adam", "adagrad", "sgd"])
    p.add_argument("--lr", type=float, default=1e-3, help="learning rate")
    p.add_argument("--seed", type=int, default=0, help="initialisation seed")
    p.add_argument("--ready-file", help="write bound ports as JSON here once serving")
    p.add_argument(
        "--missing-after",
        type=float,
        default=10.0,
        help="seconds of silence before a worker shows as missing",
    )
    p.add_argument(
        "--gone-after",
        type=float,
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
        "--checkpoint-every", type=int, default=500, help="updates between checkpoints (0 = off)"
    )
    p.add_argument(
        "--checkpoint-secs", type=float, default=60.0, help="seconds between checkpoints (0 = off)"
    )
    p.add_argument("--keep-checkpoints", type=int, default=3, help="how many checkpoints to keep")
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=10.0,
        help="on SIGTERM, seconds to apply gradients already received",
    )
    p.add_argument("--log-level", default="INFO")


def run(args: argparse.Namespace) -> int:
    """Check the options, build the server, serve until SIGTERM/SIGINT."""
    setup_logging("server", args.log_level)
    from shared.security import SecurityError, load_server_keys

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
    from services.server.service import Server, ServerConfig, is_loopback

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
    if args.keep_checkpoints < 1 or args.checkpoint_every < 0 or args.checkpoint_secs < 0:
        log.error("--keep-checkpoints must be >= 1, --checkpoint-every/-secs >= 0")
        return 2
    if not 0 < args.missing_after < args.gone_after:
        log.error("--missing-after must be > 0 and < --gone-after")
        return 2
    from shared.models import load_spec

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
    )
    try:
        server = Server(load_spec(args.model), config)
    except SecurityError as exc:  # e.g. the ZAP authenticator did not start
        log.error("refusing to start: %s", exc)
        return 2
    server.install_signal_handlers()
    server.run()
    return 0
