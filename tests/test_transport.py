"""Transport helpers that every wait in the services leans on."""

from __future__ import annotations

import socket

import pytest

from downpour.net.transport import backoff_delays, interface_addresses, is_loopback


def test_backoff_doubles_to_its_cap_and_stays_there_for_any_number_of_calls() -> None:
    delay = backoff_delays(0.002, 0.05, seed=1)
    first = [delay() for _ in range(5)]
    for i, d in enumerate(first):  # full jitter: within [bound / 2, bound], bound doubling
        bound = min(0.05, 0.002 * 2**i)
        assert bound / 2 <= d <= bound
    # a sync wait of minutes at a 2 ms base calls it thousands of times: 2 ** n must not
    # overflow a float
    later = [delay() for _ in range(20_000)]
    assert all(0.025 <= d <= 0.05 for d in later)


@pytest.mark.parametrize(
    "host", ["127.0.0.1", "127.3.2.1", "::1", "[::1]", "localhost", "lo", " 127.0.0.1 "]
)
def test_loopback_hosts_are_loopback(host: str) -> None:
    assert is_loopback(host)


@pytest.mark.parametrize(
    "host",
    [
        "127.0.0.1.example.com",  # starts like a loopback address, is a name
        "localhost.example.com",
        "::1.example.com",
        "0.0.0.0",
        "::",
        "*",
        "",
        "10.1.2.3",
        "192.0.2.7",
        "::ffff:10.1.2.3",
        "no-such-host.invalid",
    ],
)
def test_names_and_addresses_that_are_not_loopback_are_refused(host: str) -> None:
    assert not is_loopback(host)


def test_an_interface_name_is_judged_by_its_addresses() -> None:
    assert interface_addresses("no-such-interface0") is None
    lo = interface_addresses("lo")
    assert lo and "127.0.0.1" in lo
    others = [n for _, n in socket.if_nameindex() if n != "lo" and interface_addresses(n)]
    if not others:
        pytest.skip("no interface other than lo has an address on this machine")
    name = others[0]
    addrs = interface_addresses(name)
    assert addrs and is_loopback(name) is all(a.startswith(("127.", "::1")) for a in addrs)
