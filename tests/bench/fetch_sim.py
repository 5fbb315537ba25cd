"""Weight pulls of the study's simulated workers under byte-saving fetch settings.

``study.simulate`` asks ``Pulls.take`` which weights a worker computes its next gradient on.
A fetch setting (``Job.fetch``) is one of, or several joined by ``+``:

``every``         a pull before every step, as ``downpour worker`` with ``--n-fetch 1``
                  (the default; the study's behaviour: the weights the server holds now);
``n-fetch:K``     ``--n-fetch K``: the worker installs a pull before every K-th step (its
                  steps 0, K, 2K, ...) and computes the steps between on the weights it holds,
                  unchanged (the real worker applies nothing locally); its gradients carry
                  the held version as ``base_version``. The pull comes right after the server
                  took the previous push, as every pull in the study (``--no-prefetch``);
``bf16``          ``--pull-compress bf16``: the reply carries ``wire.as_bf16`` of the weights
                  (the codec the server's pull handler uses) and the worker computes on what
                  ``wire.decode`` widens back to float32; the server keeps float32;
``adaptive:B``    ``--pull-bound B``: the worker asks before every step; the server answers
                  "unchanged" (no tensors) unless the weights moved by more than ``B`` of
                  their norm since the worker's version: ``||w_now - w_have|| / ||w_now||``.
                  The server (``downpour.server.policies.movement``) estimates it on a fixed sample
                  of the dense weights' elements; this simulation computes it exactly, over
                  every variable a simulated worker pulls whole (the whole model but a
                  dynamic table, whose rows go by id and come with every pull; a real worker
                  pulls fixed tables by row too, and the server measures only the variables
                  it sends whole).

A worker that the server held (``sync``) or whose gradient it dropped as stale pulls fresh
weights whatever the setting, as the real puller does (``await_new_version``, the
``dropped_stale`` refresh). Every reply is encoded with ``downpour.wire`` as the server
sends it; ``bytes_pulled`` counts its frames (an "unchanged" reply: the header only; a step
that sends no pull: nothing). ``every`` installs the server's arrays themselves (the study's
path, unchanged) and only counts the bytes of their dense reply.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

FETCH_EVERY = "every"


@dataclass(frozen=True)
class FetchMode:
    """A parsed fetch setting (see the module docstring)."""

    text: str
    n_fetch: int = 1
    bf16: bool = False
    bound: float | None = None  # adaptive: relative movement that warrants a pull

    @property
    def direct(self) -> bool:
        """``every``: the server's arrays go to the step as they are, as today's study."""
        return self.n_fetch == 1 and not self.bf16 and self.bound is None


def parse_fetch(text: str) -> FetchMode:
    """``every``, ``n-fetch:K``, ``bf16``, ``adaptive:B`` or several joined by ``+``
    (``bf16+n-fetch:2``); ValueError for anything else."""
    n_fetch, bf16, bound = 1, False, None
    for part in text.split("+"):
        head, _, arg = part.partition(":")
        try:
            if part == FETCH_EVERY:
                continue
            if part == "bf16":
                bf16 = True
            elif head == "n-fetch" and int(arg) >= 1:
                n_fetch = int(arg)
            elif head == "adaptive" and float(arg) > 0:
                bound = float(arg)
            else:
                raise ValueError
        except ValueError:
            raise ValueError(
                f"fetch setting {part!r} in {text!r}: expected every, n-fetch:K (K >= 1), "
                "bf16 or adaptive:B (B > 0), joined by '+'"
            ) from None
    return FetchMode(text, n_fetch, bf16, bound)


def _norm(arrays: list[Any]) -> float:
    return math.sqrt(sum(float((a.astype("float64") ** 2).sum()) for a in arrays))


def _byte_view(frame: Any) -> memoryview:
    """A frame as a view of its bytes; an empty one (a dynamic table's ``Keyed`` with no
    rows, as a whole pull carries it) as an empty view, which ``cast`` refuses to make."""
    view = memoryview(frame)
    return view.cast("B") if view.nbytes else memoryview(b"")


class Pulls:
    """The weights every simulated worker holds, the pulls that refresh them, and their
    bytes. ``take`` is called before each of a worker's steps; the counters go into the
    run's record (``record``)."""

    def __init__(self, text: str, workers: int, names: list[str], limits: Any) -> None:
        self.mode = parse_fetch(text)
        self.names = names
        self.limits = limits
        self.held: list[tuple[int, list[Any]] | None] = [None] * workers
        self.steps = [0] * workers  # steps each worker has started
        self.requests = 0  # pull requests sent
        self.installed = 0  # pulls whose weights were installed
        self.skipped = 0  # adaptive: requests answered "unchanged" as moved too little
        self.bytes_pulled = 0
        self._frames: tuple[int, list[bytes]] | None = None  # one version's encoded reply
        # adaptive: the server's weights at the version each worker holds
        self._base: list[list[np.ndarray | None] | None] = [None] * workers

    def take(
        self, i: int, version: int, weights: list[Any], refresh: bool = False
    ) -> tuple[int, list[Any]]:
        """(version, weights) worker ``i`` computes its next step on, given the server's
        current ``weights`` at ``version`` (what a pull would serve); ``refresh``: the worker
        must pull fresh weights (held by sync, or a gradient dropped as stale)."""
        step, held = self.steps[i], self.held[i]
        self.steps[i] += 1
        if held is not None and not refresh and step % self.mode.n_fetch != 0:
            return held  # no pull this step
        self.requests += 1
        if held is not None and held[0] == version:
            self.bytes_pulled += self._unchanged_bytes(version)
            return held
        if held is not None and not refresh and not self._moved_enough(i, weights):
            self.skipped += 1
            self.bytes_pulled += self._unchanged_bytes(version)
            return held
        pulled = self._pull(version, weights)
        self.installed += 1
        self.held[i] = (version, pulled)
        if self.mode.bound is not None:  # a dynamic table (no array) is not measured
            self._base[i] = [
                np.array(a, copy=True) if isinstance(a, np.ndarray) else None for a in weights
            ]
        return version, pulled

    def record(self) -> dict[str, Any]:
        """The run's pull figures."""
        return {
            "fetch": self.mode.text,
            "pull_requests": self.requests,
            "pulls_installed": self.installed,
            "pulls_skipped": self.skipped,
            "bytes_pulled": self.bytes_pulled,
            "worker_steps": list(self.steps),
        }

    def _pull(self, version: int, weights: list[Any]) -> list[Any]:
        """The reply's bytes counted; the weights as the worker installs them."""
        from downpour import wire

        if self._frames is None or self._frames[0] != version:
            tensors = [wire.as_bf16(a) for a in weights] if self.mode.bf16 else weights
            msg = wire.weights_reply(
                version, wire.PullReply("sim"), dict(zip(self.names, tensors, strict=True))
            )
            frames = [_byte_view(f) for f in wire.encode(msg)]
            if not self.mode.direct:  # the network: the worker decodes bytes of its own
                frames = [bytes(f) for f in frames]
            self._frames = (version, frames)
        frames = self._frames[1]
        self.bytes_pulled += sum(len(f) for f in frames)
        if self.mode.direct:
            return weights
        reply = wire.decode(frames, self.limits)
        return list(reply.tensors.values())

    def _unchanged_bytes(self, version: int) -> int:
        from downpour import wire

        msg = wire.weights_reply(version, wire.PullReply("sim", unchanged=True))
        return sum(memoryview(f).nbytes for f in wire.encode(msg))

    def _moved_enough(self, i: int, weights: list[Any]) -> bool:
        """Whether the server's ``weights`` moved more than the bound since the version
        worker ``i`` holds (always, but for adaptive settings)."""
        base = self._base[i]
        if self.mode.bound is None or base is None:
            return True
        pairs = [(a, b) for a, b in zip(weights, base, strict=True) if b is not None]
        w_norm = _norm([a for a, _ in pairs])
        moved = _norm([a - b for a, b in pairs])
        return w_norm == 0.0 or moved / w_norm > self.mode.bound
