"""The ``evaluator`` role of a job (``downpour job``, roles from TF_CONFIG): a side-car.

Every ``--eval-every-secs`` seconds it scores the servers' current weights on the held-out
set and logs the figure. It reads the servers' job state every ``--poll-secs`` seconds in
between, so it ends with the job, within a few seconds of it:

- exit 0 when every ps reports the job ``done``; or when a ps stops answering after one has
  reported ``done`` (the servers exit once the chief acknowledged the end, which can come
  between two reads); or, with ``--state-dir ROOT``, when the chief's job-end record
  (``ROOT/job-end.json``, ``downpour.checkpoints.dirs.read_job_end``) says ``done`` and was
  written after this evaluator started, or no ps answers any more;
- exit 3 when a ps reports the job ``failed`` (or the record says so), or a ps does not
  answer for ``--wait-servers`` seconds while the job runs;
- exit 2 for bad settings.
"""

from __future__ import annotations

import argparse
import logging
import time
from typing import TYPE_CHECKING

from downpour.checkpoints.dirs import read_job_end
from downpour.cli.job import watch as common
from downpour.cli.job.watch import JobFailed, JobWatch
from downpour.config.settings import Option, positive

if TYPE_CHECKING:
    from downpour.config.tf_config import TFConfig

log = logging.getLogger("downpour.chief")

__all__ = ["EVALUATOR_OPTIONS", "run_evaluator"]

EVALUATOR_OPTIONS: tuple[Option, ...] = (
    *common.COMMON_OPTIONS,
    Option(
        "eval_every_secs",
        60.0,
        "seconds between scores of the servers' current weights",
        common.JOB_GROUP,
        type=positive(),
        metavar="S",
    ),
)


class JobEnded(Exception):
    """The chief recorded the job's end; ``state`` is ``done`` or ``failed``."""

    def __init__(self, state: str) -> None:
        super().__init__(state)
        self.state = state


def _recorded_end(args: argparse.Namespace, watch: JobWatch, since: float) -> str | None:
    """The state of the chief's job-end record when it counts for this run: written after
    ``since`` (wall clock), or no ps answers any more; else None."""
    if not args.state_dir:
        return None
    record = read_job_end(args.state_dir)
    if record is None:
        return None
    fresh = float(record.get("written_at", 0.0)) >= since
    silent = not any(watch.heard.get(e, 0.0) >= watch.started for e in watch.statuses)
    return str(record["state"]) if fresh or silent else None


def run_evaluator(tf: TFConfig, argv: list[str]) -> int:
    """The evaluator's role (module docstring): score every ``--eval-every-secs`` until the
    job ends. 0 when it is done, 3 when it failed, 2 for bad settings."""
    started = common.setup(EVALUATOR_OPTIONS, argv, tf, "evaluator")
    if started is None:
        return common.EXIT_USAGE
    args, watch = started
    since = time.time()
    evaluator = common.held_out_scorer(args)
    next_score = time.monotonic()

    def between() -> None:
        nonlocal next_score
        if (ended := _recorded_end(args, watch, since)) is not None:
            raise JobEnded(ended)
        if evaluator is not None and time.monotonic() >= next_score and watch.all_answered():
            if line := common.score(evaluator, watch):
                log.info("%s", line)
            next_score = time.monotonic() + args.eval_every_secs
        watch.pause()

    def ended(states: list[str]) -> bool:
        return all(s in ("done", "gone") for s in states)

    try:
        watch.until(ended, between, gone_after_done=True)
    except JobEnded as end:
        if end.state != "done":
            log.error("job failed: the chief recorded its end as %s", end.state)
            return common.EXIT_FAILED
        log.info("the chief recorded the job's end: evaluator exits")
        return common.EXIT_OK
    except JobFailed as exc:
        if _recorded_end(args, watch, since) == "done":  # the servers left after the chief
            log.info("the chief recorded the job's end: evaluator exits")
            return common.EXIT_OK
        log.error("job failed: %s", exc)
        return common.EXIT_FAILED
    log.info("the job is done: evaluator exits")
    return common.EXIT_OK
