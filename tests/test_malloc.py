"""The server's malloc arena limit (``downpour.memory.malloc``): what it bounds, how it is reported,
and what happens where it cannot be set.

The heap probes run in fresh interpreters: arenas are process-wide and glibc fixes its own
limit once more than 8 exist, so only a process that has not yet run threads shows the
effect. Real threads, real numpy buffers of a Deep MNIST gradient's size, real glibc."""

from __future__ import annotations

import logging
import os
import platform

import pytest
from conftest import isolated_json

from downpour.cli.status import render
from downpour.memory import malloc

GLIBC = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the arenas are glibc's")
ENV_SET = pytest.mark.skipif(
    "MALLOC_ARENA_MAX" in os.environ, reason="MALLOC_ARENA_MAX fixes the arenas of every probe"
)

# In a fresh interpreter: the server's receive-buffer setting for frames of ``size`` bytes
# (the heap keeps 4 of them free), ``limit`` arenas (0: glibc's own), then ``threads`` threads
# starting together, each allocating and freeing 20 buffers of ``size``; the heap afterwards.
HEAP_PROBE = """
import json, sys, threading
import numpy as np
from downpour.memory import malloc
from downpour.net.receive import keep_receive_buffers
limit, size, threads = json.loads(sys.argv[1])
if limit:
    malloc.limit_arenas(limit, environ={})
keep_receive_buffers(size, 4 * size)
start = threading.Barrier(threads)
def work():
    start.wait()
    for _ in range(20):
        a = np.ones(size // 8)
        a += 1
        del a
ts = [threading.Thread(target=work) for _ in range(threads)]
for t in ts:
    t.start()
for t in ts:
    t.join()
heap = malloc.read_heap()
print(json.dumps({"arenas": heap.arenas, "system": heap.system, "free": heap.free}))
"""
SIZE = 12_845_056  # Deep MNIST's largest gradient tensor, in bytes


@GLIBC
@ENV_SET
def test_two_arenas_bound_the_freed_buffers_that_eight_threads_leave_behind() -> None:
    capped = isolated_json(HEAP_PROBE, [2, SIZE, 8])
    assert 1 <= capped["arenas"] <= 2
    # each arena keeps at most the retained receive buffers (4 frames) plus one in use
    assert capped["system"] <= 2 * 5 * SIZE, capped
    assert capped["free"] <= capped["system"]
    # glibc's own limit (8 per core) gives the same threads more arenas, each keeping as much
    unbounded = isolated_json(HEAP_PROBE, [0, SIZE, 8])
    assert unbounded["arenas"] > 2, unbounded
    assert unbounded["system"] > 1.5 * capped["system"], (unbounded, capped)


@pytest.fixture
def fresh_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """The module's record of the limit, restored after the test (this process's arenas are
    never touched: every test here that sets one goes through a stand-in mallopt or the
    environment)."""
    monkeypatch.setattr(malloc, "_limit", None)
    monkeypatch.setattr(malloc, "_heap", None)


def test_malloc_arena_max_in_the_environment_wins(
    fresh_limit: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    called: list[tuple[int, int]] = []
    monkeypatch.setattr(malloc, "mallopt", lambda p, v: called.append((p, v)))
    limit = malloc.limit_arenas(2, environ={"MALLOC_ARENA_MAX": "4"})
    assert limit == malloc.ArenaLimit(4, "MALLOC_ARENA_MAX") and called == []
    doc = malloc.status(now=0.0)
    assert doc is not None and doc["arena_limit"] == 4
    assert doc["limit_source"] == "MALLOC_ARENA_MAX" and doc["problem"] is None


def test_a_limit_that_cannot_be_set_is_a_warning_and_in_status(
    fresh_limit: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(malloc, "libc_function", lambda name: None)  # a C library without it
    with caplog.at_level(logging.WARNING, "downpour.memory.malloc"):
        limit = malloc.limit_arenas(2, environ={})
    assert limit.arenas is None and limit.source == "none"
    assert limit.problem == "no mallopt in this C library"
    assert "malloc arenas not limited to 2" in caplog.text and "MALLOC_ARENA_MAX" in caplog.text
    doc = malloc.status(now=0.0)
    assert doc == {"arena_limit": None, "limit_source": "none", "problem": limit.problem,
                   "heap": None}  # fmt: skip
    assert "WARNING: malloc arenas not limited (no mallopt" in render({"malloc": doc})


def test_status_is_none_until_a_limit_is_set_and_reads_the_heap_at_most_every_10_s(
    fresh_limit: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert malloc.status() is None
    reads: list[int] = []

    def read() -> malloc.HeapState:
        reads.append(1)
        return malloc.HeapState(len(reads), 0, 1)

    monkeypatch.setattr(malloc, "read_heap", read)
    monkeypatch.setattr(malloc, "mallopt", lambda p, v: None)  # this process's arenas stay
    malloc.limit_arenas(2, environ={})
    first = malloc.status(now=100.0)
    assert first is not None and first["heap"]["arenas"] == 1
    assert malloc.status(now=100.0 + malloc.HEAP_READ_EVERY_S - 0.1)["heap"]["arenas"] == 1
    assert malloc.status(now=100.0 + malloc.HEAP_READ_EVERY_S)["heap"]["arenas"] == 2


@GLIBC
def test_the_heap_read_from_glibc_adds_up() -> None:
    heap = malloc.read_heap()
    assert heap is not None and heap.arenas >= 1
    assert 0 <= heap.free <= heap.system


def test_malloc_info_without_its_totals_reads_as_unknown() -> None:
    assert malloc.parse_heap("") is None
    assert malloc.parse_heap('<malloc version="1"><heap nr="0"></heap></malloc>') is None
    text = (
        '<malloc version="1"><heap nr="0"></heap><heap nr="1"></heap>'
        '<total type="fast" count="2" size="64"/><total type="rest" count="3" size="1000"/>'
        '<system type="current" size="4096"/></malloc>'
    )
    assert malloc.parse_heap(text) == malloc.HeapState(2, 1064, 4096)
