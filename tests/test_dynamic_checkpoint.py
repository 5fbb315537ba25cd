"""Dynamic tables in checkpoints (fast tier): saved by id in real checkpoint files, restored
onto the same layout exactly and onto other shard counts with every id on the shard
``id_shard`` names, nothing lost or duplicated; mismatched checkpoints refused, naming why."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from downpour.checkpoints.layout import pieces_from_parts
from downpour.checkpoints.store import Checkpoint, CheckpointStore
from downpour.model.hashing import id_shard
from downpour.server.checkpointing.capture import capture_state
from downpour.server.tables.checkpoint import (
    TABLES_META,
    capture_tables,
    load_tables,
    restore_tables,
    table_key,
)
from downpour.server.tables.table import COUNTERS, DynamicTable
from downpour.tables.policy import TablePolicy
from downpour.tables.sketch import CountMinSketch

CONFIG = {  # variable path -> (layer name, dim, constructor keywords)
    "users/embeddings": (
        "users",
        4,
        {"optimizer": "lazy_adam", "seed": 3, "policy": TablePolicy(None, admit_after=2)},
    ),
    "items/embeddings": ("items", 3, {"optimizer": "adagrad", "seed": 3}),
}
SMALL = 1 << 10  # sketch width of these tests
PER_ID = ("ids", "rows", "versions", "counts")  # and the optimizer slots, slot_<name>


class Shard:
    """A stand-in for ParameterState: its tables, shard, shard count and table configs."""

    def __init__(self, shard: int, num_shards: int, config: dict = CONFIG) -> None:
        self.shard = shard
        self.partition = SimpleNamespace(num_shards=num_shards)
        self.config = config
        self.tables = {path: DynamicTable(name, dim, **self.table_config(path))
                       for path, (name, dim, _) in config.items()}  # fmt: skip
        self.version = 0

    def table_config(self, path: str) -> dict[str, Any]:
        kw = dict(self.config[path][2]) | {"num_shards": self.partition.num_shards}
        kw["shard"] = self.shard
        if kw.get("policy", TablePolicy(None)).admit_after > 1:
            kw["sketch"] = CountMinSketch(SMALL)
        return kw


def _layout(n: int, config: dict = CONFIG) -> list[Shard]:
    return [Shard(k, n, config) for k in range(n)]


def _batch(step: int, path: str) -> tuple[np.ndarray, np.ndarray]:
    """Step ``step``'s ids of table ``path`` (fresh ones, some repeated, and 43 recurring)
    and their gradient rows."""
    rng = np.random.default_rng([step, len(path)])
    pool = rng.integers(-(2**63), 2**63 - 1, 60, np.int64)
    ids = np.concatenate([pool[rng.integers(0, 60, 50)], np.arange(-3, 40)])
    return ids, rng.standard_normal((ids.size, CONFIG[path][1])).astype(np.float32)


def _train(shards: list[Shard], steps: range) -> None:
    """Seeded pushes, each id's rows applied on the shard ``id_shard`` names."""
    n = shards[0].partition.num_shards
    for step in steps:
        for path in CONFIG:
            ids, grads = _batch(step, path)
            home = id_shard(ids, n)
            for st in shards:
                mine = home == st.shard
                st.tables[path].apply(ids[mine], grads[mine], 0.05, step + 1, step + 1)
        for st in shards:
            st.version = step + 1
    for st in shards:  # some slots freed and reused
        st.tables["items/embeddings"].evict_idle(steps.stop, 2)


def _write(shards: list[Shard], root: Path) -> list[Checkpoint]:
    """Each shard's checkpoint in ``root/shard-K`` (as a server writes one), read back."""
    out = []
    for st in shards:
        arrays, records = capture_tables(st)
        meta = {"shard": st.shard, "num_shards": st.partition.num_shards, TABLES_META: records}
        store = CheckpointStore(root / f"shard-{st.shard}")
        store.write(st.version, arrays, meta)
        out.append(store.latest())
    return out


def _exports(shards: list[Shard], path: str) -> list[dict[str, np.ndarray]]:
    return [st.tables[path].export_state() for st in shards]


def _by_id(exports: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """The per-id arrays of all shards, joined and sorted by id."""
    fields = [f for f in exports[0] if f in PER_ID or f.startswith("slot_")]
    joined = {f: np.concatenate([e[f] for e in exports]) for f in fields}
    order = np.argsort(joined["ids"])
    return {f: a[order] for f, a in joined.items()}


def _assert_equal_states(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert sorted(got) == sorted(want)
    for f in want:
        assert got[f].dtype == want[f].dtype and np.array_equal(got[f], want[f]), f


@pytest.mark.parametrize(("shard", "n"), [(0, 1), (1, 3)])
def test_a_restart_restores_every_table_exactly(tmp_path: Path, shard: int, n: int) -> None:
    """Rows, slots, versions, counts, sketch and counters equal, and training goes on alike."""
    before = _layout(n)
    _train(before, range(6))
    ckpt = _write(before, tmp_path)[shard]
    after = Shard(shard, n)
    restore_tables(after, [ckpt])
    for path in CONFIG:
        want = before[shard].tables[path].export_state()
        assert want["ids"].size > 20 and want["counters"].any()
        if path == "users/embeddings":
            assert want["sketch"].any() and want["counters"][COUNTERS.index("refused")] > 0
        _assert_equal_states(after.tables[path].export_state(), want)
    _train([before[shard]], range(6, 8))
    _train([after], range(6, 8))
    for path in CONFIG:  # slots are reused in another order: compared by id
        got, want = after.tables[path].export_state(), before[shard].tables[path].export_state()
        _assert_equal_states(_by_id([got]), _by_id([want]))
        for f in set(want) - set(_by_id([want])):  # the sketch and the counters
            assert np.array_equal(got[f], want[f]), f


def test_a_capture_is_the_state_of_its_moment(tmp_path: Path) -> None:
    """The captured arrays are copies: applies after the capture do not reach the checkpoint."""
    shards = _layout(1)
    _train(shards, range(3))
    want = _exports(shards, "users/embeddings")[0]
    arrays, records = capture_tables(shards[0])
    _train(shards, range(3, 5))
    assert records["users/embeddings"]["rows"] == want["ids"].size
    store = CheckpointStore(tmp_path)
    store.write(3, arrays, {"shard": 0, "num_shards": 1, TABLES_META: records})
    restored = load_tables(Shard(0, 1), [store.latest()])
    _assert_equal_states(restored["users/embeddings"].export_state(), want)


@pytest.mark.parametrize(("old", "new"), [(1, 3), (3, 2), (2, 4), (2, 2)])
def test_tables_restore_onto_another_shard_count(tmp_path: Path, old: int, new: int) -> None:
    before = _layout(old)
    _train(before, range(6))
    ckpts = _write(before, tmp_path)
    after = _layout(new)
    for st in after:
        restore_tables(st, ckpts)
    for path in CONFIG:
        olds, news = _exports(before, path), _exports(after, path)
        for k, e in enumerate(news):  # every id on its shard
            assert e["ids"].size > 0 and (id_shard(e["ids"], new) == k).all()
        want, got = _by_id(olds), _by_id(news)
        assert np.unique(got["ids"]).size == got["ids"].size  # nothing duplicated
        _assert_equal_states(got, want)  # nothing lost: rows, slots, versions, counts
        total = sum(e["counters"] for e in olds)
        assert np.array_equal(sum(e["counters"] for e in news), total)
        if old == new:  # each shard's ids are its old own: everything as it was
            for o, e in zip(olds, news, strict=True):
                _assert_equal_states(e, o)


@pytest.mark.parametrize(("old", "new"), [(3, 2), (2, 4)])
def test_a_merged_sketch_admits_no_id_later_than_its_old_shard(
    tmp_path: Path, old: int, new: int
) -> None:
    before = _layout(old)
    _train(before, range(6))
    after = _layout(new)
    for st in after:
        restore_tables(st, _write(before, tmp_path))
    touched = np.unique(np.concatenate([_batch(s, "users/embeddings")[0] for s in range(6)]))
    was = np.empty(touched.size, np.int64)
    for st in before:
        mine = id_shard(touched, old) == st.shard
        was[mine] = st.tables["users/embeddings"].sketch.estimate(touched[mine])
    now = np.empty_like(was)
    for st in after:
        mine = id_shard(touched, new) == st.shard
        now[mine] = st.tables["users/embeddings"].sketch.estimate(touched[mine])
    assert was.any() and (now >= was).all()
    masses = [st.tables["users/embeddings"].sketch.mass for st in before]
    if new == 2 * old:  # new shard s holds ids of old shard s mod 2 only
        assert [st.tables["users/embeddings"].sketch.mass for st in after] == masses * 2
    else:
        assert all(st.tables["users/embeddings"].sketch.mass == sum(masses) for st in after)


def test_sketches_that_cannot_be_added_start_afresh_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    before = _layout(2)
    before[1].tables["users/embeddings"].map.sketch = CountMinSketch(2 * SMALL)
    _train(before, range(3))
    ckpts = _write(before, tmp_path)
    target = Shard(0, 1)
    with caplog.at_level(logging.WARNING, "downpour.server"):
        restore_tables(target, ckpts)
    assert "admission sketches differ" in caplog.text and "'users/embeddings'" in caplog.text
    table = target.tables["users/embeddings"]
    assert table.sketch.width == SMALL and not table.sketch.counters.any()
    assert len(table) == sum(len(st.tables["users/embeddings"]) for st in before)


def _retabled(path: str, **changes: Any) -> dict:
    name, dim, kw = CONFIG[path]
    config = dict(CONFIG)
    config[path] = (changes.pop("name", name), changes.pop("dim", dim), {**kw, **changes})
    return config


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({**CONFIG, "extra/embeddings": ("extra", 2, {})},
         r"holds no dynamic table \['extra/embeddings'\]"),
        ({"items/embeddings": CONFIG["items/embeddings"]},
         r"holds dynamic tables \['users/embeddings'\], which this model lacks"),
        ({}, r"holds dynamic tables \['items/embeddings', 'users/embeddings'\], which this"),
        (_retabled("users/embeddings", dim=5),
         r"'users/embeddings': saved with dim 4, this server has 5"),
        (_retabled("items/embeddings", optimizer="sgd"),
         r"'items/embeddings': saved with optimizer 'adagrad', this server has 'sgd'"),
        (_retabled("items/embeddings", name="things"),
         r"saved with layer 'items', this server has 'things'"),
    ],
)  # fmt: skip
def test_tables_that_disagree_with_the_model_are_refused(
    tmp_path: Path, config: dict, message: str
) -> None:
    before = _layout(2)
    _train(before, range(2))
    ckpts = _write(before, tmp_path)
    target = Shard(0, 3, config)
    untouched = dict(target.tables)
    with pytest.raises(ValueError, match=message):
        restore_tables(target, ckpts)
    assert target.tables == untouched


def test_malformed_or_incomplete_checkpoints_are_refused(tmp_path: Path) -> None:
    before = _layout(3)
    _train(before, range(2))
    target = Shard(1, 2)
    untouched = dict(target.tables)

    def refused(ckpts: list[Checkpoint], message: str) -> None:
        with pytest.raises(ValueError, match=message):
            restore_tables(target, ckpts)
        assert target.tables == untouched

    ckpts = _write(before, tmp_path / "a")
    refused(ckpts[:2], r"one of each old shard, got .*shard-0.* \(shard 0 of 3\)")
    refused([ckpts[0], ckpts[0], ckpts[2]], "one of each old shard")
    del ckpts[1].meta[TABLES_META]["users/embeddings"]["dim"]
    refused(ckpts, r"shard-1.*'users/embeddings': malformed record")

    ckpts = _write(before, tmp_path / "b")
    ckpts[2].arrays.members.pop(table_key("items/embeddings", "slot_accumulator"))
    refused(ckpts, r"'items/embeddings': its metadata records \['slot_accumulator'\], which")

    ckpts = _write(before, tmp_path / "c")
    ckpts[0].meta[TABLES_META]["items/embeddings"]["rows"] += 1
    refused(ckpts, r"'ids' must have shape \(\d+,\)")

    ckpts = _write(before, tmp_path / "d")
    ckpts[0].meta["shard"], ckpts[1].meta["shard"] = 1, 0  # the files swapped
    for c in ckpts[:2]:
        for rec in c.meta[TABLES_META].values():
            rec["shard"] = c.meta["shard"]
    refused(ckpts, r"ids \(first -?\d+\) belong to another shard of 3: a damaged checkpoint")


def test_a_record_less_checkpoint_reads_past_the_tables_arrays() -> None:
    from downpour.model.partition import make_partition

    part = make_partition(["w"], [(4, 2)], ["float32"], 1, "fp")
    arrays = {"model/w": np.zeros((4, 2), np.float32), table_key("users/embeddings", "ids"):
              np.zeros(0, np.int64)}  # fmt: skip
    pieces, unknown = pieces_from_parts(0, arrays, part.shards[0])
    assert [p.key for p in pieces] == ["model/w"] and unknown == []


# ---------------------------------------------------------------- through ParameterState


def _states(n: int, seed: int = 5, options: Any = None) -> list[Any]:
    from tiny_models import embedding_form

    from downpour.server.state import ParameterState, TableOptions

    spec, options = embedding_form("dict", dynamic=True), options or TableOptions(admit_after=2)
    return [ParameterState(spec, "adam", 0.05, seed=seed, jit=False, shard=k, num_shards=n,
                           table_options=options) for k in range(n)]  # fmt: skip


def _push(states: list[Any], steps: range) -> None:
    """Seeded full gradient lists (the table's rows keyed by id), each shard its piece."""
    from downpour.wire import Keyed

    part = states[0].partition
    variables = {p.var: p for parts in part.shards for p in parts}
    for step in steps:
        rng, grads = np.random.default_rng(step), []
        for _, p in sorted(variables.items()):
            if p.dynamic:
                ids = _batch(step, "users/embeddings")[0]
                rows = rng.standard_normal((ids.size, p.shape[1])).astype(p.dtype)
                grads.append(Keyed(ids, rows, p.shape))
            else:
                grads.append(rng.standard_normal(p.shape).astype(p.dtype))
        for st, piece in zip(states, part.split(grads), strict=True):
            st.apply(piece)


def test_a_parameter_state_checkpoint_restores_its_tables_onto_another_shard_count(
    tmp_path: Path,
) -> None:
    """Written as the server writes (``capture_state``: fixed variables and tables, one
    version), read by ``restore_set`` on 3 shards: the tables' union equals the 2 old shards',
    the fixed variables come back too, and training goes on alike."""
    from test_reshard import _joined

    from downpour.server.checkpointing.restore import restore_set

    def write(states: list[Any], root: Path) -> list[Checkpoint]:
        out = []
        for st in states:
            arrays, meta = capture_state(st)
            assert meta["num_shards"] == 2 and meta[TABLES_META]
            store = CheckpointStore(root / f"shard-{st.shard}")
            store.write(st.version, arrays, meta)
            out.append(store.latest())
        return out

    before = _states(2)
    _push(before, range(5))
    after = _states(3, seed=99)
    ckpts = write(before, tmp_path)
    for st in after:
        assert restore_set(st, ckpts).version == 5
    (path,) = before[0].tables
    assert path == "embed/embeddings"
    olds = [st.tables[path].export_state() for st in before]
    news = [st.tables[path].export_state() for st in after]
    assert all((id_shard(e["ids"], 3) == k).all() and e["ids"].size for k, e in enumerate(news))
    _assert_equal_states(_by_id(news), _by_id(olds))
    want, got = _joined(before), _joined(after)
    assert want and all(np.array_equal(got[k], want[k]) for k in want)

    _push(before, range(5, 7))
    _push(after, range(5, 7))
    olds = [st.tables[path].export_state() for st in before]
    news = [st.tables[path].export_state() for st in after]
    old_ids, new_ids = _by_id(olds)["ids"], _by_id(news)["ids"]
    assert np.array_equal(new_ids, old_ids)  # the same ids admitted since the restore
    for f, a in _by_id(olds).items():
        np.testing.assert_allclose(_by_id(news)[f], a, rtol=1e-6, atol=1e-7, err_msg=f)


@pytest.mark.parametrize("shards", [1, 3, 4])
def test_a_restore_onto_another_shard_count_gives_the_same_lookups(
    tmp_path: Path, shards: int
) -> None:
    """Two shards with fallback rows (B = 120, which 1 to 4 shards all divide) trained with
    admit_after 2, restored onto 1, 3 or 4 shards: every id, with a row of its own or
    reading its fallback row, and ids never seen, reads the same values; each id's frequency
    estimate is at least what it was (the sketches add)."""
    from downpour.server.checkpointing.restore import restore_set
    from downpour.server.state import TableOptions

    options = TableOptions(admit_after=2, fallback_rows=120)
    before = _states(2, options=options)
    _push(before, range(5))
    ckpts = []
    for st in before:
        arrays, meta = capture_state(st)
        store = CheckpointStore(tmp_path / f"shard-{st.shard}")
        store.write(st.version, arrays, meta)
        ckpts.append(store.latest())
    after = _states(shards, seed=99, options=options)
    for st in after:
        restore_set(st, ckpts)
    (path,) = before[0].tables
    seen = np.unique(np.concatenate([_batch(s, "users/embeddings")[0] for s in range(5)]))
    ids = np.concatenate([seen, np.arange(10**6, 10**6 + 50)])

    def lookups(states: list[Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        n = len(states)
        rows = np.empty((ids.size, 8), np.float32)
        own = np.zeros(ids.size, bool)
        est = np.zeros(ids.size, np.int64)
        for k, st in enumerate(states):
            mine = id_shard(ids, n) == k
            table = st.tables[path]
            rows[mine] = table.gather(ids[mine])
            own[mine] = table.map.locate(ids[mine]) >= 0
            est[mine] = table.sketch.estimate(ids[mine])
        return rows, own, est

    want, own_before, est_before = lookups(before)
    got, own_after, est_after = lookups(after)
    assert own_before.any() and not own_before.all()  # both kinds of id are looked up
    np.testing.assert_array_equal(own_after, own_before)
    np.testing.assert_array_equal(got, want)
    assert (est_after >= est_before).all()
    assert all(st.tables[path].map.fallback_total == 120 for st in before + after)
