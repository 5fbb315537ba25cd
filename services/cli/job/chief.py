"""The ``chief`` role of a job (``downpour job``, roles from TF_CONFIG).

The chief coordinates the end of a job whose servers run with ``--job-workers`` (see
``downpour.server.job``; under ``TF_CONFIG`` a ps task gets it from the worker list):

1. it waits until every ps answers on its status socket (``--wait-servers`` seconds at most);
2. it waits until every ps reports ``job: done`` (exit 3 as soon as one reports ``failed``,
   or when one stops answering for ``--wait-servers`` seconds before it reported the end);
3. while the servers still serve, it scores the held-out set with their final weights
   (``downpour.serving.scoring.Evaluator``, dynamic tables too) and prints
   ``held-out <metric>: 0.xxxx``;
4. it acknowledges the end to every ps (a status request with ``ack="done"``), which lets
   them exit 0 at once instead of after ``--linger-after-done``;
5. with ``--state-dir ROOT`` (the volume the ps tasks keep ROOT/shard-i on) it exports the
   final checkpoints (``downpour.serving.export``) to ``EXPORT_DIR/<version>``, a
   SavedModel directory numbered as TF Serving watches them (the highest of the shards'
   final versions; ``--export-dir``, default ROOT/export), and records the job's end in
   ``ROOT/job-end.json`` (``downpour.checkpoints.dirs.write_job_end``), which the evaluator
   ends on. An export already there (a chief restarted after exporting) is kept. Exit 0.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from downpour.checkpoints.dirs import shard_dirs, write_job_end
from downpour.cli.job.watch import (
    COMMON_OPTIONS,
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    JOB_GROUP,
    JobFailed,
    JobWatch,
    held_out_scorer,
    score,
    setup,
)
from downpour.config.settings import Option, at_least

if TYPE_CHECKING:
    from downpour.config.tf_config import TFConfig

log = logging.getLogger("downpour.chief")

__all__ = ["CHIEF_OPTIONS", "run_chief"]

CHIEF_OPTIONS: tuple[Option, ...] = (
    *COMMON_OPTIONS,
    Option(
        "export_dir",
        None,
        "where the final model goes, as EXPORT_DIR/<version> (default: ROOT/export)",
        JOB_GROUP,
        metavar="DIR",
    ),
    Option(
        "export_every",
        0,
        "while the job runs, export the newest checkpoints of ROOT/shard-* each time they are "
        "this many versions past the last export, as TF Serving versions with deltas "
        "(downpour.serving.versions; 0 = only the final model)",
        JOB_GROUP,
        type=at_least(0),
        metavar="N",
    ),
    Option(
        "export_keep",
        5,
        "with --export-every: how many versions EXPORT_DIR keeps",
        JOB_GROUP,
        type=at_least(1),
        metavar="K",
    ),
)


def run_chief(tf: TFConfig, argv: list[str]) -> int:
    """The chief's role (module docstring): wait for the job's end, score, acknowledge,
    export. 0 when the job is done and exported; 3 when it failed; 2 for bad settings."""
    started = setup(CHIEF_OPTIONS, argv, tf, "chief")
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
        _record_end(args, "failed", watch, None)
        return EXIT_FAILED
    evaluator = held_out_scorer(args)
    line = None if evaluator is None else score(evaluator, watch)
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
            _record_end(args, "failed", watch, None)
            return EXIT_FAILED
        print(f"exported {exports.base} (version {exports.last})", flush=True)
        _record_end(args, "done", watch, str(exports.base / str(exports.last)))
        return EXIT_OK
    out = export_final(args, watch, len(watch.statuses))
    _record_end(args, "done" if out is not None else "failed", watch, out)
    return EXIT_OK if out is not None else EXIT_FAILED


def _record_end(args: argparse.Namespace, state: str, watch: JobWatch, export: str | None) -> None:
    """With ``--state-dir``: the job-end record the evaluator ends on (``write_job_end``)."""
    if not args.state_dir:
        return
    versions = [int((d.get("job") or {}).get("version") or 0) for d in watch.docs.values()]
    try:
        write_job_end(args.state_dir, state, max(versions, default=0), export)
    except OSError as exc:
        log.warning("could not record the job's end in %s: %s", args.state_dir, exc)


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


def export_final(args: argparse.Namespace, watch: JobWatch, num_shards: int) -> str | None:
    """Export ROOT/shard-* to EXPORT_DIR/<version>; its path, or None (said at error level)
    when the export is refused."""
    from downpour.serving.export import ExportError, export

    root = Path(args.state_dir)
    version = max(int(doc["job"]["version"] or 0) for doc in watch.docs.values())
    out = Path(args.export_dir or root / "export") / str(version)
    if out.exists():
        log.info("%s exists already (exported by an earlier run of this chief): kept", out)
        return str(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        result = export(shard_dirs(root, num_shards), out, args.model, args.data_dir)
    except ExportError as exc:
        log.error("export of %s failed: %s", root, exc)
        return None
    print(f"exported {result.path} ({result.format}, version {version})", flush=True)
    return str(result.path)
