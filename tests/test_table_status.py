"""Dynamic tables wherever a user looks: ``downpour status``'s cluster view (each table with a
line per shard and a total line, every count an entry holds, within 100 columns), the
cluster's ``--json``, ``/metrics`` (every number of each table's entry, labelled ``table``) and
run-local's run directory (every shard's status document)."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from inproc import WorkerThread, make_worker, serving, settle
from prometheus_client.parser import text_string_to_metric_families

from downpour.cli import status
from downpour.cli.local import _write_run_files
from downpour.cli.status import fetch_status, render, render_cluster, table_blocks
from downpour.runtime import metrics as m
from downpour.server.observers.prometheus import render_text

TABLE = "embed/embeddings"
SETTINGS = {"optimizer", "admit_after", "capacity", "evict_policy", "evict_idle_versions"}


def _entry(rows: int, **more: Any) -> dict[str, Any]:
    """A table's status entry as a shard reports it, with ``more`` figures."""
    return {
        "live_rows": rows,
        "bytes_rows": 32 * rows,
        "bytes_slots": 32 * rows,
        "bytes_index": 100,
        "bytes_sketch": 0,
        "bytes_meta": 10,
        "bytes": 64 * rows + 110,
        "inserted": rows + 3,
        "admitted": rows,
        "refused": 7,
        "evicted_idle": 0,
        "evicted_capacity": 3,
        "bad_input": 0,
        **more,
        "optimizer": "adagrad",
        "admit_after": 2,
        "capacity": 50,
        "evict_policy": "lru",
        "evict_idle_versions": None,
    }


def _shard_doc(shard: int, tables: dict[str, Any]) -> dict[str, Any]:
    return {"model": "m", "shard": shard, "num_shards": 2, "version": 3, "workers": {},
            "dynamic_tables": tables}  # fmt: skip


def _block(text: str, path: str) -> dict[str, dict[str, str]]:
    """The cells of table ``path``'s block in a cluster view: {row label: {column: cell}},
    over every group of columns the block wraps into."""
    lines = text.splitlines()
    head = f"dynamic table {path}"
    i = next(n for n, line in enumerate(lines) if line.partition(":")[0] == head)
    cells: dict[str, dict[str, str]] = {}
    heads: list[str] = []
    for line in lines[i + 1 :]:
        if not line.startswith("  "):
            break
        words = line.split()
        if words[0] == "shard":
            heads = words[1:]
            continue
        if not heads:  # settings wrapped under the heading
            continue
        # a bytes cell is two words ("2.7 kB"): join each number with its unit
        values: list[str] = []
        for w in words[1:]:
            if w in ("B", "kB", "MB", "GB"):
                values[-1] += f" {w}"
            else:
                values.append(w)
        cells.setdefault(words[0], {}).update(zip(heads, values, strict=True))
    return cells


def _n(cell: str) -> int:
    return int(cell.replace(",", ""))


def test_the_cluster_view_shows_each_table_per_shard_with_every_count_and_totals() -> None:
    """Counts a table adds (a new one, counts by reason) show up as columns of their own,
    a shard without them shows "-", the columns wrap within 100 columns, totals add up."""
    big = _entry(12_345_678, readmitted=5, refused_by={"sketch": 3, "unadmitted": 4})
    docs = {
        "tcp://127.0.0.1:5573": _shard_doc(1, {"a/emb": _entry(2), TABLE: _entry(38)}),
        "tcp://127.0.0.1:5572": _shard_doc(0, {"a/emb": big, TABLE: _entry(40)}),
    }
    text = render_cluster(docs)
    block = _block(text, "a/emb")
    assert list(block) == ["0/2", "1/2", "total"]  # shard order, whatever the endpoints'
    assert block["0/2"]["live_rows"] == "12,345,678" and block["0/2"]["bytes"] == "790.1 MB"
    assert block["1/2"]["live_rows"] == "2" and block["1/2"]["bytes"] == "238 B"
    assert block["total"]["live_rows"] == "12,345,680" and block["total"]["bytes"] == "790.1 MB"
    assert block["0/2"]["readmitted"] == "5" and block["1/2"]["readmitted"] == "-"
    assert block["0/2"]["refused_by.sketch"] == "3"
    assert block["total"]["refused_by.unadmitted"] == "4"
    for key in ("inserted", "admitted", "refused", "evicted_idle", "evicted_capacity"):
        assert _n(block["total"][key]) == _n(block["0/2"][key]) + _n(block["1/2"][key]), key
    assert not set(block["0/2"]) & SETTINGS  # settings go in the heading, not in columns
    heading = next(line for line in text.splitlines() if line.startswith("dynamic table a/emb"))
    assert heading.endswith("optimizer adagrad, admit_after 2, capacity 50, evict_policy lru")
    tables = table_blocks(docs)
    assert max(map(len, tables)) <= 100
    assert sum(line.startswith("  shard") for line in tables) == 3  # a/emb's wraps in two
    assert text.index("dynamic table a/emb") < text.index(f"dynamic table {TABLE}")
    assert render_cluster({"a": {"model": "m"}, "b": {"error": "timeout"}}).count("dynamic") == 0


def test_one_servers_view_lists_every_count_of_its_tables() -> None:
    doc = _shard_doc(0, {TABLE: _entry(40, readmitted=5, refused_by={"sketch": 3})})
    lines = render(doc).splitlines()
    i = lines.index(f"dynamic table {TABLE}: 40 rows of 50, 2.7 kB")  # settings: too long
    assert lines[i + 1] == "  optimizer adagrad, admit_after 2, capacity 50, evict_policy lru"
    counts = " ".join(" ".join(lines[i + 2 : i + 4]).split())
    assert max(map(len, lines[i : i + 4])) <= 100
    assert "inserted 43, admitted 40, refused 7, evicted_idle 0, evicted_capacity 3" in counts
    assert "bad_input 0, readmitted 5, refused_by.sketch 3" in counts


def test_metrics_carry_every_number_of_a_tables_entry_by_the_catalogue() -> None:
    """Sizes and settings under their catalogued names, bytes by part, and every other number
    (counts a table adds, counts by reason among them) as an event; the names of before kept."""
    entry = _entry(40, readmitted=5, refused_by={"sketch": 3})
    families = {
        f.name: f
        for f in text_string_to_metric_families(render_text(lambda: _shard_doc(0, {TABLE: entry})))
    }
    value = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in families.values()
        for s in f.samples
    }
    t = ("table", TABLE)
    assert value["downpour_dynamic_table_rows", (t,)] == 40
    assert value["downpour_dynamic_table_bytes", (t,)] == entry["bytes"]
    assert value["downpour_dynamic_table_admit_after", (t,)] == 2
    assert value["downpour_dynamic_table_capacity_rows", (t,)] == 50
    assert "downpour_dynamic_table_evict_idle_versions" not in families  # None: unset
    for part in ("rows", "slots", "index", "sketch", "meta"):
        labels = (("part", part), t)
        assert value["downpour_dynamic_table_part_bytes", labels] == entry[f"bytes_{part}"]
    events = {"inserted", "admitted", "refused", "evicted_idle", "evicted_capacity", "bad_input"}
    for event in events | {"readmitted"}:
        assert value["downpour_dynamic_table_events_total", (("event", event), t)] == entry[event]
    assert value["downpour_dynamic_table_events_total", (("event", "refused_by.sketch"), t)] == 3
    assert families["downpour_dynamic_table_events"].type == "counter"
    assert families["downpour_dynamic_table_rows"].type == "gauge"


def _scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``/metrics`` over HTTP: {(sample name, sorted labels): value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        assert resp.status == 200
        text = resp.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


def test_a_two_shard_clusters_tables_in_status_json_and_metrics(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Two in-process shards of a dynamic-table model trained by two workers: the cluster
    view's line per shard is each shard's entry, its totals their sums; ``--json`` carries both
    shards' tables; each shard's ``/metrics`` carries every number of its entries."""
    spec = "tiny_models:dynamic_dict"
    config = {"optimizer": "adagrad", "learning_rate": 0.5, "admit_after": 2,
              "table_rows_per_shard": 40, "admission": "always", "metrics_port": 0}  # fmt: skip
    with (
        serving(spec, shard=0, num_shards=2, **config) as s0,
        serving(spec, shard=1, num_shards=2, **config) as s1,
    ):
        servers = [s0, s1]
        ports = [s.port for s in servers]
        threads = [
            WorkerThread(make_worker(ports, spec, worker_id=f"w{i}", steps=15, num_workers=2,
                                     worker_index=i, n_fetch=1))
            for i in (0, 1)
        ]  # fmt: skip
        sums = [t.result() for t in threads]
        for s in servers:
            settle(s.status, sums)
        docs = {s.status: fetch_status(s.status) for s in servers}
        scraped = [_scrape(s.info["metrics_port"]) for s in servers]
        assert status.main([s.status for s in servers], True, None, 10.0) == 0
    printed = json.loads(capsys.readouterr().out)
    entries = [d["dynamic_tables"][TABLE] for d in docs.values()]
    assert [printed[ep]["dynamic_tables"][TABLE]["live_rows"] for ep in docs] == [
        e["live_rows"] for e in entries
    ]
    assert all(0 < e["live_rows"] <= 40 for e in entries)
    assert all(e["refused"] > 0 and e["evicted_capacity"] > 0 for e in entries), entries

    block = _block(render_cluster(docs), TABLE)
    assert list(block) == ["0/2", "1/2", "total"]
    _, _, events = m.table_figures(entries[0])
    for key in ("live_rows", *events):
        shown = [_n(block[label][key]) for label in ("0/2", "1/2")]
        assert shown == [e[key] for e in entries], key
        assert _n(block["total"][key]) == sum(shown), key
    assert block["total"]["bytes"] == status._bytes(sum(e["bytes"] for e in entries))

    for entry, value in zip(entries, scraped, strict=True):
        t = ("table", TABLE)
        named, parts, events = m.table_figures(entry)
        by_key = {mi.key: mi for mi in m.TABLE_METRICS}
        for key, v in named.items():
            assert value[by_key[key].name, (t,)] == v, key
        for part, v in parts.items():
            assert value["downpour_dynamic_table_part_bytes", (("part", part), t)] == v, part
        for event, v in events.items():
            assert value["downpour_dynamic_table_events_total", (("event", event), t)] == v


def test_the_run_directory_holds_every_shards_status(tmp_path: Path) -> None:
    docs = [_shard_doc(k, {TABLE: _entry(10 + k)}) | {"staleness": {"buckets": []}}
            for k in range(3)]  # fmt: skip
    history = [{"t": 0.5, "version": 3, "loss": 1.0, "staleness_mean": 0.0, "updates_per_s": 1,
                "accuracy": 0.5, "eval_version": None, "eval_accuracy": None}]  # fmt: skip
    _write_run_files(tmp_path, docs, history, [])
    for k, doc in enumerate(docs):
        assert json.loads((tmp_path / f"status-shard-{k}.json").read_text()) == doc
    assert json.loads((tmp_path / "status.json").read_text()) == docs[0]  # downpour plot's
    assert (tmp_path / "history.csv").exists()
