"""The ``chief`` and ``evaluator`` roles of a job (``downpour job``, roles from TF_CONFIG).

The chief coordinates the end of a job whose servers run with ``--job-workers`` (see
``downpour.server.job``):

1. it waits until every ps answers on its status socket (``--wait-servers`` seconds at most);
2. it waits until every ps reports ``job: done`` (exit 3 as soon as one reports ``failed``,
   or when one stops answering for ``--wait-servers`` seconds before it reported the end);
3. while the servers still serve, it scores the held-out set with their final weights
   (``downpour.serving.scoring.load_and_score``, dynamic tables too) and prints
   ``held-out <metric>: 0.xxxx``;
4. it acknowledges the end to every ps (a status request with ``ack="done"``), which lets
   them exit 0 at once instead of after ``--linger-after-done``;
5. with ``--state-dir ROOT`` (the volume the ps tasks keep ROOT/shard-i on) it exports the
   final checkpoints (``downpour.cli.export.export``) to ``EXPORT_DIR/<version>``, a
   SavedModel directory numbered as TF Serving watches them (the highest of the shards'
   final versions; ``--export-dir``, default ROOT/export). An export already there (a chief
   restarted after exporting) is kept. Exit 0.

The evaluator is a side-car: every ``--eval-every-secs`` seconds it scores the servers'
current weights on the held-out set and logs the figure; it exits 0 when every ps reports
the job done (3 when one reports it failed).

Where the servers are: ps task i of TF_CONFIG serves weights at its ``host:port`` and status
at ``host:port+2`` (the port convention of ``downpour job``); ``--status-endpoints`` gives
the status endpoints instead, in ps order.
"""

from __future__ import annotations

import argparse
import logging
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from downpour.checkpoints.dirs import shard_dirs
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
    at_least,
    positive,
)
from downpour.net.client import fetch_status
from downpour.net.security import ClientKeys
from downpour.net.transport import RemoteError, ServerUnavailable
from downpour.wire import ProtocolError

if TYPE_CHECKING:
    from downpour.config.tf_config import TFConfig

log = logging.getLogger("downpour.chief")

__all__ = ["CHIEF_OPTIONS", "EVALUATOR_OPTIONS", "run_chief", "run_evaluator"]

EXIT_OK = 0
EXIT_USAGE = 2
EXIT_FAILED = 3  # the job failed, or the servers could not be reached
TERMINAL = ("done", "failed")

_JOB = "job"
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
        _JOB,
        metavar="HOST:PORT[,...]",
    ),
    Option(
        "wait_servers",
        600.0,
        "seconds to wait for every ps to answer (at start, and while it does not answer)",
        _JOB,
        type=positive(),
        metavar="S",
    ),
    Option("poll_secs", 1.0, "seconds between status reads", _JOB, type=positive(), metavar="S"),
    LOG_FORMAT,
    LOG_LEVEL,
)
CHIEF_OPTIONS: tuple[Option, ...] = (
    *COMMON_OPTIONS,
    Option(
        "state_dir",
        None,
        "the job's state root: ps task i keeps its checkpoints in ROOT/shard-i; the final "
        "model is exported from them",
        _JOB,
        metavar="ROOT",
    ),
    Option(
        "export_dir",
        None,
        "where the final model goes, as EXPORT_DIR/<version> (default: ROOT/export)",
        _JOB,
        metavar="DIR",
    ),
    Option(
        "export_every",
        0,
        "while the job runs, export the newest checkpoints of ROOT/shard-* each time they are "
        "this many versions past the last export, as TF Serving versions with deltas "
        "(downpour.serving.versions; 0 = only the final model)",
        _JOB,
        type=at_least(0),
        metavar="N",
    ),
    Option(
        "export_keep",
        5,
        "with --export-every: how many versions EXPORT_DIR keeps",
        _JOB,
        type=at_least(1),
        metavar="K",
    ),
)
EVALUATOR_OPTIONS: tuple[Option, ...] = (
    *COMMON_OPTIONS,
    Option(
        "eval_every_secs",
        60.0,
        "seconds between scores of the servers' current weights",
        _JOB,
        type=positive(),
        metavar="S",
    ),
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
        self.started = time.monotonic()

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
        """Each ps's job state (``running`` for a ps not heard from yet)."""
        return [((self.docs.get(e) or {}).get("job") or {}).get("state", "running")
                for e in self.statuses]  # fmt: skip

    def poll(self) -> list[str]:
        """Read every ps not yet ended; the job states. JobFailed when a ps reports
        ``failed``, or one not ended has not answered for ``wait_s`` seconds."""
        now = time.monotonic()
        for e, state in zip(self.statuses, self.job_states(), strict=True):
            if state in TERMINAL:
                continue
            doc = self.read(e)
            if doc is not None and doc.get("job") is None:
                raise JobFailed(f"server {e} does not end a job: start it with --job-workers N")
            if doc is None and now - self.heard.get(e, self.started) > self.wait_s:
                raise JobFailed(f"server {e} did not answer for {self.wait_s:g} s")
        states = self.job_states()
        for e, state in zip(self.statuses, states, strict=True):
            if state == "failed":
                reason = self.docs[e]["job"].get("reason")
                raise JobFailed(f"server {e} reports the job failed: {reason}")
        return states

    def until(self, done: Callable[[list[str]], bool], between: Callable[[], None]) -> None:
        """Poll until ``done(states)``, calling ``between()`` after each poll that is not."""
        self.started = time.monotonic()
        while not done(self.poll()):
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


def _setup(
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


def _score(evaluator: Any, watch: JobWatch) -> str | None:
    """``held-out <metric>: 0.xxxx (versions ...)`` for the servers' current weights, or None
    (said at warning level) when they could not be scored."""
    try:
        versions, metric = evaluator.score_at(watch.reps, watch.keys, watch.who)
    except (ServerUnavailable, RemoteError, ProtocolError, OSError, ValueError) as exc:
        log.warning("no held-out score: %s", exc)
        return None
    return f"held-out {evaluator.spec.metric_name}: {metric:.4f} (versions {versions})"


def _evaluator(args: argparse.Namespace) -> Any:
    """The held-out scorer of ``--model``, or None (said at warning level) without one."""
    from downpour.serving.scoring import Evaluator

    try:
        return Evaluator(args.model, args.data_dir, args.device)
    except ValueError as exc:
        log.warning("no held-out scores: %s", exc)
        return None


def run_chief(tf: TFConfig, argv: list[str]) -> int:
    """The chief's role (module docstring): wait for the job's end, score, acknowledge,
    export. 0 when the job is done and exported; 3 when it failed; 2 for bad settings."""
    started = _setup(CHIEF_OPTIONS, argv, tf, "chief")
    if started is None:
        return EXIT_USAGE
    args, watch = started
    log.info("chief: waiting for the job's end on %d server(s)", len(watch.statuses))
    exports = CheckpointExports(args, len(watch.statuses)) if args.export_every else None

    def between() -> None:
        if exports is not None:
            exports.maybe()
        watch.pause()

    try:
        watch.until(lambda states: all(s == "done" for s in states), between)
    except JobFailed as exc:
        log.error("job failed: %s", exc)
        watch.acknowledge()
        return EXIT_FAILED
    evaluator = _evaluator(args)
    line = None if evaluator is None else _score(evaluator, watch)
    if line is not None:
        log.info("final model: %s", line)
        print(line, flush=True)
    watch.acknowledge()
    if not args.state_dir:
        log.warning("no --state-dir: the final model is not exported")
        return EXIT_OK
    if exports is not None:  # the final checkpoints as the last version of the series
        version = exports.write()
        if version is None and not exports.current():
            return EXIT_FAILED
        print(f"exported {exports.base} (version {exports.last})", flush=True)
        return EXIT_OK
    return export_final(args, watch, len(watch.statuses))


class CheckpointExports:
    """``--export-every N``: the newest checkpoints of ROOT/shard-* exported into EXPORT_DIR
    (``downpour.serving.versions``: each version written aside and renamed into place, the delta
    from the previous one beside it, the last K kept) each time they are N versions past the
    last export. A version is the highest of the shards' checkpoint versions; each shard's
    own is recorded in the export. An export that fails is said at warning level and tried
    again at the next due version."""

    def __init__(self, args: argparse.Namespace, num_shards: int) -> None:
        from downpour.serving import versions

        if not args.state_dir:
            raise ValueError("--export-every exports the checkpoints of --state-dir ROOT")
        self.args = args
        self.dirs = shard_dirs(args.state_dir, num_shards)
        self.base = Path(args.export_dir or Path(args.state_dir) / "export")
        self.base.mkdir(parents=True, exist_ok=True)
        held = versions.versions(self.base)
        self.last = held[-1] if held else 0
        self.written = self.failed = 0

    def newest(self) -> int | None:
        """The version the shards' newest checkpoints make (None: a shard has none yet)."""
        from downpour.checkpoints.store import CheckpointStore

        found = [CheckpointStore(d).list() for d in self.dirs]
        return max(f[-1][0] for f in found) if all(found) else None

    def current(self) -> bool:
        """True when the newest checkpoints are exported already."""
        return self.newest() == self.last

    def maybe(self) -> None:
        """Export when the newest checkpoints are ``--export-every`` versions past the last."""
        newest = self.newest()
        if newest is not None and newest >= self.last + self.args.export_every:
            self.write()

    def write(self) -> int | None:
        """Export the newest checkpoints if newer than the last export; their version."""
        from downpour.checkpoints.tables import tables_from_checkpoints as tables_of
        from downpour.model.build import fingerprint
        from downpour.serving.export import ExportError, load_checkpoints, load_model
        from downpour.serving.saved_model import ServingError, as_table, dense_variables
        from downpour.serving.versions import export_versions

        try:
            ckpts = sorted(load_checkpoints(self.dirs), key=lambda c: int(c.meta.get("shard", 0)))
            version = max(c.version for c in ckpts)
            if version <= self.last:
                return None
            loaded = load_model(ckpts, self.args.model, self.args.data_dir)
            model = loaded.model
            weights = {v.path: v.numpy() for v in dense_variables(model)}
            tables = {p: as_table(t) for p, t in tables_of(ckpts).items()}
            export_versions(
                self.base, model, version, weights, tables,
                fingerprint(model.trainable_variables), loaded.spec.name,
                [c.version for c in ckpts], self.args.export_keep,
            )  # fmt: skip
        except (ExportError, ServingError, OSError, ValueError) as exc:
            self.failed += 1
            log.warning("export of the checkpoints in %s failed: %s", self.dirs[0].parent, exc)
            return None
        self.last = version
        self.written += 1
        log.info("exported version %d into %s", version, self.base)
        return version


def export_final(args: argparse.Namespace, watch: JobWatch, num_shards: int) -> int:
    """Export ROOT/shard-* to EXPORT_DIR/<version>; 0, or 3 when the export is refused."""
    from downpour.serving.export import ExportError, export

    root = Path(args.state_dir)
    version = max(int(doc["job"]["version"] or 0) for doc in watch.docs.values())
    out = Path(args.export_dir or root / "export") / str(version)
    if out.exists():
        log.info("%s exists already (exported by an earlier run of this chief): kept", out)
        return EXIT_OK
    out.parent.mkdir(parents=True, exist_ok=True)
    dirs = shard_dirs(root, num_shards)
    try:
        result = export(dirs, out, args.model, args.data_dir)
    except ExportError as exc:
        log.error("export of %s failed: %s", root, exc)
        return EXIT_FAILED
    print(f"exported {result.path} ({result.format}, version {version})", flush=True)
    return EXIT_OK


def run_evaluator(tf: TFConfig, argv: list[str]) -> int:
    """The evaluator's role (module docstring): score every ``--eval-every-secs`` until the
    job ends. 0 when it is done, 3 when it failed, 2 for bad settings."""
    started = _setup(EVALUATOR_OPTIONS, argv, tf, "evaluator")
    if started is None:
        return EXIT_USAGE
    args, watch = started
    evaluator = _evaluator(args)

    def score_and_wait() -> None:
        if evaluator is not None and (line := _score(evaluator, watch)):
            log.info("%s", line)
        watch.pause(args.eval_every_secs)

    try:
        watch.until(lambda states: all(s == "done" for s in states), score_and_wait)
    except JobFailed as exc:
        log.error("job failed: %s", exc)
        return EXIT_FAILED
    log.info("the job is done: evaluator exits")
    return EXIT_OK
