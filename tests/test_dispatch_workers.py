"""Workers training under ``--data-dispatch server``: splits from the server, each read once per
epoch. In-process: three workers on one epoch see the training set exactly once between
them; bad settings and undividable input are refused before the hello. Slow tier (real
processes): a worker SIGKILLed mid-split and a fourth joining, every split acknowledged
once and no example lost; a server SIGKILLed mid-epoch and restarted from its checkpoint
resumes the epoch with the same worker processes."""

from __future__ import annotations

import os
import re
import signal
from collections import Counter
from pathlib import Path

import input_models
import pytest
import tensorflow as tf
from conftest import Cluster, free_ports, summary, wait_until
from inproc import WorkerThread, make_worker, serving

from downpour import InputContext, ModelSpec, cli
from downpour.checkpoints.store import CheckpointStore
from downpour.cli.status import fetch_status
from downpour.config.settings import ConfigError
from downpour.examples import digits_csv
from downpour.examples.records import TRAIN, split_files
from downpour.inputs.context import Split
from downpour.inputs.pipeline import InputError
from downpour.worker.service import WorkerError

SPLIT = 64  # elements per split: 10 splits of the 600 ids (the last one 24), 2 batches each
N_SPLITS = -(-input_models.N_IDS // SPLIT)


def recorded_ids(ids_dir: Path, pids: set[int] | None = None) -> list[int]:
    """The ids the plugin recorded, of every process or of those in ``pids``."""
    return [
        int(x)
        for p in sorted(ids_dir.glob("ids-*.txt"))
        if pids is None or int(p.stem.rsplit("-", 1)[1]) in pids
        for x in p.read_text().split()
    ]


def test_three_dispatched_workers_see_each_example_once_in_an_epoch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(input_models.IDS_DIR_ENV, str(tmp_path))  # the plugin's record hook
    with serving("input_models:ids", data_dispatch="server") as server:
        workers = [
            make_worker(
                server.port,
                "input_models:ids",
                worker_id=f"w{i}",
                data_dispatch="server",
                split_size=SPLIT,
            )
            for i in range(3)
        ]
        threads = [WorkerThread(w) for w in workers]
        sums = [t.result(timeout=180) for t in threads]
        doc = wait_until(
            lambda: (doc := fetch_status(server.status))["dispatch"]["finished"] and doc,
            30,
            "the status document after the epoch",
        )
    assert sorted(recorded_ids(tmp_path)) == list(range(input_models.N_IDS))
    # under dispatch each worker's context carries its id and its own index
    contexts = [w.input_ctx for w in workers]
    assert sorted(c.worker_index for c in contexts) == [0, 1, 2]
    assert [c.worker_id for c in contexts] == ["w0", "w1", "w2"]
    assert all(c.num_workers > c.worker_index for c in contexts)
    assert sum(s["steps"] for s in sums) == 9 * 2 + 1  # the last split has 24 examples
    assert sum(s["dispatch"]["acked"] for s in sums) == N_SPLITS
    assert all(s["dispatch"]["acks_stale"] == 0 and not s["stopped_early"] for s in sums)
    d = doc["dispatch"]
    assert (d["epochs_done"], d["handed_out"], d["acked"], d["released"]) == (
        1,
        N_SPLITS,
        N_SPLITS,
        0,
    )


def test_steps_cap_a_dispatched_worker_and_its_finished_splits_are_acknowledged() -> None:
    with serving("input_models:ids", data_dispatch="server") as server:
        worker = make_worker(
            server.port, "input_models:ids", data_dispatch="server", split_size=SPLIT, steps=4
        )
        s = WorkerThread(worker).result(timeout=120)
        d = wait_until(
            lambda: (d := fetch_status(server.status)["dispatch"])["splits_done"] == 2 and d,
            30,
            "the status document with both acknowledgements",
        )
    assert s["steps"] == 4 and s["dispatch"]["acked"] == 2  # two whole splits of two batches
    assert (d["splits_done"], d["epochs_done"]) == (2, 0)


def test_dispatched_workers_read_each_file_once(tmp_path: Path) -> None:
    data = tmp_path / "digits"
    assert cli.main(["data", "csv", str(data), "--dataset", "digits", "--shards", "3"]) == 0
    files = split_files(data, TRAIN, digits_csv.FORMAT)
    ctx = InputContext(data_dir=str(data), batch_size=32)
    batches = sum(  # each file read alone, as a split
        sum(1 for _ in digits_csv.input_fn(ctx.for_epoch(0, Split(i, file=f))))
        for i, f in enumerate(files)
    )
    spec = "downpour.examples.digits_csv:spec"
    with serving(spec, data_dispatch="server", data_dir=str(data)) as server:
        threads = [
            WorkerThread(
                make_worker(
                    server.port, spec, worker_id=f"w{i}", data_dispatch="server", data_dir=str(data)
                )
            )
            for i in range(2)
        ]
        sums = [t.result(timeout=180) for t in threads]
        d = wait_until(
            lambda: (d := fetch_status(server.status)["dispatch"])["finished"] and d,
            30,
            "the status document after the epoch",
        )
    assert sum(s["steps"] for s in sums) == batches
    assert (d["universe"], d["acked"], d["handed_out"]) == (
        f"{len(files)} files",
        len(files),
        len(files),
    )


def _no_helper(ctx: InputContext) -> tf.data.Dataset:
    x = tf.zeros((64, 8))
    return tf.data.Dataset.from_tensor_slices(({"x": x, "id": tf.zeros(64, tf.int64)}, x[:, 0]))


def _endless(ctx: InputContext) -> tf.data.Dataset:
    ds = tf.data.Dataset.from_tensor_slices(
        ({"x": tf.zeros((64, 8)), "id": tf.zeros(64, tf.int64)}, tf.zeros(64, tf.int64))
    )
    return ctx.shard(ds.repeat()).batch(ctx.batch_size)


@pytest.mark.parametrize(
    ("input_fn", "expected"),
    [
        (_no_helper, "calls neither ctx.shard_files(files) nor ctx.shard(dataset)"),
        (_endless, "an infinite number of elements"),
    ],
)
def test_input_the_server_cannot_divide_is_refused_before_hello(input_fn, expected: str) -> None:
    spec = input_models.ids()
    spec = ModelSpec(
        name=spec.name, build=spec.build, input_fn=input_fn, batch_size=spec.batch_size
    )
    # port 1: nothing listens there, and nothing is sent before the input is checked
    with pytest.raises(InputError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        make_worker(1, spec, data_dispatch="server")


def test_a_server_that_does_not_dispatch_ends_the_worker_with_a_clear_error() -> None:
    with serving("input_models:ids") as server:
        worker = make_worker(server.port, "input_models:ids", data_dispatch="server")
        with pytest.raises(WorkerError, match="refused the split request"):
            WorkerThread(worker).result(timeout=120)


def test_dispatch_refuses_static_shard_settings() -> None:
    with pytest.raises(ConfigError, match="leave --num-workers and --worker-index"):
        make_worker(1, "input_models:ids", data_dispatch="server", num_workers=3)
    with pytest.raises(ConfigError, match="counts whole epochs"):
        make_worker(1, "input_models:ids", data_dispatch="server", epochs=1.5)
    with pytest.raises(ConfigError, match="--split-size goes with --data-dispatch server"):
        make_worker(1, "input_models:ids", split_size=10)


@pytest.mark.slow
def test_a_killed_worker_split_is_reread_and_a_joiner_takes_work(
    cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ids_dir = tmp_path / "ids"
    ids_dir.mkdir()
    gate = tmp_path / "gate"
    gate.touch()  # every worker stops at its first batch until the test removes this
    monkeypatch.setenv(input_models.IDS_DIR_ENV, str(ids_dir))
    monkeypatch.setenv(input_models.GATE_ENV, str(gate))
    server = cluster.server(
        "--data-dispatch",
        "server",
        "--missing-after",
        "0.5",
        "--gone-after",
        "2",
        model="input_models:ids",
    )
    args = ("--data-dispatch", "server", "--split-size", str(SPLIT), "--heartbeat", "0.2")

    def start(name: str):
        return cluster.worker(server.port, *args, model="input_models:ids", worker_id=name)

    def holding(w) -> bool:  # the worker read its split's first batch and waits at the gate
        return any(ids_dir.glob(f"ids-*-0-{w.proc.pid}.txt"))

    workers = [start(f"w{i}") for i in range(3)]
    for w in workers:
        wait_until(lambda w=w: holding(w), 180, "every worker holding a split")
    killed = workers.pop(1)
    os.kill(killed.proc.pid, signal.SIGKILL)  # mid-split: its split is never acknowledged
    killed.wait(30)
    joiner = start("w3")
    wait_until(lambda: holding(joiner), 180, "the joiner holding a split mid-epoch")
    workers.append(joiner)
    gate.unlink()
    for w in workers:
        assert w.wait(timeout=300) == 0, w.log_text()

    survivors = {w.proc.pid for w in workers}
    seen = Counter(recorded_ids(ids_dir, survivors))
    assert sorted(seen) == list(range(input_models.N_IDS)) and set(seen.values()) == {1}
    assert set(recorded_ids(ids_dir, {killed.proc.pid})) <= set(seen)
    sums = [summary(w) for w in workers]
    assert sum(s["dispatch"]["acked"] for s in sums) == N_SPLITS
    assert sums[-1]["dispatch"]["acked"] >= 1  # the joiner's split counted
    doc = wait_until(
        lambda: (doc := fetch_status(server.status))["dispatch"]["finished"] and doc,
        30,
        "the status document after the epoch",
    )
    d = doc["dispatch"]
    assert (d["epochs_done"], d["splits_done"], d["acked"]) == (1, N_SPLITS, N_SPLITS)
    assert (d["released"], d["handed_out"], d["acks_stale"]) == (1, N_SPLITS + 1, 0)


@pytest.mark.slow
def test_a_worker_killed_inside_a_split_after_pushing_part_of_it_trains_nothing_twice(
    cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Splits of three batches. Every worker pushes its split's first batch, then its input
    blocks on the split's third batch (the feed reads one batch ahead, so the second is read
    but not trained). One worker is SIGKILLed there: its split goes back to the queue and
    the worker that takes it next skips the batch already trained. The plugin records the
    ids a worker *reads*; a skipped batch is read and dropped (``Dataset.skip``), so the
    resuming worker reads the killed worker's split again, in the same order, and trains
    all of it but its first batch. Every training id is trained exactly once: the server
    applies one update per batch of the epoch (not one more for the split read twice), one
    batch is skipped, and every split is acknowledged once."""
    size = 96  # 6 splits of 3 batches and one of 24 elements: 19 batches
    n_splits = -(-input_models.N_IDS // size)
    n_batches = sum(-(-min(size, input_models.N_IDS - i * size) // 32) for i in range(n_splits))
    ids_dir = tmp_path / "ids"
    ids_dir.mkdir()
    gate = tmp_path / "gate"
    gate.touch()
    monkeypatch.setenv(input_models.IDS_DIR_ENV, str(ids_dir))
    monkeypatch.setenv(input_models.GATE_ENV, str(gate))
    monkeypatch.setenv(input_models.GATE_FROM_ENV, "3")
    server = cluster.server(
        "--data-dispatch", "server", "--missing-after", "0.5", "--gone-after", "2",
        "--optimizer", "sgd", model="input_models:ids",
    )  # fmt: skip
    args = ("--data-dispatch", "server", "--split-size", str(size), "--heartbeat", "0.2")
    workers = [
        cluster.worker(server.port, *args, model="input_models:ids", worker_id=f"w{i}")
        for i in range(3)
    ]

    def pushed(name: str) -> bool:
        w = fetch_status(server.status)["workers"].get(name)
        return w is not None and w["applied"] >= 1

    for i in range(3):
        wait_until(lambda i=i: pushed(f"w{i}"), 180, f"w{i} pushing its split's first batch")
    killed = workers.pop(1)
    os.kill(killed.proc.pid, signal.SIGKILL)
    killed.wait(30)
    wait_until(
        lambda: "w1" not in fetch_status(server.status)["dispatch"]["in_flight"],
        60,
        "the killed worker's split back in the queue",
    )
    gate.unlink()
    for w in workers:
        assert w.wait(timeout=300) == 0, w.log_text()

    read = [recorded_ids(ids_dir, {w.proc.pid}) for w in workers]
    survivors = Counter(i for ids in read for i in ids)
    assert sorted(survivors) == list(range(input_models.N_IDS))
    assert set(survivors.values()) == {1}, "a survivor read an id twice"
    lost = recorded_ids(ids_dir, {killed.proc.pid})  # its split's three batches, as it read them
    assert len(lost) == 96
    runs = [ids[i : i + 96] for ids in read for i in range(len(ids) - 95)]
    assert lost in runs, "the split was not read again in the same order"
    doc = wait_until(
        lambda: (doc := fetch_status(server.status))["dispatch"]["finished"] and doc,
        30,
        "the status document after the epoch",
    )
    d = doc["dispatch"]
    assert doc["updates_applied"] == n_batches  # one update per batch of the epoch
    assert (d["splits_done"], d["acked"], d["acks_stale"]) == (n_splits, n_splits, 0)
    assert (d["released"], d["resumed"]) == (1, 1)
    sums = [summary(w) for w in workers]
    assert sum(s["dispatch"]["batches_skipped"] for s in sums) == 1


GRANT = re.compile(r"split request of .*: split (\d+)$", re.MULTILINE)  # the server's debug line


def split_ids(index: int, size: int) -> set[int]:
    """The ids of split ``index`` of epoch 0 (``size`` elements each), as a worker reads it:
    the plugin's input_fn for that split, with the workers' default seed (data order) and
    the global seed a worker sets as it builds its model (``build_model``)."""
    tf.random.set_seed(0)
    ctx = InputContext(seed=0, batch_size=32).for_epoch(
        0, Split(index, start=index * size, stop=min(input_models.N_IDS, (index + 1) * size))
    )
    return {int(i) for x, _ in input_models.ids_input_fn(ctx) for i in x["id"].numpy()}


@pytest.mark.slow
def test_a_server_killed_mid_epoch_resumes_it_with_the_workers_it_had(
    cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three real workers, a server checkpointing every 0.2 s. Once some splits are done the
    workers are frozen (SIGSTOP) and the server is SIGKILLed as soon as its newest checkpoint
    holds exactly the dispatcher state it serves; it restarts from that checkpoint on the
    same ports and the workers go on (SIGCONT).

    The same epoch resumes with the done count of the checkpoint, every split ends
    acknowledged once, and every example is trained on. An example is trained on twice only
    if the old server handed its split out and the checkpoint does not count it done: its
    worker finishes reading it, but its lease died with the old server, so the split is handed
    out and read again. The old server's grants come from its debug log: a request a worker
    sent just before it froze can still be granted after the checkpoint was compared."""
    size = 32  # 19 splits of one batch each
    n_splits = -(-input_models.N_IDS // size)
    expected = {i: split_ids(i, size) for i in range(n_splits)}  # before the record hook is on
    ids_dir = tmp_path / "ids"
    ids_dir.mkdir()
    monkeypatch.setenv(input_models.IDS_DIR_ENV, str(ids_dir))
    monkeypatch.setenv(input_models.PACE_ENV, "0.3")  # an epoch of 19 batches lasts seconds
    state = tmp_path / "state"
    ports = free_ports(3)
    args = (
        "--data-dispatch", "server", "--state-dir", str(state), "--checkpoint-secs", "0.2",
        "--push-port", str(ports[1]), "--status-port", str(ports[2]),
    )  # fmt: skip
    server = cluster.server(*args, "--log-level", "DEBUG", model="input_models:ids", port=ports[0])
    wargs = ("--data-dispatch", "server", "--split-size", str(size), "--epochs", "1")
    workers = [
        cluster.worker(ports[0], *wargs, model="input_models:ids", worker_id=f"w{i}")
        for i in range(3)
    ]

    def dispatch() -> dict:
        return fetch_status(server.status)["dispatch"]

    wait_until(lambda: dispatch()["splits_done"] >= 3, 300, "three splits done")
    for w in workers:
        os.kill(w.proc.pid, signal.SIGSTOP)

    def settled() -> dict | None:  # the checkpoint holds what the server serves, all frozen
        doc = fetch_status(server.status)
        live = doc["dispatch"]
        ckpt = CheckpointStore(state).latest()
        saved = None if ckpt is None else ckpt.meta.get("dispatch")
        if saved is None or live["splits_awaiting_push"] or ckpt.version != doc["version"]:
            return None
        same = (saved["epoch"], len(saved["acked"]), len(saved["in_flight"])) == (
            live["epoch"],
            live["splits_done"],
            live["splits_in_flight"],
        )
        return saved if same and saved["counters"]["acked"] == live["acked"] else None

    saved = wait_until(settled, 60, "a checkpoint of the frozen dispatcher")
    assert saved["epoch"] == 0 and 3 <= len(saved["acked"]) < n_splits  # mid-epoch
    server.proc.kill()
    server.wait(30)
    granted = {int(m) for m in GRANT.findall(server.log_text())}  # by the old server
    assert set(saved["acked"]) | set(saved["in_flight"]) <= granted
    server = cluster.server(*args, model="input_models:ids", port=ports[0])
    resumed = dispatch()
    assert (resumed["epoch"], resumed["splits_done"], resumed["splits_in_flight"]) == (
        0,
        len(saved["acked"]),
        0,
    )  # the same epoch, nothing done lost, the splits in flight back in the queue
    for w in workers:
        os.kill(w.proc.pid, signal.SIGCONT)
    for w in workers:
        assert w.wait(timeout=300) == 0, w.log_text()

    d = wait_until(
        lambda: (d := dispatch())["finished"] and d, 30, "the status document after the epoch"
    )
    assert (d["epoch"], d["epochs_done"], d["splits_done"]) == (0, 1, n_splits)
    assert d["acked"] == n_splits  # each split acknowledged once, across both servers
    seen = Counter(recorded_ids(ids_dir))
    assert set(seen) == set(range(input_models.N_IDS))  # no example lost
    reread = set().union(*(expected[i] for i in granted - set(saved["acked"])))
    twice = {i for i, n in seen.items() if n > 1}
    assert twice <= reread and max(seen.values()) <= 2, (twice - reread, granted, saved)
    sums = [summary(w) for w in workers]
    assert all(not s["stopped_early"] for s in sums)
