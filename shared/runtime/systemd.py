"""systemd's service notification protocol (``Type=notify``), without libsystemd.

The service manager passes an AF_UNIX datagram socket in ``$NOTIFY_SOCKET`` (a path, or an
abstract-namespace name written with a leading '@'); a service sends newline-separated
``KEY=VALUE`` assignments to it, one datagram each:

- ``READY=1``     start-up finished (for the server: sockets bound, checkpoint restored)
- ``STOPPING=1``  shutdown begun (for the server: SIGTERM received, draining)
- ``WATCHDOG=1``  still healthy; expected every ``$WATCHDOG_USEC`` microseconds
  (``WatchdogSec=``), sent here at half that interval
- ``STATUS=...``  a one-line status shown by ``systemctl status``

Without ``$NOTIFY_SOCKET`` (not started by systemd) every call is a no-op, so the services
call these unconditionally. See sd_notify(3).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Mapping

log = logging.getLogger("downpour.runtime.systemd")


def notify(state: str, environ: Mapping[str, str] | None = None) -> bool:
    """Send ``state`` (e.g. "READY=1\\nSTATUS=serving") to $NOTIFY_SOCKET; False if not sent.

    Never raises: a service must not fail because its supervisor went away.
    """
    environ = os.environ if environ is None else environ
    address = environ.get("NOTIFY_SOCKET", "")
    if not address:
        return False
    if address[0] == "@":  # abstract namespace: a leading NUL byte on the wire
        address = "\0" + address[1:]
    elif address[0] != "/":
        log.debug("NOTIFY_SOCKET %r is not an AF_UNIX address; not notifying", address)
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall(state.encode())
    except OSError as exc:
        log.debug("systemd notify %r failed: %s", state, exc)
        return False
    return True


def watchdog_interval(environ: Mapping[str, str] | None = None) -> float | None:
    """Seconds between WATCHDOG=1 pings (half of $WATCHDOG_USEC), or None if not asked for.

    $WATCHDOG_PID, when set, names the process the watchdog is meant for (sd_watchdog_enabled).
    """
    environ = os.environ if environ is None else environ
    try:
        usec = int(environ.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    pid = environ.get("WATCHDOG_PID")
    if usec <= 0 or (pid and pid != str(os.getpid())):
        return None
    return usec / 2e6


class Watchdog:
    """Sends WATCHDOG=1 at half the configured interval; call ``tick()`` from a healthy loop."""

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        self.environ = os.environ if environ is None else environ
        self.interval_s = watchdog_interval(self.environ)
        self._last = float("-inf")

    def tick(self, healthy: bool = True) -> bool:
        """Ping if due and ``healthy``; True if a ping was sent. A sick service stays silent,
        so systemd restarts it when the interval runs out."""
        if self.interval_s is None or not healthy:
            return False
        now = time.monotonic()
        if now - self._last < self.interval_s:
            return False
        self._last = now
        return notify("WATCHDOG=1", self.environ)
