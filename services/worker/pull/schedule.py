"""When a prefetching worker sends the request for its next weight pull.

With ``--n-fetch N`` the worker installs new weights before every N-th step. A request sent
right after the last install would bring weights about N steps old by the time they are
installed. ``FetchSchedule`` instead delays the request until the reply is expected to arrive
just before the fetch step. It keeps running averages (EWMA) of the worker's step time (from
one step's request decision to the next: input, compute, push) and of the pull round trip
(request handed to the fetcher thread -> reply ready to install, slowest shard). Before each
step it asks: with ``left`` steps to go before the fetch step, is
``left * step_time <= round_trip + margin * step_time``? If so, the request goes out now.

The decision is pure arithmetic on those figures (no sockets, no clock), so it is unit-tested
as such. With no estimate yet (the first pulls), or one step left, the request goes at once:
with N = 1 that is always, right after each install.
"""

from __future__ import annotations

from downpour.runtime.metrics import Ewma

ALPHA = 0.3  # weight of a new sample in the running averages: a few steps of memory
MARGIN_STEPS = 0.5  # the reply is wanted this fraction of a step before the fetch step


class FetchSchedule:
    """Decides, step by step, whether the pull for the next fetch step is requested now.

    ``step`` counts the steps computed so far; the fetch steps are the multiples of
    ``n_fetch`` (the worker installs the pulled weights before computing them).
    """

    def __init__(
        self, n_fetch: int, alpha: float = ALPHA, margin_steps: float = MARGIN_STEPS
    ) -> None:
        if n_fetch < 1:
            raise ValueError(f"n_fetch must be >= 1, got {n_fetch}")
        self.n_fetch = n_fetch
        self.margin_steps = margin_steps
        self.step_s = Ewma(alpha)
        self.round_trip_s = Ewma(alpha)
        self.last_lead: int | None = None  # steps before its fetch step the last request went

    def steps_left(self, step: int) -> int:
        """Steps still to compute, this one included, before the next fetch step."""
        return self.n_fetch - step % self.n_fetch

    def note_step(self, seconds: float) -> None:
        """One training step's wall time (compute, push, reading the next batch)."""
        self.step_s.update(max(0.0, seconds))  # a clock oddity counts as 0

    def note_round_trip(self, seconds: float) -> None:
        """One pull's time from request to a reply ready to install (slowest shard)."""
        self.round_trip_s.update(max(0.0, seconds))

    def lead_steps(self) -> float | None:
        """How many steps ahead of a fetch step its request should go (the round trip in
        steps, plus the margin); None without both estimates."""
        step, rtt = self.step_s.value, self.round_trip_s.value
        if step is None or rtt is None:
            return None
        if step <= 0.0:
            return float(self.n_fetch)
        return rtt / step + self.margin_steps

    def due(self, step: int) -> bool:
        """Whether, before computing step ``step``, the pull for the next fetch step should
        be requested: at once without estimates or with one step left; else once the steps
        left take no longer than the round trip plus the margin."""
        left = self.steps_left(step)
        if left <= 1:
            return True
        lead = self.lead_steps()
        return lead is None or left <= lead

    def requested(self, step: int) -> None:
        """Record that the request for the next fetch step went out before step ``step``."""
        self.last_lead = self.steps_left(step)
