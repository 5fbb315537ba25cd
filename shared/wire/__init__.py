"""The downpour wire protocol. This module is the spec, and the only one that imports msgpack.

A message is one ZeroMQ multipart message::

    frame 0         header: a msgpack map, at most ``Limits.max_header_bytes``
    frame 1 .. n    tensor payloads in descriptor order, raw little-endian C-order bytes:
                    a ``dense`` or ``bf16`` tensor takes one frame, a ``sparse``,
                    ``sparse_bf16``, ``keyed``, ``keyed_bf16`` or ``topk`` tensor two
                    (indices, then values)

Header map (string keys; msgpack ext types are refused, nothing is ever unpickled)::

    version       int    PROTOCOL_VERSION; a peer with another version gets ERROR "version"
    type          str    one of MSG_TYPES
    sender        str    worker id, or "server"
    seq           int    sender's sequence number (pushes: strictly increasing per worker id)
    base_version  int    the weight version the payload was computed from (push) or the
                         version the sender holds / is sent (pull, weights)
    tensors       list   one descriptor map per tensor, see below
    body          map    type-specific scalars, strings, lists and maps

Tensor descriptor::

    name          str    variable name (unique within a message)
    dtype         str    numpy dtype name from ALLOWED_DTYPES: the logical dtype, the one
                         the decoded tensor has (bf16: one of BF16_DTYPES)
    shape         list   dense shape, each dim >= 0, at most Limits.max_ndim dims
    encoding      str    "dense" | "sparse" | "bf16" | "topk" | "sparse_bf16" | "keyed" |
                         "keyed_bf16" | "keyed_counted" | "keyed_counted_bf16": a name in
                         ``CODECS``
    nbytes        int    bytes of the values frame; dense: prod(shape) * itemsize;
                         bf16: prod(shape) * 2; sparse, topk, sparse_bf16: see nnz
    nnz           int    sparse, topk, sparse_bf16 only. sparse: rows present, values
                         frame is (nnz, *shape[1:]) of dtype; sparse_bf16: the same
                         rows, 2 bytes a value (nbytes = nnz * prod(shape[1:]) * 2, dtype
                         one of BF16_DTYPES); topk: elements present, nnz <= prod(shape),
                         values frame is (nnz,) of dtype
    index_dtype   str    sparse, topk, sparse_bf16 only: "int32" | "int64"; indices frame
                         is (nnz,). sparse, sparse_bf16: row numbers in [0, shape[0]);
                         keyed and its forms: ids, any value; topk: positions in the
                         C-order flattened tensor, in [0, prod(shape))

Encodings (compressed gradients ``downpour worker --compress``, compressed pulls
``--pull-compress``)::

    dense    the tensor's bytes as they are
    sparse   ``tf.IndexedSlices`` rows: decodes to ``Sparse``; repeated rows are summed.
             A worker pushes each row once, by int32 row number when the table has fewer
             than 2**31 rows (``pushed_rows``)
    bf16     a float tensor rounded to bfloat16 (the upper 16 bits of a float32, rounded to
             nearest even): one frame of prod(shape) little-endian 2-byte values. Decodes to
             a fresh array of the logical dtype (a float32 gradient stays float32)
    topk     the k largest-magnitude elements of a tensor: decodes to ``FlatSparse``, whose
             ``to_dense()`` scatters the values into zeros; repeated positions are summed
    sparse_bf16
             ``sparse`` rows whose values are rounded to bfloat16 as ``bf16`` does (the rows
             of a row reply to a pull asking for "bf16", and row gradients pushed under
             ``--compress bf16``): the same indices frame, then a values frame of
             nnz * prod(shape[1:]) little-endian 2-byte values. Decodes to ``Sparse`` whose
             values are a fresh array of the logical dtype
    keyed    rows of a dynamic table (``downpour.layers.DynamicEmbedding``): ``sparse``
             whose indices are ids of any int64 (or int32) value, not row numbers; the
             shape is the table's declared one. Decodes to ``Keyed``
    keyed_bf16
             ``keyed`` rows with bf16 values, as ``sparse_bf16``; decodes to ``Keyed``
    keyed_counted
             ``keyed`` rows with each id once and the lookups each row sums: the indices
             and values frames of ``keyed``, then a counts frame of nnz little-endian int32,
             each >= 1 (a count below 1 is refused as "counts"). What a worker pushes for
             a dynamic table (``pushed_rows``): the server counts lookups for admission and
             per row. Decodes to ``Keyed`` with ``counts``
    keyed_counted_bf16
             ``keyed_counted`` with bf16 values, as ``keyed_bf16`` (pushed under
             ``--compress bf16``)
    Each encoding is one codec in ``CODECS`` (``downpour.wire.codecs``), the table encode and
    decode both go through; a server's hello reply lists them as its "encodings". An
    encoding the receiver has no codec for is refused as "bad_header".

Message types (REQ/REP unless noted)::

    hello    -> hello      worker announces protocol + model fingerprint and what it decodes
                           in replies ("accepts", see "What a client accepts" below); reply
                           carries the server version, gradient port, the worker's last
                           accepted seq, the "encodings" the server decodes and its staleness
                           "policy"
    pull     -> weights    body {"have": V, "incarnation": I} when the sender holds version V
                           from server incarnation I (omitted when it holds none); reply
                           base_version = current version with all tensors, or body
                           {"unchanged": true} and no tensors when it is still V of I.
                           A pull may be a row request, see "Row requests" below.
                           Replies to hello and pull carry the server's "incarnation" (random
                           per start), so versions from before a restart are never confused.
                           A pull reply carries "dropped_stale": n when the server's policy
                           dropped n of the sender's gradients as too old since its last pull.
                           A pull body may carry "encoding": "bf16" (default "dense"): the
                           weights then travel as bf16 tensors (half the bytes), and
                           "pushed": the seq of the sender's latest push. A server whose
                           policy holds pulls (ssp:K) may answer {"unchanged": true,
                           "wait_ms": n} and no tensors: ask again after n ms.
    push     (PUSH/PULL)   gradients + base_version + seq; body {"loss", "batch_size", "steps",
                           "stats"}
    heartbeat -> heartbeat a worker that is otherwise silent says it is alive; body = its
                           figures; reply base_version = current version
    status   -> status     body = metrics snapshot (status socket)
    split    -> split      data dispatch (``--data-dispatch server``, shard 0 only): body
                           ``SplitRequest`` (the universe digest, acks of finished splits as
                           [epoch, index, seq] triples -- seq: the push that carried the
                           split's last gradients; [epoch, index] waits for no push -- the
                           universe itself and an epoch bound on the first call, the
                           sender's process token); reply body ``SplitReply``: a split
                           (index, file or [start, stop)) of an epoch, or "wait" (retry after
                           retry_ms), or "end", and how many acks completed, were held until
                           their push arrives, or were stale. A server that does not
                           dispatch answers ERROR "dispatch_off"; another universe's digest,
                           ERROR "data_universe"
    any      -> error      body {"code": reason, "message": text}
    Bodies are built and read by the typed classes of ``downpour.wire.bodies`` (``HelloRequest``
    ... ``SplitReply``, importable from here); a missing required field, a field of the wrong
    type or out of range is refused as "bad_header"; keys a body does not declare are ignored.

Row requests (row-sparse tables, e.g. Embeddings: the hello reply's "row_tables" names them)::

    request  a pull whose tensors are row ids: one ``dense`` 1-D int32 or int64 tensor per
             table, named by the table's wire name, listing the rows wanted (in the frame
             after the header, zero-copy like any tensor). Decode refuses a pull tensor of
             more than ``Limits.max_pull_rows`` elements (``rows_too_many``) from the header,
             before any frame is read. The server refuses a name that is no variable of its
             (``rows_unknown``) or a dense one (``rows_dense``), ids that are not a dense
             1-D int32/int64 list (``rows_dtype``; another encoding: ``bad_header``), ids
             < 0 (``rows_negative``) and ids >= the table's rows (``rows_range``), in that
             order; it removes duplicates before gathering.
    reply    a weights message. Each requested table comes as a ``sparse`` tensor (a
             dynamic table's as ``keyed``): its unique requested ids, sorted (int32 when
             the table's rows on the shard number fewer than 2**31, ``row_numbers``, and the
             sender accepts int32 ids; a dynamic table's int64), and those rows' values at
             the reply's base_version; an empty id list gives an empty table entry. A request
             body with "encoding": "bf16" gets float32 and float64 tables' rows as
             ``sparse_bf16`` (``keyed_bf16``; the same ids, values in half the bytes) when the
             sender accepts them, and the whole variables as ``bf16``. A worker asks
             for a fixed table's rows by int32 ids where they fit, too. The other variables
             come whole as in a plain pull (a row-sparse table not named in the request, too:
             that is a first full load), or are left out with body {"unchanged": true} when
             the sender's "have" is still current: "unchanged" then speaks of the whole
             variables only, and the requested rows are sent all the same. A request body
             {"rows_only": true} leaves out every variable but the requested rows (a worker
             topping up rows between its regular pulls); without row ids it is a plain
             pull. Tensors keep the server's variable order.

What a client accepts (the hello body's "accepts", ``Accepts``)::

    accepts  {"encodings": [...], "row_ids": [...]}: the tensor encodings and the index
             dtypes of row ids the sender decodes in replies. Each list holds the baseline's
             names (encodings: ``dense``, ``sparse`` and ``bf16``; row_ids: ``int64``) and
             at most MAX_ACCEPTED names; a list left out is the baseline's. Names the server
             does not know are ignored: a newer client lists encodings added after the
             server. A list that is not a list of strings, is longer or leaves out a
             baseline name is refused as "bad_header" (the hello is counted in rejected).
    baseline ``BASELINE_ENCODINGS`` (dense, sparse, bf16, topk) and int64 row ids, the
             encodings of protocol version 1 as first published: what the server sends a
             sender that states nothing, in its hello or by never saying hello.
    replies  the server keeps each sender's accepts from its latest hello and sends it
             nothing else: a bf16 pull's rows go as ``sparse_bf16`` / ``keyed_bf16`` only to
             a sender that accepts them, as float32 ``sparse`` / ``keyed`` otherwise (the
             values exact); a fixed table's row numbers go as int32 only to a sender that
             accepts int32, as int64 otherwise. A dynamic table's rows travel only as
             ``keyed``, which has no baseline form: a sender that states nothing is sent
             ``keyed`` (float32 values, int64 ids), and a hello whose accepts leave out
             ``keyed`` is refused by a shard holding a dynamic table (ERROR "accepts"). The
             changes under protocol version 1 and what an older peer sees of each:
             docs/wire.md's changelog.

Decoding validates before it allocates: a first pass checks every descriptor (dtype in
``ALLOWED_DTYPES``, the encoding's own fields by its codec, ``nbytes`` against the shape,
tensor counts and totals against ``Limits``) and the frame count; a second pass has each
codec check its frames' lengths and build its tensor. msgpack's own limits apply with
``strict_map_key``; no ext types; never pickle. Dense payloads are sent ``copy=False`` and
decoded as zero-copy ``np.frombuffer`` views: no copy on either side.
The server sizes its limits from the model (``Limits.for_payload``), sets ZeroMQ's
``MAXMSGSIZE`` (a bound per frame) on its gradient socket to the same total, and receives
every message within a bound on its frames and bytes in all (``downpour.net.receive``; the bounds
per socket are in docs/security.md): past it a message is dropped unread (``oversize``).
``decode(frames, limits, types)`` refuses a type the receiving socket does not serve
(``wrong_socket``) from the header, before any tensor is looked at. ``PROTOCOL_VERSION`` is
checked on every message.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from downpour.wire.bodies import (
    ACCEPTS_ALL,
    ACCEPTS_BASELINE,
    BASELINE_ROW_IDS,
    GRANTS,
    MAX_ACCEPTED,
    MAX_ACKS,
    MAX_FILES,
    MAX_SPLITS,
    MAX_WAIT_MS,
    Accepts,
    Body,
    DataUniverse,
    ErrorReply,
    HeartbeatReply,
    HeartbeatRequest,
    HelloReply,
    HelloRequest,
    PullReply,
    PullRequest,
    PushBody,
    SplitReply,
    SplitRequest,
    StatusReply,
    StatusRequest,
    wire_field,
)
from downpour.wire.codecs import (
    BASELINE_ENCODINGS,
    BF16,
    CODECS,
    DENSE,
    ENCODINGS,
    KEYED,
    KEYED_BF16,
    KEYED_COUNTED,
    KEYED_COUNTED_BF16,
    REPLY_ENCODINGS,
    SPARSE,
    SPARSE_BF16,
    TOPK,
    Codec,
    Slot,
    codec_for,
    wire_count,
    wire_dtype,
)
from downpour.wire.payloads import (
    ALLOWED_DTYPES,
    BF16_DTYPES,
    INDEX_DTYPES,
    BFloat16,
    FlatSparse,
    Keyed,
    KeyedBF16,
    Payload,
    Sparse,
    SparseBF16,
    Tensor,
    WireTensor,
    all_finite,
    as_bf16,
    counted_rows,
    dedupe_rows,
    densify,
    is_keyed,
    is_rows,
    logical_dtype,
    logical_shape,
    pushed_rows,
    row_numbers,
    row_range,
    rows_of,
    unique_rows,
    values_of,
)
from downpour.wire.protocol import (
    DEFAULT_LIMITS,
    MAX_STATUS_WORKERS,
    R_ACCEPTS,
    R_COUNT,
    R_COUNTS,
    R_DISPATCH_OFF,
    R_DTYPE,
    R_DUPLICATE,
    R_FINGERPRINT,
    R_FUTURE,
    R_HEADER,
    R_INTERNAL,
    R_NAME,
    R_NBYTES,
    R_NONFINITE,
    R_OVERSIZE,
    R_PARTITION,
    R_ROWS_DENSE,
    R_ROWS_DTYPE,
    R_ROWS_NEGATIVE,
    R_ROWS_RANGE,
    R_ROWS_TOO_MANY,
    R_ROWS_UNKNOWN,
    R_SHAPE,
    R_TOO_LARGE,
    R_TOO_MANY_WORKERS,
    R_TRUNCATED,
    R_TYPE,
    R_UNIVERSE,
    R_VERSION,
    R_WRONG_SOCKET,
    STATUS_LIMITS,
    Limits,
    ProtocolError,
)

# downpour.wire is the public import of the protocol: everything above is re-exported.
__all__ = [
    "ACCEPTS_ALL",
    "ACCEPTS_BASELINE",
    "ALLOWED_DTYPES",
    "BASELINE_ENCODINGS",
    "BASELINE_ROW_IDS",
    "BF16",
    "BF16_DTYPES",
    "CODECS",
    "DEFAULT_LIMITS",
    "DENSE",
    "ENCODINGS",
    "ERROR",
    "GRANTS",
    "HEARTBEAT",
    "HELLO",
    "INDEX_DTYPES",
    "MAX_ACCEPTED",
    "MAX_ACKS",
    "MAX_FILES",
    "MAX_SPLITS",
    "MAX_STATUS_WORKERS",
    "MAX_WAIT_MS",
    "MSG_TYPES",
    "PROTOCOL_VERSION",
    "PULL",
    "PUSH",
    "REQUEST_DROP_FACTOR",
    "REPLY_ENCODINGS",
    "REQUEST_MAX_BYTES",
    "R_ACCEPTS",
    "R_COUNT",
    "R_COUNTS",
    "R_DISPATCH_OFF",
    "R_DTYPE",
    "R_DUPLICATE",
    "R_FINGERPRINT",
    "R_FUTURE",
    "R_HEADER",
    "R_INTERNAL",
    "R_NAME",
    "R_NBYTES",
    "R_NONFINITE",
    "R_OVERSIZE",
    "R_PARTITION",
    "R_ROWS_DENSE",
    "R_ROWS_DTYPE",
    "R_ROWS_NEGATIVE",
    "R_ROWS_RANGE",
    "R_ROWS_TOO_MANY",
    "R_ROWS_UNKNOWN",
    "R_SHAPE",
    "R_TOO_LARGE",
    "R_TOO_MANY_WORKERS",
    "R_TRUNCATED",
    "R_TYPE",
    "R_UNIVERSE",
    "R_VERSION",
    "R_WRONG_SOCKET",
    "SPARSE",
    "SPARSE_BF16",
    "KEYED",
    "KEYED_BF16",
    "KEYED_COUNTED",
    "KEYED_COUNTED_BF16",
    "SPLIT",
    "STATUS",
    "STATUS_LIMITS",
    "TOPK",
    "WEIGHTS",
    "Accepts",
    "BFloat16",
    "Body",
    "Codec",
    "DataUniverse",
    "ErrorReply",
    "FlatSparse",
    "HeartbeatReply",
    "HeartbeatRequest",
    "HelloReply",
    "HelloRequest",
    "Keyed",
    "KeyedBF16",
    "Limits",
    "Message",
    "Payload",
    "ProtocolError",
    "PullReply",
    "PullRequest",
    "PushBody",
    "Sparse",
    "SparseBF16",
    "SplitReply",
    "SplitRequest",
    "StatusReply",
    "StatusRequest",
    "Tensor",
    "WireTensor",
    "all_finite",
    "as_bf16",
    "counted_rows",
    "decode",
    "dedupe_rows",
    "densify",
    "encode",
    "error_message",
    "expect",
    "heartbeat_reply",
    "heartbeat_request",
    "hello_reply",
    "hello_request",
    "is_keyed",
    "is_rows",
    "logical_dtype",
    "logical_shape",
    "pull_request",
    "push_message",
    "pushed_rows",
    "request_max_bytes",
    "row_numbers",
    "row_range",
    "rows_of",
    "split_reply",
    "split_request",
    "status_reply",
    "status_request",
    "unique_rows",
    "values_of",
    "weights_reply",
    "wire_field",
]

PROTOCOL_VERSION = 1

HELLO = "hello"
PULL = "pull"
WEIGHTS = "weights"
PUSH = "push"
STATUS = "status"
HEARTBEAT = "heartbeat"
SPLIT = "split"
ERROR = "error"
MSG_TYPES = frozenset({HELLO, PULL, WEIGHTS, PUSH, STATUS, HEARTBEAT, SPLIT, ERROR})

# The most a request (hello, pull, heartbeat, split) may carry; hello replies announce it. A
# client that knows it refuses a bigger request itself. The server refuses one it receives
# (ERROR ``oversize``, counted); its REP socket's ZeroMQ MAXMSGSIZE is REQUEST_DROP_FACTOR
# times the limit, a memory guard: a frame beyond that has its connection dropped unread,
# which no socket event tells apart from a peer leaving, so only the client can report it.
REQUEST_MAX_BYTES = 1 << 20
REQUEST_DROP_FACTOR = 4


def request_max_bytes(max_pull_rows: int, row_tables: int) -> int:
    """The request limit of a server whose pulls may name up to ``max_pull_rows`` int64 ids
    for each of ``row_tables`` tables: ``REQUEST_MAX_BYTES`` plus room for those ids."""
    return REQUEST_MAX_BYTES + 8 * max_pull_rows * row_tables


@dataclass
class Message:
    """One decoded or to-be-encoded message. ``tensors`` keeps insertion order."""

    type: str
    sender: str = ""
    seq: int = 0
    base_version: int = 0
    body: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, WireTensor] = field(default_factory=dict)


# ---------------------------------------------------------------- encode


def encode(msg: Message) -> list[Any]:
    """Message -> multipart frames. Tensor frames are the arrays themselves (send copy=False):
    each tensor's codec (``CODECS``, picked by its value type) gives its descriptor and frames.

    The caller must not mutate the arrays until ZeroMQ has sent them.
    """
    if msg.type not in MSG_TYPES:
        raise ValueError(f"unknown message type {msg.type!r}")
    descriptors: list[dict[str, Any]] = []
    frames: list[Any] = [b""]
    for name, t in msg.tensors.items():
        desc, tensor_frames = codec_for(t).encode(name, t)
        descriptors.append(desc)
        frames.extend(tensor_frames)
    header = {
        "version": PROTOCOL_VERSION,
        "type": msg.type,
        "sender": msg.sender,
        "seq": int(msg.seq),
        "base_version": int(msg.base_version),
        "tensors": descriptors,
        "body": msg.body,
    }
    frames[0] = msgpack.packb(header, use_bin_type=True)
    return frames


def error_message(code: str, message: str, sender: str = "server") -> Message:
    """An ERROR reply carrying a stable reason code and a human-readable message."""
    return Message(ERROR, sender=sender, body=ErrorReply(code, message).to_body())


# ---------------------------------------------------------------- decode


def _no_ext(code: int, data: bytes) -> Any:
    raise ProtocolError(R_HEADER, f"msgpack ext type {code} is not allowed")


def _buffer(frame: Any) -> memoryview:
    """A flat byte view of a frame (zmq.Frame, bytes, or an ndarray from encode)."""
    buf = getattr(frame, "buffer", None)  # zmq.Frame when received with copy=False
    mv = memoryview(buf if buf is not None else frame)
    return mv if mv.ndim == 1 and mv.format == "B" else mv.cast("B")


def _check_plain(obj: Any, depth: int = 0) -> None:
    """Header values must be str/int/float/bool/None, lists and str-keyed maps: no bytes."""
    if depth > 32:
        raise ProtocolError(R_HEADER, "header nests too deeply")
    if isinstance(obj, dict):
        for k, v in obj.items():
            if not isinstance(k, str):
                raise ProtocolError(R_HEADER, "header map keys must be strings")
            _check_plain(v, depth + 1)
    elif isinstance(obj, list):
        for v in obj:
            _check_plain(v, depth + 1)
    elif not (obj is None or isinstance(obj, str | int | float | bool)):
        raise ProtocolError(R_HEADER, f"{type(obj).__name__} is not allowed in a header")


def _unpack_header(raw: memoryview, limits: Limits) -> dict[str, Any]:
    if len(raw) > limits.max_header_bytes:
        raise ProtocolError(R_TOO_LARGE, f"header of {len(raw)} bytes exceeds limit")
    try:
        header = msgpack.unpackb(
            raw,
            raw=False,
            strict_map_key=True,
            ext_hook=_no_ext,
            max_str_len=limits.max_str_len,
            max_bin_len=0,
            max_ext_len=0,
            max_array_len=max(limits.max_tensors, limits.max_ndim, 64),
            max_map_len=max(limits.max_tensors, 64),
        )
    except ProtocolError:
        raise
    except Exception as exc:  # msgpack raises several unrelated types on bad input
        raise ProtocolError(R_HEADER, f"header is not valid msgpack: {exc}") from None
    if not isinstance(header, dict):
        raise ProtocolError(R_HEADER, "header is not a map")
    _check_plain(header)
    return header


def _str(header: Mapping[str, Any], key: str) -> str:
    v = header.get(key)
    if not isinstance(v, str):
        raise ProtocolError(R_HEADER, f"header field {key!r} must be a string")
    return v


def _shape(desc: Mapping[str, Any], limits: Limits) -> tuple[int, ...]:
    shape = desc.get("shape")
    if not isinstance(shape, list) or len(shape) > limits.max_ndim:
        raise ProtocolError(R_SHAPE, f"shape must be a list of at most {limits.max_ndim} dims")
    for d in shape:
        if not isinstance(d, int) or isinstance(d, bool) or d < 0 or d >= 1 << 40:
            raise ProtocolError(R_SHAPE, f"bad dimension {d!r} in shape")
    # bounded even when a 0 dim makes the byte count 0: numpy cannot shape 2^39 x 2^39 x 0
    if math.prod(max(d, 1) for d in shape) > limits.max_total_bytes:
        raise ProtocolError(R_TOO_LARGE, f"shape {shape} exceeds the element limit")
    return tuple(shape)


def _check_row_count(name: str, shape: tuple[int, ...], limits: Limits) -> None:
    """A pull's tensors are row ids: at most ``limits.max_pull_rows`` elements each. Read
    from the descriptor alone, so a request claiming 10**9 ids is refused before its frames
    are looked at (their dtype, rank and values are the server's to check)."""
    n = math.prod(shape)
    if n > limits.max_pull_rows:
        raise ProtocolError(
            R_ROWS_TOO_MANY, f"{n} row ids for {name[:80]!r}, at most {limits.max_pull_rows}"
        )


def _plan(descs: list[Any], mtype: str, limits: Limits) -> tuple[list[Slot], int]:
    """Pass 1: validate every descriptor against its codec and the limits, allocating
    nothing. The slots to build, and how many frames the message must have."""
    slots: list[Slot] = []
    needed = 1
    total = 0
    names: set[str] = set()
    for desc in descs:
        if not isinstance(desc, dict):
            raise ProtocolError(R_HEADER, "tensor descriptor must be a map")
        name = _str(desc, "name")
        if name in names:
            raise ProtocolError(R_NAME, f"duplicate tensor name {name!r}")
        names.add(name)
        encoding = desc.get("encoding")
        codec = CODECS.get(encoding) if isinstance(encoding, str) else None
        if codec is None:
            raise ProtocolError(R_HEADER, f"unknown encoding {encoding!r} for {name!r}")
        dtype = wire_dtype(desc.get("dtype"), ALLOWED_DTYPES)
        shape = _shape(desc, limits)
        if mtype == PULL:
            if codec is not CODECS[DENSE]:
                raise ProtocolError(R_HEADER, f"row ids of {name!r} must be dense, not {encoding}")
            _check_row_count(name, shape, limits)
        nbytes = wire_count(desc, "nbytes")
        checked = codec.check(name, desc, dtype, shape)
        if nbytes != checked.nbytes:
            raise ProtocolError(
                R_NBYTES,
                f"{name!r}: nbytes {nbytes} != {checked.nbytes} implied by shape and dtype",
            )
        total += nbytes + checked.extra_bytes
        if total > limits.max_total_bytes:
            raise ProtocolError(
                R_TOO_LARGE, f"payload exceeds the limit of {limits.max_total_bytes} bytes"
            )
        slots.append(checked.slot)
        needed += codec.frames
    return slots, needed


def decode(
    frames: Sequence[Any],
    limits: Limits = DEFAULT_LIMITS,
    types: Collection[str] | None = None,
) -> Message:
    """Multipart frames -> Message, or ProtocolError with a reason code.

    Dense tensors are read-only views on the received frames (no copy); so are the index and
    value arrays of sparse and topk tensors. bf16 tensors are converted into fresh arrays.
    ``types``: the message types the receiving socket serves; another is refused as
    ``wrong_socket`` from the header, before its tensors are looked at.
    """
    if len(frames) < 1:
        raise ProtocolError(R_TRUNCATED, "empty message")
    header = _unpack_header(_buffer(frames[0]), limits)
    version = header.get("version")
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise ProtocolError(
            R_VERSION, f"protocol version {version!r}, this peer speaks {PROTOCOL_VERSION}"
        )
    mtype = _str(header, "type")
    if mtype not in MSG_TYPES:
        raise ProtocolError(R_TYPE, f"unknown message type {mtype[:64]!r}")
    sender = _str(header, "sender")
    if types is not None and mtype not in types:
        raise ProtocolError(R_WRONG_SOCKET, f"{mtype!r} is not served on this socket", sender)
    seq = wire_count(header, "seq")
    base_version = wire_count(header, "base_version")
    body = header.get("body", {})
    if not isinstance(body, dict):
        raise ProtocolError(R_HEADER, "body must be a map")
    descs = header.get("tensors", [])
    if not isinstance(descs, list):
        raise ProtocolError(R_HEADER, "tensors must be a list")
    if len(descs) > limits.max_tensors:
        raise ProtocolError(R_COUNT, f"{len(descs)} tensors exceed the limit {limits.max_tensors}")
    slots, needed = _plan(descs, mtype, limits)
    if len(frames) != needed:
        raise ProtocolError(R_TRUNCATED, f"{len(frames)} frames, the header describes {needed}")
    # Pass 2: each codec checks its frames' lengths, then views (or, bf16, converts) them.
    tensors: dict[str, WireTensor] = {}
    i = 1
    for slot in slots:
        n = slot.codec.frames
        tensors[slot.name] = slot.codec.decode(slot, [_buffer(f) for f in frames[i : i + n]])
        i += n
    return Message(mtype, sender, seq, base_version, body, tensors)


# ---------------------------------------------------------------- messages


def hello_request(sender: str, body: HelloRequest) -> Message:
    """A HELLO request message."""
    return Message(HELLO, sender, body=body.to_body())


def hello_reply(version: int, body: HelloReply, sender: str = "server") -> Message:
    """The server's HELLO reply at weight ``version``."""
    return Message(HELLO, sender, base_version=version, body=body.to_body())


def pull_request(
    sender: str,
    body: PullRequest | None = None,
    rows: Mapping[str, np.ndarray] | None = None,
) -> Message:
    """A PULL request message; ``rows`` makes it a row request: the row ids wanted of each
    row-sparse table, by wire name (int32 or int64, any order, repeats allowed)."""
    return Message(PULL, sender, body=(body or PullRequest()).to_body(), tensors=dict(rows or {}))


def weights_reply(
    version: int,
    body: PullReply,
    tensors: Mapping[str, WireTensor] | None = None,
    sender: str = "server",
) -> Message:
    """The server's WEIGHTS reply: ``tensors`` at ``version`` (none when unchanged)."""
    return Message(
        WEIGHTS, sender, base_version=version, body=body.to_body(), tensors=dict(tensors or {})
    )


def push_message(
    sender: str,
    seq: int,
    base_version: int,
    body: PushBody,
    tensors: Mapping[str, WireTensor],
) -> Message:
    """A PUSH message: gradients computed from ``base_version``, under sequence ``seq``."""
    return Message(
        PUSH, sender, seq=seq, base_version=base_version, body=body.to_body(), tensors=dict(tensors)
    )


def heartbeat_request(sender: str, body: HeartbeatRequest) -> Message:
    """A HEARTBEAT request message."""
    return Message(HEARTBEAT, sender, body=body.to_body())


def heartbeat_reply(version: int, body: HeartbeatReply, sender: str = "server") -> Message:
    """The server's HEARTBEAT reply at weight ``version``."""
    return Message(HEARTBEAT, sender, base_version=version, body=body.to_body())


def status_request(sender: str, body: StatusRequest | None = None) -> Message:
    """A STATUS request message (for the status socket); ``body``: an acknowledgement."""
    return Message(STATUS, sender, body=body.to_body() if body is not None else {})


def status_reply(doc: Mapping[str, Any], sender: str = "server") -> Message:
    """The server's STATUS reply carrying its status document."""
    return Message(STATUS, sender, body=StatusReply(doc).to_body())


def split_request(sender: str, body: SplitRequest, seq: int = 0) -> Message:
    """A SPLIT request message (``seq``: the sender's request count, for logs)."""
    return Message(SPLIT, sender, seq=seq, body=body.to_body())


def split_reply(body: SplitReply, sender: str = "server") -> Message:
    """The dispatcher's SPLIT reply."""
    return Message(SPLIT, sender, body=body.to_body())


def expect(reply: Message, mtype: str) -> Message:
    """``reply`` if it is of type ``mtype``; ProtocolError(R_TYPE) otherwise (an ERROR
    reply is the caller's to turn into its own error first)."""
    if reply.type != mtype:
        raise ProtocolError(R_TYPE, f"expected a {mtype!r} reply, got {reply.type!r}")
    return reply
