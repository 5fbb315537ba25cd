"""The ``downpour`` command: one entry point, a subcommand per service or tool.

Heavy imports (TensorFlow) happen inside the subcommands that need them, so
``downpour status`` and ``downpour --help`` answer at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from downpour.config import loading
from downpour.config.settings import KEY, SERVER_KEY, add_options
from downpour.server import main as server_main
from downpour.worker import main as worker_main

# The configurable services: settings from defaults < --config FILE < DOWNPOUR_* < flags.
SERVICES = {"server": server_main, "worker": worker_main}


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand."""
    parser = argparse.ArgumentParser(
        prog="downpour", description="Asynchronous Downpour-SGD parameter server for TensorFlow."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (
        ("server", "run a parameter server"),
        ("worker", "run a training worker"),
    ):
        p = sub.add_parser(name, help=help_text)
        add_options(p, SERVICES[name].OPTIONS)
        loading.add_config_option(p)
    _add_config(sub)
    _add_status(sub)
    _add_keygen(sub)
    _add_tools(sub)
    return parser


_Subcommands = argparse._SubParsersAction  # what add_subparsers returns


def _add_config(sub: _Subcommands) -> None:
    """``downpour config show``."""
    cfg = sub.add_parser("config", help="show a service's effective settings and their sources")
    show = cfg.add_subparsers(dest="config_command", required=True).add_parser(
        "show",
        help="print the effective settings of a service and where each value came from",
        usage="downpour config show [--json] {server,worker} [--config FILE] [SERVICE FLAGS...]",
    )
    show.add_argument("--json", action="store_true", help="machine-readable output")
    show.add_argument("service", choices=sorted(SERVICES))
    show.add_argument(
        "flags", nargs=argparse.REMAINDER, help="--config FILE and flags, as the service takes them"
    )


def _add_status(sub: _Subcommands) -> None:
    """``downpour status``."""
    st = sub.add_parser("status", help="show a server's status")
    st.add_argument(
        "endpoints", nargs="+", help="status endpoint(s): tcp://host:port, host:port or port"
    )
    st.add_argument("--json", action="store_true", help="machine-readable output")
    st.add_argument("--watch", type=float, metavar="SECONDS", help="refresh every SECONDS")
    st.add_argument("--count", type=int, metavar="N", help="with --watch: stop after N refreshes")
    st.add_argument("--timeout", type=float, default=5.0)
    own_key = dataclasses.replace(KEY, help="own CURVE secret key (a reader's or worker's)")
    add_options(st, (own_key, SERVER_KEY))


def _add_keygen(sub: _Subcommands) -> None:
    """``downpour keygen``."""
    kg = sub.add_parser("keygen", help="create CURVE key pairs for a server, workers, readers")
    kg.add_argument("dir", help="key directory (created; existing keys are never overwritten)")
    names = kg.add_mutually_exclusive_group()
    names.add_argument("--workers", type=int, default=2, help="worker-0 .. worker-N-1")
    names.add_argument("--names", help="comma-separated worker names instead of --workers")
    kg.add_argument(
        "--readers", default="status", help="comma-separated status-reader names ('' = none)"
    )


def _add_tools(sub: _Subcommands) -> None:
    """``downpour job``, ``run-local``, ``plot``, ``export`` and ``data``, whose modules add
    their own options."""
    from downpour.cli import job, local

    job.add_arguments(
        sub.add_parser(
            "job",
            help="run this task's role of a TF_CONFIG cluster (Kubeflow, JobSet, Volcano)",
            description=job.DESCRIPTION,
        )
    )
    local.add_arguments(
        sub.add_parser("run-local", help="demo: a server and workers on this machine")
    )
    pl = sub.add_parser("plot", help="PNG plots of a run directory (history.csv, status.json)")
    pl.add_argument("run_dir", metavar="RUN_DIR", help="a run directory written by run-local")

    from downpour.cli import export

    export.add_arguments(
        sub.add_parser(
            "export", help="write the newest checkpoint as a .keras file or a SavedModel"
        )
    )
    from downpour.cli import data

    data.add_arguments(
        sub.add_parser(
            "data",
            help="write the shipped data, or the synthetic click log, as TFRecord or CSV "
            "shards (docs/data.md)",
            description="Write MNIST-5k or scikit-learn's digits as TFRecord or CSV shards, "
            "train and held-out, for input_fn pipelines (downpour.examples.mnist_tfrecord, "
            "downpour.examples.digits_csv), or the generated click log of "
            "downpour.examples.recsys (clicks).",
        )
    )


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``downpour`` console script."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's C++ start-up chatter
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["job"]:  # its flags are the role's service's: its own parser passes them on
        from downpour.cli import job

        return job.main(argv[1:])
    args = build_parser().parse_args(argv)
    if args.command in SERVICES:  # the top-level parser has no options: argv[0] is the command
        return run_service(args.command, argv[argv.index(args.command) + 1 :])
    if args.command == "config":
        return config_show(args.service, args.flags, args.json)
    if args.command == "status":
        from downpour.cli import status
        from downpour.net.security import SecurityError, client_keys_from_args

        try:
            keys = client_keys_from_args(args.key, args.server_key)
        except SecurityError as exc:
            print(f"downpour status: {exc}", file=sys.stderr)
            return 2
        return status.main(args.endpoints, args.json, args.watch, args.timeout, keys, args.count)
    if args.command == "keygen":
        return keygen(args)
    if args.command == "run-local":
        from downpour.cli import local

        return local.run(args)
    if args.command == "plot":
        from downpour.cli.plot import main as plot_main

        return plot_main(args.run_dir)
    if args.command == "export":
        from downpour.cli import export

        return export.main(args)
    if args.command == "data":
        from downpour.cli import data

        return data.main(args)
    raise AssertionError(args.command)


def run_service(name: str, argv: list[str]) -> int:
    """Resolve the service's settings (defaults, file, environment, flags), then run it."""
    try:
        settings = loading.load(name, SERVICES[name].OPTIONS, argv, os.environ, SERVICES)
    except loading.ConfigError as exc:
        print(f"downpour {name}: error: {exc}", file=sys.stderr)
        return 2
    return SERVICES[name].start(settings.values())


def config_show(name: str, argv: list[str], as_json: bool) -> int:
    """``downpour config show``: the effective settings of a service and their sources."""
    try:
        settings = loading.load(name, SERVICES[name].OPTIONS, argv, os.environ, SERVICES)
    except loading.ConfigError as exc:
        print(f"downpour config show: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(settings.as_dict(), indent=2) if as_json else settings.render())
    return 0


def keygen(args: argparse.Namespace) -> int:
    """``downpour keygen DIR``: print the files created, or why nothing was."""
    from downpour.net.security import SecurityError, generate_keys

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
