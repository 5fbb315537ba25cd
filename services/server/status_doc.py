"""The server's status document: plain types, JSON-serialisable (fields: docs/cli.md).

Built by the loop thread from what the handlers keep (``HandlerContext``) and published as
one dict; the status socket, the Prometheus exporter and the TensorBoard writer only ever
read a published document, so none of them can stall or race the loop.
"""

from __future__ import annotations

from typing import Any

from downpour import wire
from downpour.memory import malloc
from downpour.net import security
from downpour.runtime.metrics import peak_rss_mib, rss_mib
from downpour.server.handlers import HandlerContext


def build_status(
    ctx: HandlerContext,
    *,
    now: float,
    started: float,
    started_wall: float,
    restored_from: int | None = None,
    restore_s: float | None = None,
    checkpoints: dict[str, Any] | None = None,
    evaluation: dict[str, Any] | None = None,
    exports: dict[str, Any] | None = None,
    auth: security.Authenticator | None = None,
) -> dict[str, Any]:
    """The status document at monotonic time ``now``, for a server started at monotonic
    ``started`` (wall clock ``started_wall``); the checkpoint, evaluation and authentication
    sections (and the serving exports') come from their owners."""
    state, stats = ctx.state, ctx.stats
    held, slots = state.held_bytes()
    return {
        "service": "server",
        "protocol": wire.PROTOCOL_VERSION,
        "model": ctx.model,
        "fingerprint": state.fingerprint,
        **ctx.shard,
        "shard_bytes": held,
        "slot_bytes": slots,
        "peak_rss_mib": peak_rss_mib(),
        "rss_mib": rss_mib(),
        "malloc": malloc.status(now),
        "version": state.version,
        "updates_applied": state.version,
        "updates_per_s": round(stats.update_rate.per_second(now), 3),
        "uptime_s": round(now - started, 3),
        "started_at": started_wall,
        "apply_ms": stats.apply_ms.value,
        "apply_traces": state.apply_traces,
        # "flat", or why every apply binds its inputs again (logged at warning level)
        "apply_call": state.apply_call_problem or "flat",
        "loss": stats.loss.value,
        "staleness": stats.staleness.snapshot(),
        "policy": {**ctx.policy.describe(), "learning_rate": state.learning_rate},
        "row_tables": [n for n, sparse in zip(state.names, state.sparse, strict=True) if sparse],
        "pull_bounds": ctx.movement.describe(),
        "row_detection": None if state.row_sparsity is None else state.row_sparsity.problem,
        "dynamic_tables": state.table_status(),
        "rejected": _rejected(ctx),
        "rejected_total": stats.rejected.total() + stats.counters["status_oversize"],
        **security.status_fields(auth),
        "workers": ctx.registry.status(now),
        "registry": ctx.registry.summary(),
        "incarnation": ctx.incarnation,
        "restored_from": restored_from,
        "restore_s": restore_s,
        "checkpoints": checkpoints,
        "eval": evaluation,
        "exports": exports,
        "dispatch": None if ctx.dispatcher is None else ctx.dispatcher.progress(),
        "job": None if ctx.job is None else ctx.job.status(now),
        **stats.counters,
    }


def _rejected(ctx: HandlerContext) -> dict[str, int]:
    """Refusals by reason: the loop's, and the status socket's oversize requests (counted by
    the status thread apart, so neither thread writes the other's counter)."""
    rejected = dict(ctx.stats.rejected)
    if n := ctx.stats.counters["status_oversize"]:
        rejected[wire.R_OVERSIZE] = rejected.get(wire.R_OVERSIZE, 0) + n
    return rejected
