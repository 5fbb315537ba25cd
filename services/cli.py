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
    st.add_argument("--key", metavar="FILE", help="own CURVE secret key (a reader's or worker's)")
    st.add_argument("--server-key", metavar="FILE", help="the server's CURVE public key")

    kg = sub.add_parser("keygen", help="create CURVE key pairs for a server, workers, readers")
    kg.add_argument("dir", help="key directory (created; existing keys are never overwritten)")
    names = kg.add_mutually_exclusive_group()
    names.add_argument("--workers", type=int, default=2, help="worker-0 .. worker-N-1")
    names.add_argument("--names", help="comma-separated worker names instead of --workers")
    kg.add_argument(
        "--readers", default="status", help="comma-separated status-reader names ('' = none)"
    )

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
        from shared.security import SecurityError, client_keys_from_args

        try:
            keys = client_keys_from_args(args.key, args.server_key)
        except SecurityError as exc:
            print(f"downpour status: {exc}", file=sys.stderr)
            return 2
        return status.main(args.endpoints, args.json, args.watch, args.timeout, keys)
    if args.command == "keygen":
        return keygen(args)
    if args.command == "run-local":
        from services import local

        return local.run(args)
    raise AssertionError(args.command)


def keygen(args: argparse.Namespace) -> int:
    """``downpour keygen DIR``: print the files created, or why nothing was."""
    from shared.security import SecurityError, generate_keys

    workers = (
        [n.strip() for n in args.names.split(",") if n.strip()]
        if args.names is not None
        else [f"worker-{i}" for i in range(args.workers)]
    )
    readers = [n.strip() for n in args.readers.split(",") if n.strip()]
    try:
        created = generate_keys(args.dir, workers, readers)
    except (SecurityError, OSError) as exc:
        print(f"downpour keygen: {exc}", file=sys.stderr)
        return 2
    for path in created:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
