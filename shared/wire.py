"""The downpour wire protocol. This module is the spec, and the only one that imports msgpack.

A message is one ZeroMQ multipart message::

    frame 0         header: a msgpack map, at most ``Limits.max_header_bytes``
    frame 1 .. n    tensor payloads in descriptor order, raw little-endian C-order bytes:
                    a ``dense`` or ``bf16`` tensor takes one frame, a ``sparse`` or
                    ``topk`` tensor two (indices, then values)

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
    encoding      str    "dense" | "sparse" | "bf16" | "topk"
    nbytes        int    bytes of the values frame; dense: prod(shape) * itemsize;
                         bf16: prod(shape) * 2; sparse, topk: see nnz
    nnz           int    sparse, topk only. sparse: rows present, values frame is
                         (nnz, *shape[1:]); topk: elements present, nnz <= prod(shape),
                         values frame is (nnz,) of dtype
    index_dtype   str    sparse, topk only: "int32" | "int64"; indices frame is (nnz,).
                         sparse: row numbers in [0, shape[0]); topk: positions in the
                         C-order flattened tensor, in [0, prod(shape))

Encodings (compressed gradients, ``downpour worker --compress``)::

    dense    the tensor's bytes as they are
    sparse   ``tf.IndexedSlices`` rows: decodes to ``Sparse``; repeated rows are summed
    bf16     a float tensor rounded to bfloat16 (the upper 16 bits of a float32, rounded to
             nearest even): one frame of prod(shape) little-endian 2-byte values. Decodes to
             a fresh array of the logical dtype (a float32 gradient stays float32)
    topk     the k largest-magnitude elements of a tensor: decodes to ``FlatSparse``, whose
             ``to_dense()`` scatters the values into zeros; repeated positions are summed
    A peer that predates an encoding refuses it as "bad_header" (unknown encoding).

Message types (REQ/REP unless noted)::

    hello    -> hello      worker announces protocol + model fingerprint; reply carries the
                           server version, gradient port, the worker's last accepted seq, the
                           "encodings" the server decodes and its staleness "policy"
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
    Bodies are built and read by the typed classes below (``HelloRequest`` ... ``ErrorReply``);
    a body field of the wrong type is refused as "bad_header".

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
    reply    a weights message. Each requested table comes as a ``sparse`` tensor: its
             unique requested ids (sorted, int64) and those rows' values at the reply's
             base_version; an empty id list gives an empty table entry. The other variables
             come whole as in a plain pull (a row-sparse table not named in the request, too:
             that is a first full load), or are left out with body {"unchanged": true} when
             the sender's "have" is still current: "unchanged" then speaks of the whole
             variables only, and the requested rows are sent all the same. A request body
             {"rows_only": true} leaves out every variable but the requested rows (a worker
             topping up rows between its regular pulls). Tensors keep the
             server's variable order. A server that predates row requests ignores the ids
             and replies with every variable whole, which a row-pulling worker takes as well.

Decoding validates before it allocates: dtype in ``ALLOWED_DTYPES``, ``nbytes`` against the
shape, frame lengths, tensor counts and totals against ``Limits`` before any array is made;
msgpack's own limits with ``strict_map_key``; no ext types; never pickle. Dense payloads are
sent ``copy=False`` and decoded as zero-copy ``np.frombuffer`` views: no copy on either side.
The server sizes its limits from the model (``Limits.for_payload``) and sets ZeroMQ's
``MAXMSGSIZE`` on its gradient socket to the same total, so an oversized message is dropped
by ZeroMQ before it is buffered. ``PROTOCOL_VERSION`` is checked on every message.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import ml_dtypes
import msgpack
import numpy as np

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

DENSE = "dense"
SPARSE = "sparse"
BF16 = "bf16"
TOPK = "topk"
ENCODINGS = frozenset({DENSE, SPARSE, BF16, TOPK})

ALLOWED_DTYPES: frozenset[str] = frozenset(
    {
        "float16",
        "float32",
        "float64",
        "bool",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
    }
)
INDEX_DTYPES = frozenset({"int32", "int64"})
# logical dtypes a bf16-encoded tensor may decode to
BF16_DTYPES = frozenset({"float16", "float32", "float64"})
_BF16_WIRE = np.dtype("<u2")  # bfloat16 bits as they travel; viewed as ml_dtypes.bfloat16

# Rejection reasons: the stable vocabulary used in ERROR replies and status counters.
R_TRUNCATED = "truncated"  # fewer / more frames than the descriptors need
R_HEADER = "bad_header"  # header is not a well-formed msgpack map of the schema
R_VERSION = "version"  # protocol version differs
R_TYPE = "unknown_type"
R_DTYPE = "dtype"
R_SHAPE = "shape"
R_NBYTES = "nbytes"
R_TOO_LARGE = "too_large"
R_COUNT = "count"  # wrong number of tensors
R_NAME = "name"  # tensor names do not match
R_NONFINITE = "nonfinite"  # NaN or Inf in a gradient
R_DUPLICATE = "duplicate"  # (sender, seq) already applied: a replay or a resend
R_FUTURE = "future_version"  # base_version ahead of the server (e.g. after a restore)
R_FINGERPRINT = "fingerprint"  # worker built another model
R_PARTITION = "partition"  # worker splits the model over the shards differently
R_WRONG_SOCKET = "wrong_socket"  # a valid type sent to the socket that does not serve it
R_INTERNAL = "internal"  # the server failed handling a valid-looking message
R_DISPATCH_OFF = "dispatch_off"  # a split request to a server that does not dispatch data
R_UNIVERSE = "data_universe"  # a split request over other data than the dispatcher serves
R_ROWS_DTYPE = "rows_dtype"  # row ids that are not int32 / int64
R_ROWS_TOO_MANY = "rows_too_many"  # more row ids for one table than Limits.max_pull_rows
R_ROWS_NEGATIVE = "rows_negative"  # a row id below 0
R_ROWS_RANGE = "rows_range"  # a row id at or past the table's last row
R_ROWS_DENSE = "rows_dense"  # a row request for a variable that is not row-sparse
R_ROWS_UNKNOWN = "rows_unknown"  # a row request for a variable the server does not hold
R_TOO_MANY_WORKERS = "too_many_workers"  # a new worker id while the registry is full
R_OVERSIZE = "oversize"  # a request larger than the server accepts

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


class ProtocolError(Exception):
    """A message broke the protocol. ``code`` is a stable reason for counters and replies.

    Recovery: the receiver drops the message (answering ERROR where it has a reply) and
    goes on serving; the sender has to fix what it sends, resending the same bytes fails again.
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


@dataclass(frozen=True)
class Limits:
    """Upper bounds enforced by decode before any allocation."""

    max_header_bytes: int = 1 << 20
    max_tensors: int = 4096
    max_ndim: int = 8
    max_total_bytes: int = 1 << 31
    max_str_len: int = 4096
    max_pull_rows: int = 1 << 20  # row ids per table in one row request

    def for_payload(self, payload_bytes: int) -> Limits:
        """Limits sized for a model: total payload at most ``payload_bytes`` plus slack."""
        return replace(self, max_total_bytes=int(payload_bytes * 1.05) + 4096)


DEFAULT_LIMITS = Limits()
# A status reply carries the server's whole status document in its header: one entry per
# worker it tracks (--max-workers, at most MAX_STATUS_WORKERS), so it gets larger bounds.
MAX_STATUS_WORKERS = 1 << 16
STATUS_LIMITS = Limits(max_header_bytes=1 << 28, max_tensors=MAX_STATUS_WORKERS)


def dedupe_rows(indices: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unique row indices (int64) and each row's summed values. Keras's Adagrad and Adam
    square a sparse gradient's values row by row, so a repeated row must be summed first."""
    rows, inverse = np.unique(indices, return_inverse=True)
    if len(rows) == len(indices):
        order = np.argsort(indices, kind="stable")
        return indices[order].astype(np.int64), np.ascontiguousarray(values[order])
    summed = np.zeros((len(rows), *values.shape[1:]), dtype=values.dtype)
    np.add.at(summed, inverse, values)
    return rows.astype(np.int64), summed


@dataclass(frozen=True)
class Sparse:
    """Row-sparse tensor (``tf.IndexedSlices``): ``dense[indices[i]] += values[i]``."""

    indices: np.ndarray
    values: np.ndarray
    dense_shape: tuple[int, ...]

    def to_dense(self) -> np.ndarray:
        """Materialise as a dense array; repeated indices are summed, as TF does."""
        out = np.zeros(self.dense_shape, dtype=self.values.dtype)
        np.add.at(out, self.indices, self.values)
        return out


@dataclass(frozen=True)
class FlatSparse:
    """Element-sparse tensor (a top-k gradient): ``dense.ravel()[indices[i]] += values[i]``.

    ``indices`` (nnz,) int32/int64 positions in the C-order flattened tensor, ``values``
    (nnz,) of the tensor's dtype. What a ``topk`` tensor encodes from and decodes to.
    """

    indices: np.ndarray
    values: np.ndarray
    dense_shape: tuple[int, ...]

    @property
    def dtype(self) -> np.dtype:
        """The dense tensor's dtype (that of the values)."""
        return self.values.dtype

    def to_dense(self, out: np.ndarray | None = None) -> np.ndarray:
        """Scatter into zeros (``out``, C-contiguous, if given: reused, no allocation).

        Repeated positions are summed.
        """
        shape = tuple(self.dense_shape)
        if out is None:
            out = np.zeros(shape, dtype=self.values.dtype)
        else:
            if out.shape != shape or not out.flags.c_contiguous or not out.flags.writeable:
                raise ValueError(f"out must be a writeable C-contiguous array of shape {shape}")
            out.fill(0)
        np.add.at(out.reshape(-1), self.indices, self.values)
        return out


@dataclass(frozen=True)
class BFloat16:
    """A float tensor to send as bfloat16 (2 bytes an element); decodes to ``dtype``.

    ``values`` is an ``ml_dtypes.bfloat16`` array; build it with ``from_array`` (round to
    nearest even). Only encode takes it: decode hands back the array converted to ``dtype``.
    """

    values: np.ndarray
    dtype: np.dtype = np.dtype(np.float32)

    @classmethod
    def from_array(cls, a: np.ndarray) -> BFloat16:
        """Round a float array to bfloat16 (nearest even; beyond about 3.39e38 is inf)."""
        a = np.asarray(a)
        if a.dtype.name not in BF16_DTYPES:
            raise ValueError(f"bf16 takes {sorted(BF16_DTYPES)}, not {a.dtype}")
        return cls(a.astype(ml_dtypes.bfloat16), np.dtype(a.dtype.name))

    @property
    def dense_shape(self) -> tuple[int, ...]:
        """The tensor's shape."""
        return tuple(self.values.shape)

    def to_dense(self) -> np.ndarray:
        """The values as a fresh array of ``dtype``."""
        return self.values.astype(self.dtype)


Tensor = np.ndarray | Sparse  # a gradient as the worker computes it
WireTensor = np.ndarray | Sparse | FlatSparse | BFloat16  # what a Message may carry


def all_finite(a: np.ndarray) -> bool:
    """True if no NaN/Inf. One read-only pass catches both: for float32/float64 the dot
    product of the values with themselves (BLAS, about twice as fast as a sum; every term is
    non-negative, so an Inf cannot cancel), else a sum; a finite result proves every value
    finite, and an overflow falls back to a scan. The server checks every gradient with it;
    a top-k worker keeps bad ones out of residuals."""
    if a.dtype.kind not in "fc" or a.size == 0:
        return True
    with np.errstate(all="ignore"):
        if a.dtype in (np.float32, np.float64) and a.flags.c_contiguous:
            flat = a.reshape(-1)
            if np.isfinite(np.dot(flat, flat)):
                return True
        elif np.isfinite(a.sum()):
            return True
    return bool(np.isfinite(a).all())


def as_bf16(a: np.ndarray) -> np.ndarray | BFloat16:
    """``a`` to send in bfloat16 where that halves it (float32, float64); float16 (as many
    bytes and more precise) and non-float arrays as they are. Gradients (``--compress bf16``)
    and weights (``--pull-compress bf16``) follow this one rule."""
    if a.dtype.name in BF16_DTYPES and a.dtype != np.float16:
        return BFloat16.from_array(a)
    return a


def densify(t: WireTensor, out: np.ndarray | None = None) -> np.ndarray:
    """Any tensor a message carries as a dense ndarray (``out``: reused by FlatSparse only).

    An ndarray comes back as it is (a decoded one is a read-only view on its frame).
    """
    if isinstance(t, FlatSparse):
        return t.to_dense(out)
    if isinstance(t, Sparse | BFloat16):
        return t.to_dense()
    return np.asarray(t)


def logical_shape(t: WireTensor) -> tuple[int, ...]:
    """The dense shape of any tensor a message carries."""
    return tuple(t.shape if isinstance(t, np.ndarray) else t.dense_shape)


def logical_dtype(t: WireTensor) -> np.dtype:
    """The dense dtype of any tensor a message carries."""
    return t.values.dtype if isinstance(t, Sparse) else np.dtype(t.dtype)


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


def _dense_frame(a: np.ndarray) -> np.ndarray:
    a = np.asarray(a, order="C")  # unlike ascontiguousarray, keeps 0-d arrays 0-d
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    return a


def _bf16_frame(values: np.ndarray) -> np.ndarray:
    """bfloat16 values as little-endian uint16 (a buffer cannot export the bfloat16 dtype)."""
    values = np.asarray(values, order="C")
    if values.dtype != ml_dtypes.bfloat16:
        raise ValueError(f"BFloat16.values must be ml_dtypes.bfloat16, not {values.dtype}")
    return values.view(np.uint16).astype(_BF16_WIRE, copy=False)


def _index_frame(indices: np.ndarray) -> np.ndarray:
    indices = _dense_frame(indices)
    if indices.dtype.name not in INDEX_DTYPES:
        indices = indices.astype(np.int64)
    return indices


def encode(msg: Message) -> list[Any]:
    """Message -> multipart frames. Tensor frames are the arrays themselves (send copy=False).

    The caller must not mutate the arrays until ZeroMQ has sent them.
    """
    if msg.type not in MSG_TYPES:
        raise ValueError(f"unknown message type {msg.type!r}")
    descriptors: list[dict[str, Any]] = []
    frames: list[Any] = [b""]
    for name, t in msg.tensors.items():
        if isinstance(t, FlatSparse):
            values = _dense_frame(t.values).reshape(-1)
            indices = _index_frame(t.indices).reshape(-1)
            if indices.shape != values.shape:
                raise ValueError(f"{name!r}: {indices.size} indices for {values.size} values")
            descriptors.append(
                {
                    "name": name,
                    "dtype": values.dtype.name,
                    "shape": [int(d) for d in t.dense_shape],
                    "encoding": TOPK,
                    "nbytes": values.nbytes,
                    "nnz": int(indices.shape[0]),
                    "index_dtype": indices.dtype.name,
                }
            )
            frames.append(indices)
            frames.append(values)
        elif isinstance(t, BFloat16):
            if np.dtype(t.dtype).name not in BF16_DTYPES:
                raise ValueError(f"{name!r}: bf16 cannot stand for {np.dtype(t.dtype)}")
            bits = _bf16_frame(t.values)
            descriptors.append(
                {
                    "name": name,
                    "dtype": np.dtype(t.dtype).name,
                    "shape": list(bits.shape),
                    "encoding": BF16,
                    "nbytes": bits.nbytes,
                }
            )
            frames.append(bits)
        elif isinstance(t, Sparse):
            values = _dense_frame(t.values)
            indices = _index_frame(t.indices)
            descriptors.append(
                {
                    "name": name,
                    "dtype": values.dtype.name,
                    "shape": [int(d) for d in t.dense_shape],
                    "encoding": SPARSE,
                    "nbytes": values.nbytes,
                    "nnz": int(indices.shape[0]),
                    "index_dtype": indices.dtype.name,
                }
            )
            frames.append(indices)
            frames.append(values)
        else:
            a = _dense_frame(np.asarray(t))
            descriptors.append(
                {
                    "name": name,
                    "dtype": a.dtype.name,
                    "shape": list(a.shape),
                    "encoding": DENSE,
                    "nbytes": a.nbytes,
                }
            )
            frames.append(a)
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


def _int(header: Mapping[str, Any], key: str) -> int:
    v = header.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < 0 or v >= 1 << 63:
        raise ProtocolError(R_HEADER, f"header field {key!r} must be a non-negative int")
    return v


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


def _dtype(name: Any, allowed: frozenset[str]) -> np.dtype:
    if not isinstance(name, str) or name not in allowed:
        raise ProtocolError(R_DTYPE, f"dtype {name!r} is not allowed")
    return np.dtype(name).newbyteorder("<")


def _view(buf: memoryview, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    a = np.frombuffer(buf, dtype=dtype).reshape(shape)
    a.flags.writeable = False  # a view on the received frame: nobody may change it
    return a


def _check_row_count(name: str, shape: tuple[int, ...], limits: Limits) -> None:
    """A pull's tensors are row ids: at most ``limits.max_pull_rows`` elements each. Read
    from the descriptor alone, so a request claiming 10**9 ids is refused before its frames
    are looked at (their dtype, rank and values are the server's to check)."""
    n = math.prod(shape)
    if n > limits.max_pull_rows:
        raise ProtocolError(
            R_ROWS_TOO_MANY, f"{n} row ids for {name[:80]!r}, at most {limits.max_pull_rows}"
        )


def decode(frames: Sequence[Any], limits: Limits = DEFAULT_LIMITS) -> Message:
    """Multipart frames -> Message, or ProtocolError with a reason code.

    Dense tensors are read-only views on the received frames (no copy); so are the index and
    value arrays of sparse and topk tensors. bf16 tensors are converted into fresh arrays.
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
    seq = _int(header, "seq")
    base_version = _int(header, "base_version")
    body = header.get("body", {})
    if not isinstance(body, dict):
        raise ProtocolError(R_HEADER, "body must be a map")
    descs = header.get("tensors", [])
    if not isinstance(descs, list):
        raise ProtocolError(R_HEADER, "tensors must be a list")
    if len(descs) > limits.max_tensors:
        raise ProtocolError(R_COUNT, f"{len(descs)} tensors exceed the limit {limits.max_tensors}")

    # Pass 1: validate every descriptor and the frame sizes, allocate nothing.
    plan: list[tuple[str, str, np.dtype, tuple[int, ...], int, np.dtype | None]] = []
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
        if not isinstance(encoding, str) or encoding not in ENCODINGS:
            raise ProtocolError(R_HEADER, f"unknown encoding {encoding!r} for {name!r}")
        dtype = _dtype(desc.get("dtype"), ALLOWED_DTYPES)
        shape = _shape(desc, limits)
        if mtype == PULL:
            _check_row_count(name, shape, limits)
        nbytes = _int(desc, "nbytes")
        if encoding == DENSE:
            expect = math.prod(shape) * dtype.itemsize
            index_dtype = None
            nnz = -1
            needed += 1
        elif encoding == BF16:
            if dtype.name not in BF16_DTYPES:
                raise ProtocolError(R_DTYPE, f"{name!r}: bf16 cannot decode to {dtype.name}")
            expect = math.prod(shape) * _BF16_WIRE.itemsize
            # decode allocates the logical dtype: that size counts against the limit too
            total += math.prod(shape) * (dtype.itemsize - _BF16_WIRE.itemsize)
            index_dtype = None
            nnz = -1
            needed += 1
        elif encoding == TOPK:
            nnz = _int(desc, "nnz")
            if nnz > math.prod(shape):
                raise ProtocolError(
                    R_SHAPE, f"topk tensor {name!r}: nnz {nnz} > {math.prod(shape)} elements"
                )
            index_dtype = _dtype(desc.get("index_dtype"), INDEX_DTYPES)
            expect = nnz * dtype.itemsize
            total += nnz * index_dtype.itemsize
            needed += 2
        else:
            if len(shape) < 1:
                raise ProtocolError(R_SHAPE, f"sparse tensor {name!r} needs a rank >= 1 shape")
            nnz = _int(desc, "nnz")
            index_dtype = _dtype(desc.get("index_dtype"), INDEX_DTYPES)
            expect = nnz * math.prod(shape[1:]) * dtype.itemsize
            total += nnz * index_dtype.itemsize
            needed += 2
        if nbytes != expect:
            raise ProtocolError(
                R_NBYTES, f"{name!r}: nbytes {nbytes} != {expect} implied by shape and dtype"
            )
        total += nbytes
        if total > limits.max_total_bytes:
            raise ProtocolError(
                R_TOO_LARGE, f"payload exceeds the limit of {limits.max_total_bytes} bytes"
            )
        plan.append((name, encoding, dtype, shape, nnz, index_dtype))
    if len(frames) != needed:
        raise ProtocolError(R_TRUNCATED, f"{len(frames)} frames, the header describes {needed}")

    # Pass 2: check each frame's length, then view it.
    tensors: dict[str, WireTensor] = {}
    i = 1
    for name, encoding, dtype, shape, nnz, index_dtype in plan:
        if encoding == DENSE:
            buf = _buffer(frames[i])
            i += 1
            if buf.nbytes != math.prod(shape) * dtype.itemsize:
                raise ProtocolError(R_TRUNCATED, f"{name!r}: frame has {buf.nbytes} bytes")
            tensors[name] = _view(buf, dtype, shape)
        elif encoding == BF16:
            buf = _buffer(frames[i])
            i += 1
            if buf.nbytes != math.prod(shape) * _BF16_WIRE.itemsize:
                raise ProtocolError(R_TRUNCATED, f"{name!r}: bf16 frame has {buf.nbytes} bytes")
            bits = np.frombuffer(buf, dtype=_BF16_WIRE).astype(np.uint16, copy=False)
            a = bits.view(ml_dtypes.bfloat16).reshape(shape).astype(dtype.newbyteorder("="))
            a.flags.writeable = False  # like every decoded tensor
            tensors[name] = a
        elif encoding == TOPK:
            assert index_dtype is not None
            ibuf, vbuf = _buffer(frames[i]), _buffer(frames[i + 1])
            i += 2
            if ibuf.nbytes != nnz * index_dtype.itemsize:
                raise ProtocolError(R_TRUNCATED, f"{name!r}: index frame has {ibuf.nbytes} bytes")
            if vbuf.nbytes != nnz * dtype.itemsize:
                raise ProtocolError(R_TRUNCATED, f"{name!r}: value frame has {vbuf.nbytes} bytes")
            indices = _view(ibuf, index_dtype, (nnz,))
            if nnz and (int(indices.min()) < 0 or int(indices.max()) >= math.prod(shape)):
                raise ProtocolError(R_SHAPE, f"{name!r}: topk index out of range")
            tensors[name] = FlatSparse(indices, _view(vbuf, dtype, (nnz,)), shape)
        else:
            assert index_dtype is not None
            ibuf, vbuf = _buffer(frames[i]), _buffer(frames[i + 1])
            i += 2
            if ibuf.nbytes != nnz * index_dtype.itemsize:
                raise ProtocolError(R_TRUNCATED, f"{name!r}: index frame has {ibuf.nbytes} bytes")
            if vbuf.nbytes != nnz * math.prod(shape[1:]) * dtype.itemsize:
                raise ProtocolError(R_TRUNCATED, f"{name!r}: value frame has {vbuf.nbytes} bytes")
            indices = _view(ibuf, index_dtype, (nnz,))
            if nnz and (int(indices.min()) < 0 or int(indices.max()) >= shape[0]):
                raise ProtocolError(R_SHAPE, f"{name!r}: sparse index out of range")
            values = _view(vbuf, dtype, (nnz, *shape[1:]))
            tensors[name] = Sparse(indices, values, shape)
    return Message(mtype, sender, seq, base_version, body, tensors)


# ---------------------------------------------------------------- typed bodies
#
# One frozen dataclass per message body: ``to_body()`` builds the map a Message carries,
# ``from_body()`` reads one back and refuses a field of the wrong type with ProtocolError
# (R_HEADER). Absent optional fields read as their defaults; ``to_body()`` leaves out fields
# that are None, so an older peer sees the map it always saw. Clients and the server build
# and read bodies only through these.


def _field(body: Mapping[str, Any], key: str, kind: str, default: Any = None) -> Any:
    """``body[key]`` checked against ``kind`` ("int", "float", "str", "bool", "map",
    "list"); ``default`` when absent or None."""
    v = body.get(key)
    if v is None:
        return default
    ok = {
        "int": isinstance(v, int) and not isinstance(v, bool),
        "float": isinstance(v, int | float) and not isinstance(v, bool),
        "str": isinstance(v, str),
        "bool": isinstance(v, bool),
        "map": isinstance(v, dict),
        "list": isinstance(v, list),
    }[kind]
    if not ok:
        raise ProtocolError(R_HEADER, f"body field {key!r} must be {kind}, not {type(v).__name__}")
    return v


def _body_map(body: Any) -> Mapping[str, Any]:
    if not isinstance(body, Mapping):
        raise ProtocolError(R_HEADER, f"body must be a map, not {type(body).__name__}")
    return body


def _without_none(fields: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in fields.items() if v is not None}


@dataclass(frozen=True)
class HelloRequest:
    """A worker's hello: its model and how it splits the model over the shards.

    A hello without ``partition`` (a plain client) is accepted by an unsharded server.
    ``process`` is a token of the sender's process: a hello from the same worker id with
    another token is a restarted worker (a dispatching server takes back its splits).
    """

    fingerprint: str | None = None
    model: str | None = None
    variables: int | None = None
    shard: int | None = None
    num_shards: int | None = None
    partition: str | None = None
    process: str | None = None

    def to_body(self) -> dict[str, Any]:
        """The hello body map."""
        return _without_none(self.__dict__)

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> HelloRequest:
        """Read a hello body; ProtocolError(R_HEADER) on a field of the wrong type."""
        b = _body_map(body)
        return cls(
            fingerprint=_field(b, "fingerprint", "str"),
            model=_field(b, "model", "str"),
            variables=_field(b, "variables", "int"),
            shard=_field(b, "shard", "int"),
            num_shards=_field(b, "num_shards", "int"),
            partition=_field(b, "partition", "str"),
            process=_field(b, "process", "str"),
        )


@dataclass(frozen=True)
class HelloReply:
    """The server's answer to hello (the message's base_version is its weight version).

    ``encodings`` is None for a server that predates compression (it decodes dense and
    sparse); ``policy`` is the server's staleness policy, e.g. ``sync:2/2``. ``row_tables``:
    the wire names of the variables this server serves by row (None: a server that predates
    row requests).
    """

    push_port: int
    status_port: int | None = None
    fingerprint: str | None = None
    model: str | None = None
    last_seq: int = 0
    payload_bytes: int | None = None
    incarnation: str | None = None
    encodings: tuple[str, ...] | None = None
    policy: str = ""
    shard: int | None = None
    num_shards: int | None = None
    partition: str | None = None
    max_request_bytes: int | None = None  # bigger requests get the connection dropped
    row_tables: tuple[str, ...] | None = None

    def to_body(self) -> dict[str, Any]:
        """The hello reply body map."""
        body = _without_none(self.__dict__)
        if self.encodings is not None:
            body["encodings"] = list(self.encodings)
        if self.row_tables is not None:
            body["row_tables"] = list(self.row_tables)
        return body

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> HelloReply:
        """Read a hello reply body; ProtocolError(R_HEADER) when ``push_port`` is missing or
        a field has the wrong type."""
        b = _body_map(body)
        push_port = _field(b, "push_port", "int")
        if push_port is None or not 0 < push_port < 65536:
            raise ProtocolError(R_HEADER, f"hello reply push_port {push_port!r} is not a port")
        encodings = _field(b, "encodings", "list")
        if encodings is not None and not all(isinstance(e, str) for e in encodings):
            raise ProtocolError(R_HEADER, "hello reply encodings must be strings")
        row_tables = _field(b, "row_tables", "list")
        if row_tables is not None and not all(isinstance(e, str) for e in row_tables):
            raise ProtocolError(R_HEADER, "hello reply row_tables must be strings")
        return cls(
            push_port=push_port,
            status_port=_field(b, "status_port", "int"),
            fingerprint=_field(b, "fingerprint", "str"),
            model=_field(b, "model", "str"),
            last_seq=_field(b, "last_seq", "int", 0),
            payload_bytes=_field(b, "payload_bytes", "int"),
            incarnation=_field(b, "incarnation", "str"),
            encodings=None if encodings is None else tuple(encodings),
            policy=_field(b, "policy", "str", ""),
            shard=_field(b, "shard", "int"),
            num_shards=_field(b, "num_shards", "int"),
            partition=_field(b, "partition", "str"),
            max_request_bytes=_field(b, "max_request_bytes", "int"),
            row_tables=None if row_tables is None else tuple(row_tables),
        )


MAX_WAIT_MS = 60_000  # the longest "ask again after" a reply may ask for


@dataclass(frozen=True)
class PullRequest:
    """A weight pull. ``have``: the version the sender holds from server ``incarnation``
    (None: it holds none, send everything). ``encoding``: dense or bf16 weights.
    ``pushed``: the seq of the sender's latest push (an ssp server counts the pushes it has
    not received yet). ``rows_only``: with a row request, send the requested rows and
    nothing else."""

    have: int | None = None
    incarnation: str | None = None
    encoding: str = DENSE
    pushed: int | None = None
    rows_only: bool = False

    def to_body(self) -> dict[str, Any]:
        """The pull body map (``encoding`` only when not dense: an older server accepts it)."""
        body: dict[str, Any] = {}
        if self.have is not None:
            body["have"] = self.have
            body["incarnation"] = self.incarnation
        if self.encoding != DENSE:
            body["encoding"] = self.encoding
        if self.pushed is not None:
            body["pushed"] = self.pushed
        if self.rows_only:
            body["rows_only"] = True
        return body

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> PullRequest:
        """Read a pull body; ProtocolError(R_HEADER) on a field of the wrong type. Which
        encodings a server serves is the server's check."""
        b = _body_map(body)
        return cls(
            have=_field(b, "have", "int"),
            incarnation=_field(b, "incarnation", "str"),
            encoding=_field(b, "encoding", "str", DENSE),
            pushed=_field(b, "pushed", "int"),
            rows_only=_field(b, "rows_only", "bool", False),
        )


@dataclass(frozen=True)
class PullReply:
    """The body of a weights reply: the server's ``incarnation``; ``unchanged`` when the
    sender's version is current (no tensors follow); ``dropped_stale``: how many of the
    sender's gradients the policy dropped as too old since its last pull; ``wait_ms`` > 0:
    the policy holds this pull (ssp: the sender is too far ahead), no tensors follow, ask
    again after that many milliseconds."""

    incarnation: str | None = None
    unchanged: bool = False
    dropped_stale: int = 0
    wait_ms: int = 0

    def to_body(self) -> dict[str, Any]:
        """The weights body map."""
        body: dict[str, Any] = _without_none({"incarnation": self.incarnation})
        if self.unchanged:
            body["unchanged"] = True
        if self.dropped_stale:
            body["dropped_stale"] = self.dropped_stale
        if self.wait_ms:
            body["wait_ms"] = self.wait_ms
        return body

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> PullReply:
        """Read a weights body; ProtocolError(R_HEADER) on a field of the wrong type."""
        b = _body_map(body)
        dropped = _field(b, "dropped_stale", "int", 0)
        if dropped < 0:
            raise ProtocolError(R_HEADER, f"dropped_stale {dropped} is negative")
        wait_ms = _field(b, "wait_ms", "int", 0)
        if not 0 <= wait_ms <= MAX_WAIT_MS:
            raise ProtocolError(R_HEADER, f"wait_ms {wait_ms} is not in [0, {MAX_WAIT_MS}]")
        return cls(
            incarnation=_field(b, "incarnation", "str"),
            unchanged=_field(b, "unchanged", "bool", False),
            dropped_stale=dropped,
            wait_ms=wait_ms,
        )


@dataclass(frozen=True)
class PushBody:
    """The scalars a gradient push carries: the last batch's loss, the batch size, the
    worker's step count and its figures (``downpour.metrics.WORKER_REPORTED``)."""

    loss: float | None = None
    batch_size: int | None = None
    steps: int | None = None
    stats: Mapping[str, float] | None = None

    def to_body(self) -> dict[str, Any]:
        """The push body map."""
        return _without_none(self.__dict__)

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> PushBody:
        """Read a push body; ProtocolError(R_HEADER) on a field of the wrong type."""
        b = _body_map(body)
        return cls(
            loss=_field(b, "loss", "float"),
            batch_size=_field(b, "batch_size", "int"),
            steps=_field(b, "steps", "int"),
            stats=_field(b, "stats", "map"),
        )


@dataclass(frozen=True)
class HeartbeatRequest:
    """A silent worker's "still alive", with its figures."""

    stats: Mapping[str, float] | None = None

    def to_body(self) -> dict[str, Any]:
        """The heartbeat body map."""
        return _without_none(self.__dict__)

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> HeartbeatRequest:
        """Read a heartbeat body; ProtocolError(R_HEADER) on a field of the wrong type."""
        return cls(stats=_field(_body_map(body), "stats", "map"))


@dataclass(frozen=True)
class HeartbeatReply:
    """The server's answer to a heartbeat (base_version: its weight version)."""

    incarnation: str | None = None

    def to_body(self) -> dict[str, Any]:
        """The heartbeat reply body map."""
        return _without_none(self.__dict__)

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> HeartbeatReply:
        """Read a heartbeat reply body; ProtocolError(R_HEADER) on a wrong type."""
        return cls(incarnation=_field(_body_map(body), "incarnation", "str"))


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
class ErrorReply:
    """An ERROR reply: a stable reason ``code`` (the R_* names) and a text for people."""

    code: str
    message: str = ""

    def to_body(self) -> dict[str, Any]:
        """The error body map."""
        return {"code": self.code, "message": self.message}

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> ErrorReply:
        """Read an error body; a missing or mistyped code reads as R_INTERNAL."""
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
class DataUniverse:
    """What a dispatched ``input_fn`` shards over: ``files`` (one split each, at most
    MAX_FILES), or ``elements`` divided into splits of ``split_size`` (at most MAX_SPLITS).
    ValueError when it is neither, or out of bounds."""

    files: tuple[str, ...] | None = None
    elements: int | None = None
    split_size: int | None = None

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

    def to_body(self) -> dict[str, Any]:
        """The universe map."""
        if self.files is not None:
            return {"files": list(self.files)}
        return {"elements": self.elements, "split_size": self.split_size}

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> DataUniverse:
        """Read a universe map; ProtocolError(R_HEADER) when malformed or out of bounds."""
        b = _body_map(body)
        files = _field(b, "files", "list")
        if files is not None and not all(isinstance(f, str) for f in files):
            raise ProtocolError(R_HEADER, "universe files must be strings")
        try:
            return cls(
                files=None if files is None else tuple(files),
                elements=_field(b, "elements", "int"),
                split_size=_field(b, "split_size", "int"),
            )
        except ValueError as exc:
            raise ProtocolError(R_HEADER, f"universe: {exc}") from None


@dataclass(frozen=True)
class SplitRequest:
    """A worker asks the dispatcher for its next split and reports the ones it finished.

    ``digest``: its universe's (always). ``acks``: (epoch, index, seq) of finished splits,
    ``seq`` the sequence number of the push that carried the split's last gradients: the
    dispatcher completes the ack only once that push has reached it, so an ack never
    overtakes its gradients (0: wait for no push; an (epoch, index) pair means seq 0).
    ``want``: False to only acknowledge. ``universe`` and ``epochs`` (0: unbounded) on the
    first call; the first worker's universe and bound are the ones served. ``process``: a
    token of the sender's process (a new one releases what the old process held).
    """

    digest: str
    acks: tuple[tuple[int, ...], ...] = ()
    want: bool = True
    universe: DataUniverse | None = None
    epochs: int | None = None
    process: str | None = None

    def __post_init__(self) -> None:
        # every ack as (epoch, index, seq): a pair waits for no push
        acks = tuple((int(a[0]), int(a[1]), int(a[2]) if len(a) > 2 else 0) for a in self.acks)
        object.__setattr__(self, "acks", acks)

    def to_body(self) -> dict[str, Any]:
        """The split request body map (an ack with seq 0 goes as an [epoch, index] pair)."""
        body: dict[str, Any] = {"digest": self.digest, "want": self.want}
        if self.acks:
            body["acks"] = [[e, i, s] if s else [e, i] for e, i, s in self.acks]
        if self.universe is not None:
            body["universe"] = self.universe.to_body()
        return {**body, **_without_none({"epochs": self.epochs, "process": self.process})}

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> SplitRequest:
        """Read a split request; ProtocolError(R_HEADER) on a missing digest, a malformed
        ack, more than MAX_ACKS acks, a bad universe or a negative epoch bound."""
        b = _body_map(body)
        digest = _field(b, "digest", "str")
        if digest is None or len(digest) != 64:
            raise ProtocolError(R_HEADER, "split request needs the universe's 64-hex digest")
        raw_acks = _field(b, "acks", "list", [])
        if len(raw_acks) > MAX_ACKS:
            raise ProtocolError(R_HEADER, f"{len(raw_acks)} acks in one request (max {MAX_ACKS})")
        acks = []
        for a in raw_acks:
            ok = isinstance(a, list) and len(a) in (2, 3)
            ok = ok and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in a)
            if not ok:
                raise ProtocolError(
                    R_HEADER, f"ack {a!r} is not [epoch, index] or [epoch, index, seq] (ints >= 0)"
                )
            acks.append((a[0], a[1], a[2] if len(a) == 3 else 0))
        universe = _field(b, "universe", "map")
        epochs = _field(b, "epochs", "int")
        if epochs is not None and epochs < 0:
            raise ProtocolError(R_HEADER, f"epochs {epochs} is negative")
        return cls(
            digest=digest,
            acks=tuple(acks),
            want=_field(b, "want", "bool", True),
            universe=None if universe is None else DataUniverse.from_body(universe),
            epochs=epochs,
            process=_field(b, "process", "str"),
        )


@dataclass(frozen=True)
class SplitReply:
    """The dispatcher's answer. ``grant``: "split" (``index`` and ``file`` or ``[start,
    stop)`` of ``epoch``), "wait" (ask again after ``retry_ms``: the epoch's last splits are
    in flight elsewhere) or "end" (the epoch bound is reached). ``acked`` / ``held`` /
    ``stale``: how many of the request's acks completed a lease / are held until the push
    they name arrives (then they complete, the worker need not send them again) / were
    ignored (not leased to the sender).
    """

    grant: str
    epoch: int
    index: int | None = None
    file: str | None = None
    start: int | None = None
    stop: int | None = None
    retry_ms: int = 0
    acked: int = 0
    stale: int = 0
    held: int = 0

    def to_body(self) -> dict[str, Any]:
        """The split reply body map."""
        return _without_none(self.__dict__)

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> SplitReply:
        """Read a split reply; ProtocolError(R_HEADER) on an unknown grant, a split without
        its index or range, or a field of the wrong type."""
        b = _body_map(body)
        grant = _field(b, "grant", "str")
        epoch = _field(b, "epoch", "int")
        if grant not in GRANTS or epoch is None or epoch < 0:
            raise ProtocolError(R_HEADER, f"split reply grant {grant!r} / epoch {epoch!r}")
        r = cls(
            grant=grant,
            epoch=epoch,
            index=_field(b, "index", "int"),
            file=_field(b, "file", "str"),
            start=_field(b, "start", "int"),
            stop=_field(b, "stop", "int"),
            retry_ms=_field(b, "retry_ms", "int", 0),
            acked=_field(b, "acked", "int", 0),
            stale=_field(b, "stale", "int", 0),
            held=_field(b, "held", "int", 0),
        )
        if grant == "split":
            ranged = r.start is not None and r.stop is not None and 0 <= r.start < r.stop
            if r.index is None or r.index < 0 or (r.file is None and not ranged):
                raise ProtocolError(R_HEADER, "a split reply needs an index and a file or range")
        return r


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


def status_request(sender: str) -> Message:
    """A STATUS request message (for the status socket)."""
    return Message(STATUS, sender)


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
