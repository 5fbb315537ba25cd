"""``--export-dir DIR --export-every N``: serving exports written while the server trains.

Every N updates the loop thread takes a snapshot of the weights (the fixed variables, and each
dynamic table's live ids, rows and versions from ``export_state``), between two applies like a
checkpoint capture, so everything in it is of one version. A background thread then assigns it
to a copy of the model and writes version ``<DIR>/<version>/`` with
``downpour.serving.versions.export_versions`` (the layout, the delta beside it and the pruning are
described there). One export at a time: one that falls due while the previous is still being
written is skipped, counted and logged. On stop the server writes a last export of its final
version (as it writes its final checkpoint), unless that version is already exported.

One server exports only when it holds the whole model (one shard); with shards the chief
exports, from every shard's weights.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from downpour.serving.versions import clean_leftovers, export_versions, versions
from downpour.spec import ModelSpec

if TYPE_CHECKING:
    from downpour.server.state import ParameterState
    from downpour.serving.saved_model import Table

log = logging.getLogger("downpour.server")

Snapshot = tuple[int, dict[str, np.ndarray], dict[str, "Table"]]


def take_snapshot(state: ParameterState) -> Snapshot:
    """(version, fixed weights by path, dynamic tables by path) of ``state``: loop thread,
    between applies. The arrays are copies the next apply does not change."""
    from downpour.serving.saved_model import as_table

    weights = {
        state.partition_paths[p.var]: v.numpy()
        for p, v in zip(state.parts, state.variables, strict=True)
    }
    tables = {path: as_table(t.export_state()) for path, t in state.tables.items()}
    return state.version, weights, tables


@dataclass
class ExportCounts:
    """What the exports did so far (the status document's ``exports``, with the settings)."""

    written: int = 0
    skipped: int = 0  # fell due while the previous export was still being written
    failed: int = 0
    last_version: int = -1
    last_seconds: float | None = None
    last_delta: str | None = None


class ServingExporter:
    """Decides when to export, and writes each export on a background thread."""

    def __init__(
        self, spec: ModelSpec, directory: str, every: int, keep: int, fingerprint: str
    ) -> None:
        """Prepare exports of ``spec`` (its model built now, so a model that cannot be served
        is refused at start: ``downpour.serving.saved_model.ServingError``) into ``directory``."""
        from downpour.model.build import batchnorm_layers, build_model
        from downpour.serving.saved_model import Table, dynamic_layers, serving_module

        if every < 1 or keep < 1:
            raise ValueError(f"export every {every} and keep {keep} must be >= 1")
        self.spec, self.dir, self.every, self.keep = spec, directory, every, keep
        self.fingerprint = fingerprint
        self.model = build_model(spec)  # a copy: the loop's variables are never touched
        empty = {  # traced once now: the ServingError of a model that cannot be served
            path: Table(
                np.zeros(0, np.int64), np.zeros((0, layer.dim), np.float32), np.zeros(0, np.int64)
            )  # fmt: skip
            for path, layer in dynamic_layers(self.model).items()
        }
        serving_module(self.model, empty)
        if batchnorm_layers(self.model):
            log.warning(
                "exports to %s carry the BatchNormalization statistics the model was built "
                "with (the server trains trainable variables only); `downpour export` "
                "recomputes them from the training data",
                directory,
            )
        clean_leftovers(directory)
        held = versions(directory)
        self.counts = ExportCounts(last_version=held[-1] if held else -1)
        if held:
            log.info("%s holds versions up to %d: exporting newer ones", directory, held[-1])
        self._next = max(self.counts.last_version, 0) + every
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="export")
        self._running: Future[None] | None = None

    def after_loop_pass(self, state: ParameterState) -> None:
        """Loop thread: take a snapshot and start its export when one is due; count and log a
        skip when the previous export is still being written."""
        if state.version < self._next:
            return
        self._next = state.version + self.every
        if self._running is not None and not self._running.done():
            self.counts.skipped += 1
            log.warning(
                "export of version %d skipped: the previous export is still being written "
                "(%d skipped so far; raise --export-every)",
                state.version,
                self.counts.skipped,
            )
            return
        self._running = self._pool.submit(self._write, take_snapshot(state))

    def final(self, state: ParameterState) -> None:
        """Loop thread, after the last apply: wait for a running export, then export the
        final version on this thread unless it is already exported."""
        if self._running is not None:
            self._running.result()
        if state.version > self.counts.last_version:
            self._write(take_snapshot(state))

    def _write(self, snapshot: Snapshot) -> None:
        version, weights, tables = snapshot
        t0 = time.perf_counter()
        try:
            written = export_versions(self.dir, self.model, version, weights, tables,
                                      self.fingerprint, self.spec.name, keep=self.keep)  # fmt: skip
        except Exception:  # a failed export must not take the server down; it is counted
            self.counts.failed += 1
            log.exception("export of version %d to %s failed", version, self.dir)
            return
        c = self.counts
        c.last_seconds = round(time.perf_counter() - t0, 3)
        c.last_version, c.written = version, c.written + 1
        c.last_delta = str(written.delta) if written.delta is not None else None
        log.info(
            "exported version %d to %s in %.1f s%s",
            version,
            written.path,
            c.last_seconds,
            f" (delta {written.delta})" if written.delta is not None else "",
        )

    def close(self) -> None:
        """Wait for a background export to finish (idempotent)."""
        self._pool.shutdown(wait=True)

    def snapshot(self) -> dict[str, Any]:
        """The ``exports`` field of the status document: the counts and the settings."""
        return asdict(self.counts) | {"every": self.every, "keep": self.keep, "dir": self.dir}
