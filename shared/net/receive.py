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

Where the received bytes land: libzmq's I/O thread ``malloc``s a buffer per frame and reads
the socket straight into it; the receiver frees it when it drops the frame. glibc maps a
large allocation afresh (``mmap``) and unmaps it on free, or trims the heap it came from, so
every push of a model's tensors page-faults its way through fresh zeroed pages: thousands of
faults, in kernel time, per message. ``keep_receive_buffers`` raises glibc's mapping and trim
thresholds and its top pad (a thread's heap that has emptied is otherwise unmapped whatever
the trim threshold) so that those buffers come from the heap and freed ones are reused by
the next message, the way a pool of receive buffers would be.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from typing import Any

import zmq

from downpour.memory.malloc import libc_function, mallopt

log = logging.getLogger(__name__)

TRIM_AFTER_BYTES = 1 << 24  # a dropped message at least this large returns the heap to the OS
# glibc's mallopt parameters (malloc.h) and the largest mapping threshold it accepts on 64-bit
# (HEAP_MAX_SIZE / 2): a frame larger than that is always mapped, and unmapped on free
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
MAX_MMAP_THRESHOLD = 1 << 25
MIN_TRIM_THRESHOLD = 1 << 17  # glibc's default: a heap with less free on top is never trimmed
FRAME_SLACK = 1 << 12  # libzmq's message header and the allocator's, on top of a frame's bytes
MAX_INT = (1 << 31) - 1  # mallopt takes a C int


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


@dataclass(frozen=True)
class ReceiveHeap:
    """What ``keep_receive_buffers`` set: frames up to ``reused_frame_bytes`` come from the
    heap, which keeps up to ``retained_bytes`` free for the next messages; ``problem`` says
    why it set nothing (None: it did)."""

    reused_frame_bytes: int
    retained_bytes: int
    problem: str | None = None


def _mallopt_pairs(mmap_at: int, retain: int) -> list[tuple[int, int]]:
    """The ``mallopt`` (parameter, value) pairs: map only allocations of ``mmap_at`` bytes or
    more; keep ``retain`` bytes of free heap (trim threshold and top pad)."""
    return [(M_MMAP_THRESHOLD, mmap_at), (M_TRIM_THRESHOLD, retain), (M_TOP_PAD, retain)]


def keep_receive_buffers(largest_frame: int, retain: int) -> ReceiveHeap:
    """Make the C heap reuse received frames' buffers: allocations up to ``largest_frame``
    bytes (at most glibc's ``MAX_MMAP_THRESHOLD``) come from the heap instead of fresh
    mappings, and up to ``retain`` bytes of freed heap stay with the process for the next
    messages instead of going back to the system. Process-wide (every thread's ``malloc``);
    a service calls it once at start. Logs at warning level when it cannot (not glibc, or a
    value glibc refuses: frames then page-fault into fresh memory on every receive) and when
    frames larger than glibc can keep on the heap will still be mapped per message."""
    mmap_at = min(max(int(largest_frame) + FRAME_SLACK, MIN_TRIM_THRESHOLD), MAX_MMAP_THRESHOLD)
    trim_at = min(max(int(retain), mmap_at, MIN_TRIM_THRESHOLD), MAX_INT)
    problem = None
    for param, value in _mallopt_pairs(mmap_at, trim_at):
        if (problem := mallopt(param, value)) is not None:
            break
    if problem is not None:
        log.warning("%s: received frames are mapped afresh on every receive", problem)
        return ReceiveHeap(0, 0, problem)
    if largest_frame + FRAME_SLACK > MAX_MMAP_THRESHOLD:
        log.warning(
            "frames over %d MiB (the largest here: %.0f MiB) are mapped afresh on every "
            "receive: glibc keeps no larger allocation on its heap",
            MAX_MMAP_THRESHOLD >> 20,
            largest_frame / (1 << 20),
        )
    return ReceiveHeap(mmap_at - FRAME_SLACK, trim_at)


def release_memory() -> bool:
    """Return the C heap's free memory to the system (glibc's ``malloc_trim``); False where
    the C library has none (the memory is then kept for reuse by the process)."""
    trim = libc_function("malloc_trim")
    if trim is None:
        log.debug("no malloc_trim in this C library: freed memory stays with the process")
        return False
    trim.argtypes = [ctypes.c_size_t]
    return bool(trim(0))
