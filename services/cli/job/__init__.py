"""``downpour job``: run this task's role of a ``TF_CONFIG`` cluster (Kubeflow TFJob, JobSet,
Volcano), the same command in every replica.

``TF_CONFIG``'s task picks the role (``downpour.config.tf_config``): a ``ps`` task runs
``downpour server``, a ``worker`` task ``downpour worker``, both taking shard, ports, worker
index and the ps list from ``TF_CONFIG``; a ``chief`` (or ``master``) task runs the job's
coordinator (``downpour.cli.job.chief``) and an ``evaluator`` the side-car
(``downpour.cli.job.evaluator``). Besides ``--model`` and ``--state-dir``, the flags are the
role's service's own, and as with the service they override ``TF_CONFIG`` (as ``DOWNPOUR_*``
variables and ``--config`` file settings do).

Each role's command line is built from that role's own option table (``role_argv``), so no
role is handed a flag it does not declare: a ps task gets ``--state-dir ROOT/shard-I`` for
``--state-dir ROOT`` (a volume every ps task mounts; ``downpour export --state-dir
ROOT/shard-0 --state-dir ROOT/shard-1 ...`` reads it, ``downpour.checkpoints.dirs``), the
chief and the evaluator get ``--state-dir ROOT``, and workers, which keep no state, get none.
A ps task ends with the job because ``TF_CONFIG``'s worker list gives it ``--job-workers
len(worker)`` (``downpour.config.tf_config``), as it does under ``downpour server``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from downpour.checkpoints.dirs import shard_dir
from downpour.config.settings import MODEL, ConfigError, Option, to_argv
from downpour.config.tf_config import TF_CONFIG_ENV, TFConfig, from_environ

log = logging.getLogger("downpour.job")
JOB_WORKERS = "job_workers"  # the server setting that ends it once that many workers finished

DESCRIPTION = (
    "Run this task's role of the TF_CONFIG cluster: ps task I -> downpour server (shard I of "
    "len(ps), ports P, P+1, P+2 of ps[I]'s HOST:P), worker task I -> downpour worker (worker "
    "I of len(worker), --server = the ps list), chief/master -> the job's coordinator, "
    "evaluator -> the side-car. Flags other than --model and --state-dir go to the role's "
    "service and override TF_CONFIG. "
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


def role_options(service: str) -> tuple[Option, ...]:
    """The option table of the role that runs ``service`` (``server``, ``worker``, ``chief``,
    ``evaluator``): what its command line may hold."""
    if service == "server":
        from downpour.server.settings import SERVER_OPTIONS

        return SERVER_OPTIONS
    if service == "worker":
        from downpour.worker.settings import WORKER_OPTIONS

        return WORKER_OPTIONS
    if service == "chief":
        from downpour.cli.job.chief import CHIEF_OPTIONS

        return CHIEF_OPTIONS
    from downpour.cli.job.evaluator import EVALUATOR_OPTIONS

    return EVALUATOR_OPTIONS


def job_settings(tf: TFConfig, model: str, state_dir: str | None) -> dict[str, Any]:
    """What ``downpour job``'s own options mean for this task, by setting name: the model for
    every role; a ps task its shard's directory of the state root; the chief and the
    evaluator the state root itself."""
    values: dict[str, Any] = {"model": model}
    if state_dir is not None:
        if tf.service == "server":
            values["state_dir"] = str(shard_dir(state_dir, tf.task_index))
        else:
            values["state_dir"] = state_dir
    return values


def role_argv(
    tf: TFConfig,
    model: str,
    state_dir: str | None,
    rest: Sequence[str],
    options: Sequence[Option] | None = None,
) -> tuple[str, list[str]]:
    """What runs this task: (``server``/``worker``/``chief``/``evaluator``, its arguments).

    The job's settings (``job_settings``) become flags through the role's own option table
    (``options``, default ``role_options``), as run-local builds its children's: a setting
    the role does not declare is not passed (a worker keeps no state), and one given in
    ``rest`` (the flags for the role's service) wins.
    """
    options = role_options(tf.service) if options is None else tuple(options)
    declared = {o.name: o for o in options}
    if tf.service == "server" and JOB_WORKERS not in declared:
        log.warning(
            "this server has no --job-workers setting: it keeps serving after the "
            "workers finish, so the job does not complete by itself"
        )
    values = {
        name: value
        for name, value in job_settings(tf, model, state_dir).items()
        if name in declared and not _given(declared[name].flag, rest)
    }
    return tf.service, [*to_argv(options, values, always=("model",)), *rest]


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
    if service == "chief":
        from downpour.cli.job import chief  # the coordinator

        return chief.run_chief(tf, service_argv)
    from downpour.cli.job import evaluator  # the side-car

    return evaluator.run_evaluator(tf, service_argv)
