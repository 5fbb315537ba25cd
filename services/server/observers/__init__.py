"""The server's optional observers, wired together: held-out evaluation (``--eval-every``),
TensorBoard summaries (``--logdir``) and the Prometheus endpoint (``--metrics-port``).

All of them run in their own threads and read either the published status document or a
``weights()`` snapshot; the loop's only work is ``after_loop_pass`` (a comparison, plus taking
a snapshot when an evaluation is due).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from downpour.spec import ModelSpec

if TYPE_CHECKING:
    from downpour.server.observers.evaluation import HeldOutEvaluator
    from downpour.server.observers.prometheus import MetricsExporter
    from downpour.server.observers.summaries import SummaryWriter
    from downpour.server.state import ParameterState

log = logging.getLogger("downpour.server")


class ObserverSettings(Protocol):
    """The server settings the observers read (the server's config object has them all)."""

    eval_every: int
    data_dir: str | None
    logdir: str | None
    summary_interval_s: float
    metrics_port: int | None
    metrics_host: str


class Observers:
    """Builds what ``config`` asks for; ``start()`` in run(), ``close()`` after the loop."""

    def __init__(
        self, spec: ModelSpec, config: ObserverSettings, get_doc: Callable[[], dict[str, Any]]
    ) -> None:
        self.evaluator: HeldOutEvaluator | None = None
        self.summaries: SummaryWriter | None = None
        self.exporter: MetricsExporter | None = None
        self._closed = False
        if config.eval_every:
            from downpour.server.observers.evaluation import HeldOutEvaluator

            self.evaluator = HeldOutEvaluator(spec, config.data_dir, config.eval_every)
        if config.logdir:
            from downpour.server.observers.summaries import SummaryWriter

            self.summaries = SummaryWriter(config.logdir, get_doc, config.summary_interval_s)
            if self.evaluator is not None:
                self.evaluator.on_result = self.summaries.record_eval
        if config.metrics_port is not None:  # binds now, so the ready file can name the port
            from downpour.server.observers.prometheus import MetricsExporter

            self.exporter = MetricsExporter(get_doc, config.metrics_host, config.metrics_port)

    def start(self) -> None:
        """Start the observer threads and say where they are."""
        if self.evaluator is not None:
            self.evaluator.start()
            log.info("evaluating the held-out set every %d updates", self.evaluator.every)
        if self.summaries is not None:
            self.summaries.start()
            log.info("writing TensorBoard summaries to %s", self.summaries.logdir)
        if self.exporter is not None:
            log.info(
                "Prometheus metrics on http://%s:%d/metrics", self.exporter.host, self.exporter.port
            )

    def after_loop_pass(self, state: ParameterState) -> None:
        """Loop thread: hand the evaluator a weight snapshot when one is due."""
        ev = self.evaluator
        if ev is not None and ev.due(state.version):
            ev.submit(*state.weights())

    def eval_status(self) -> dict[str, Any] | None:
        """The ``eval`` field of the status document."""
        return self.evaluator.snapshot() if self.evaluator is not None else None

    def endpoints(self) -> dict[str, Any]:
        """Extra ready-file fields (``metrics_port``)."""
        return {"metrics_port": self.exporter.port} if self.exporter is not None else {}

    def close(self) -> None:
        """Stop in order: the evaluator (its last result), summaries (final point), HTTP.
        Idempotent, like ``Server.close``."""
        if self._closed:
            return
        self._closed = True
        if self.evaluator is not None:
            self.evaluator.close()
        if self.summaries is not None:
            self.summaries.close()
        if self.exporter is not None:
            self.exporter.close()
