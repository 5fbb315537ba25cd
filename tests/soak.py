"""The soak test's fault schedule, process probes and accounting check (tests/test_soak.py).

The schedule is drawn up front from one seed, so the same seed and length give the same
faults at the same offsets (what they hit still depends on timing: how long a restart takes,
which worker is old enough to be picked, which message a reset cuts). Its intervals scale
with the soak: ``SOAK_SECONDS`` of 480 gives the full plan below; a short development run gets
the same kinds of events, closer together.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
from typing import Any

WORKER_EVERY_S = 20.0  # a random worker SIGKILLed about this often
SERVER_EVERY_S = 120.0  # the server SIGKILLed about this often ...
QUIET_S = 180.0  # ... but its last incarnation serves at least this long: it is measured
WARM_S = 60.0  # the last incarnation's warm-up before its first measurement
RESET_EVERY_S = 20.0  # a relay resets every open connection about this often
TRAINED_S = 10.0  # a worker is picked for a kill only once it has served this long
FULL_S = 480.0  # the fault phase of a full soak: the intervals above at their full length


@dataclass(frozen=True)
class Event:
    """One fault, due ``at`` seconds in: ``worker`` (SIGKILL a worker, picked when it fires),
    ``server`` (SIGKILL the server) or ``reset`` (relay ``target`` resets its connections)."""

    at: float
    kind: str
    target: int = 0


@dataclass
class Plan:
    """The soak's timing for a fault phase of ``seconds``, its events in time order, and the
    random source that picks each killed worker."""

    seconds: float
    warm_s: float
    quiet_s: float
    events: list[Event] = field(default_factory=list)
    rng: random.Random = field(default_factory=random.Random)

    def count(self, kind: str) -> int:
        """How many events of ``kind`` the plan holds."""
        return sum(e.kind == kind for e in self.events)

    def pick_worker(self, serving: list[float | None]) -> int | None:
        """The worker to kill, given how long each worker process has served (None: not yet
        joined): a random one of those serving at least ``TRAINED_S``, so that a restarted
        worker trains before it can be killed again; None when there is none yet (the kill
        waits)."""
        ready = [i for i, t in enumerate(serving) if t is not None and t >= TRAINED_S]
        return self.rng.choice(ready) if ready else None


def plan(seconds: float, seed: int, relays: int) -> Plan:
    """The seeded fault schedule for a fault phase of ``seconds``.

    Worker kills about every 20 s (+-25 %), relay resets about every 20 s (+-50 %); server
    kills about every 120 s (+-15 %) while at least 180 s are left (the phase runs on until
    the last incarnation has served that long: a restart takes its time). A shorter phase
    than ``FULL_S`` shrinks the server's interval, its last stretch and its warm-up in
    proportion, so a development run (``SOAK_SECONDS=200``) still restarts the server.
    """
    rng = random.Random(seed)
    scale = min(1.0, seconds / FULL_S)
    quiet = QUIET_S * scale
    events: list[Event] = []
    t = SERVER_EVERY_S * scale * rng.uniform(0.85, 1.15)
    while t < seconds - quiet:
        events.append(Event(t, "server"))
        t += SERVER_EVERY_S * scale * rng.uniform(0.85, 1.15)
    t = WORKER_EVERY_S * rng.uniform(0.75, 1.25)
    while t < seconds:
        events.append(Event(t, "worker"))
        t += WORKER_EVERY_S * rng.uniform(0.75, 1.25)
    t = RESET_EVERY_S * rng.uniform(0.5, 1.5)
    while t < seconds:
        events.append(Event(t, "reset", rng.randrange(relays)))
        t += RESET_EVERY_S * rng.uniform(0.5, 1.5)
    events.sort(key=lambda e: e.at)
    return Plan(seconds, WARM_S * scale, quiet, events, random.Random(seed + 1))


def open_fds(pid: int) -> int:
    """How many file descriptors process ``pid`` has open."""
    return len(os.listdir(f"/proc/{pid}/fd"))


def rss_mb(pid: int) -> float:
    """Resident set size of process ``pid`` in MiB (VmRSS)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def accounting(doc: dict[str, Any]) -> dict[str, Any]:
    """The push accounting of one server incarnation's status document, and its violations.

    Every push the server receives is refused or accepted, and every accepted push is
    applied, dropped by the policy or held for a sync round:

    - per worker: ``pushes = applied + dropped + held + rejected`` (its record counts each
      push it sent and how each ended);
    - server-wide: the ``pushes_received`` that were not accepted were refused, so
      ``pushes_received - accepted`` lies between the workers' own refusals and every refusal
      (``rejected_total`` also counts refused requests and pushes from ids without a record);
    - ``async`` applies one worker's gradient per update, and this incarnation applied
      ``version - restored_from`` updates: that is the workers' ``applied`` summed.

    Returns the totals and ``violations`` (empty when every identity holds).
    """
    workers = doc["workers"]
    tot = {
        k: sum(w[k] for w in workers.values())
        for k in ("pushes", "applied", "dropped", "held", "rejected")
    }
    accepted = tot["applied"] + tot["dropped"] + tot["held"]
    refused = doc["pushes_received"] - accepted
    applied_here = doc["version"] - (doc["restored_from"] or 0)
    violations = [
        f"{wid}: {w}"
        for wid, w in workers.items()
        if w["pushes"] != w["applied"] + w["dropped"] + w["held"] + w["rejected"]
    ]
    if not tot["rejected"] <= refused <= doc["rejected_total"]:
        violations.append(
            f"received {doc['pushes_received']} - accepted {accepted} = {refused} refused, "
            f"not within [{tot['rejected']}, rejected_total {doc['rejected_total']}]"
        )
    if applied_here != tot["applied"]:
        violations.append(f"version - restored_from = {applied_here} != applied {tot}")
    return {
        **tot,
        "received": doc["pushes_received"],
        "accepted": accepted,
        "refused": refused,
        "rejected_total": doc["rejected_total"],
        "applied_here": applied_here,
        "rejected_reasons": dict(doc["rejected"]),
        "violations": violations,
    }
