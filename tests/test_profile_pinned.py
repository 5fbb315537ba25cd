"""The pinned profiler's reading of ``perf report``: CPU by thread and shared object."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent / "bench"


@pytest.fixture(scope="module")
def profile_pinned():  # noqa: ANN201 - the bench module, imported from tests/bench
    sys.path.insert(0, str(BENCH))
    try:
        import profile_pinned

        yield profile_pinned
    finally:
        sys.path.remove(str(BENCH))


REPORT = """\
# To display the perf.data header info, please use --header/--header-only options.
#
# Samples: 20K of event 'cpu-clock:ppp'
# Event count (approx.): 5000000000
#
# Overhead;Command        ;Shared Object
 33.32% ;python         ;[JIT] tid 8480
 27.07% ;ZMQbg/IO/1     ;[kernel.kallsyms]
 14.06% ;python         ;libc.so.6
 1.10%  ;python         ;[JIT] tid 8491
 0.56%  ;ZMQbg/IO/1     ;libc.so.6
 0.32%  ;py-spy         ;[kernel.kallsyms]

# (Tip: Print event counts in CSV format with: perf stat -x,)
"""


def test_perf_rows_read_busy_time_and_group_by_thread_and_object(profile_pinned) -> None:
    busy_s, rows = profile_pinned.perf_rows(REPORT)
    assert busy_s == 5.0  # cpu-clock's event count is nanoseconds sampled busy
    assert set(rows) == {"python", "ZMQbg/IO/1", "py-spy"}  # header and tip lines skipped
    assert rows["python"]["[JIT] (XLA)"] == pytest.approx(33.32 + 1.10)  # two JIT regions
    assert rows["python"]["libc.so.6"] == pytest.approx(14.06)
    assert dict(rows["ZMQbg/IO/1"]) == {"[kernel.kallsyms]": 27.07, "libc.so.6": 0.56}


def test_perf_rows_refuse_a_report_without_its_event_count(profile_pinned) -> None:
    with pytest.raises(ValueError, match="event count"):
        profile_pinned.perf_rows(REPORT.replace("# Event count (approx.): 5000000000\n", ""))


def test_perf_lines_give_cpu_per_update_and_drop_small_rows(profile_pinned) -> None:
    # 5 s busy of a 10 s window, 1,000 updates: 1 % of the samples is 0.05 ms an update
    lines = profile_pinned.perf_lines(REPORT, 10.0, 1000, "update")
    assert lines[0] == "  busy 50.0 % of the core, idle the rest"
    assert lines[1].startswith("  python:  24.2 % of the core")  # the busiest thread first
    io = lines.index("  ZMQbg/IO/1:  13.8 % of the core, 1.38 ms per update")  # 27.63 % of 5 s
    # its kernel time is listed; its libc (0.28 % of the core) is not, nor py-spy (0.16 %)
    assert lines[io + 1 :] == ["    [kernel.kallsyms]  13.5 % of the core, 1.35 ms per update"]
