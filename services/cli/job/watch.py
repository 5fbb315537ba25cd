"""What a job's chief and evaluator share: their common options and a watch on the servers.

Where the servers are: ps task i of ``TF_CONFIG`` serves weights at its ``host:port`` and
status at ``host:port+2`` (``downpour.config.tf_config.ps_endpoints``, the port convention's
one home); ``--status-endpoints`` gives the status endpoints instead, in ps order.
``JobWatch`` reads every ps's status document and follows each one's job state
(``downpour.server.job``: ``running``, ``done``, ``failed``).
"""

from __future__ import annotations

import argparse
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from downpour.config.settings import (
    DATA_DIR,
    DEVICE,
    KEY,
    LOG_FORMAT,
    LOG_LEVEL,
    MODEL,
    SERVER_KEY,
    Option,
    add_options,
    positive,
)
from downpour.net.client import fetch_status
from downpour.net.security import ClientKeys
from downpour.net.transport import RemoteError, ServerUnavailable
from downpour.wire import ProtocolError

if TYPE_CHECKING:
    from downpour.config.tf_config import TFConfig

log = logging.getLogger("downpour.chief")

EXIT_OK = 0
EXIT_USAGE = 2
EXIT_FAILED = 3  # the job failed, or the servers could not be reached
TERMINAL = ("done", "failed", "gone")

JOB_GROUP = "job"
STATE_DIR = Option(
    "state_dir",
    None,
    "the job's state root: ps task i keeps its checkpoints in ROOT/shard-i; the chief exports "
    "the final model from them and records the job's end in ROOT/job-end.json",
    JOB_GROUP,
    metavar="ROOT",
)
COMMON_OPTIONS: tuple[Option, ...] = (
    MODEL,
    DATA_DIR,
    DEVICE,
    KEY,
    SERVER_KEY,
    Option(
        "status_endpoints",
        None,
        "the ps tasks' status endpoints, comma-separated in ps order (default: each ps "
        "host:port+2)",
        JOB_GROUP,
        metavar="HOST:PORT[,...]",
    ),
    Option(
        "wait_servers",
        600.0,
        "seconds to wait for every ps to answer (at start, and while it does not answer)",
        JOB_GROUP,
        type=positive(),
        metavar="S",
    ),
    Option(
        "poll_secs", 1.0, "seconds between status reads", JOB_GROUP, type=positive(), metavar="S"
    ),
    STATE_DIR,
    LOG_FORMAT,
    LOG_LEVEL,
)


class JobFailed(Exception):
    """A ps reported the job failed, or a ps could not be reached; the message says which."""


def parse(options: Sequence[Option], argv: list[str], prog: str) -> argparse.Namespace:
    """The role's settings from ``argv`` (argparse exits 2 on a bad one)."""
    parser = argparse.ArgumentParser(prog=prog)
    add_options(parser, options)
    return parser.parse_args(argv)


def endpoints(tf: TFConfig, status_endpoints: str | None) -> tuple[list[str], list[str]]:
    """(the ps tasks' REP endpoints, their status endpoints), in ps order, by ``TF_CONFIG``'s
    port convention (``downpour.config.tf_config``) unless ``status_endpoints`` names them.
    ValueError when TF_CONFIG has no ps or ``status_endpoints`` names another number."""
    from downpour.config.tf_config import ps_endpoints

    reps, statuses = ps_endpoints(tf)
    if not reps:
        raise ValueError("TF_CONFIG has no ps tasks: a downpour job needs parameter servers")
    if status_endpoints:
        given = [e.strip() for e in status_endpoints.split(",") if e.strip()]
        statuses = [e if e.startswith("tcp://") else f"tcp://{e}" for e in given]
        if len(statuses) != len(reps):
            raise ValueError(f"--status-endpoints names {len(statuses)} servers for {len(reps)} ps")
    return reps, statuses


class JobWatch:
    """Reads every ps's status document; remembers the last one each answered with."""

    def __init__(
        self,
        reps: list[str],
        statuses: list[str],
        keys: ClientKeys | None,
        args: argparse.Namespace,
        who: str,
    ) -> None:
        self.reps = reps  # where the weights are served, for scoring
        self.statuses = statuses
        self.keys = keys
        self.wait_s = args.wait_servers
        self.poll_s = args.poll_secs
        self.who = who
        self.stop = threading.Event()
        self.docs: dict[str, dict[str, Any]] = {}
        self.heard: dict[str, float] = {}
        self.gone: set[str] = set()
        self.started = time.monotonic()
        self.polled_at = self.started

    def read(self, endpoint: str, ack: str | None = None) -> dict[str, Any] | None:
        """``endpoint``'s status document, or None when it does not answer in time;
        JobFailed when it refuses the request (e.g. a key it does not list)."""
        try:
            doc = fetch_status(endpoint, min(5.0, self.wait_s), self.keys, self.who, ack)
        except ServerUnavailable as exc:
            log.debug("status %s: %s", endpoint, exc)
            return None
        except (RemoteError, ProtocolError) as exc:
            raise JobFailed(f"server {endpoint} refused the status request: {exc}") from None
        self.docs[endpoint] = doc
        self.heard[endpoint] = time.monotonic()
        return doc

    def job_states(self) -> list[str]:
        """Each ps's job state (``running`` for a ps not heard from yet, ``gone`` for one
        that exited after the job's end)."""
        return [
            "gone" if e in self.gone
            else ((self.docs.get(e) or {}).get("job") or {}).get("state", "running")
            for e in self.statuses
        ]  # fmt: skip

    def poll(self, gone_after_done: bool = False) -> list[str]:
        """Read every ps not yet ended; the job states. JobFailed when a ps reports
        ``failed``, or one not ended has not answered for ``wait_s`` seconds. With
        ``gone_after_done``, a ps that stops answering once any ps has reported ``done`` is
        taken to have exited at the job's end: its state is ``gone``."""
        now = self.polled_at = time.monotonic()
        for e, state in zip(self.statuses, self.job_states(), strict=True):
            if state in TERMINAL:
                continue
            doc = self.read(e)
            if doc is not None and doc.get("job") is None:
                raise JobFailed(f"server {e} does not end a job: start it with --job-workers N")
            if doc is None and gone_after_done and "done" in self.job_states():
                log.info("server %s no longer answers after the job's end: it has exited", e)
                self.gone.add(e)
                continue
            if doc is None and now - self.heard.get(e, self.started) > self.wait_s:
                raise JobFailed(f"server {e} did not answer for {self.wait_s:g} s")
        states = self.job_states()
        for e, state in zip(self.statuses, states, strict=True):
            if state == "failed":
                reason = self.docs[e]["job"].get("reason")
                raise JobFailed(f"server {e} reports the job failed: {reason}")
        return states

    def all_answered(self) -> bool:
        """Whether every ps answered in the last poll."""
        return all(self.heard.get(e, -1.0) >= self.polled_at for e in self.statuses)

    def until(
        self,
        done: Callable[[list[str]], bool],
        between: Callable[[], None],
        gone_after_done: bool = False,
    ) -> None:
        """Poll until ``done(states)``, calling ``between()`` after each poll that is not."""
        self.started = time.monotonic()
        while not done(self.poll(gone_after_done)):
            between()

    def pause(self, seconds: float | None = None) -> None:
        """Wait ``seconds`` (default: the poll interval) before the next read."""
        self.stop.wait(self.poll_s if seconds is None else seconds)

    def acknowledge(self) -> None:
        """Tell every ps the chief has what it needs: it may exit now."""
        for e in self.statuses:
            try:
                answered = self.read(e, ack="done") is not None
            except JobFailed as exc:
                log.warning("%s", exc)
                continue
            if not answered:
                log.info("server %s did not answer the acknowledgement: it has exited", e)


def setup(
    options: Sequence[Option], argv: list[str], tf: TFConfig, role: str
) -> tuple[argparse.Namespace, JobWatch] | None:
    """The role's settings and its watch on the servers; None (said at error level) when
    TF_CONFIG or the keys will not do."""
    from downpour.net.security import SecurityError, client_keys_from_args
    from downpour.runtime.logs import setup_logging

    args = parse(options, argv, f"downpour job ({role})")
    if not logging.getLogger().handlers:  # leave an embedding program's logging alone
        setup_logging(role, args.log_level, args.log_format)
    try:
        reps, statuses = endpoints(tf, args.status_endpoints)
        keys = client_keys_from_args(args.key, args.server_key)
    except (ValueError, SecurityError) as exc:
        log.error("%s", exc)
        return None
    who = f"{role}-{tf.task_index}"
    if keys is not None:  # under CURVE a sender speaks as its key's name: NAME/INSTANCE
        who = f"{keys.keypair.name}/{who}"
    return args, JobWatch(reps, statuses, keys, args, who)


def score(evaluator: Any, watch: JobWatch) -> str | None:
    """``held-out <metric>: 0.xxxx (versions ...)`` for the servers' current weights, or None
    (said at warning level) when they could not be scored."""
    try:
        versions, metric = evaluator.score_at(watch.reps, watch.keys, watch.who)
    except (ServerUnavailable, RemoteError, ProtocolError, OSError, ValueError) as exc:
        log.warning("no held-out score: %s", exc)
        return None
    return f"held-out {evaluator.spec.metric_name}: {metric:.4f} (versions {versions})"


def held_out_scorer(args: argparse.Namespace) -> Any:
    """The held-out scorer of ``--model``, or None (said at warning level) without one."""
    from downpour.serving.scoring import Evaluator

    try:
        return Evaluator(args.model, args.data_dir, args.device)
    except ValueError as exc:
        log.warning("no held-out scores: %s", exc)
        return None
