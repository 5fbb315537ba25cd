"""Checkpoints restored onto any number of shards (fast tier): the row mapping between any
two shard counts, format-2 refusals with their messages, memory-mapped reads, restores of
real shard states onto other layouts, and snapshots taken while pushes arrive that equal a
replay of their version. The process scenarios are in tests/test_reshard_processes.py."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from downpour.checkpoints.layout import (
    WEIGHTS,
    Piece,
    array_key,
    assemble,
    part_record,
    pieces_from_records,
    plan_rows,
)
from downpour.checkpoints.npz import NpzArrays
from downpour.checkpoints.store import FORMAT, CheckpointStore
from downpour.model.partition import make_partition
from downpour.server.checkpointing.capture import capture, records
from downpour.server.checkpointing.restore import find_sources, restore, restore_set
from downpour.server.state import ParameterState
from downpour.spec import load_spec
from downpour.wire import Sparse

# ---------------------------------------------------------------- row mapping, pure numpy

VARS = [("big", (37, 3)), ("table", (50, 2)), ("bias", (5,)), ("scale", ())]


def _full(slot: str) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(len(slot))
    return {n: rng.standard_normal(s).astype(np.float32) for n, s in VARS}


def _old_set(n: int) -> tuple[list[dict[str, np.ndarray]], list[Piece]]:
    """The arrays of ``n`` old shards (weights and a momentum slot) and their pieces."""
    part = make_partition([n for n, _ in VARS], [s for _, s in VARS], ["float32"] * 4, n, "fp")
    sources, pieces = [], []
    for k, parts in enumerate(part.shards):
        arrays, recs = {}, {}
        for slot in (WEIGHTS, "momentum"):
            full = _full(slot)
            for p in parts:
                key = array_key(slot, p.wire_name)
                arrays[key] = full[p.name] if p.whole else full[p.name][p.start : p.stop]
                recs[key] = part_record(p, slot)
        sources.append(arrays)
        pieces += pieces_from_records(k, f"shard{k}", arrays, recs)
    return sources, pieces


@pytest.mark.parametrize("old", [1, 2, 3, 4])
@pytest.mark.parametrize("new", [1, 2, 3, 4])
def test_every_new_part_is_its_rows_of_the_old_set(old: int, new: int) -> None:
    sources, pieces = _old_set(old)
    shapes = dict(VARS)
    target = make_partition(list(shapes), list(shapes.values()), ["float32"] * 4, new, "fp")
    if old > 1:
        assert any(p.start > 0 for p in pieces)  # something was split by rows
    for slot in (WEIGHTS, "momentum"):
        full = _full(slot)
        for parts in target.shards:
            for p in parts:
                copies = plan_rows(p.name, slot, p.start, p.stop, p.shape, "float32", pieces)
                got = assemble(copies, sources, p.part_shape, "float32")
                want = full[p.name] if p.whole else full[p.name][p.start : p.stop]
                assert got.shape == want.shape and np.array_equal(got, want), (p.wire_name, slot)


def _piece(key: str, start: int, stop: int, shape: tuple = (10, 2), dtype: str = "float32"):
    return Piece(0, key, "v", WEIGHTS, start, stop, shape, (stop - start, *shape[1:]), dtype)


def test_rows_a_new_part_spans_come_from_each_overlapping_old_piece() -> None:
    pieces = [_piece("a", 0, 3), _piece("b", 3, 7), _piece("c", 7, 10)]
    copies = plan_rows("v", WEIGHTS, 2, 9, (10, 2), "float32", pieces)
    assert [(c.key, c.src_start, c.src_stop, c.dst_start, c.dst_stop) for c in copies] == [
        ("a", 2, 3, 0, 1),
        ("b", 0, 4, 1, 5),
        ("c", 0, 2, 5, 7),
    ]


@pytest.mark.parametrize(
    ("pieces", "message"),
    [
        (
            [_piece("a", 0, 4), _piece("c", 7, 10)],
            r"'v' \(weights\): rows 4:7 are in no checkpoint",
        ),
        ([_piece("a", 0, 5), _piece("b", 4, 10)], r"a \(rows 0:5\) and b \(rows 4:10\) overlap"),
        ([_piece("a", 0, 10, dtype="float64")], "a has dtype float64, here float32"),
        ([_piece("a", 0, 10, shape=(10, 3))], r"a is of a variable of shape \(10, 3\)"),
        ([], r"'v' \(weights\): no checkpoint given holds it"),
    ],
)
def test_a_gap_an_overlap_or_a_mismatch_is_refused_naming_it(pieces: list, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        plan_rows("v", WEIGHTS, 0, 10, (10, 2), "float32", pieces)


# ---------------------------------------------------------------- the archive


def test_memory_mapped_members_equal_a_full_read(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rng = np.random.default_rng(0)
    arrays = {
        "f32": rng.standard_normal((50, 7)).astype(np.float32),
        "i64": np.arange(12, dtype=np.int64).reshape(3, 4),
        "fortran": np.asfortranarray(rng.standard_normal((6, 5))),
        "f16": rng.standard_normal(9).astype(np.float16),
        "scalar": np.int64(42),
        "empty": np.zeros((0, 3), np.float32),
        "flags": np.array([True, False, True]),
    }
    for name, save in (("stored.npz", np.savez), ("packed.npz", np.savez_compressed)):
        save(tmp_path / name, **arrays)
        want = np.load(tmp_path / name, allow_pickle=False)
        got = NpzArrays(tmp_path / name)
        assert sorted(got) == sorted(want.files)
        for k in want.files:
            assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
            assert np.array_equal(got[k], want[k]), k
        assert np.array_equal(got["f32"][10:20], want["f32"][10:20])
    assert isinstance(NpzArrays(tmp_path / "stored.npz")["f32"], np.memmap)
    caplog.clear()
    with caplog.at_level(logging.WARNING, "downpour.server"):
        NpzArrays(tmp_path / "packed.npz")["f32"]
    assert "compressed and cannot be memory-mapped" in caplog.text


def test_an_unknown_format_or_none_is_refused_naming_file_and_formats(tmp_path: Path) -> None:
    for name, doc in (("ckpt-000000000001.npz", {"format": 1, "version": 1}),
                      ("ckpt-000000000002.npz", {"version": 2})):  # fmt: skip
        meta = np.frombuffer(json.dumps(doc).encode(), dtype=np.uint8)
        np.savez(tmp_path / name, **{"model/x": np.zeros(3), "__meta__": meta})
    store = CheckpointStore(tmp_path)
    with pytest.raises(ValueError) as old:
        store.read(tmp_path / "ckpt-000000000001.npz")
    text = str(old.value)
    assert "ckpt-000000000001.npz" in text and "checkpoint format 1" in text
    assert f"reads format {FORMAT}" in text
    with pytest.raises(ValueError, match=f"no format recorded; .* reads format {FORMAT}"):
        store.read(tmp_path / "ckpt-000000000002.npz")
    assert store.latest() is None  # neither loads


def test_a_member_whose_data_would_run_past_the_end_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "ckpt-000000000001.npz"
    CheckpointStore(tmp_path).write(1, {"model/a": np.zeros(1000)}, {})
    data = path.read_bytes()
    assert data.count(b"(1000,)") == 1
    path.write_bytes(data.replace(b"(1000,)", b"(9000,)"))  # the header claims more rows
    with pytest.raises(ValueError, match=r"unreadable checkpoint: member model/a: .* past the"):
        CheckpointStore.read(path)


# ---------------------------------------------------------------- real shard states

SPEC = "tiny_models:embedding"  # a row-sparse table (5000 x 8) and a dense layer


def _states(n: int, optimizer: str = "adam", seed: int = 5) -> list[ParameterState]:
    spec = load_spec(SPEC)
    return [ParameterState(spec, optimizer, 0.01, seed=seed, jit=False, shard=i, num_shards=n)
            for i in range(n)]  # fmt: skip


def _grads(shapes: list[tuple[int, ...]], step: int) -> list[Any]:
    """A full gradient list of the embedding model: rows of the table, dense the rest."""
    rng = np.random.default_rng(step)
    rows = np.unique(rng.integers(0, shapes[0][0], 40))
    table = Sparse(rows, rng.standard_normal((len(rows), shapes[0][1])).astype(np.float32),
                   shapes[0])  # fmt: skip
    return [table, *(rng.standard_normal(s).astype(np.float32) for s in shapes[1:])]


def _train(states: list[ParameterState], steps: range) -> None:
    """Apply steps ``steps`` of one seeded gradient sequence, each state its shard's slice."""
    if not states:
        return
    part = states[0].partition
    shapes = [p.shape for p in sorted({p for ps in part.shards for p in ps if p.start == 0},
                                      key=lambda p: p.var)]  # fmt: skip
    for step in steps:
        pieces = part.split(_grads(shapes, step))
        for st in states:
            st.apply(pieces[st.shard])


def _write(states: list[ParameterState], root: Path, workers: dict[str, int]) -> list[Path]:
    """Each state's checkpoint in ``root/shard-I``, with the metadata a server writes."""
    dirs = []
    for st in states:
        meta = {
            "fingerprint": st.fingerprint,
            "shard": st.shard,
            "num_shards": st.partition.num_shards,
            "partition": st.partition.digest,
            "workers": workers,
            "arrays": records(st),
        }
        d = root / f"shard-{st.shard}"
        CheckpointStore(d).write(st.version, capture(st), meta)
        dirs.append(d)
    return dirs


def _joined(states: list[ParameterState]) -> dict[tuple[str, str], np.ndarray]:
    """Every variable's weights and slots, joined from the shards' parts by their rows."""
    pieces: dict[tuple[str, str], list[tuple[int, np.ndarray]]] = {}
    for st in states:
        arrays = capture(st)
        for p in st.partition.shards[st.shard]:
            for key, a in arrays.items():
                if key == f"model/{p.wire_name}" or key.endswith(f"/{p.wire_name}"):
                    slot = "weights" if key.startswith("model/") else key.split("/")[1]
                    pieces.setdefault((p.name, slot), []).append((p.start, a))
    return {k: np.concatenate([a for _, a in sorted(v, key=lambda t: t[0])])
            for k, v in pieces.items()}  # fmt: skip


@pytest.mark.parametrize(("old", "new"), [(2, 3), (3, 1), (1, 2)])
def test_a_checkpoint_set_restores_onto_another_shard_count(
    tmp_path: Path, old: int, new: int
) -> None:
    """Weights and Adam's slots come back equal; versions and sequence numbers follow the
    rule (max); and training goes on as it would have on the old layout."""
    before = _states(old)
    _train(before, range(6))
    _train(before[:1], range(6, 8))  # old shard 0 checkpointed two updates later
    dirs = _write(before, tmp_path, {"w0": 7})
    ckpts = [CheckpointStore(d).latest() for d in dirs]
    ckpts[-1].meta["workers"] = {"w0": 9, "w1": 3}  # (only in memory) another shard's seqs

    after = _states(new, seed=99)  # other initial weights: everything must be overwritten
    done = [restore_set(st, ckpts) for st in after]
    assert [d.version for d in done] == [8] * new and all(st.version == 8 for st in after)
    assert done[0].workers == {"w0": 9, "w1": 3}
    assert done[0].dispatch is ckpts[0]  # old shard 0's, which holds the dispatcher
    want, got = _joined(before), _joined(after)
    assert set(got) == set(want) and any(slot == "velocity" for _, slot in got)
    for key in want:
        assert np.array_equal(got[key], want[key]), key
    for st in after:  # the step count Adam reads: the largest old one
        assert int(capture(st)["optimizer/iteration"]) == 8

    # every old shard at version 8 (the step count Adam reads agrees): training goes on alike
    _train(before[1:], range(6, 8))
    ckpts = [CheckpointStore(d).latest() for d in _write(before, tmp_path / "even", {})]
    for st in after:
        restore_set(st, ckpts)
    _train(before, range(8, 10))
    _train(after, range(8, 10))
    want, got = _joined(before), _joined(after)
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-6, atol=1e-7, err_msg=str(key))


def test_refused_restores_name_the_problem_and_change_nothing(tmp_path: Path) -> None:
    before = _states(2, optimizer="sgd")
    _train(before, range(2))
    ckpts = [CheckpointStore(d).latest() for d in _write(before, tmp_path, {})]
    target = _states(1)[0]  # holds every variable
    untouched = capture(target)

    def refused(sources: list, message: str) -> None:
        with pytest.raises(ValueError, match=message):
            restore_set(target, sources)
        now = capture(target)
        assert all(np.array_equal(now[k], untouched[k]) for k in untouched)
        assert target.version == 0

    refused(ckpts, r"'embed/embeddings' \(momentum\): no checkpoint given holds it")  # sgd's
    adam = _states(2)
    ckpts = [CheckpointStore(d).latest() for d in _write(adam, tmp_path / "adam", {})]
    refused(ckpts[:1], r"need the checkpoint of each of the 2 old shard\(s\) once, got shard")
    refused([ckpts[0], ckpts[0]], r"got shard\(s\) \[0, 0\]")
    ckpts[1].meta["fingerprint"] = "another-model"
    refused(ckpts, "saved for model fingerprint another-model")
    ckpts[1].meta["fingerprint"] = target.fingerprint
    second = adam[1].partition.shards[1][0]  # shard 1's rows of the table
    assert second.name == "embed/embeddings" and second.start > 0
    del ckpts[1].meta["arrays"][f"model/{second.wire_name}"]
    refused(ckpts, rf"'embed/embeddings' \(weights\): rows {second.start}:{second.stop} are in no")


def test_a_shard_finds_its_own_checkpoint_or_the_old_set(tmp_path: Path) -> None:
    old = _states(2)
    _train(old, range(3))
    dirs = _write(old, tmp_path / "old", {})
    target = _states(3, seed=99)[2]
    own = CheckpointStore(dirs[0])  # shard 0 of 2: another layout than shard 2 of 3
    with pytest.raises(ValueError, match="--restore-from with the old layout's state dir"):
        find_sources(target, own, None)
    assert find_sources(target, CheckpointStore(tmp_path / "empty"), None) == []
    found = find_sources(target, own, str(tmp_path / "old"))  # the parent of shard-I dirs
    assert sorted(c.meta["shard"] for c in found) == [0, 1]
    restore_set(target, found)
    mine = _write([target], tmp_path / "new", {})[0]
    assert [c.path.parent for c in find_sources(target, CheckpointStore(mine), None)] == [mine]
    with pytest.raises(ValueError, match="give each shard its own --state-dir"):
        restore(_states(3)[0], CheckpointStore(mine).latest())


def test_run_local_reshards_a_state_dir_of_another_shard_count(tmp_path: Path) -> None:
    """run-local's --state-dir holding 2 shards' checkpoints: 3 shards (or 1) restore from
    them (--restore-from); 2 shards use their own dirs as they are."""
    from test_local_options import child_config, run_local_args

    from downpour.cli.local.options import plan_children

    old = _states(2)
    _train(old, range(2))
    _write(old, tmp_path / "state", {})
    olds = ",".join(str(tmp_path / "state" / f"shard-{i}") for i in range(2))
    for shards, want in ((3, olds), (1, olds), (2, None)):
        args = run_local_args({"shards": shards, "state_dir": str(tmp_path / "state")})
        servers = [child_config(c) for c in plan_children(args, tmp_path / "run").servers]
        assert [s.restore_from for s in servers] == [want] * shards
