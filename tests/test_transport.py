"""Transport helpers that every wait in the services leans on."""

from __future__ import annotations

from downpour.transport import backoff_delays


def test_backoff_doubles_to_its_cap_and_stays_there_for_any_number_of_calls() -> None:
    delay = backoff_delays(0.002, 0.05, seed=1)
    first = [delay() for _ in range(5)]
    for i, d in enumerate(first):  # full jitter: within [bound / 2, bound], bound doubling
        bound = min(0.05, 0.002 * 2**i)
        assert bound / 2 <= d <= bound
    # a sync wait of minutes at a 2 ms base calls it thousands of times: 2 ** n used to
    # overflow a float after ~1,000 calls and crash the worker
    later = [delay() for _ in range(20_000)]
    assert all(0.025 <= d <= 0.05 for d in later)
