"""Section 3, the server: the bare compiled apply against the real server under a flood.

* Bare apply: ``ParameterState.apply`` called in a loop in this process, with the XLA step
  and with the op-by-op graph, fed arrays that are views on received ZeroMQ frames (as the
  server gets them), interleaved with a memcpy of the gradient list.
* Memory-traffic floor: one Adam step must read var, grad, m and v and write var, m and v:
  7 x the payload. A memcpy of the payload reads it once and writes it once (2 x), so the
  floor is 3.5 x the memcpy time measured beside the applies.
* Flood: a real ``downpour server`` process and a pusher thread sending gradients that were
  computed and encoded once (only the small header changes per message, for the sequence
  number). The pusher keeps at most ``in_flight`` messages ahead of the server's applied
  version, so the server never waits for input and queues stay bounded. Applies/s come from
  the status socket: version and uptime of the same snapshot, over timed windows. Bare and
  flood alternate: a round of bare applies while the server idles, then a flood window.
* Pull latency: while the flood runs, weight fetches (``pull`` with body {}, so every reply
  carries all the weights), timed one by one.

``python tests/bench/bench_server.py [smoke|quick|full]`` runs this section alone (after the
wire section, whose push time sets the pull latency bound) and prints its keys as JSON.
"""

from __future__ import annotations

import inspect
import threading
import time
from typing import Any

import numpy as np
import zmq
from bench_util import (
    PLANS,
    Plan,
    Procs,
    cpu_seconds,
    log,
    median,
    percentile,
    start_server,
    status_endpoint,
    time_ms,
)
from bench_wire import Loopback, model_gradients
from bench_wire import run as run_wire

from downpour import wire
from downpour.cli.status import fetch_status
from downpour.net.client import ShardClient
from downpour.net.transport import make_context, tcp
from downpour.server.policies.movement import Movement
from downpour.server.state import ParameterState
from downpour.spec import ModelSpec, load_spec
from downpour.wire import Message

ADAM_TRAFFIC = 7  # payloads read + written per Adam step: var, grad, m, v in; var, m, v out
MEMCPY_TRAFFIC = 2  # payloads read + written per memcpy


def received_views(names: list[str], grads: list[np.ndarray]) -> tuple[list[np.ndarray], Any]:
    """The gradients as the server sees them: decoded views on received frames (and frames)."""
    link = Loopback()
    try:
        msg = Message(wire.PUSH, "bench", seq=1, tensors=dict(zip(names, grads, strict=True)))
        frames = link.roundtrip(wire.encode(msg))
        decoded = wire.decode(frames, wire.DEFAULT_LIMITS)
    finally:
        link.close()  # received frames own their memory: the views stay valid
    return [np.asarray(t) for t in decoded.tensors.values()], frames


class BareApply:
    """ParameterState.apply in a loop in this process, XLA and graph, beside a memcpy.

    The three are sampled interleaved, so the apply time and the memcpy that sets its floor
    are measured under the same conditions; so is a fourth, the ``--pull-bound`` sample
    (``Movement.note``) of the version each default apply makes, timed on its own: what a
    server pays per version bounded pulls see.
    """

    def __init__(self, spec: ModelSpec, grads: list[np.ndarray]) -> None:
        self.default_jit = bool(inspect.signature(ParameterState).parameters["jit"].default)
        self.grads = grads
        self.states = {
            jit: ParameterState(spec, "adam", 1e-3, seed=0, jit=jit) for jit in (True, False)
        }
        self.dst = [np.empty_like(g) for g in grads]
        self.samples: dict[str, list[float]] = {"xla": [], "graph": [], "memcpy": [], "sample": []}
        self.cpu_s = 0.0  # CPU seconds of the default variant's timed applies
        for st in self.states.values():
            time_ms(lambda st=st: st.apply(grads), 0, warmup=3)  # compile, warm caches
        default = self.states[self.default_jit]
        self.movement = Movement(default.dense_variables())
        self.movement.note(default.version)  # the sampling call compiles

    def _sample(self) -> None:
        self.movement.note(self.states[self.default_jit].version)

    def _memcpy(self) -> None:
        for d, g in zip(self.dst, self.grads, strict=True):
            np.copyto(d, g)

    def measure(self, reps: int) -> float:
        """Take ``reps`` more samples of each; returns this batch's default applies/s."""
        batch = []
        for _ in range(reps):
            self.samples["memcpy"] += time_ms(self._memcpy, 1, warmup=0)
            for jit, st in self.states.items():
                c0 = cpu_seconds()
                t = time_ms(lambda st=st: st.apply(self.grads), 1, warmup=0)
                self.samples["xla" if jit else "graph"] += t
                if jit == self.default_jit:
                    self.cpu_s += cpu_seconds() - c0
                    batch += t
                    self.samples["sample"] += time_ms(self._sample, 1, warmup=0)
        return 1e3 / median(batch)

    def result(self) -> dict[str, Any]:
        """Medians, the XLA speedup, and the floor from the interleaved memcpy."""
        for jit, st in self.states.items():
            if st.apply_traces != 1:
                raise RuntimeError(f"apply step (jit={jit}) traced {st.apply_traces} times")
        if self.movement.reads != len(self.samples["sample"]) + 1:  # +1: the compiling one
            raise RuntimeError("a timed --pull-bound sample did not read a new version")
        xla, graph = median(self.samples["xla"]), median(self.samples["graph"])
        apply_ms = xla if self.default_jit else graph
        memcpy_ms = median(self.samples["memcpy"])
        n = len(self.samples["xla"])
        return {
            "default_jit": self.default_jit,
            "apply_ms_xla": xla,
            "apply_ms_graph": graph,
            "xla_speedup": graph / xla,
            "apply_ms": apply_ms,
            "bare_apply_per_s": 1e3 / apply_ms,
            "apply_memcpy_ms": memcpy_ms,
            "apply_floor_ms": memcpy_ms * ADAM_TRAFFIC / MEMCPY_TRAFFIC,
            # CPU time over wall time of the timed applies: cores the bare apply keeps busy
            "bare_apply_cpu_cores": 1e3 * self.cpu_s / n / apply_ms,
            "apply_reps": n,
            # --pull-bound: one sample of the weights, read once per version bounded pulls see
            "pull_bound_sample_ms": median(self.samples["sample"]),
            "pull_bound_sampled": self.movement.sampled,
        }


def push_frames(tensors: dict[str, np.ndarray], seq: int, sender: str = "bench-flood") -> list[Any]:
    """One encoded gradient push of ``tensors`` (name: gradient), as a worker sends it."""
    body = {"loss": 0.0, "batch_size": 50, "steps": 0}
    return wire.encode(Message(wire.PUSH, sender, seq=seq, body=body, tensors=tensors))


class Flood:
    """A pusher thread that keeps the server saturated with gradient messages."""

    def __init__(
        self, push_port: int, names: list[str], grads: list[np.ndarray], in_flight: int
    ) -> None:
        self.names = names
        self.grads = grads
        self.in_flight = in_flight
        self.sent = 0
        self.applied = 0  # the server's version as last seen by the sampler
        self.blocked = 0  # sends that hit the high-water mark
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._paused = threading.Event()
        self._idle = threading.Event()  # set by the pusher once it has seen the pause
        self._progress = threading.Condition()
        self.ctx = make_context()
        self.sock = self.ctx.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.SNDHWM, 4)
        self.sock.setsockopt(zmq.SNDTIMEO, 1000)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(tcp("127.0.0.1", push_port))
        self.thread = threading.Thread(target=self._run, name="flood", daemon=True)

    def start(self) -> None:
        """Start pushing."""
        self.thread.start()

    def pause(self) -> None:
        """Stop sending until ``resume()``; returns once the pusher is idle (bounded)."""
        self._idle.clear()
        self._paused.set()
        if not self._idle.wait(timeout=10.0):
            raise RuntimeError("flood pusher did not pause within 10 s")

    def resume(self) -> None:
        """Send again."""
        self._paused.clear()
        with self._progress:
            self._progress.notify_all()

    def saw_version(self, version: int) -> None:
        """The sampler reports the server's version; the pusher may send ahead of it."""
        with self._progress:
            self.applied = max(self.applied, version)
            self._progress.notify_all()

    def _run(self) -> None:
        tensors = dict(zip(self.names, self.grads, strict=True))
        try:
            while not self._stop.is_set():
                with self._progress:
                    if self._paused.is_set():
                        self._idle.set()
                        self._progress.wait(timeout=0.05)
                        continue
                    if self.sent - self.applied >= self.in_flight:
                        self._progress.wait(timeout=0.05)
                        continue
                seq = self.sent + 1
                frames = push_frames(tensors, seq)
                try:
                    self.sock.send_multipart(frames, copy=False)
                except zmq.Again:
                    self.blocked += 1
                    continue
                self.sent = seq
        except BaseException as exc:  # reported by stop()
            self.error = exc

    def stop(self) -> None:
        """Stop pushing and close the socket (bounded)."""
        self._stop.set()
        with self._progress:
            self._progress.notify_all()
        self.thread.join(timeout=10)
        self.sock.close(linger=0)
        self.ctx.term()
        if self.error is not None:
            raise RuntimeError(f"flood pusher failed: {self.error!r}")


def sample(endpoint: str, flood: Flood | None = None) -> dict[str, Any]:
    """One status document; tells the flood how far the server got."""
    doc = fetch_status(endpoint, timeout_s=10.0)
    if flood is not None:
        flood.saw_version(int(doc["version"]))
    return doc


def wait_for(endpoint: str, flood: Flood, version: int, timeout_s: float) -> dict[str, Any]:
    """Status once the server's version reaches ``version``; bounded."""
    deadline = time.monotonic() + timeout_s
    while True:
        doc = sample(endpoint, flood)
        if doc["version"] >= version:
            return doc
        if time.monotonic() > deadline:
            raise RuntimeError(f"server at version {doc['version']} after {timeout_s:.0f} s")
        time.sleep(0.05)


def rate_window(endpoint: str, flood: Flood, window_s: float) -> tuple[float, dict[str, Any]]:
    """Applies/s over one window (version and uptime from the same status snapshot)."""
    first = doc = sample(endpoint, flood)
    end = time.monotonic() + window_s
    while time.monotonic() < end:  # keep the pusher informed during the window
        time.sleep(0.05)
        doc = sample(endpoint, flood)
    dt = doc["uptime_s"] - first["uptime_s"]
    return (doc["version"] - first["version"]) / dt if dt > 0 else float("nan"), doc


def pull_latencies(
    rep_port: int, grads: list[np.ndarray], endpoint: str, flood: Flood, n: int
) -> list[float]:
    """``n`` full weight fetches (body {}) while the flood runs, each timed in ms."""
    ctx = make_context()
    limits = wire.DEFAULT_LIMITS.for_payload(sum(g.nbytes for g in grads))
    endpoint_rep = tcp("127.0.0.1", rep_port)
    client = ShardClient(ctx, endpoint_rep, sender="bench-puller", timeout_s=30.0, limits=limits)
    out = []
    try:
        for i in range(n):
            t0 = time.perf_counter()
            reply = client.pull(wire.PullRequest())
            out.append(1e3 * (time.perf_counter() - t0))
            if not reply.tensors:
                raise RuntimeError("pull with body {} came back without weights")
            if i % 4 == 0:
                sample(endpoint, flood)
            time.sleep(0.02)  # pacing, like a worker between steps
    finally:
        client.close()
        ctx.term()
    return out


def server_flood(
    plan: Plan,
    procs: Procs,
    spec: ModelSpec,
    names: list[str],
    grads: list[np.ndarray],
    views: list[np.ndarray],
) -> dict[str, Any]:
    """Bare applies/s and a real server's applies/s under a flood, alternating; then pulls.

    Each round measures the bare apply in this process while the server idles (the flood
    paused and drained), then the server under the flood for one window: the two sides of
    the ratio see the same machine conditions.
    """
    bare = BareApply(spec, views)
    server, info = start_server(procs, "server-flood")
    log("server: ready, flooding")
    endpoint = status_endpoint(info)
    reps = max(1, plan.apply_reps // plan.flood_windows)
    in_flight = max(16, int(0.5 * bare.measure(reps)))  # half a second of applies
    flood = Flood(info["push_port"], names, grads, in_flight)
    flood.start()
    rates, bare_rates = [], []
    server_cpu = own_cpu = wall = 0.0
    try:
        wait_for(endpoint, flood, 5, 120.0)  # the first apply compiles
        end = time.monotonic() + plan.flood_warmup_s
        while time.monotonic() < end:
            sample(endpoint, flood)
            time.sleep(0.05)
        log(f"server: {plan.flood_windows} rounds of bare apply, then the server flooded")
        idle_pulls: list[float] = []
        for i in range(plan.flood_windows):
            flood.pause()
            wait_for(endpoint, flood, flood.sent, 60.0)  # drained: the server idles
            bare_rates.append(bare.measure(reps))
            if i == 0:  # the same fetch without the flood: its floor on this machine
                idle_pulls = pull_latencies(
                    info["port"], grads, endpoint, flood, max(5, plan.pulls // 10)
                )
            flood.resume()
            wait_for(endpoint, flood, flood.applied + min(8, in_flight), 60.0)  # refilled
            c0, o0, w0 = cpu_seconds(server.pid), cpu_seconds(), time.monotonic()
            rate, doc = rate_window(endpoint, flood, plan.flood_window_s)
            rates.append(rate)
            wall += time.monotonic() - w0
            server_cpu += cpu_seconds(server.pid) - c0
            own_cpu += cpu_seconds() - o0
        log("server: pull latency under the flood")
        before = sample(endpoint, flood)
        pulls = pull_latencies(info["port"], grads, endpoint, flood, plan.pulls)
        after = sample(endpoint, flood)
        during_pulls = (after["version"] - before["version"]) / max(
            after["uptime_s"] - before["uptime_s"], 1e-9
        )
    finally:
        flood.stop()
        procs.stop(server)
        log("server: stopped")
    if doc.get("rejected_total"):
        raise RuntimeError(f"server rejected flood messages: {doc.get('rejected')}")
    applied = sum(rates) / len(rates) * wall
    return {
        **bare.result(),
        "server_apply_per_s": median(rates),
        "server_apply_windows": rates,
        "bare_apply_windows": bare_rates,
        "ratio_per_round": [r / b for r, b in zip(rates, bare_rates, strict=True)],
        # CPU use during the flood windows: the server process (all threads) and this
        # process (the pusher and its ZeroMQ I/O thread); 2.0 cores saturate this machine.
        "server_cpu_cores": server_cpu / wall,
        "pusher_cpu_cores": own_cpu / wall,
        "server_cpu_ms_per_apply": 1e3 * server_cpu / max(applied, 1e-9),
        "server_reported_apply_ms": doc.get("apply_ms"),
        "server_apply_traces": doc.get("apply_traces"),
        "in_flight": in_flight,
        "pusher_blocked": flood.blocked,
        "pull_p50_ms": percentile(pulls, 50),
        "pull_p99_ms": percentile(pulls, 99),
        "pull_max_ms": max(pulls),
        "pull_idle_p50_ms": percentile(idle_pulls, 50),
        "pull_idle_p99_ms": percentile(idle_pulls, 99),
        "pulls": len(pulls),
        "server_apply_per_s_while_pulling": during_pulls,
    }


def run(
    plan: Plan,
    procs: Procs,
    spec: ModelSpec,
    names: list[str],
    grads: list[np.ndarray],
    wire_result: dict[str, Any],
) -> dict[str, Any]:
    """The whole server section; ``wire_result`` is section 1's result (one transfer's time)."""
    views, frames = received_views(names, grads)
    out = server_flood(plan, procs, spec, names, grads, views)
    del views, frames
    out["ratio"] = out["server_apply_per_s"] / out["bare_apply_per_s"]
    out["apply_vs_floor"] = out["apply_ms"] / out["apply_floor_ms"]
    out["pull_p99_bound_ms"] = 2 * (out["apply_ms"] + wire_result["push_decode_ms"])
    return out


def main() -> None:
    """``python tests/bench/bench_server.py [smoke|quick|full]``: this section alone, as JSON."""
    import json
    import sys
    import tempfile
    from pathlib import Path

    plan = PLANS[sys.argv[1] if len(sys.argv) > 1 else "smoke"]
    spec = load_spec("downpour.models:deep_mnist")
    names, _, grads = model_gradients(spec)
    wire_result = run_wire(names, grads, plan.wire_reps)
    with Procs(Path(tempfile.mkdtemp(prefix="downpour-bench-server-"))) as procs:
        print(json.dumps(run(plan, procs, spec, names, grads, wire_result), indent=2))


if __name__ == "__main__":
    main()
