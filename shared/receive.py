"""Receiving whole messages within a bound on their frames and bytes.

ZeroMQ's ``MAXMSGSIZE`` limits each *frame*: a peer that sends a message of many frames, each
under it, could make a receiver hold as much as it sends. ``recv_bounded`` receives a message
frame by frame, keeping frames only while the message stays within ``Bound`` (at most
``frames`` frames and ``nbytes`` bytes in all); past either, it receives the rest and drops
each frame at once, and returns ``Oversize`` with the message's totals instead of frames. A
message within the bound costs what ``recv_multipart`` costs: the same per-frame receive, no
copy (``copy=False``), one length check per frame.

What it cannot change: ZeroMQ delivers a multipart message only once all of it has arrived,
so the library holds a message whole, for a moment, before its first frame can be read. The
bound keeps the server from keeping, decoding or answering such a message; ``release_memory``
(called after a large drop) hands the freed heap back to the system, so the resident memory a
sender can leave behind does not grow with what it sent.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from typing import Any

import zmq

log = logging.getLogger(__name__)

TRIM_AFTER_BYTES = 1 << 24  # a dropped message at least this large returns the heap to the OS


@dataclass(frozen=True)
class Bound:
    """The most a valid message of one socket holds: ``frames`` frames, ``nbytes`` bytes."""

    frames: int
    nbytes: int

    def describe(self) -> str:
        """The bound in words, for refusals and logs."""
        return f"{self.frames} frames and {self.nbytes} bytes"


@dataclass(frozen=True)
class Oversize:
    """A message past its bound, received and dropped: how many frames and bytes it had."""

    frames: int
    nbytes: int


def recv_bounded(sock: zmq.Socket, bound: Bound, flags: int = 0) -> list[Any] | Oversize:
    """One message from ``sock`` as its frames (``zmq.Frame``, not copied), or ``Oversize``
    when it has more than ``bound.frames`` frames or ``bound.nbytes`` bytes; raises
    ``zmq.Again`` with ``zmq.NOBLOCK`` when no message is waiting."""
    frame = sock.recv(flags, copy=False)
    frames = [frame]
    count, total = 1, len(frame)
    while count <= bound.frames and total <= bound.nbytes:
        if not frame.more:
            return frames
        frame = sock.recv(flags, copy=False)
        frames.append(frame)
        count += 1
        total += len(frame)
    frames.clear()
    while frame.more:  # the rest of the message: received and dropped, none kept
        frame = sock.recv(flags, copy=False)
        count += 1
        total += len(frame)
    del frame
    if total >= TRIM_AFTER_BYTES:
        release_memory()
    return Oversize(count, total)


def release_memory() -> bool:
    """Return the C heap's free memory to the system (glibc's ``malloc_trim``); False where
    the C library has none (the memory is then kept for reuse by the process)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        log.debug("no malloc_trim in this C library: freed memory stays with the process")
        return False
    trim.argtypes = [ctypes.c_size_t]
    return bool(trim(0))
