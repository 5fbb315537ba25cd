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
    p.add_argument("--log-level", default="INFO")


def run(args: argparse.Namespace) -> int:
    """Check the options, build the server, serve until SIGTERM/SIGINT."""
    setup_logging("server", args.log_level)
    from services.server.service import Server, ServerConfig, is_loopback

    if not is_loopback(args.host) and not args.insecure:
        log.error(
            "refusing to bind %s without authentication: anyone who reaches the port "
            "can change the model. Pass --insecure to do it anyway.",
            args.host,
        )
        return 2
    if not is_loopback(args.host):
        log.warning("serving %s WITHOUT authentication (--insecure)", args.host)
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
    )
    server = Server(load_spec(args.model), config)
    server.install_signal_handlers()
    server.run()
    return 0
