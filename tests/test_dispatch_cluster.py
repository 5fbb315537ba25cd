"""Data dispatch against a real server process (``--data-dispatch server``), through the shard
client over real sockets: workers that take splits, one that stops and is released by
liveness, one that joins late, every split acknowledged exactly once; and (slow tier) a server
SIGKILLed mid-epoch and restarted from its checkpoint resumes the same epoch."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
from conftest import Cluster, Service, free_ports, wait_until

from downpour import wire
from downpour.checkpoints.store import CheckpointStore
from downpour.net.client import ShardClient, SplitGrant, fetch_status
from downpour.net.transport import make_context

FILES = wire.DataUniverse(files=tuple(f"part-{i:02d}.tfrecord" for i in range(16)))


@pytest.fixture
def zctx() -> Iterator[zmq.Context]:
    ctx = make_context()
    yield ctx
    ctx.destroy(linger=0)  # closes the sockets of readers a failed test left open


class Reader:
    """A stand-in for a dispatched worker's input loop: hello, then take a split, "read" it,
    acknowledge it with the next request. Records the acks the server accepted."""

    def __init__(
        self, zctx: zmq.Context, server: Service, name: str, process: str | None = None
    ) -> None:
        self.name = name
        self.process = process
        self.client = ShardClient(zctx, server.rep, sender=name, timeout_s=5, server_timeout_s=60)
        self.client.hello(
            wire.HelloRequest(fingerprint=server.info["fingerprint"], process=process)
        )
        self.held: tuple[int, int] | None = None
        self.accepted: list[tuple[int, int]] = []
        self.stale: list[tuple[int, int]] = []
        self.last: SplitGrant | None = None

    def step(self, want: bool = True) -> SplitGrant:
        """Acknowledge the split held (if any) and ask for the next."""
        acks = (self.held,) if self.held is not None else ()
        grant = self.client.next_split(FILES, acks, epochs=1, want=want, process=self.process)
        if self.held is not None:
            (self.accepted if grant.reply.acked else self.stale).append(self.held)
        self.held = None
        if grant.kind == "split":
            assert grant.split is not None and grant.split.file == FILES.files[grant.split.index]
            self.held = (grant.epoch, grant.split.index)
        self.last = grant
        return grant

    def close(self) -> None:
        self.client.close()


def counts(server: Service, *names: str) -> list[int]:
    """These figures of the server's published dispatch status."""
    d = fetch_status(server.status)["dispatch"]
    return [d[n] for n in names]


def run_to_end(readers: list[Reader], timeout: float) -> None:
    """Round-robin the readers until each has been told "end" (bounded). A reader told to
    wait asks again after the server's retry hint: the epoch's last splits are in flight."""
    deadline = time.monotonic() + timeout
    active = list(readers)
    while active:
        assert time.monotonic() < deadline, "the epoch did not end in time"
        waiting = 0.0
        for r in list(active):
            g = r.step()
            if g.kind == "end":
                active.remove(r)
            elif g.kind == "wait":
                waiting = max(waiting, g.retry_s)
        if waiting:
            time.sleep(waiting)  # the protocol's pacing (retry_ms), not a synchronisation


def test_splits_go_once_each_to_workers_that_come_and_go(
    cluster: Cluster, zctx: zmq.Context
) -> None:
    server = cluster.server(
        "--data-dispatch", "server", "--missing-after", "0.5", "--gone-after", "2"
    )
    readers = [Reader(zctx, server, f"w{i}", f"proc-{i}") for i in range(3)]
    for r in readers:
        r.step()
    for r in readers:
        r.step()  # each has done one split and holds a second
    dead = readers.pop(1)  # w1 stops: it holds a split and never acknowledges it
    stuck = dead.held
    assert stuck is not None
    readers.append(Reader(zctx, server, "w3", "proc-3"))  # a fourth worker joins mid-epoch
    run_to_end(readers, timeout=60)

    accepted = Counter(a for r in [*readers, dead] for a in r.accepted)
    assert sorted(i for _, i in accepted) == list(range(FILES.num_splits))  # none lost
    assert set(accepted.values()) == {1} and {e for e, _ in accepted} == {0}  # each once
    assert stuck in accepted  # the dead worker's split was done by another
    assert readers[-1].accepted, "the late joiner got no work"

    # the status document is republished a few times a second: wait for one after the end
    doc = wait_until(
        lambda: (doc := fetch_status(server.status))["dispatch"]["finished"] and doc,
        10,
        "the status document after the epoch",
    )
    d = doc["dispatch"]
    assert (d["epochs_done"], d["splits_done"], d["released"]) == (1, FILES.num_splits, 1)
    assert doc["workers"]["w1"]["state"] == "gone"
    assert dead.step().reply.stale == 1  # it comes back too late: its ack is ignored
    for r in [*readers, dead]:
        r.close()


def test_a_worker_with_other_data_is_refused(cluster: Cluster, zctx: zmq.Context) -> None:
    from downpour.net.transport import Refused

    server = cluster.server("--data-dispatch", "server")
    Reader(zctx, server, "w0", "p0").step()
    other = ShardClient(zctx, server.rep, sender="w1", timeout_s=5)
    with pytest.raises(Refused) as exc:
        other.next_split(wire.DataUniverse(elements=100, split_size=10))
    assert exc.value.code == wire.R_UNIVERSE
    wait_until(
        lambda: fetch_status(server.status)["rejected"] == {wire.R_UNIVERSE: 1},
        10,
        "the refusal counted in the status document",
    )
    other.close()


def test_a_restarted_worker_saying_hello_gets_its_split_taken_back(
    cluster: Cluster, zctx: zmq.Context
) -> None:
    server = cluster.server("--data-dispatch", "server")
    first = Reader(zctx, server, "w0")  # this process's token, sent by the client itself
    first.step()
    lost = first.held
    assert lost is not None and first.client.next_split(FILES).split.index == lost[1]  # a retry
    restarted = Reader(zctx, server, "w0", process="the-next-process")  # hello releases
    other = Reader(zctx, server, "w1")
    assert (other.step().epoch, other.held) == (0, lost)
    wait_until(
        lambda: counts(server, "released", "resent") == [1, 1],
        10,
        "one release and one resend in the status document",
    )
    for r in (first, restarted, other):
        r.close()


@pytest.mark.slow
def test_a_server_killed_mid_epoch_resumes_it_from_its_checkpoint(
    cluster: Cluster, zctx: zmq.Context, tmp_path: Path
) -> None:
    state = tmp_path / "state"
    port = free_ports(1)[0]
    args = ("--data-dispatch", "server", "--state-dir", str(state), "--checkpoint-secs", "0.2")
    server = cluster.server(*args, port=port)
    readers = [Reader(zctx, server, f"w{i}", f"proc-{i}") for i in range(2)]
    for _ in range(3):
        for r in readers:
            r.step()  # after three rounds: 2 x 2 splits done, one in flight each
    before = {a for r in readers for a in r.accepted}
    assert len(before) == 4

    def checkpointed() -> bool:
        ckpt = CheckpointStore(state).latest()
        return ckpt is not None and len(ckpt.meta.get("dispatch", {}).get("acked", [])) == 4

    wait_until(checkpointed, 30, "a checkpoint holding the 4 acknowledged splits")
    server.proc.kill()
    server.wait(30)
    server = cluster.server(*args, port=port)

    d = fetch_status(server.status)["dispatch"]
    assert (d["epoch"], d["splits_done"], d["splits_in_flight"]) == (0, 4, 0)
    assert d["splits_left"] == FILES.num_splits - 4
    for r in readers:
        r.accepted.clear()
    run_to_end(readers, timeout=60)
    after = Counter(a for r in readers for a in r.accepted)
    assert len(readers[0].stale) + len(readers[1].stale) == 2  # the leases of the dead era
    assert set(after.values()) == {1} and not before & set(after)
    assert sorted(i for _, i in [*before, *after]) == list(range(FILES.num_splits))
    wait_until(
        lambda: fetch_status(server.status)["dispatch"]["epochs_done"] == 1,
        10,
        "the status document after the epoch",
    )
    for r in readers:
        r.close()
