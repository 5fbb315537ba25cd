"""The C allocator of a server process: how many arenas it may use, and what they hold.

glibc's malloc gives a thread that finds the arenas in use by others an arena of its own, up
to 8 per core. Every arena keeps freed memory up to the trim threshold and grows by the top
pad, both of which the server raises to keep a few pushes' worth of receive buffers
(``downpour.net.receive.keep_receive_buffers``). So each arena a server thread happens to take
(the apply loop, the receivers, TensorFlow's op threads, the evaluator, the checkpoint
writer) can keep that much: resident memory climbs with the work done, one arena at a time,
until every arena there may be exists. ``limit_arenas`` caps the arenas at 2 before any
thread starts, which bounds what they keep and makes it level off early.

``MALLOC_ARENA_MAX`` in the environment is glibc's own setting, read at process start: when
it is set, it wins. Arenas made before ``limit_arenas`` stay, and glibc fixes its own limit
once more than 8 exist, so a server built inside a process that already ran many threads
should get ``MALLOC_ARENA_MAX`` instead. The status document's ``malloc`` section shows the
arenas in use beside the limit.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

log = logging.getLogger("downpour.memory.malloc")

DEFAULT_ARENAS = 2
ENV = "MALLOC_ARENA_MAX"
M_ARENA_MAX = -8  # glibc's mallopt parameter numbers (malloc.h)
HEAP_READ_EVERY_S = 10.0  # malloc_info walks every arena's free lists: not on every status


@dataclass(frozen=True)
class ArenaLimit:
    """What governs the process's malloc arenas: ``arenas`` the limit in force (None: the C
    library's own, 8 per core), ``source`` where it came from (``MALLOC_ARENA_MAX``,
    ``downpour`` or ``none``), and ``problem``, why downpour's limit could not be set (None
    when it was, or when the environment set one)."""

    arenas: int | None
    source: str
    problem: str | None = None


@dataclass(frozen=True)
class HeapState:
    """The C heap as glibc's ``malloc_info`` reports it: ``arenas`` in use, and the bytes
    ``free`` in them (freed, kept by the process for reuse) out of ``system`` obtained from
    the system."""

    arenas: int
    free: int
    system: int


_limit: ArenaLimit | None = None
_heap: tuple[float, HeapState | None] | None = None  # (monotonic time read, state)


def libc_function(name: str) -> Any | None:
    """The C library's function ``name`` via ctypes, or None where it has none (not glibc)."""
    try:
        return getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):
        return None


def mallopt(param: int, value: int) -> str | None:
    """glibc's ``mallopt(param, value)``: None when it took the value, else why not."""
    fn = libc_function("mallopt")
    if fn is None:
        return "no mallopt in this C library"
    fn.argtypes, fn.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    if fn(param, value) != 1:
        return f"mallopt({param}, {value}) refused"
    return None


def limit_arenas(
    arenas: int = DEFAULT_ARENAS, environ: Mapping[str, str] | None = None
) -> ArenaLimit:
    """Cap this process's malloc arenas at ``arenas`` unless ``MALLOC_ARENA_MAX`` already
    does; returns (and keeps, for ``status``) what is in force. A limit that cannot be set
    is logged at warning level and named in the result. Call it before threads start."""
    global _limit
    env = os.environ if environ is None else environ
    if (given := env.get(ENV)) is not None:
        _limit = ArenaLimit(int(given) if given.strip().isdigit() else None, ENV)
        return _limit
    problem = mallopt(M_ARENA_MAX, arenas)
    if problem is None:
        _limit = ArenaLimit(arenas, "downpour")
    else:
        log.warning(
            "malloc arenas not limited to %d (%s): each thread's arena may keep its freed "
            "receive buffers, so resident memory grows with the threads; set %s",
            arenas,
            problem,
            ENV,
        )
        _limit = ArenaLimit(None, "none", problem)
    return _limit


def read_heap() -> HeapState | None:
    """The C heap now (``malloc_info``), or None where the C library cannot say."""
    info = libc_function("malloc_info")
    stream = libc_function("open_memstream")
    if info is None or stream is None:
        return None
    close, free = libc_function("fclose"), libc_function("free")
    stream.restype = ctypes.c_void_p
    stream.argtypes = (ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_size_t))
    info.argtypes = (ctypes.c_int, ctypes.c_void_p)
    close.argtypes = free.argtypes = (ctypes.c_void_p,)
    buf, size = ctypes.c_void_p(), ctypes.c_size_t()
    f = stream(ctypes.byref(buf), ctypes.byref(size))
    if not f:
        return None
    try:
        ok = info(0, f) == 0
    finally:
        close(f)  # flushes: buf and size are set from here on
    try:
        text = ctypes.string_at(buf.value, size.value).decode() if buf.value else ""
    finally:
        free(buf)
    return parse_heap(text) if ok else None


def parse_heap(text: str) -> HeapState | None:
    """``malloc_info``'s XML as a ``HeapState``: its heaps, and the totals after the last
    heap (free = fast bins + the rest; system = the current size)."""
    tail = text[text.rfind("</heap>") :]
    totals = dict(re.findall(r'<total type="(fast|rest)" count="\d+" size="(\d+)"/>', tail))
    system = re.search(r'<system type="current" size="(\d+)"/>', tail)
    if not totals or system is None:
        return None
    free = sum(int(v) for v in totals.values())
    return HeapState(text.count("<heap nr="), free, int(system.group(1)))


def status(now: float | None = None) -> dict[str, Any] | None:
    """The status document's ``malloc`` section: the arena limit in force and the heap, read
    at most every ``HEAP_READ_EVERY_S``; None in a process that never called
    ``limit_arenas``."""
    global _heap
    if _limit is None:
        return None
    now = time.monotonic() if now is None else now
    if _heap is None or now - _heap[0] >= HEAP_READ_EVERY_S:
        _heap = (now, read_heap())
    heap = _heap[1]
    return {
        "arena_limit": _limit.arenas,
        "limit_source": _limit.source,
        "problem": _limit.problem,
        "heap": None if heap is None else asdict(heap),
    }
