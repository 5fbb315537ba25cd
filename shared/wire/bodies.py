"""The typed message bodies: one frozen dataclass per body, its wire fields declared once.

Each field carries its wire rule in ``wire_field(...)``: its kind ("int", "float", "str",
"bool", "map", "list"), an inclusive range, the values it may take, whether the body needs
it, and converters between the wire value and the field value. From those declarations
``to_body()`` builds the map a Message carries (a field at its default is left out unless
declared ``always``; a None field always is), and ``from_body()`` reads one back, refusing a
missing required field, a field of the wrong kind or out of range with ProtocolError
(R_HEADER). Keys a body does not declare are ignored. Clients and the server build and read
bodies only through these. ``downpour.wire`` re-exports all of it; import it from there.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Collection, Mapping
from dataclasses import MISSING, dataclass, field, fields
from functools import cached_property
from typing import Any, Self

import numpy as np

from downpour.wire.codecs import (
    BASELINE_ENCODINGS,
    BF16,
    DENSE,
    ENCODINGS,
    KEYED_BF16,
    REPLY_ENCODINGS,
    SPARSE_BF16,
)
from downpour.wire.payloads import INDEX_DTYPES, Payload, row_numbers
from downpour.wire.protocol import R_HEADER, R_INTERNAL, ProtocolError

_KINDS: dict[str, Callable[[Any], bool]] = {
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "float": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "str": lambda v: isinstance(v, str),
    "bool": lambda v: isinstance(v, bool),
    "map": lambda v: isinstance(v, dict),
    "list": lambda v: isinstance(v, list),
}


@dataclass(frozen=True)
class WireRule:
    """How one body field travels: see ``wire_field``."""

    kind: str
    required: bool = False
    lo: int | None = None
    hi: int | None = None
    choices: Collection[str] | None = None
    always: bool = False
    read: Callable[[str, Any], Any] | None = None
    write: Callable[[Any], Any] | None = None

    def load(self, key: str, v: Any) -> Any:
        """The field value of wire value ``v`` (not None); ProtocolError(R_HEADER) when it
        breaks the rule."""
        if not _KINDS[self.kind](v):
            raise ProtocolError(
                R_HEADER, f"body field {key!r} must be {self.kind}, not {type(v).__name__}"
            )
        if (self.lo is not None and v < self.lo) or (self.hi is not None and v > self.hi):
            raise ProtocolError(
                R_HEADER, f"body field {key!r} is {v}, not in [{self.lo}, {self.hi}]"
            )
        if self.choices is not None and v not in self.choices:
            raise ProtocolError(
                R_HEADER, f"body field {key!r} is {v!r}, not one of {sorted(self.choices)}"
            )
        return v if self.read is None else self.read(key, v)


def wire_field(
    kind: str,
    default: Any = MISSING,
    *,
    lo: int | None = None,
    hi: int | None = None,
    choices: Collection[str] | None = None,
    always: bool = False,
    read: Callable[[str, Any], Any] | None = None,
    write: Callable[[Any], Any] | None = None,
) -> Any:
    """A dataclass field with its wire rule: ``kind`` of the wire value; no ``default``: the
    body needs it; ``lo``/``hi``: inclusive bounds; ``choices``: the values it may take;
    ``always``: sent even at its default; ``read(key, wire value)`` / ``write(value)``:
    converters between wire and field values (``read`` raises ProtocolError when malformed).
    """
    rule = WireRule(kind, default is MISSING, lo, hi, choices, always, read, write)
    return field(default=default, metadata={"wire": rule})


def _strings(key: str, v: list[Any]) -> tuple[str, ...]:
    if not all(isinstance(s, str) for s in v):
        raise ProtocolError(R_HEADER, f"body field {key!r} must be a list of strings")
    return tuple(v)


MAX_NOTICES = 8  # notices a push or heartbeat may carry (a worker keeps its first ones)
NOTICE_CHARS = 300  # the longest notice a push or heartbeat may carry


def _notices(key: str, v: list[Any]) -> tuple[str, ...]:
    items = _strings(key, v)
    if len(items) > MAX_NOTICES or any(len(s) > NOTICE_CHARS for s in items):
        raise ProtocolError(
            R_HEADER,
            f"body field {key!r}: at most {MAX_NOTICES} notices of at most {NOTICE_CHARS} "
            "characters each",
        )
    return items


def _bound(key: str, v: float) -> float:
    if not math.isfinite(v) or v < 0:
        raise ProtocolError(R_HEADER, f"body field {key!r} is {v}, not a finite number >= 0")
    return float(v)


def _body_map(body: Any) -> Mapping[str, Any]:
    if not isinstance(body, Mapping):
        raise ProtocolError(R_HEADER, f"body must be a map, not {type(body).__name__}")
    return body


class Body:
    """A typed body: a frozen dataclass whose fields are declared with ``wire_field``."""

    def to_body(self) -> dict[str, Any]:
        """The body map, in field order."""
        body: dict[str, Any] = {}
        for f in fields(self):  # type: ignore[arg-type]
            rule: WireRule = f.metadata["wire"]
            v = getattr(self, f.name)
            if v is None or (not rule.always and f.default is not MISSING and v == f.default):
                continue
            body[f.name] = v if rule.write is None else rule.write(v)
        return body

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> Self:
        """Read a body map; ProtocolError(R_HEADER) on a missing required field, a field of
        the wrong kind or out of range, or values that do not make a valid body."""
        b = _body_map(body)
        values: dict[str, Any] = {}
        for f in fields(cls):  # type: ignore[arg-type]
            rule: WireRule = f.metadata["wire"]
            v = b.get(f.name)
            if v is not None:
                values[f.name] = rule.load(f.name, v)
            elif rule.required:
                raise ProtocolError(R_HEADER, f"{cls.__name__} needs body field {f.name!r}")
        try:
            read = cls(**values)
        except ValueError as exc:
            raise ProtocolError(R_HEADER, f"{cls.__name__}: {exc}") from None
        read.validate()
        return read

    def validate(self) -> None:
        """Checks across fields after ``from_body`` (ProtocolError); none by default."""


BASELINE_ROW_IDS = frozenset({"int64"})  # the row ids every peer of protocol version 1 decodes
MAX_ACCEPTED = 64  # names in one list of a hello's ``accepts``


def _accepted(known: frozenset[str], floor: frozenset[str]) -> Callable[[str, Any], frozenset[str]]:
    """The ``read`` of an ``Accepts`` list: at most MAX_ACCEPTED strings holding ``floor``;
    names outside ``known`` are dropped (a newer peer's, which this one never sends)."""

    def read(key: str, v: list[Any]) -> frozenset[str]:
        names = _strings(key, v)
        if len(names) > MAX_ACCEPTED:
            raise ProtocolError(
                R_HEADER, f"{key!r} lists {len(names)} names, at most {MAX_ACCEPTED}"
            )
        missing = floor.difference(names)
        if missing:
            raise ProtocolError(
                R_HEADER,
                f"{key!r} leaves out {', '.join(sorted(missing))}, which every peer of this "
                "protocol version decodes",
            )
        return known.intersection(names)

    return read


@dataclass(frozen=True)
class Accepts(Body):
    """What a client decodes in the replies it is sent, stated in its hello (``accepts``).

    ``encodings``: tensor encodings, ``row_ids``: the index dtypes of a row reply's ids. Each
    list must hold the baseline's (``dense``, ``sparse`` and ``bf16``; ``int64``) and names
    this peer does not know are ignored; a list left out is the baseline's. The server sends
    the sender nothing else: a bf16 pull's rows in float32 without ``sparse_bf16`` /
    ``keyed_bf16`` (``rounds``), a fixed table's row numbers int64 without ``int32``
    (``row_numbers``). ``ACCEPTS_BASELINE`` is what a sender that states nothing accepts."""

    encodings: frozenset[str] = wire_field(
        "list",
        BASELINE_ENCODINGS,
        read=_accepted(ENCODINGS, BASELINE_ENCODINGS & REPLY_ENCODINGS),
        write=sorted,
    )
    row_ids: frozenset[str] = wire_field(
        "list", BASELINE_ROW_IDS, read=_accepted(INDEX_DTYPES, BASELINE_ROW_IDS), write=sorted
    )

    @cached_property
    def everything(self) -> bool:
        """Whether the peer decodes every encoding a reply may carry and int32 row ids: its
        replies are sent as they are."""
        return self.encodings >= REPLY_ENCODINGS and "int32" in self.row_ids

    def rounds(self, t: Any) -> bool:
        """Whether ``t`` (an array, a fixed table's rows or a dynamic table's) goes rounded to
        bfloat16 to this peer when it pulls in bf16: it decodes the rounded form."""
        if self.everything:
            return True
        if isinstance(t, Payload) and t.row_sparse:
            return (KEYED_BF16 if t.keyed else SPARSE_BF16) in self.encodings
        return BF16 in self.encodings

    def row_numbers(self, ids: np.ndarray, rows: int) -> np.ndarray:
        """Row numbers ``ids`` (int64) of a table of ``rows`` rows as this peer takes them:
        int32 where they fit and it decodes them (``downpour.wire.row_numbers``), else int64."""
        return row_numbers(ids, rows) if "int32" in self.row_ids else ids


ACCEPTS_BASELINE = Accepts()  # what a client that states nothing is sent
ACCEPTS_ALL = Accepts(ENCODINGS, INDEX_DTYPES)  # everything this peer decodes


def _read_accepts(key: str, v: Mapping[str, Any]) -> Accepts:
    try:
        return Accepts.from_body(v)
    except ProtocolError as exc:
        raise ProtocolError(R_HEADER, f"body field {key!r}: {exc.message}") from None


@dataclass(frozen=True)
class HelloRequest(Body):
    """A worker's hello: its model and how it splits the model over the shards.

    A hello without ``partition`` (a plain client) is accepted by an unsharded server.
    ``process`` is a token of the sender's process: a hello from the same worker id with
    another token is a restarted worker (a dispatching server takes back its splits).
    ``accepts``: what the sender decodes in replies (``Accepts``); None: the baseline
    (``ACCEPTS_BASELINE``).
    """

    fingerprint: str | None = wire_field("str", None)
    model: str | None = wire_field("str", None)
    variables: int | None = wire_field("int", None)
    shard: int | None = wire_field("int", None)
    num_shards: int | None = wire_field("int", None)
    partition: str | None = wire_field("str", None)
    process: str | None = wire_field("str", None)
    accepts: Accepts | None = wire_field("map", None, read=_read_accepts, write=Accepts.to_body)


@dataclass(frozen=True)
class HelloReply(Body):
    """The server's answer to hello (the message's base_version is its weight version).

    ``encodings``: the tensor encodings the server decodes (``downpour.wire.ENCODINGS``);
    ``policy``: its staleness policy, e.g. ``sync:2/2``; ``row_tables``: the wire names of
    the variables it serves by row. A reply without ``encodings`` or ``row_tables`` reads as
    None: the reply does not say. ``worker_index``: the sender's index in the order this
    server first heard of each worker id; ``workers``: how many ids it knows now.
    ``job_workers``: the server ends its job once that many workers have finished, so a
    worker tells it when it finishes (``HeartbeatRequest.finished``); None: it does not.
    """

    push_port: int = wire_field("int", lo=1, hi=65535)
    status_port: int | None = wire_field("int", None)
    fingerprint: str | None = wire_field("str", None)
    model: str | None = wire_field("str", None)
    last_seq: int = wire_field("int", 0, always=True)
    payload_bytes: int | None = wire_field("int", None)
    incarnation: str | None = wire_field("str", None)
    encodings: tuple[str, ...] | None = wire_field("list", None, read=_strings, write=list)
    policy: str = wire_field("str", "", always=True)
    shard: int | None = wire_field("int", None)
    num_shards: int | None = wire_field("int", None)
    partition: str | None = wire_field("str", None)
    # bigger requests get the connection dropped
    max_request_bytes: int | None = wire_field("int", None)
    row_tables: tuple[str, ...] | None = wire_field("list", None, read=_strings, write=list)
    worker_index: int | None = wire_field("int", None, lo=0)
    workers: int | None = wire_field("int", None, lo=0)
    job_workers: int | None = wire_field("int", None, lo=1)


MAX_WAIT_MS = 60_000  # the longest "ask again after" a reply may ask for


@dataclass(frozen=True)
class PullRequest(Body):
    """A weight pull. ``have``: the version the sender holds from server ``incarnation``
    (None: it holds none, send everything). ``encoding``: dense or bf16 weights (which
    encodings a server serves is the server's check). ``pushed``: the seq of the sender's
    latest push (an ssp server counts the pushes it has not received yet). ``rows_only``:
    with a row request, send the requested rows and nothing else. ``bound``: send the
    weights only if they moved by more than that fraction of their norm since ``have``,
    else answer ``unchanged`` (``downpour.server.policies.movement``); a server that does not know
    the field sends them."""

    have: int | None = wire_field("int", None)
    incarnation: str | None = wire_field("str", None)
    encoding: str = wire_field("str", DENSE)
    pushed: int | None = wire_field("int", None)
    rows_only: bool = wire_field("bool", False)
    bound: float | None = wire_field("float", None, read=_bound)


@dataclass(frozen=True)
class PullReply(Body):
    """The body of a weights reply: the server's ``incarnation``; ``unchanged`` when the
    sender's version is current (no tensors follow); ``dropped_stale``: how many of the
    sender's gradients the policy dropped as too old since its last pull; ``wait_ms`` > 0:
    the policy holds this pull (ssp: the sender is too far ahead), no tensors follow, ask
    again after that many milliseconds. ``dense_version``: under a hybrid policy, on a shard
    holding dense variables, the dense updates it has made (the version its dense half's
    rounds count: row applies move the reply's version but not this); absent otherwise.
    ``moved``: with ``unchanged``, to a pull with a ``bound``, the estimated fraction of
    their norm the weights moved since the sender's version (at most the bound: the sender
    computes on the weights it holds). A worker that does not know these fields ignores
    them."""

    incarnation: str | None = wire_field("str", None)
    unchanged: bool = wire_field("bool", False)
    dropped_stale: int = wire_field("int", 0, lo=0)
    wait_ms: int = wire_field("int", 0, lo=0, hi=MAX_WAIT_MS)
    dense_version: int | None = wire_field("int", None, lo=0)
    moved: float | None = wire_field("float", None, read=_bound)


def _read_position(key: str, v: list[Any]) -> tuple[int, int, int]:
    ok = len(v) == 3 and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v)
    if not ok:
        raise ProtocolError(R_HEADER, f"{key} {v!r} is not [epoch, index, batches] (ints >= 0)")
    return (v[0], v[1], v[2])


@dataclass(frozen=True)
class PushBody(Body):
    """The scalars a gradient push carries: the last batch's loss, the batch size, the
    worker's step count and its figures (``downpour.runtime.metrics.WORKER_REPORTED``). Under
    ``--data-dispatch server``, ``split`` is ``[epoch, index, batches]``: with this push the
    worker has sent the gradients of the first ``batches`` batches of that split, so a
    split taken back from a worker that died resumes after them. ``notices``: the slow or
    degraded paths the worker runs on (``downpour.runtime.metrics.Notices``), sent while it has any;
    a server that does not know the field ignores it."""

    loss: float | None = wire_field("float", None)
    batch_size: int | None = wire_field("int", None)
    steps: int | None = wire_field("int", None)
    stats: Mapping[str, float] | None = wire_field("map", None)
    split: tuple[int, int, int] | None = wire_field("list", None, read=_read_position, write=list)
    notices: tuple[str, ...] | None = wire_field("list", None, read=_notices, write=list)


@dataclass(frozen=True)
class HeartbeatRequest(Body):
    """A silent worker's "still alive", with its figures. ``finished``: sent once the worker
    has done its epochs or steps, the sequence number of its last push (0: it pushed none),
    so a server counts it finished once that push has arrived (``--job-workers``).
    ``notices``: as a push's. A server that does not know these fields ignores them."""

    stats: Mapping[str, float] | None = wire_field("map", None)
    finished: int | None = wire_field("int", None, lo=0)
    notices: tuple[str, ...] | None = wire_field("list", None, read=_notices, write=list)


@dataclass(frozen=True)
class HeartbeatReply(Body):
    """The server's answer to a heartbeat (base_version: its weight version)."""

    incarnation: str | None = wire_field("str", None)


STATUS_ACKS = ("done",)


@dataclass(frozen=True)
class StatusRequest(Body):
    """A status request: empty for a plain read. ``ack="done"``: the reader (a job's chief)
    has what it needs from a server whose job has ended, which may exit now instead of
    lingering (``--linger-after-done``); ignored while the job runs."""

    ack: str | None = wire_field("str", None, choices=STATUS_ACKS)


@dataclass(frozen=True)
class StatusReply:
    """A status reply: the server's status document (plain types, JSON-serialisable)."""

    doc: Mapping[str, Any]

    def to_body(self) -> dict[str, Any]:
        """The status reply body map: the document itself."""
        return dict(self.doc)

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> StatusReply:
        """Read a status body (any map is a document)."""
        return cls(dict(_body_map(body)))


@dataclass(frozen=True)
class ErrorReply(Body):
    """An ERROR reply: a stable reason ``code`` (the R_* names) and a text for people."""

    code: str = wire_field("str")
    message: str = wire_field("str", "", always=True)

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> Self:
        """Read an error body; a missing or mistyped code reads as R_INTERNAL, a mistyped
        message as its text: an error reply is reported, never refused."""
        b = _body_map(body)
        code = b.get("code")
        message = b.get("message")
        return cls(
            code if isinstance(code, str) else R_INTERNAL,
            message if isinstance(message, str) else str(message or ""),
        )


MAX_FILES = 4096  # a header list holds at most Limits.max_tensors items
MAX_SPLITS = 1 << 20  # splits of an element universe (bounds the dispatcher's memory)
MAX_ACKS = 1024  # acks in one split request
GRANTS = ("split", "wait", "end")


@dataclass(frozen=True)
class DataUniverse(Body):
    """What a dispatched ``input_fn`` shards over: ``files`` (one split each, at most
    MAX_FILES), or ``elements`` divided into splits of ``split_size`` (at most MAX_SPLITS).
    ValueError when it is neither, or out of bounds."""

    files: tuple[str, ...] | None = wire_field("list", None, read=_strings, write=list)
    elements: int | None = wire_field("int", None)
    split_size: int | None = wire_field("int", None)

    def __post_init__(self) -> None:
        if (self.files is None) == (self.elements is None):
            raise ValueError("a data universe is either files or elements (with split_size)")
        if self.files is not None:
            if not 1 <= len(self.files) <= MAX_FILES:
                raise ValueError(f"{len(self.files)} files: between 1 and {MAX_FILES} please")
            if not all(isinstance(f, str) and f for f in self.files):
                raise ValueError("every file name must be a non-empty string")
            if len(set(self.files)) != len(self.files):
                raise ValueError("the file list names a file twice")
            if self.split_size is not None:
                raise ValueError("split_size applies to elements, not files")
            return
        assert self.elements is not None
        if self.elements < 1 or self.split_size is None or self.split_size < 1:
            raise ValueError(
                f"elements ({self.elements}) and split_size ({self.split_size}) must be >= 1"
            )
        if self.num_splits > MAX_SPLITS:
            raise ValueError(
                f"{self.elements} elements in splits of {self.split_size} make "
                f"{self.num_splits} splits, more than {MAX_SPLITS}: use a larger split_size"
            )

    @property
    def num_splits(self) -> int:
        """Splits per epoch: one per file, or ceil(elements / split_size)."""
        if self.files is not None:
            return len(self.files)
        assert self.elements is not None and self.split_size is not None
        return -(-self.elements // self.split_size)

    def digest(self) -> str:
        """SHA-256 (hex) of the canonical universe: equal for equal data descriptions."""
        canon = json.dumps(self.to_body(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canon.encode()).hexdigest()

    def describe(self) -> str:
        """A short text for logs and status, e.g. ``12 files`` or ``60000 elements / 1000``."""
        if self.files is not None:
            return f"{len(self.files)} files"
        return f"{self.elements} elements / {self.split_size}"


def _digest(key: str, v: str) -> str:
    if len(v) != 64:
        raise ProtocolError(R_HEADER, f"body field {key!r}: the universe's 64-hex digest")
    return v


def _read_acks(key: str, v: list[Any]) -> tuple[tuple[int, int, int], ...]:
    if len(v) > MAX_ACKS:
        raise ProtocolError(R_HEADER, f"{len(v)} acks in one request (max {MAX_ACKS})")
    acks = []
    for a in v:
        ok = isinstance(a, list) and len(a) in (2, 3)
        ok = ok and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in a)
        if not ok:
            raise ProtocolError(
                R_HEADER, f"ack {a!r} is not [epoch, index] or [epoch, index, seq] (ints >= 0)"
            )
        acks.append((a[0], a[1], a[2] if len(a) == 3 else 0))
    return tuple(acks)


def _write_acks(acks: tuple[tuple[int, int, int], ...]) -> list[list[int]]:
    """Acks as lists; one with seq 0 goes as an [epoch, index] pair."""
    return [[e, i, s] if s else [e, i] for e, i, s in acks]


def _read_universe(key: str, v: Mapping[str, Any]) -> DataUniverse:
    return DataUniverse.from_body(v)


@dataclass(frozen=True)
class SplitRequest(Body):
    """A worker asks the dispatcher for its next split and reports the ones it finished.

    ``digest``: its universe's (always). ``acks``: (epoch, index, seq) of finished splits,
    ``seq`` the sequence number of the push that carried the split's last gradients: the
    dispatcher completes the ack only once that push has reached it, so an ack never
    overtakes its gradients (0: wait for no push; an (epoch, index) pair means seq 0).
    ``want``: False to only acknowledge. ``universe`` and ``epochs`` (0: unbounded) on the
    first call; the first worker's universe and bound are the ones served. ``process``: a
    token of the sender's process (a new one releases what the old process held).
    """

    digest: str = wire_field("str", read=_digest)
    acks: tuple[tuple[int, ...], ...] = wire_field("list", (), read=_read_acks, write=_write_acks)
    want: bool = wire_field("bool", True, always=True)
    universe: DataUniverse | None = wire_field(
        "map", None, read=_read_universe, write=DataUniverse.to_body
    )
    epochs: int | None = wire_field("int", None, lo=0)
    process: str | None = wire_field("str", None)

    def __post_init__(self) -> None:
        # every ack as (epoch, index, seq): a pair waits for no push
        acks = tuple((int(a[0]), int(a[1]), int(a[2]) if len(a) > 2 else 0) for a in self.acks)
        object.__setattr__(self, "acks", acks)


@dataclass(frozen=True)
class SplitReply(Body):
    """The dispatcher's answer. ``grant``: "split" (``index`` and ``file`` or ``[start,
    stop)`` of ``epoch``), "wait" (ask again after ``retry_ms``: the epoch's last splits are
    in flight elsewhere) or "end" (the epoch bound is reached). ``skip``: batches of the split
    whose gradients an earlier holder sent (a worker that died in it): read after them.
    ``acked`` / ``held`` /
    ``stale``: how many of the request's acks completed a lease / are held until the push
    they name arrives (then they complete, the worker need not send them again) / were
    ignored (not leased to the sender).
    """

    grant: str = wire_field("str", choices=GRANTS)
    epoch: int = wire_field("int", lo=0)
    index: int | None = wire_field("int", None)
    file: str | None = wire_field("str", None)
    start: int | None = wire_field("int", None)
    stop: int | None = wire_field("int", None)
    retry_ms: int = wire_field("int", 0, always=True)
    acked: int = wire_field("int", 0, always=True)
    stale: int = wire_field("int", 0, always=True)
    held: int = wire_field("int", 0, always=True)
    skip: int = wire_field("int", 0, lo=0)

    def validate(self) -> None:
        """A split names its index and a file or a non-empty range."""
        if self.grant != "split":
            return
        ranged = self.start is not None and self.stop is not None and 0 <= self.start < self.stop
        if self.index is None or self.index < 0 or (self.file is None and not ranged):
            raise ProtocolError(R_HEADER, "a split reply needs an index and a file or range")
