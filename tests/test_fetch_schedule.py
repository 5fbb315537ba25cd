"""The fetch schedule's decision (``downpour.worker.pull.schedule``): when a prefetching worker
with ``--n-fetch N`` requests its next pull, from its step time and pull round trip, and
what row pulls expect of a pull sent later. Pure arithmetic: no sockets, no clock."""

from __future__ import annotations

import pytest

from downpour.worker.pull.schedule import FetchSchedule
from downpour.worker.rows.pulling import versions_ahead


def schedule(n_fetch: int, step_s: float | None, rtt_s: float | None) -> FetchSchedule:
    s = FetchSchedule(n_fetch, alpha=1.0)  # alpha 1: the estimate is the last sample
    if step_s is not None:
        s.note_step(step_s)
    if rtt_s is not None:
        s.note_round_trip(rtt_s)
    return s


def request_steps(s: FetchSchedule, steps: range) -> list[int]:
    """The steps before which the schedule sends a request (one per fetch interval: a
    request stays outstanding until its fetch step takes it)."""
    out, outstanding = [], False
    for step in steps:
        if step and step % s.n_fetch == 0:
            outstanding = False  # the fetch step installs the reply
        if not outstanding and s.due(step):
            s.requested(step)
            out.append(step)
            outstanding = True
    return out


def test_n_fetch_1_requests_right_after_every_install() -> None:
    for est in [(None, None), (0.01, 0.001), (0.01, 10.0), (0.0, 0.0)]:
        s = schedule(1, *est)
        assert all(s.due(step) for step in range(20))
        assert s.steps_left(7) == 1


def test_without_estimates_the_request_goes_at_once() -> None:
    assert schedule(4, None, None).due(0)  # the first prefetch, before any step
    assert schedule(4, 0.01, None).due(4)  # no round trip measured yet
    assert schedule(4, None, 0.01).due(8)  # no step time yet


def test_a_fast_pull_is_requested_one_step_before_its_fetch_step() -> None:
    s = schedule(4, step_s=0.010, rtt_s=0.002)  # the reply comes within a fifth of a step
    assert [s.due(step) for step in range(4, 8)] == [False, False, False, True]
    assert request_steps(s, range(4, 16)) == [7, 11, 15]
    assert s.last_lead == 1


def test_a_slow_pull_is_requested_as_many_steps_ahead_as_it_takes() -> None:
    # 2.2 steps of round trip + half a step of margin: 2.7 steps ahead -> with 2 left
    s = schedule(4, step_s=0.010, rtt_s=0.022)
    assert [s.steps_left(step) for step in range(4, 8)] == [4, 3, 2, 1]
    assert request_steps(s, range(4, 12)) == [6, 10]
    assert s.last_lead == 2
    # the margin decides the boundary: 1.6 steps of round trip + 0.5 = 2.1 -> 2 left
    assert request_steps(schedule(4, 0.010, 0.016), range(4, 8)) == [6]
    assert request_steps(schedule(4, 0.010, 0.014), range(4, 8)) == [7]


def test_a_round_trip_longer_than_the_interval_requests_right_after_the_install() -> None:
    s = schedule(4, step_s=0.010, rtt_s=0.100)
    assert request_steps(s, range(4, 16)) == [4, 8, 12]  # as without a schedule
    assert s.last_lead == 4
    assert schedule(8, step_s=0.0, rtt_s=0.001).due(8)  # instant steps: never wait


def test_the_estimates_follow_a_change_in_step_time() -> None:
    s = FetchSchedule(4)
    s.note_round_trip(0.02)
    for _ in range(20):
        s.note_step(0.100)  # slow steps: the round trip hides in one step
    assert request_steps(s, range(4, 8)) == [7]
    for _ in range(20):
        s.note_step(0.005)  # fast steps: the same round trip is 4 steps
    assert request_steps(s, range(8, 12)) == [8]
    lead = s.lead_steps()
    assert lead is not None and 4.0 < lead < 5.0


def test_a_negative_time_from_a_clock_oddity_counts_as_zero() -> None:
    s = FetchSchedule(4, alpha=0.25)
    s.note_step(0.004)
    s.note_step(-1.0)
    assert s.step_s.value == 0.003
    s.note_round_trip(-1.0)
    assert s.round_trip_s.value == 0.0


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="n_fetch"):
        FetchSchedule(0)


def test_row_pulls_expect_a_later_request_to_bring_a_newer_version() -> None:
    """With row pulls the worker asks for the rows that will be stale when the reply lands,
    from the versions it expects the reply to be ahead of the weights held; a request the
    schedule sends later than N steps after the last one expects more versions."""

    steps, gap = [4, 8], [4, 4]  # shard 1 moves twice as fast
    held = 16  # the weights held were requested before step 16
    assert versions_ahead(steps, gap, held, 20) == [4, 8]  # N = 4 steps on: the last pace
    assert versions_ahead(steps, gap, held, 22) == [6, 12]  # 6 steps since the held request
    assert versions_ahead(steps, gap, held, 16) == [1, 2]  # at once: at least a step's pace
