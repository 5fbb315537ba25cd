"""The split dispatcher (``--data-dispatch server``) without sockets: every split of an epoch
acknowledged exactly once while workers come and go, released splits back in the queue, an
epoch that ends only when all are acknowledged, an ack held until its split's last push
arrives, and the state through a checkpoint round trip.
Also the wire bodies of split requests and replies."""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest

from downpour import wire
from downpour.server.dispatch import (
    GRANT_END,
    GRANT_SPLIT,
    GRANT_WAIT,
    DataMismatch,
    Dispatcher,
    LeasePolicy,
)

FILES = wire.DataUniverse(files=tuple(f"part-{i:03d}.tfrecord" for i in range(12)))


def dispatcher(
    universe: wire.DataUniverse = FILES, epochs: int = 0, lease: LeasePolicy | None = None
) -> Dispatcher:
    d = Dispatcher(seed=7, lease=lease or LeasePolicy())
    d.register(universe, epochs)
    return d


def take(d: Dispatcher, worker: str, now: float = 0.0) -> int:
    grant = d.next_split(worker, now)
    assert grant.kind == GRANT_SPLIT and grant.split is not None, grant
    return grant.split.index


def test_every_split_is_acknowledged_exactly_once_while_workers_come_and_go() -> None:
    rng = random.Random(3)
    d = dispatcher()
    acked: Counter[int] = Counter()
    by_worker: Counter[str] = Counter()
    stuck = take(d, "w1")  # w1 takes a split and stops acking (it hangs, then dies)
    holding: dict[str, int | None] = {"w0": None, "w2": None}
    steps = 0
    while d.epochs_done == 0:
        steps += 1
        assert steps < 1000, "the epoch never ended"
        w = rng.choice(sorted(holding))
        held = holding[w]
        if held is not None and rng.random() < 0.7:
            if d.ack(w, 0, held):
                acked[held] += 1
                by_worker[w] += 1
            holding[w] = None
        g = d.next_split(w, 0.0)
        holding[w] = g.split.index if g.kind == GRANT_SPLIT and g.split else None
        if steps == 5:  # liveness calls w1 gone: its split goes back
            assert d.release("w1") == [stuck]
        if steps == 9:  # w3 joins mid-epoch
            holding["w3"] = None
    assert d.ack("w1", 0, stuck) is False  # w1 comes back too late: a stale ack
    assert sorted(acked) == list(range(FILES.num_splits))
    assert set(acked.values()) == {1}
    assert d.counters["acked"] == FILES.num_splits
    assert by_worker["w3"] > 0  # the late joiner did part of the epoch
    assert d.epoch == 1  # the next epoch has started


def test_a_released_split_goes_to_the_next_worker_and_the_old_holders_ack_is_stale() -> None:
    d = dispatcher()
    lost = take(d, "w0")
    assert d.release("w0") == [lost]
    assert take(d, "w1") == lost
    assert d.ack("w0", 0, lost) is False
    assert d.counters["acks_stale"] == 1
    assert d.ack("w1", 0, lost) is True
    assert d.progress()["splits_done"] == 1


def test_a_released_split_resumes_after_the_batches_its_pushes_brought() -> None:
    d = dispatcher()
    lost = take(d, "w0")
    assert d.advance("w0", 0, lost, 2) and d.advance("w0", 0, lost, 1)  # never backwards
    assert not d.advance("w1", 0, lost, 5)  # not leased to w1: ignored
    assert d.release("w0") == [lost]
    assert not d.advance("w0", 0, lost, 3)  # a late push of the released lease
    grant = d.next_split("w1", 0.0)
    assert grant.split is not None and (grant.split.index, grant.split.skip) == (lost, 2)
    assert d.counters["resumed"] == 1
    assert d.ack("w1", 0, lost)
    assert d.state()["progress"] == {}  # a done split keeps none
    assert d.next_split("w2", 0.0).split.skip == 0  # a fresh split reads from its start


def test_split_progress_survives_a_checkpoint_round_trip() -> None:
    d = dispatcher()
    held = take(d, "w0")
    d.advance("w0", 0, held, 1)
    restored = Dispatcher.from_state(json.loads(json.dumps(d.state())))
    grant = restored.next_split("w9", 0.0)
    assert grant.split is not None and (grant.split.index, grant.split.skip) == (held, 1)


def test_a_new_epoch_starts_every_split_from_its_first_batch() -> None:
    d = dispatcher(wire.DataUniverse(files=("a", "b")))
    first = take(d, "w0")
    d.advance("w0", 0, first, 1)
    d.release("w0")
    again = d.next_split("w1", 0.0).split
    assert again is not None and again.skip == 1
    d.ack("w1", 0, again.index)
    d.ack("w1", 0, take(d, "w1"))
    assert d.epoch == 1 and all(d.next_split(w, 0.0).split.skip == 0 for w in ("a", "b"))


def test_the_epoch_ends_only_when_every_split_is_acknowledged() -> None:
    d = dispatcher(wire.DataUniverse(elements=30, split_size=10))
    held = {w: take(d, w) for w in ("a", "b", "c")}
    assert d.next_split("d", 0.0).kind == GRANT_WAIT  # all in flight: wait, epoch not over
    d.ack("a", 0, held["a"])
    d.ack("b", 0, held["b"])
    assert d.epoch == 0 and d.next_split("a", 0.0).kind == GRANT_WAIT
    d.ack("c", 0, held["c"])
    assert (d.epoch, d.epochs_done) == (1, 1)
    grant = d.next_split("a", 0.0)
    assert grant.kind == GRANT_SPLIT and grant.epoch == 1


def test_element_splits_cover_the_elements_exactly_once() -> None:
    d = dispatcher(wire.DataUniverse(elements=25, split_size=10))
    ranges = []
    for w in ("a", "b", "c"):
        s = d.next_split(w, 0.0).split
        assert s is not None and s.file is None
        ranges.append((s.start, s.stop))
    assert sorted(ranges) == [(0, 10), (10, 20), (20, 25)]


def test_a_worker_joining_mid_epoch_gets_a_split_of_that_epoch() -> None:
    d = dispatcher()
    first = take(d, "w0")
    d.ack("w0", 0, first)
    grant = d.next_split("late", 0.0)
    assert grant.kind == GRANT_SPLIT and grant.epoch == 0 and grant.split.index != first


def test_the_order_is_shuffled_per_epoch_and_the_same_for_the_same_seed() -> None:
    d1, d2 = dispatcher(), dispatcher()
    seq1 = [take(d1, f"w{i}") for i in range(12)]
    seq2 = [take(d2, f"w{i}") for i in range(12)]
    assert seq1 == seq2  # same seed, same order
    assert sorted(seq1) == list(range(12)) and seq1 != sorted(seq1)
    for i, ix in enumerate(seq1):
        d1.ack(f"w{i}", 0, ix)
    epoch1 = [take(d1, f"w{i}") for i in range(12)]
    assert epoch1 != seq1 and sorted(epoch1) == list(range(12))


def test_a_bounded_run_ends_after_its_epochs() -> None:
    d = dispatcher(wire.DataUniverse(elements=2, split_size=1), epochs=2)
    for e in range(2):
        for _ in range(2):
            d.ack("w", e, take(d, "w"))
    assert d.finished and d.next_split("w", 0.0).kind == GRANT_END
    assert d.next_split("newcomer", 0.0).kind == GRANT_END


def test_other_data_is_refused_and_counted() -> None:
    d = dispatcher()
    other = wire.DataUniverse(files=("elsewhere.tfrecord",))
    with pytest.raises(DataMismatch, match="differs"):
        d.register(other)
    with pytest.raises(DataMismatch):
        d.check_digest(other.digest())
    assert d.counters["refused_universe"] == 2
    d.register(FILES)  # the same data is welcome
    assert d.universe == FILES


def test_a_request_at_the_in_flight_limit_gets_its_newest_split_again() -> None:
    d = dispatcher()
    first = take(d, "w")
    assert take(d, "w") == first  # a retry after a lost reply: nothing new leased
    assert d.counters == {**d.counters, "handed_out": 1, "resent": 1}
    d2 = dispatcher(lease=LeasePolicy(max_in_flight=2))
    a, b = take(d2, "w"), take(d2, "w")
    assert a != b and take(d2, "w") == b


def test_an_expired_lease_goes_back_to_the_queue() -> None:
    d = dispatcher(lease=LeasePolicy(lease_s=30.0))
    slow = take(d, "slow", now=0.0)
    assert take(d, "fast", now=10.0) != slow
    d.ack("fast", 0, d.held_by("fast")[0])
    assert take(d, "fast", now=31.0) == slow  # expired at 30 s: handed out again
    assert d.ack("slow", 0, slow) is False


def test_a_new_process_of_a_worker_releases_what_the_old_one_held() -> None:
    d = dispatcher()
    assert d.note_process("w", "p1") == []
    held = take(d, "w")
    assert d.note_process("w", "p1") == []  # the same process: nothing happens
    assert d.note_process("w", "p2") == [held]
    assert d.held_by("w") == [] and d.counters["released"] == 1


def test_state_round_trip_resumes_the_epoch_with_in_flight_splits_requeued() -> None:
    d = dispatcher()
    done = [take(d, "a")]
    d.ack("a", 0, done[0])
    in_flight = take(d, "b")
    doc = json.loads(json.dumps(d.state()))  # as checkpoint metadata stores it
    r = Dispatcher.from_state(doc)
    assert (r.universe, r.epoch, r.counters["acked"]) == (FILES, 0, 1)
    assert r.progress()["splits_done"] == 1 and r.progress()["splits_in_flight"] == 0
    assert r.ack("b", 0, in_flight) is False  # its lease died with the old server
    seen = []
    while r.epoch == 0:
        ix = take(r, "c")
        seen.append(ix)
        r.ack("c", 0, ix)
    assert seen[0] == in_flight  # requeued at the front
    assert sorted([*done, *seen]) == list(range(FILES.num_splits))


def test_an_ack_before_its_push_is_held_until_the_push_arrives() -> None:
    d = dispatcher()
    first = take(d, "w")
    assert d.hold("w", 0, first, seq=5) is True  # the push of seq 5 is still on its way
    p = d.progress()
    assert (p["splits_done"], p["splits_in_flight"], p["splits_awaiting_push"]) == (0, 1, 1)
    second = take(d, "w")  # a held ack frees the in-flight slot: a new split, not a resend
    assert second != first and d.counters["resent"] == 0
    assert d.pushed("w", 4) == [] and d.progress()["splits_done"] == 0
    assert d.pushed("other", 9) == []  # another worker's push completes nothing of w's
    assert d.pushed("w", 5) == [first]
    assert d.progress()["splits_done"] == 1 and d.held_by("w") == [second]
    assert (d.counters["acked"], d.counters["acks_held"]) == (1, 1)
    assert d.ack("w", 0, first) is False  # done once: a repeat is stale


def test_the_epoch_ends_when_the_push_of_its_last_held_ack_arrives() -> None:
    d = dispatcher(wire.DataUniverse(files=("a", "b")), epochs=1)
    a, b = take(d, "w0"), take(d, "w1")
    d.ack("w0", 0, a)
    d.hold("w1", 0, b, seq=3)
    assert d.next_split("w0", 0.0).kind == GRANT_WAIT and d.epochs_done == 0
    d.pushed("w1", 3)
    assert d.epochs_done == 1 and d.next_split("w0", 0.0).kind == GRANT_END


def test_a_gone_workers_held_ack_is_released_with_its_leases() -> None:
    d = dispatcher()
    held = take(d, "w")
    d.hold("w", 0, held, seq=2)
    assert d.release("w") == [held]  # gone before its push arrived: the split is redone
    assert d.pushed("w", 2) == [] and d.progress()["splits_done"] == 0
    assert take(d, "other") == held


def test_a_held_ack_is_checkpointed_in_flight_not_done() -> None:
    d = dispatcher()
    held = take(d, "w")
    d.hold("w", 0, held, seq=2)
    doc = json.loads(json.dumps(d.state()))
    assert held in doc["in_flight"] and held not in doc["acked"]
    r = Dispatcher.from_state(doc)
    assert r.progress()["splits_done"] == 0 and take(r, "w") == held  # back in the queue


def test_an_unconfigured_or_damaged_state_is_handled() -> None:
    fresh = Dispatcher.from_state(Dispatcher(seed=3).state())
    assert not fresh.configured and fresh.seed == 3
    doc = dispatcher().state()
    doc["acked"] = [0]  # 0 is also queued: inconsistent
    with pytest.raises(ValueError, match="make up"):
        Dispatcher.from_state(doc)


def test_only_shard_0_may_dispatch() -> None:
    from downpour.config.settings import ConfigError
    from downpour.server.settings import ServerConfig, validate_server

    validate_server(ServerConfig(data_dispatch="server", shard=0, num_shards=2))
    with pytest.raises(ConfigError, match="shard 0 only"):
        validate_server(ServerConfig(data_dispatch="server", shard=1, num_shards=2))


# ---------------------------------------------------------------- wire bodies


@pytest.mark.parametrize(
    "kw, match",
    [
        ({}, "either files or elements"),
        ({"files": ()}, "between 1 and"),
        ({"files": ("a", "a")}, "twice"),
        ({"files": ("a", "")}, "non-empty"),
        ({"elements": 10}, "split_size"),
        ({"elements": 0, "split_size": 1}, ">= 1"),
        ({"elements": 1 << 40, "split_size": 1}, "larger split_size"),
        ({"files": ("a",), "elements": 3, "split_size": 1}, "either"),
    ],
)
def test_a_bad_universe_is_refused_with_its_reason(kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        wire.DataUniverse(**kw)


def test_split_bodies_round_trip_through_the_wire() -> None:
    req = wire.SplitRequest(
        FILES.digest(), acks=((0, 3, 17), (1, 2)), universe=FILES, epochs=2, process="p"
    )
    assert req.acks == ((0, 3, 17), (1, 2, 0))  # a pair waits for no push
    assert req.to_body()["acks"] == [[0, 3, 17], [1, 2]]
    msg = wire.decode(wire.encode(wire.split_request("w0", req, seq=4)))
    assert msg.type == wire.SPLIT and wire.SplitRequest.from_body(msg.body) == req
    for rep in (
        wire.SplitReply("split", 1, index=3, file="a.tfrecord", acked=1, held=2),
        wire.SplitReply("split", 0, index=2, start=20, stop=30, stale=1),
        wire.SplitReply("wait", 0, retry_ms=200),
        wire.SplitReply("end", 2),
    ):
        back = wire.decode(wire.encode(wire.split_reply(rep)))
        assert wire.SplitReply.from_body(back.body) == rep


def test_the_digest_names_the_data_not_the_object() -> None:
    same = wire.DataUniverse(files=tuple(FILES.files or ()))
    assert same.digest() == FILES.digest()
    assert wire.DataUniverse(elements=10, split_size=5).digest() != (
        wire.DataUniverse(elements=10, split_size=2).digest()
    )


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"digest": "short"},
        {"digest": "0" * 64, "acks": [[0]]},
        {"digest": "0" * 64, "acks": [[0, -1]]},
        {"digest": "0" * 64, "acks": [[0, 1, -3]]},
        {"digest": "0" * 64, "acks": [[0, 1, 2, 3]]},
        {"digest": "0" * 64, "acks": [[0, 1, True]]},
        {"digest": "0" * 64, "acks": [["0", 1]]},
        {"digest": "0" * 64, "acks": [[0, 1]] * (wire.MAX_ACKS + 1)},
        {"digest": "0" * 64, "universe": {"files": [1]}},
        {"digest": "0" * 64, "universe": {"elements": 5}},
        {"digest": "0" * 64, "epochs": -1},
        {"digest": "0" * 64, "want": "yes"},
    ],
)
def test_a_malformed_split_request_is_a_protocol_error(body: dict) -> None:
    with pytest.raises(wire.ProtocolError) as exc:
        wire.SplitRequest.from_body(body)
    assert exc.value.code == wire.R_HEADER


@pytest.mark.parametrize(
    "body",
    [
        {"grant": "maybe", "epoch": 0},
        {"grant": "split", "epoch": 0},
        {"grant": "split", "epoch": 0, "index": 1, "start": 5, "stop": 5},
        {"grant": "wait"},
    ],
)
def test_a_malformed_split_reply_is_a_protocol_error(body: dict) -> None:
    with pytest.raises(wire.ProtocolError):
        wire.SplitReply.from_body(body)
