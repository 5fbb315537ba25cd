"""The protocol's vocabulary: the reason codes a refusal carries, ``ProtocolError`` and the
``Limits`` decode enforces. ``downpour.wire`` re-exports all of it; import it from there.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

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
R_OVERSIZE = "oversize"  # a message past its socket's bound of frames or bytes
R_COUNTS = "counts"  # a keyed_counted row that stands for fewer than one lookup
R_ACCEPTS = "accepts"  # a hello whose accepts leave out what this server must send it


class ProtocolError(Exception):
    """A message broke the protocol. ``code`` is a stable reason for counters and replies.

    Recovery: the receiver drops the message (answering ERROR where it has a reply) and
    goes on serving; the sender has to fix what it sends, resending the same bytes fails again.
    ``sender``: who the message says sent it, when the header was read that far.
    """

    def __init__(self, code: str, message: str, sender: str | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.sender = sender


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
