"""``downpour job``: run this task's role of a ``TF_CONFIG`` cluster (Kubeflow TFJob, JobSet,
Volcano), the same command in every replica.

``TF_CONFIG``'s task picks the role (``downpour.config.tf_config``): a ``ps`` task runs
``downpour server``, a ``worker`` task ``downpour worker``, both taking shard, ports, worker
index and the ps list from ``TF_CONFIG``; a ``chief`` (or ``master``) task runs the job's
coordinator and an ``evaluator`` the side-car (``downpour.cli.job.chief``). Besides ``--model``
and ``--state-dir``, the flags are the role's service's own, and as with the service they
override ``TF_CONFIG`` (as ``DOWNPOUR_*`` variables and ``--config`` file settings do).

What ``downpour job`` adds on a ps task: ``--job-workers len(worker)``, so the server ends
when every worker has finished, and ``--state-dir ROOT/shard-I`` for ``--state-dir ROOT``
(a volume every ps task mounts; ``downpour export --state-dir ROOT/shard-0 --state-dir
ROOT/shard-1 ...`` reads it). A ``--job-workers`` flag given wins. Workers do not use
``--state-dir``; the chief and the evaluator get ``--state-dir ROOT`` as given.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from downpour.config.settings import MODEL, ConfigError, Option
from downpour.config.tf_config import TF_CONFIG_ENV, TFConfig, from_environ
from downpour.server.settings import SERVER_OPTIONS

log = logging.getLogger("downpour.job")
JOB_WORKERS = "job_workers"  # the server setting that ends it once that many workers finished

DESCRIPTION = (
    "Run this task's role of the TF_CONFIG cluster: ps task I -> downpour server (shard I of "
    "len(ps), ports P, P+1, P+2 of ps[I]'s HOST:P), worker task I -> downpour worker (worker "
    "I of len(worker), --server = the ps list), chief/master -> the job's coordinator, "
    "evaluator -> the side-car. Flags other than --model and --state-dir go to the role's "
    "service and override TF_CONFIG; a ps task also gets --job-workers len(worker). "
    "Exit 2 when TF_CONFIG is unset, malformed or inconsistent (see docs: configuration.md)."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``downpour job`` itself; every other flag goes to the role's service."""
    p.add_argument("--model", required=True, help=f"{MODEL.help} (every role)")
    p.add_argument(
        "--state-dir",
        metavar="ROOT",
        help="the job's state on a shared volume: ps task I keeps its checkpoints in "
        "ROOT/shard-I; the chief and the evaluator get ROOT; workers do not use it",
    )


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``downpour job``'s own options (``parse_known_args`` leaves the rest)."""
    p = argparse.ArgumentParser(
        prog="downpour job",
        description=DESCRIPTION,
        usage="downpour job --model MODULE:FN [--state-dir ROOT] [ROLE'S SERVICE FLAGS...]",
        allow_abbrev=False,  # an abbreviation is the role's service's flag, not ours
    )
    add_arguments(p)
    return p


def _given(flag: str, argv: Sequence[str]) -> bool:
    """Whether ``flag`` is on the command line ``argv`` (``--flag V`` or ``--flag=V``)."""
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def role_argv(
    tf: TFConfig,
    model: str,
    state_dir: str | None,
    rest: Sequence[str],
    server_options: Sequence[Option] = SERVER_OPTIONS,
) -> tuple[str, list[str]]:
    """What runs this task: (``server``/``worker``/``chief``/``evaluator``, its arguments).

    ``rest`` are the flags for the role's service; ``server_options`` are the server's, which
    tell whether it can end with the job (``--job-workers``).
    """
    argv = ["--model", model]
    if tf.service == "server":
        if state_dir is not None:
            argv += ["--state-dir", str(Path(state_dir) / f"shard-{tf.task_index}")]
        if not any(o.name == JOB_WORKERS for o in server_options):
            log.warning(
                "this server has no --job-workers setting: it keeps serving after the "
                "workers finish, so the job does not complete by itself"
            )
        elif not _given("--job-workers", rest):
            argv += ["--job-workers", str(len(tf.cluster.get("worker", ())))]
    elif tf.service in ("chief", "evaluator") and state_dir is not None:
        argv += ["--state-dir", state_dir]
    return tf.service, [*argv, *rest]


def main(argv: Sequence[str]) -> int:
    """``downpour job ARGS``: read TF_CONFIG, run the role; the role's exit code."""
    args, rest = build_parser().parse_known_args(list(argv))
    try:
        tf = from_environ(os.environ)
    except ConfigError as exc:
        print(f"downpour job: error: {exc}", file=sys.stderr)
        return 2
    if tf is None:
        print(
            f"downpour job: error: {TF_CONFIG_ENV} is not set: the job's roles come from it "
            "(see docs: configuration.md)",
            file=sys.stderr,
        )
        return 2
    service, service_argv = role_argv(tf, args.model, args.state_dir, rest)
    if service in ("server", "worker"):
        from downpour.cli import run_service

        return run_service(service, service_argv)
    from downpour.cli.job import chief  # the coordinator and the side-car

    run = chief.run_chief if service == "chief" else chief.run_evaluator
    return run(tf, service_argv)
