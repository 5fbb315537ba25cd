"""Request and gradient handling: plain functions of (frames or message, context) -> a reply
or the fate of a push.

Under ``--data-dispatch server`` the REP socket also serves split requests
(``handle_split``, over ``downpour.server.dispatch.Dispatcher``), and the loop calls
``release_gone`` so that the splits of workers gone by liveness go back to the queue. An ack
whose split's last push (its seq) has not reached the server yet is held by the dispatcher,
and ``handle_gradients`` completes it when that push arrives: an ack never overtakes its
split's gradients.

Nothing here touches a socket or starts a thread. The service's loop receives frames, calls
``handle_request`` (REP socket: hello, weight pulls, heartbeats) or ``handle_gradients``
(the gradient socket, which also applies what the policy decides to apply) and sends the
reply. Every refusal is counted here (``ServerStats.rejected`` by reason, and
against the worker's record where one is known) and returned as a ``Rejection`` for the
service to log; a refused message never changes a parameter.

Every valid push goes through the staleness policy (``downpour.server.policies.base``): it is
applied (with the policy's learning-rate scale), dropped (counted, not an error: the sender
hears about stale drops in its next pull reply, ``dropped_stale``) or held (``sync:K/N``
aggregation). Under ``ssp:K`` the policy also gates pulls: a worker too far ahead of the
slowest live one is answered "wait" (``wait_ms``, no weights) and asks again. Under
``lookahead`` a whole pull is served the policy's extrapolated weights of the current version
(``Policy.pull_weights``, computed once per version; row-sparse tables as they are); a row
pull is served the weights as they are.
Under a hybrid policy (``downpour.server.policies.hybrid``) a push's decision is its dense half's,
and the decision about its rows half rides on it (``Decision.rows``): the rows are applied
first, then the dense half, each one version step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from downpour import wire
from downpour.net import security
from downpour.net.receive import Bound, Oversize
from downpour.runtime.metrics import clean_reported
from downpour.server.dispatch import GRANT_END, GRANT_WAIT, DataMismatch, Dispatcher, Grant
from downpour.server.job import JobTracker
from downpour.server.policies.base import (
    APPLY,
    DROP,
    REASON_LATE,
    REASON_STALE,
    Decision,
    Policy,
    SyncPolicy,
)
from downpour.server.policies.movement import Movement
from downpour.server.registry import ALIVE, GONE, WorkerRecord, WorkerRegistry
from downpour.server.stats import ServerStats
from downpour.wire import Message, ProtocolError

if TYPE_CHECKING:
    from downpour.server.state import ParameterState

log = logging.getLogger("downpour.server")

PULL_ENCODINGS = frozenset({wire.DENSE, wire.BF16})  # what a pull may ask the weights in
WAIT_RETRY_MS = 200  # a worker told to wait for the epoch's last splits asks again after this


@dataclass
class HandlerContext:
    """What the handlers read and update. Owned by the server's loop thread.

    ``shard`` is the shard identity sent in hello replies and compared with the worker's
    (``shard``, ``num_shards``, ``partition``). ``authenticated`` is True under CURVE: then
    each message's sender must be the name of the key it came with (``peer_key``).
    ``dispatcher`` is set when this server dispatches data (``--data-dispatch server``),
    ``job`` when it ends a job (``--job-workers``).
    """

    state: ParameterState
    policy: Policy
    registry: WorkerRegistry
    model: str
    incarnation: str
    shard: dict[str, Any]
    push_port: int
    status_port: int
    limits: wire.Limits  # for gradients
    request_limits: wire.Limits = wire.DEFAULT_LIMITS  # for requests (max_pull_rows)
    max_request_bytes: int = wire.REQUEST_MAX_BYTES  # the REP socket's MAXMSGSIZE
    stats: ServerStats = field(default_factory=ServerStats)
    allow_nonfinite: bool = False
    authenticated: bool = False
    clock: Callable[[], float] = time.monotonic
    bf16_cache: tuple[int, list[wire.WireTensor]] | None = field(default=None, repr=False)
    dispatcher: Dispatcher | None = None
    job: JobTracker | None = None
    movement: Movement = field(init=False, repr=False)  # for pulls with a bound

    def __post_init__(self) -> None:
        self.policy.layout(self.state.sparse)  # which of its variables are row-sparse
        self.movement = Movement(self.state.dense_variables())


@dataclass(frozen=True)
class Rejection:
    """A refused message: its reason code, a readable explanation, and who sent it, for the
    log (None when not known, e.g. before decode)."""

    code: str
    message: str
    sender: str | None


@dataclass(frozen=True)
class Reply:
    """The answer to a request, and the refusal it reports if it is an ERROR."""

    message: Message
    rejection: Rejection | None = None


@dataclass(frozen=True)
class GradientOutcome:
    """A push's fate: exactly one of ``decision`` (it passed every check; an ``apply`` decision
    has been applied) or ``rejection``."""

    decision: Decision | None = None
    rejection: Rejection | None = None


def _nbytes(frames: Sequence[Any]) -> int:
    """Bytes received in these frames (ZeroMQ frames, bytes or arrays)."""
    return sum(memoryview(f).nbytes for f in frames)


def _refuse(ctx: HandlerContext, exc: ProtocolError, sender: str | None) -> Rejection:
    """Count a refusal by reason, and against ``sender``'s record if it is enrolled."""
    ctx.stats.rejected[exc.code] += 1
    ctx.registry.note_rejected(sender)
    return Rejection(exc.code, exc.message, sender)


def check_identity(ctx: HandlerContext, peer_key: str | None, claimed: str) -> None:
    """Under CURVE a message may only speak as its key's name (ZAP User-Id) or NAME/INSTANCE."""
    if ctx.authenticated and not security.may_speak_as(peer_key, claimed):
        raise ProtocolError(
            security.R_IDENTITY, f"sender {claimed!r} but the message came with {peer_key!r}'s key"
        )


# ---------------------------------------------------------------- requests (REP socket)


def handle_request(
    frames: Sequence[Any], ctx: HandlerContext, peer_key: str | None = None
) -> Reply:
    """A request from the REP socket -> its reply. Checks, in order: decode (protocol version,
    header, ``ctx.request_limits``), identity (under CURVE), a type this socket serves (hello, pull,
    heartbeat, split). A request over ``ctx.max_request_bytes`` is refused before it is
    decoded. A refusal is answered with ERROR carrying the reason code."""
    size = _nbytes(frames)
    ctx.stats.counters["bytes_in"] += size
    try:
        if size > ctx.max_request_bytes:
            raise ProtocolError(
                wire.R_OVERSIZE,
                f"the request is {size} bytes, larger than the server accepts "
                f"({ctx.max_request_bytes} bytes)",
            )
        msg = wire.decode(frames, ctx.request_limits, REQUEST_HANDLERS)
        check_identity(ctx, peer_key, msg.sender)
        return REQUEST_HANDLERS[msg.type](msg, ctx)
    except ProtocolError as exc:
        return Reply(wire.error_message(exc.code, exc.message), _refuse(ctx, exc, None))


def socket_bounds(ctx: HandlerContext) -> tuple[Bound, Bound]:
    """The most a valid message holds on the REP socket and on the gradient socket (see
    docs/security.md): a request is a header and at most one row-id tensor per row-sparse
    variable, in ``max_request_bytes``; a push is a header and at most two frames per
    variable (sparse and top-k: indices and values), three per dynamic table (ids, values
    and counts), in the model's payload limit plus the header limit."""
    requests = Bound(1 + sum(ctx.state.sparse), ctx.max_request_bytes)
    gradients = Bound(
        1 + sum(3 if dynamic else 2 for dynamic in ctx.state.dynamic),
        ctx.limits.max_total_bytes + ctx.limits.max_header_bytes,
    )
    return requests, gradients


def refuse_oversize(ctx: HandlerContext, over: Oversize, bound: Bound, what: str) -> Rejection:
    """Count a message dropped past its socket's bound (``oversize``) and its bytes."""
    ctx.stats.counters["bytes_in"] += over.nbytes
    exc = ProtocolError(
        wire.R_OVERSIZE,
        f"{what} of {over.frames} frames and {over.nbytes} bytes is larger than this socket "
        f"accepts ({bound.nbytes} bytes) in at most {bound.frames} frames: dropped unread",
    )
    return _refuse(ctx, exc, None)


def check_status_request(frames: Sequence[Any]) -> wire.StatusRequest:
    """A request from the status socket must decode and be a status request; raises
    ProtocolError otherwise. Returns its body (an acknowledgement, if any); the answer is the
    published status document."""
    msg = wire.decode(frames, wire.DEFAULT_LIMITS, (wire.STATUS,))
    return wire.StatusRequest.from_body(msg.body)


def handle_hello(msg: Message, ctx: HandlerContext) -> Reply:
    """Enrol a worker whose model fingerprint and partition match this server's, and note
    what it decodes in replies (its ``accepts``; refused when they leave out ``keyed`` and
    this server holds a dynamic table); the reply tells it the gradient and status ports,
    its last accepted seq and the server's version. Raises ProtocolError(R_HEADER) for a
    body field of the wrong type."""
    ctx.stats.counters["hellos"] += 1
    req = wire.HelloRequest.from_body(msg.body)
    fp = ctx.state.fingerprint
    if req.fingerprint != fp:
        return _refuse_hello(
            ctx,
            msg,
            wire.R_FINGERPRINT,
            f"worker model {req.model!r} (fingerprint {req.fingerprint}) differs from the "
            f"server's {ctx.model!r} (fingerprint {fp}): start the worker with the same "
            f"--model as the server",
        )
    mine = ctx.shard
    theirs = {"shard": req.shard, "num_shards": req.num_shards, "partition": req.partition}
    # A client that sends no partition (a plain hello) is accepted by an unsharded server.
    unsharded_client = req.partition is None and mine["num_shards"] == 1
    if theirs != mine and not unsharded_client:
        return _refuse_hello(
            ctx,
            msg,
            wire.R_PARTITION,
            f"worker expects shard {req.shard} of {req.num_shards} (partition "
            f"{req.partition}), this is shard {mine['shard']} of {mine['num_shards']} "
            f"(partition {mine['partition']}): list every shard's endpoint in shard order in "
            f"the worker's --server",
        )
    accepts = req.accepts or wire.ACCEPTS_BASELINE
    if req.accepts is not None and wire.KEYED not in accepts.encodings and any(ctx.state.dynamic):
        tables = [n for n, d in zip(ctx.state.names, ctx.state.dynamic, strict=True) if d]
        return _refuse_hello(
            ctx,
            msg,
            wire.R_ACCEPTS,
            f"this server holds dynamic tables ({', '.join(tables)}), whose rows travel only "
            f"as keyed, which the hello's accepts leave out",
        )
    rec = ctx.registry.admit(msg.sender, ctx.clock())
    if rec is None:
        return _refuse_hello(ctx, msg, wire.R_TOO_MANY_WORKERS, _registry_full(ctx))
    rec.accepts = accepts  # what every reply to it may carry, until its next hello
    if ctx.dispatcher is not None and req.process is not None:
        _note_process(ctx, ctx.dispatcher, msg.sender, req.process)
    body = wire.HelloReply(
        push_port=ctx.push_port,
        status_port=ctx.status_port,
        fingerprint=fp,
        model=ctx.model,
        last_seq=rec.last_seq,
        payload_bytes=ctx.state.payload_bytes,
        incarnation=ctx.incarnation,
        encodings=tuple(sorted(wire.ENCODINGS)),
        policy=ctx.policy.spec,
        shard=mine["shard"],
        num_shards=mine["num_shards"],
        partition=mine["partition"],
        max_request_bytes=ctx.max_request_bytes,
        row_tables=tuple(n for n, s in zip(ctx.state.names, ctx.state.sparse, strict=True) if s),
        worker_index=rec.index,
        workers=len(ctx.registry),
        job_workers=None if ctx.job is None else ctx.job.workers,
    )
    return Reply(wire.hello_reply(ctx.state.version, body))


def _registry_full(ctx: HandlerContext) -> str:
    """The explanation of a ``too_many_workers`` refusal."""
    n = ctx.registry.max_workers
    return (
        f"the server already tracks {n} workers that are alive or missing (--max-workers "
        f"{n}): a new worker id is taken once one of them is gone"
    )


def _refuse_hello(ctx: HandlerContext, msg: Message, code: str, text: str) -> Reply:
    """A refused hello: counted by reason (the worker is not enrolled), answered with ERROR."""
    ctx.stats.rejected[code] += 1
    return Reply(wire.error_message(code, text), Rejection(code, text, msg.sender))


def handle_heartbeat(msg: Message, ctx: HandlerContext) -> Message:
    """A silent worker says it is alive (and may report its figures), or that it has
    finished its work (``finished``: counted by ``ctx.job``, when the server ends a job).
    Raises ProtocolError(R_HEADER) for a body field of the wrong type, before anything is
    noted. Only an enrolled worker is noted: a heartbeat does not enrol (hello does)."""
    req = wire.HeartbeatRequest.from_body(msg.body)
    rec = ctx.registry.get(msg.sender)
    now = ctx.clock()
    if rec is not None:
        ctx.registry.touch(msg.sender, rec, now)
        if req.stats is not None:  # a worker's figures; its notices ride with them
            rec.reported = clean_reported(req.stats)
            rec.notices = req.notices or ()
    if req.finished is not None and ctx.job is not None:
        ctx.job.note_finished(msg.sender, req.finished, ctx.registry, now)
    return wire.heartbeat_reply(ctx.state.version, wire.HeartbeatReply(ctx.incarnation))


def handle_pull(msg: Message, ctx: HandlerContext) -> Message:
    """A weight pull -> the current weights (dense or bf16), or ``unchanged`` when the sender
    already holds this version of this incarnation. A row request (tensors of row ids, see
    ``downpour.wire``) gets the requested rows of its tables (``row_reply``). The reply
    carries only what the sender's latest hello accepts (the baseline when it has no
    record: ``wire.ACCEPTS_BASELINE``). Raises
    ProtocolError for a body field of the wrong type (``bad_header``), an encoding a pull may
    not ask for, or a row request the state cannot serve (``check_rows``); the sender's
    record (and its unreported stale drops) is untouched then."""
    ctx.stats.counters["pulls"] += 1
    req = wire.PullRequest.from_body(msg.body)
    if req.encoding not in PULL_ENCODINGS:
        raise ProtocolError(
            wire.R_HEADER,
            f"pull encoding must be one of {', '.join(sorted(PULL_ENCODINGS))}, "
            f"not {req.encoding!r}",
        )
    rows = check_rows(msg.tensors, ctx.state) if msg.tensors else None
    rec = ctx.registry.get(msg.sender)
    dropped = 0
    if rec is not None:  # pulls count as liveness; only hello and push enrol a worker
        rec.pulls += 1
        ctx.registry.touch(msg.sender, rec, ctx.clock())
        # a rows-only top-up serves a step the worker was already let through to: never held
        if not req.rows_only and (wait_ms := pull_wait_ms(ctx, msg.sender, rec.last_seq, req)):
            body = pull_reply(ctx, unchanged=True, wait_ms=wait_ms)
            return wire.weights_reply(ctx.state.version, body)
        dropped, rec.dropped_unreported = rec.dropped_unreported, 0  # told now: refresh
    accepts = wire.ACCEPTS_BASELINE if rec is None else rec.accepts
    if rows is not None:
        return row_reply(ctx, req, rows, dropped, accepts)
    version = ctx.state.version
    if req.have == version and req.incarnation == ctx.incarnation:
        ctx.stats.counters["pulls_unchanged"] += 1
        body = pull_reply(ctx, unchanged=True, dropped_stale=dropped)
        return wire.weights_reply(version, body)
    if (moved := within_bound(ctx, req, version)) is not None:
        ctx.stats.counters["pulls_unchanged"] += 1
        body = pull_reply(ctx, unchanged=True, dropped_stale=dropped, moved=moved)
        return wire.weights_reply(version, body)
    bf16 = req.encoding == wire.BF16
    if bf16:
        ctx.stats.counters["pulls_bf16"] += 1
    tensors: Sequence[wire.WireTensor]
    if bf16 and not ctx.policy.caps.extrapolates:
        version, tensors = ctx.state.weights_bf16()  # rounded from the variables
    else:
        version, arrays = ctx.state.weights()
        if ctx.policy.caps.extrapolates:  # lookahead: this version's extrapolated weights (cached)
            skip = [i for i, sparse in enumerate(ctx.state.sparse) if sparse]
            arrays = ctx.policy.pull_weights(version, arrays, skip)
        # bf16: the extrapolated arrays, which no variable holds, rounded in NumPy
        tensors = bf16_weights(ctx, version, arrays) if bf16 else arrays
    if bf16 and not accepts.everything:
        tensors = unrounded_rows(ctx, tensors, accepts)
    return wire.weights_reply(
        version,
        pull_reply(ctx, dropped_stale=dropped),
        dict(zip(ctx.state.names, tensors, strict=True)),
    )


def unrounded_rows(
    ctx: HandlerContext, tensors: Sequence[wire.WireTensor], accepts: wire.Accepts
) -> list[wire.WireTensor]:
    """A whole bf16 pull's tensors for a sender that does not decode every rounded form:
    rows it would not decode rounded (a dynamic table's entry, empty, as ``keyed_bf16``) go
    as the variable holds them. The others are the shared list's own, not copied."""
    return [
        ctx.state.array(i) if wire.is_rows(t) and not accepts.rounds(t) else t
        for i, t in enumerate(tensors)
    ]


def within_bound(ctx: HandlerContext, req: wire.PullRequest, version: int) -> float | None:
    """How far the weights moved since the version a pull with a ``bound`` holds, when at
    most the bound (the pull is answered "unchanged"); None: serve the weights (no bound,
    another incarnation's version, weights a policy extrapolates, or moved further). A
    bounded pull that is served has the sample of the version it gets kept."""
    if req.bound is None or ctx.policy.caps.extrapolates:  # extrapolated: no version's weights
        return None
    if req.have is None or req.incarnation != ctx.incarnation:
        ctx.movement.note(version)  # served: the version its worker holds next
        return None
    return ctx.movement.within_bound(req.have, version, req.bound)


def pull_reply(ctx: HandlerContext, **fields: Any) -> wire.PullReply:
    """A pull reply's body: this incarnation, ``fields``, and the policy's dense version
    (a hybrid's dense updates, which a worker waits to see move after a push to its dense
    rounds)."""
    return wire.PullReply(ctx.incarnation, dense_version=ctx.policy.dense_version, **fields)


def pull_wait_ms(ctx: HandlerContext, worker: str, last_seq: int, req: wire.PullRequest) -> int:
    """How long an enrolled worker's pull is held (0: serve it) under a policy that gates
    pulls (``ssp:K``), given the workers the registry calls alive and the pushes the worker
    sent (``req.pushed``) beyond the last one taken (``last_seq``)."""
    if not ctx.policy.caps.holds_pulls:
        return 0
    now, reg = ctx.clock(), ctx.registry
    live = {w for w in reg if (r := reg.get(w)) is not None and reg.liveness(r, now) == ALIVE}
    in_flight = max(0, (req.pushed or 0) - last_seq)
    return ctx.policy.pull_wait_ms(worker, in_flight, live)


def check_rows(requested: Mapping[str, Any], state: ParameterState) -> dict[int, np.ndarray]:
    """A row request's ids -> {variable index: its unique ids, sorted int64}. ``wire.decode``
    has bounded each list by ``max_pull_rows``; here every name must be a row-sparse variable
    of the state (``rows_unknown``, ``rows_dense``), its ids a dense 1-D int32/int64 list
    (``bad_header``, ``rows_dtype``) of its rows (``rows_negative``, ``rows_range``; a
    dynamic table's ids are any int64). Nothing is gathered before every table passed."""
    out: dict[int, np.ndarray] = {}
    for name, ids in requested.items():
        i = state.index.get(name)
        if i is None:
            raise ProtocolError(
                wire.R_ROWS_UNKNOWN, f"row request for {name[:80]!r}: no such variable"
            )
        if not state.sparse[i]:
            raise ProtocolError(
                wire.R_ROWS_DENSE, f"row request for {name!r}, whose gradients are not row-sparse"
            )
        if not isinstance(ids, np.ndarray):
            raise ProtocolError(wire.R_HEADER, f"row ids for {name!r} must travel dense")
        if ids.dtype.name not in wire.INDEX_DTYPES or ids.ndim != 1:
            raise ProtocolError(
                wire.R_ROWS_DTYPE,
                f"row ids for {name!r} are {ids.dtype} of shape {ids.shape}, not int32/int64 1-D",
            )
        if ids.size and not state.dynamic[i]:  # a dynamic table's ids are any int64
            low, high = int(ids.min()), int(ids.max())
            if low < 0:
                raise ProtocolError(wire.R_ROWS_NEGATIVE, f"row id {low} of {name!r} is negative")
            if high >= state.shapes[i][0]:
                raise ProtocolError(
                    wire.R_ROWS_RANGE,
                    f"row id {high} of {name!r} is past its {state.shapes[i][0]} rows",
                )
        out[i] = np.unique(ids).astype(np.int64, copy=False)
    return out


def row_reply(
    ctx: HandlerContext,
    req: wire.PullRequest,
    rows: Mapping[int, np.ndarray],
    dropped: int,
    accepts: wire.Accepts,
) -> Message:
    """The reply to a checked row request: each requested table's rows as a ``sparse``
    tensor (gathered, O(rows)), the other variables whole unless ``req.have`` is current
    (then ``unchanged``, and only the rows travel) or the request is ``rows_only``. bf16
    applies to both: the rows of float32 and float64 tables go as ``sparse_bf16`` (counted
    in ``rows_bf16``), the whole variables as ``bf16``. What the sender ``accepts`` bounds
    it: rows in float32 when it does not decode them rounded, row numbers in int64 when it
    does not decode int32 ones."""
    state = ctx.state
    version, dense = state.dense_weights()
    unchanged = req.have == version and req.incarnation == ctx.incarnation
    moved = None if unchanged or req.rows_only else within_bound(ctx, req, version)
    unchanged = unchanged or moved is not None  # the rows travel; the rest stays as held
    bf16 = req.encoding == wire.BF16
    counters = ctx.stats.counters
    counters["row_pulls"] += 1
    if unchanged:
        counters["pulls_unchanged"] += 1
    tensors: dict[str, wire.WireTensor] = {}
    for i, name in enumerate(state.names):
        ids = rows.get(i)
        if ids is not None:
            if state.dynamic[i]:
                t = wire.Keyed(ids, state.gather(i, ids), state.shapes[i])
            else:
                numbers = accepts.row_numbers(ids, state.shapes[i][0])
                t = wire.Sparse(numbers, state.gather(i, ids), state.shapes[i])
            sent = t.as_bf16() if bf16 and accepts.rounds(t) else t
            tensors[name] = sent
            counters["rows_served"] += len(ids)
            if sent.bf16:
                counters["rows_bf16"] += len(ids)
        elif not (unchanged or req.rows_only):
            a = dense[i] if dense[i] is not None else state.array(i)
            tensors[name] = wire.as_bf16(a) if bf16 and accepts.rounds(a) else a
    body = pull_reply(ctx, unchanged=unchanged, dropped_stale=dropped, moved=moved)
    return wire.weights_reply(version, body, tensors)


def bf16_weights(
    ctx: HandlerContext, version: int, arrays: list[np.ndarray]
) -> list[wire.WireTensor]:
    """Weight arrays rounded to bfloat16 for pulls that ask for it (``--pull-compress bf16``)
    under a policy whose pulls carry arrays no variable holds (lookahead's extrapolated
    weights; the others' come from ``ParameterState.weights_bf16``): half the bytes. Rounded
    once per version, shared by every worker pulling it; float16 and non-float variables go
    as they are. The server keeps and updates float32."""
    if ctx.bf16_cache is None or ctx.bf16_cache[0] != version:
        ctx.bf16_cache = (version, [wire.as_bf16(a) for a in arrays])
    return ctx.bf16_cache[1]


# ---------------------------------------------------------------- data dispatch


def handle_split(msg: Message, ctx: HandlerContext) -> Message:
    """A split request -> the sender's next split, or wait, or end.

    In order: the server dispatches (``dispatch_off``); the body is well formed
    (``bad_header``); the first request registers the universe, every request's digest
    must be the served universe's (``data_universe``); a new process token of the sender
    releases what its old process held; every ack names a split of the universe
    (``bad_header``, before any is applied). Then the acks are applied: an ack whose seq
    the sender's accepted pushes have reached completes at once, a later one is held until
    that push arrives (``handle_gradients``), an ack of a split the sender no longer holds
    is stale (ignored and counted). If ``want``, the next split is leased. A split request
    counts as hearing from the worker (liveness).
    """
    d = ctx.dispatcher
    if d is None:
        raise ProtocolError(
            wire.R_DISPATCH_OFF,
            "this server does not dispatch data: start it (shard 0) with --data-dispatch server",
        )
    req = wire.SplitRequest.from_body(msg.body)
    _check_split_request(req, d)
    rec = ctx.registry.admit(msg.sender, ctx.clock())
    if rec is None:
        raise ProtocolError(wire.R_TOO_MANY_WORKERS, _registry_full(ctx))
    if req.process is not None:
        _note_process(ctx, d, msg.sender, req.process)
    done = held = 0
    for epoch, index, seq in req.acks:
        if seq > rec.last_seq:  # its last gradients are not here yet
            held += d.hold(msg.sender, epoch, index, seq)
        else:
            done += d.ack(msg.sender, epoch, index)
    stale = len(req.acks) - done - held
    if not req.want:
        kind = GRANT_END if d.finished else GRANT_WAIT
        return wire.split_reply(wire.SplitReply(kind, d.epoch, acked=done, stale=stale, held=held))
    grant = d.next_split(msg.sender, ctx.clock())
    log.debug(
        "split request of %s (acks %s: %d done, %d held, %d stale): %s %s",
        msg.sender,
        [a[:2] for a in req.acks],
        done,
        held,
        stale,
        grant.kind,
        None if grant.split is None else grant.split.index,
        extra={"worker": msg.sender},
    )
    return wire.split_reply(_granted(grant, done, stale, held))


def _check_split_request(req: wire.SplitRequest, d: Dispatcher) -> None:
    """The universe a split request sends (registered by the first request) and its digest
    (``bad_header``, ``data_universe``), and every ack naming a split of it (``bad_header``)."""
    if req.universe is not None and req.universe.digest() != req.digest:
        raise ProtocolError(wire.R_HEADER, "the digest does not match the universe sent")
    try:
        if not d.configured:
            if req.universe is None:
                raise DataMismatch(
                    "no data universe registered yet: send it with the first split request"
                )
            d.register(req.universe, req.epochs or 0)
            log.info(
                "dispatching %s, epochs: %s", req.universe.describe(), req.epochs or "unbounded"
            )
        d.check_digest(req.digest)
    except DataMismatch as exc:
        raise ProtocolError(wire.R_UNIVERSE, str(exc)) from None
    bad = [a for a in req.acks if not d.valid_index(a[1])]
    if bad:
        raise ProtocolError(
            wire.R_HEADER, f"ack {list(bad[0])} names no split of the {d.num_splits}"
        )


def _granted(grant: Grant, done: int, stale: int, held: int) -> wire.SplitReply:
    """The reply to a split request that wants a split: ``grant``, and the acks' fates."""
    s = grant.split
    return wire.SplitReply(
        grant.kind,
        grant.epoch,
        index=None if s is None else s.index,
        file=None if s is None else s.file,
        start=None if s is None or s.file is not None else s.start,
        stop=None if s is None or s.file is not None else s.stop,
        skip=0 if s is None else s.skip,
        retry_ms=WAIT_RETRY_MS if grant.kind == GRANT_WAIT else 0,
        acked=done,
        stale=stale,
        held=held,
    )


def _note_process(ctx: HandlerContext, d: Dispatcher, worker: str, process: str) -> None:
    """Release the splits of ``worker``'s previous process when this one is new."""
    released = d.note_process(worker, process)
    if released:
        log.info(
            "worker %s restarted: splits %s back in the queue",
            worker,
            released,
            extra={"worker": worker},
        )


# What the REP socket serves, by message type; any other type is ``wrong_socket``.
REQUEST_HANDLERS: dict[str, Callable[[Message, HandlerContext], Reply]] = {
    wire.HELLO: handle_hello,
    wire.PULL: lambda msg, ctx: Reply(handle_pull(msg, ctx)),
    wire.HEARTBEAT: lambda msg, ctx: Reply(handle_heartbeat(msg, ctx)),
    wire.SPLIT: lambda msg, ctx: Reply(handle_split(msg, ctx)),
}


def release_gone(ctx: HandlerContext) -> list[str]:
    """Take back the splits of every lease holder that liveness calls gone (or that the
    registry does not know); return those workers. The loop calls it every pass."""
    d = ctx.dispatcher
    if d is None:
        return []
    now = ctx.clock()
    gone = []
    for worker in d.holders():
        rec = ctx.registry.get(worker)
        if rec is None or ctx.registry.liveness(rec, now) == GONE:
            released = d.release(worker)
            gone.append(worker)
            log.warning(
                "worker %s is gone: splits %s back in the queue",
                worker,
                released,
                extra={"worker": worker},
            )
    return gone


# ---------------------------------------------------------------- gradients


def handle_gradients(
    frames: Sequence[Any], ctx: HandlerContext, peer_key: str | None = None
) -> GradientOutcome:
    """A message from the gradient socket -> the policy's decision (applied when it says
    ``apply``), or a rejection.

    The checks run in this order, and a message is refused for the first one it fails
    (nothing after it runs). The order is the security contract:

    1. decode: well-formed frames within ``ctx.limits`` (``wire.decode``'s reason codes);
    2. socket: the message is a push (``wrong_socket``);
    3. identity: under CURVE the sender is its key's name (``identity``); from here on a
       refusal counts against that key's owner;
    4. body: ``loss``, ``batch_size``, ``steps`` and ``stats`` have their types
       (``wire.PushBody``; ``bad_header``);
    5. duplicate seq: seq above the sender's last accepted one, remembered even when its
       record was forgotten (``duplicate``);
    6. future version: base_version not ahead of the server (``future_version``);
    7. shape/dtype: tensor count, names, shapes and dtypes of the model (``count``,
       ``name``, ``shape``, ``dtype``);
    8. finite: no NaN or Inf unless ``allow_nonfinite`` (``nonfinite``);
    9. registry: a sender without a record gets one if the registry has room
       (``too_many_workers``): only a push that passed every check creates a record;
    10. policy: the staleness policy decides apply, drop or hold; an ``apply`` is applied
        here (``apply_decision``) before the function returns.

    Checks 4 to 6 read only the header, so a replay is refused before any sparse gradient
    is densified. A refused push from an enrolled sender still counts as hearing from it.

    Under ``--data-dispatch server`` a push that passed check 4 (accepted, or refused after:
    it will not come again) completes the sender's split acks held for its seq
    (``Dispatcher.pushed``). Under ``sync:K/N`` a gradient held for a round counts as arrived.
    """
    ctx.stats.counters["pushes_received"] += 1
    ctx.stats.counters["bytes_in"] += _nbytes(frames)
    sender: str | None = None
    rec = None
    try:
        msg = wire.decode(frames, ctx.limits, (wire.PUSH,))
        sender = msg.sender
        if ctx.authenticated:
            sender = peer_key
            check_identity(ctx, peer_key, msg.sender)
        body = wire.PushBody.from_body(msg.body)
        now = ctx.clock()
        rec = _heard_from(ctx, msg.sender, now)
        version = _check_seq_and_version(msg, ctx)
        grads = _check_and_stage(msg, ctx)
        if rec is None:
            rec = _enrol(ctx, msg.sender, now)
    except ProtocolError as exc:
        if rec is not None and ctx.dispatcher is not None:
            ctx.dispatcher.pushed(msg.sender, msg.seq)
        return GradientOutcome(rejection=_refuse(ctx, exc, sender or exc.sender))
    # Valid, new and enrolled: the policy decides. A drop or a hold is accepted, not an error.
    if ctx.policy.caps.needs_weights:  # dc, gap-aware: the weights this version has (a snapshot)
        ctx.policy.observe(version, ctx.state.weights()[1])
    decision = ctx.policy.offer(grads, msg.base_version, version, msg.sender)
    _note_accepted(msg, body, decision, version, rec, ctx)
    if decision.rows is not None and decision.rows.action == APPLY:  # hybrid: rows first
        apply_decision(decision.rows, ctx, credit=False)
    if decision.action == APPLY:
        apply_decision(decision, ctx)
    return GradientOutcome(decision=decision)


def _heard_from(ctx: HandlerContext, sender: str, now: float) -> WorkerRecord | None:
    """The sender's record, noted as heard from now and counted a push (refused or not);
    None when it has none yet (``_enrol`` gives it one once the push passed every check)."""
    rec = ctx.registry.get(sender)
    if rec is not None:
        ctx.registry.touch(sender, rec, now)
        rec.pushes += 1
    return rec


def _check_seq_and_version(msg: Message, ctx: HandlerContext) -> int:
    """Checks 5 and 6 (``handle_gradients``), the header's only: the seq is new and the
    base version not ahead; returns the server's version the push is measured against."""
    last_seq = ctx.registry.last_seq(msg.sender)
    if msg.seq <= last_seq:
        raise ProtocolError(wire.R_DUPLICATE, f"seq {msg.seq} <= last accepted {last_seq}")
    version = ctx.state.version
    if msg.base_version > version:
        raise ProtocolError(
            wire.R_FUTURE, f"base_version {msg.base_version} > server version {version}"
        )
    return version


def _check_and_stage(msg: Message, ctx: HandlerContext) -> list[np.ndarray | wire.Sparse]:
    """Checks 7 and 8 (``handle_gradients``): the tensors are the model's, copied into the
    apply's staging buffers with NaN/Inf checked in the same pass (``ParameterState.stage``);
    returns the gradients as the apply takes them."""
    grads = check_gradients(msg, ctx.state, keep_sparse=not isinstance(ctx.policy, SyncPolicy))
    # into the apply's staging buffers, NaN/Inf checked in the same pass
    grads, nonfinite = ctx.state.stage(grads, check=not ctx.allow_nonfinite)
    if nonfinite is not None:
        raise ProtocolError(wire.R_NONFINITE, f"{nonfinite!r} has NaN or Inf")
    return grads


def _enrol(ctx: HandlerContext, sender: str, now: float) -> WorkerRecord:
    """Check 9 (``handle_gradients``): a record for a sender without one, counted a push;
    ``too_many_workers`` when the registry has no room."""
    rec = ctx.registry.admit(sender, now)
    if rec is None:
        raise ProtocolError(wire.R_TOO_MANY_WORKERS, _registry_full(ctx))
    rec.pushes += 1
    return rec


def _note_accepted(
    msg: Message,
    body: wire.PushBody,
    decision: Decision,
    version: int,
    rec: WorkerRecord,
    ctx: HandlerContext,
) -> None:
    """An accepted push, whatever the policy decided, in its sender's record (seq,
    staleness, drops and holds, steps, loss, reported figures), the dispatcher's leases
    and the server's loss."""
    rec.last_seq = msg.seq
    if ctx.dispatcher is not None:
        ctx.dispatcher.pushed(msg.sender, msg.seq)
        if body.split is not None:  # the split's batches up to here are trained: not again
            ctx.dispatcher.advance(msg.sender, *body.split)
    rec.observe_staleness(version - msg.base_version)
    if decision.action == DROP:
        rec.dropped += 1
        if decision.reason in (REASON_STALE, REASON_LATE):  # told at its next pull
            rec.dropped_unreported += 1
    elif decision.action != APPLY:
        rec.held += 1
    if body.steps is not None:
        rec.steps = body.steps
    if body.loss is not None and np.isfinite(body.loss):
        rec.loss = float(body.loss)
        ctx.stats.loss.update(float(body.loss))
    if body.stats is not None:  # a worker's figures; its notices ride with them
        rec.reported = clean_reported(body.stats)
        rec.notices = body.notices or ()


def check_gradients(
    msg: Message, state: ParameterState, keep_sparse: bool = True
) -> list[np.ndarray | wire.Sparse]:
    """Check a push's tensors against the model; return them in variable order. A row-sparse
    gradient of a variable the state applies sparsely stays sparse when ``keep_sparse`` (a
    policy that sums gradients sums them densely)."""
    if len(msg.tensors) != len(state.names):
        raise ProtocolError(
            wire.R_COUNT, f"{len(msg.tensors)} tensors, model has {len(state.names)}"
        )
    grads: list[np.ndarray | wire.Sparse] = []
    for (name, t), want, shape, dtype, sparse, dynamic in zip(
        msg.tensors.items(),
        state.names,
        state.shapes,
        state.dtypes,
        state.sparse,
        state.dynamic,
        strict=True,
    ):
        if name != want:
            raise ProtocolError(wire.R_NAME, f"tensor {name!r} where {want!r} was expected")
        got_shape = tuple(wire.logical_shape(t))
        if got_shape != shape:
            raise ProtocolError(wire.R_SHAPE, f"{name!r}: shape {got_shape} != {shape}")
        got_dtype = wire.logical_dtype(t)
        if got_dtype != dtype:
            raise ProtocolError(wire.R_DTYPE, f"{name!r}: dtype {got_dtype} != {dtype}")
        keyed = wire.is_keyed(t)
        if dynamic:
            if not keyed:
                raise ProtocolError(
                    wire.R_SHAPE, f"{name!r} is a dynamic table: its rows travel keyed by id"
                )
            grads.append(t)
        elif keyed:
            raise ProtocolError(
                wire.R_SHAPE, f"{name!r} is not a dynamic table: its rows travel by row number"
            )
        elif sparse and keep_sparse and wire.is_rows(t):
            grads.append(t)  # applied to the rows it touches only
        else:
            grads.append(wire.densify(t))
    return grads


def apply_decision(decision: Decision, ctx: HandlerContext, credit: bool = True) -> None:
    """Apply a policy's update (its gradients, its learning-rate scale, to the variables of
    its part); with ``credit``, count it applied for its workers (a hybrid push's rows half
    is not credited: the push is counted once, by its dense half)."""
    assert decision.grads is not None
    t0 = time.perf_counter()
    if decision.momentum is not None:  # momentum-aware: Adam's beta_1 from this update on
        ctx.state.set_momentum(decision.momentum)
    ctx.state.apply(decision.grads, decision.lr_scale, decision.part)
    ctx.stats.apply_ms.update(1e3 * (time.perf_counter() - t0))
    ctx.stats.update_rate.mark()
    ctx.stats.staleness.observe(decision.staleness)
    if credit:
        ctx.registry.credit_applied(decision.workers)


def flush_policy(ctx: HandlerContext) -> Decision | None:
    """At shutdown: apply what the policy still holds (a partial sync round), if anything;
    return the applied decision, or None."""
    decision = ctx.policy.flush(ctx.state.version)
    if decision is None or decision.action != APPLY:
        return None
    log.info("applying a partial %s round of %d gradients", ctx.policy, len(decision.workers))
    apply_decision(decision, ctx)
    return decision
