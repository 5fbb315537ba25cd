"""The ``downpour`` command: one entry point, a subcommand per service or tool.

Heavy imports (TensorFlow) happen inside the subcommands that need them, so
``downpour status`` and ``downpour --help`` answer at once.
"""

from __future__ import annotations

import argparse
import sys

from services.server import main as server_main
from services.worker import main as worker_main


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand."""
    parser = argparse.ArgumentParser(
        prog="downpour", description="Asynchronous Downpour-SGD parameter server for TensorFlow."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    server_main.add_arguments(sub.add_parser("server", help="run a parameter server"))
    worker_main.add_arguments(sub.add_parser("worker", help="run a training worker"))

    st = sub.add_parser("status", help="show a server's status")
    st.add_argument(
        "endpoints", nargs="+", help="status endpoint(s): tcp://host:port, host:port or port"
    )
    st.add_argument("--json", action="store_true", help="machine-readable output")
    st.add_argument("--watch", type=float, metavar="SECONDS", help="refresh every SECONDS")
    st.add_argument("--timeout", type=float, default=5.0)

    from services import local

    local.add_arguments(
        sub.add_parser("run-local", help="demo: a server and workers on this machine")
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``downpour`` console script."""
    args = build_parser().parse_args(argv)
    if args.command == "server":
        return server_main.run(args)
    if args.command == "worker":
        return worker_main.run(args)
    if args.command == "status":
        from services import status

        return status.main(args.endpoints, args.json, args.watch, args.timeout)
    if args.command == "run-local":
        from services import local

        return local.run(args)
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
