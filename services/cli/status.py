"""``downpour status``: ask servers' status sockets and print a table or JSON.

One endpoint: that server's table. Several (the shards of one model): one cluster view, the
servers' figures side by side, each dynamic table with a line per shard and their totals, and
one row per worker merged over the shards. ``--watch`` redraws it every few seconds;
``--json`` prints the documents unchanged (one endpoint: its document; several:
``{endpoint: document}``; with ``--watch``: one compact line per refresh).

The documents come through the shard client's status call (``downpour.net.client.fetch_status``,
re-exported here). Imports no TensorFlow, so it answers in a fraction of a second.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from downpour.net.client import fetch_status
from downpour.net.security import ClientKeys
from downpour.runtime.metrics import TABLE_METRICS, TABLE_SIZES, eval_score, table_figures

__all__ = ["fetch_status", "main", "render", "render_cluster", "table_blocks"]

WIDTH = 100  # the columns the dynamic tables' lines keep within
TABLE_SETTINGS = {mi.key for mi in TABLE_METRICS} - set(TABLE_SIZES)


def normalise_endpoint(target: str) -> str:
    """Accept tcp://host:port, host:port, or a bare port (on 127.0.0.1)."""
    if target.startswith("tcp://"):
        return target
    if target.isdigit():
        return f"tcp://127.0.0.1:{target}"
    return f"tcp://{target}"


STATE_RANK = {"alive": 0, "missing": 1, "gone": 2}


def _fmt(v: Any, nd: int = 4) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{nd}g}"
    return str(v)


def _mib(v: Any) -> str:
    return "-" if v is None else f"{v:,.0f} MiB"


def _eval_line(doc: dict[str, Any]) -> str | None:
    ev = doc.get("eval")
    if not ev:
        return None
    age = time.time() - ev.get("time", time.time())
    name, value = eval_score(ev)
    return (
        f"held-out {name} {value or 0:.4f} at version {ev.get('version')} "
        f"({age:.0f}s ago, every {ev.get('every')} updates, {ev.get('count')} evaluations)"
    )


WORKER_HEADER = (
    f"{'worker':<20} {'state':<8} {'steps':>7} {'steps/s':>8} {'staleness':>9} {'loss':>8} "
    f"{'last seen':>9} {'applied':>8} {'rejected':>8} {'stale p50/p99':>13}"
)


def _stale_quantiles(w: dict[str, Any]) -> str:
    """The worker's staleness p50/p99 from its histogram ("-" before any gradient)."""
    h = w.get("staleness_histogram") or {}
    if not h.get("count"):
        return "-"
    return f"{_fmt(h.get('p50'))}/{_fmt(h.get('p99'))}"


def _worker_row(wid: str, w: dict[str, Any], extra: str = "") -> str:
    reported = w.get("reported") or {}
    loss = reported.get("loss", w.get("loss"))
    return (
        f"{wid:<20} {w.get('state', '?'):<8} {w.get('steps', 0):>7} "
        f"{_fmt(reported.get('steps_per_s'), 3):>8} {_fmt(w.get('staleness')):>9} "
        f"{_fmt(loss):>8} {w.get('last_seen_s', 0):>8.1f}s {w.get('applied', 0):>8} "
        f"{w.get('rejected', 0):>8} {_stale_quantiles(w):>13}{extra}"
    )


def _notice_lines(workers: dict[str, dict[str, Any]]) -> list[str]:
    """A warning line per slow path a worker reports it runs on (its ``notices``)."""
    return [
        f"WARNING: worker {wid}: {text}"
        for wid, w in sorted(workers.items())
        for text in w.get("notices") or ()
    ]


def render(doc: dict[str, Any]) -> str:
    """A human-readable table of one server's status document."""
    st = doc.get("staleness", {})
    lines = [
        f"model {doc.get('model')}  fingerprint {str(doc.get('fingerprint'))[:12]}  "
        f"uptime {doc.get('uptime_s', 0):.0f}s",
        f"version {doc.get('version')}  updates applied {doc.get('updates_applied')}  "
        f"updates/s {_fmt(doc.get('updates_per_s'))}  loss {_fmt(doc.get('loss'))}  "
        f"apply {_fmt(doc.get('apply_ms'))} ms",
        f"staleness mean {_fmt(st.get('mean'))} max {_fmt(st.get('max'))} "
        f"over {st.get('count', 0)} updates",
        "staleness histogram: " + " ".join(f"<={b}:{c}" for b, c in st.get("buckets", []) if c),
        f"bytes in {doc.get('bytes_in', 0):,}  out {doc.get('bytes_out', 0):,}  "
        f"pulls {doc.get('pulls', 0)} ({doc.get('pulls_unchanged', 0)} unchanged)",
        "rejected: "
        + (", ".join(f"{k}={v}" for k, v in sorted(doc.get("rejected", {}).items())) or "none"),
        "tables served by row: " + (", ".join(doc.get("row_tables") or ()) or "none"),
        f"holds {doc.get('shard_bytes', 0) / 1e6:,.1f} MB of parameters, "
        f"{doc.get('slot_bytes', 0) / 1e6:,.1f} MB of optimizer slots; "
        f"resident {_mib(doc.get('rss_mib'))}, peak {_mib(doc.get('peak_rss_mib'))}",
    ]
    if (pb := doc.get("pull_bounds") or {}).get("reads"):
        lines.append(
            f"pull bounds: {pb.get('within', 0)} pulls kept the held weights, "
            f"{pb.get('beyond', 0)} served; {pb.get('sampled', 0):,} of "
            f"{pb.get('dense_elements', 0):,} dense weights sampled in "
            f"{pb.get('reads', 0)} versions"
        )
    if doc.get("row_detection"):
        lines.append(f"WARNING: {doc['row_detection']}: every table is served whole")
    if isinstance(doc.get("receive_heap"), str):
        lines.append(f"WARNING: {doc['receive_heap']}: received frames are mapped afresh")
    if (arenas := doc.get("malloc") or {}).get("problem"):
        lines.append(f"WARNING: malloc arenas not limited ({arenas['problem']})")
    if doc.get("apply_call", "flat") != "flat":
        lines.append(f"WARNING: {doc['apply_call']}: every apply binds its inputs again")
    for path, t in sorted((doc.get("dynamic_tables") or {}).items()):
        lines += _table_lines(path, t)
    if (ev := _eval_line(doc)) is not None:
        lines.append(ev)
    lines += _notice_lines(doc.get("workers", {}))
    lines += ["", WORKER_HEADER]
    for wid, w in sorted(doc.get("workers", {}).items()):
        lines.append(_worker_row(wid, w))
    return "\n".join(lines)


def _count(v: float | None) -> str:
    """A count with thousands separators ("-" for None; a fraction as ``_fmt`` gives it)."""
    if v is None:
        return "-"
    return f"{int(v):,}" if float(v).is_integer() else _fmt(v)


def _bytes(v: float | None) -> str:
    """Bytes in the largest decimal unit that keeps a digit before the point."""
    if v is None:
        return "-"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if v >= size:
            return f"{v / size:,.1f} {unit}"
    return f"{v:.0f} B"


def _table_settings(entries: list[dict[str, Any]]) -> list[str]:
    """A table's settings over its shards' entries, as "key value" items: its text and its
    catalogued settings, by key (the values joined with "|" where shards differ); what is
    unset is left out."""
    sizes = set(TABLE_SIZES)
    keys = [
        k
        for k, v in {k: v for e in entries for k, v in e.items()}.items()
        if k not in sizes and (isinstance(v, str) or k in TABLE_SETTINGS)
    ]
    out = []
    for k in keys:
        values = [_count(v) if isinstance(v, int | float) else str(v) for e in entries
                  if (v := e.get(k)) is not None]  # fmt: skip
        if values:
            out.append(f"{k} {'|'.join(dict.fromkeys(values))}")
    return out


def _headed(head: str, sep: str, items: list[str]) -> list[str]:
    """``head``, ``sep`` and ``items`` on one line when they fit in WIDTH, else the items
    wrapped on lines of their own under ``head``."""
    line = f"{head}{sep} {', '.join(items)}"
    return [line] if len(line) <= WIDTH else [head, *_wrap(items, "  ")]


def _wrap(items: list[str], indent: str, width: int = WIDTH) -> list[str]:
    """``items`` joined by ", " on lines of at most ``width`` columns, each after ``indent``."""
    lines, line = [], ""
    for item in items:
        if line and len(indent) + len(line) + 2 + len(item) + 1 > width:  # 1: a last ","
            lines.append(indent + line + ",")
            line = item
        else:
            line = f"{line}, {item}" if line else item
    return [*lines, indent + line] if line else lines


def _table_lines(path: str, t: dict[str, Any]) -> list[str]:
    """One dynamic table of one server: its size and settings, then every count it reports."""
    named, _, events = table_figures(t)
    cap = t.get("capacity")
    head = (
        f"dynamic table {path}: {_count(named.get('live_rows', 0))} rows"
        + (f" of {cap:,}" if cap else "")
        + f", {_bytes(named.get('bytes', 0))}"
    )
    counts = [f"{k} {_count(v)}" for k, v in events.items()]
    return [*_headed(head, ";", _table_settings([t])), *_wrap(counts, "  ")]


def _grid(
    label_head: str, labels: list[str], columns: list[tuple[str, list[str]]], width: int = WIDTH
) -> list[str]:
    """A table, indented by two: a label column, then ``columns`` (heading, a cell per label)
    right-aligned; columns past ``width`` go on to a further table with the labels again."""
    lw = max(len(label_head), *map(len, labels))
    groups: list[list[tuple[str, list[str], int]]] = [[]]
    used = 2 + lw
    for head, cells in columns:
        w = max(len(head), *map(len, cells))
        if groups[-1] and used + 2 + w > width:
            groups.append([])
            used = 2 + lw
        groups[-1].append((head, cells, w))
        used += 2 + w
    lines = []
    for group in groups:
        lines.append(f"  {label_head:<{lw}}" + "".join(f"  {h:>{w}}" for h, _, w in group))
        for i, label in enumerate(labels):
            lines.append(f"  {label:<{lw}}" + "".join(f"  {c[i]:>{w}}" for _, c, w in group))
    return lines


def table_blocks(docs: dict[str, dict[str, Any]]) -> list[str]:
    """Each dynamic table of several servers (the shards of one model): a heading with its
    settings, a line per shard with its live rows, bytes and every count its entry holds (the
    keys the entries have, in their order), and a line of totals over the shards."""
    ok = {ep: d for ep, d in docs.items() if "error" not in d}
    order = sorted(ok, key=lambda ep: (int(ok[ep].get("shard") or 0), ep))
    labels = [f"{ok[ep].get('shard', 0)}/{ok[ep].get('num_shards', 1)}" for ep in order]
    if len(set(labels)) < len(labels):  # not one model's shards: name the servers
        labels = list(order)
    paths = sorted({p for d in ok.values() for p in d.get("dynamic_tables") or {}})
    lines: list[str] = []
    for path in paths:
        entries = [(ok[ep].get("dynamic_tables") or {}).get(path) for ep in order]
        figures = [None if e is None else table_figures(e) for e in entries]
        events = list(dict.fromkeys(k for f in figures if f for k in f[2]))
        columns = [(k, "named") for k in TABLE_SIZES] + [(k, "events") for k in events]
        cells = []
        for key, kind in columns:
            values = [None if f is None else (f[0] if kind == "named" else f[2]).get(key)
                      for f in figures]  # fmt: skip
            total = sum(v for v in values if v is not None)
            show = _bytes if key == "bytes" else _count
            cells.append((key, [*map(show, values), show(total)]))
        present = [e for e in entries if e is not None]
        lines += ["", *_headed(f"dynamic table {path}", ":", _table_settings(present))]
        lines += _grid("shard", [*labels, "total"], cells)
    return lines


def merge_workers(docs: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """One row per worker id over several servers (shards): the worst state, the longest
    silence, the largest staleness and step count, applied and rejected summed, the mean
    loss, the notices any server has; ``shards`` is how many servers know the worker."""
    merged: dict[str, dict[str, Any]] = {}
    for doc in docs.values():
        for wid, w in (doc.get("workers") or {}).items():
            m = merged.setdefault(
                wid,
                {
                    "state": "alive",
                    "last_seen_s": 0.0,
                    "steps": 0,
                    "staleness": None,
                    "applied": 0,
                    "rejected": 0,
                    "shards": 0,
                    "_losses": [],
                    "reported": {},
                    "notices": [],
                },
            )
            m["shards"] += 1
            if STATE_RANK.get(w.get("state"), 3) > STATE_RANK.get(m["state"], 3):
                m["state"] = w.get("state")
            m["last_seen_s"] = max(m["last_seen_s"], float(w.get("last_seen_s") or 0.0))
            m["steps"] = max(m["steps"], int(w.get("steps") or 0))
            if w.get("staleness") is not None:
                m["staleness"] = max(m["staleness"] or 0, w["staleness"])
            m["applied"] += int(w.get("applied") or 0)
            m["rejected"] += int(w.get("rejected") or 0)
            m["notices"] += [n for n in w.get("notices") or () if n not in m["notices"]]
            reported = w.get("reported") or {}
            loss = reported.get("loss", w.get("loss"))
            if loss is not None:
                m["_losses"].append(loss)
            rate = reported.get("steps_per_s")
            if rate is not None:
                m["reported"]["steps_per_s"] = max(m["reported"].get("steps_per_s", 0.0), rate)
    for m in merged.values():
        losses = m.pop("_losses")
        m["loss"] = sum(losses) / len(losses) if losses else None
    return merged


def shard_summary(docs: dict[str, dict[str, Any]]) -> str | None:
    """For shards of one partitioned model: which shards answer and which are missing (each
    shard applies every push to its slice, so its version counts the cluster's updates)."""
    sharded = [d for d in docs.values() if int(d.get("num_shards") or 1) > 1]
    if not sharded:
        return None
    partitions = {d.get("partition") for d in sharded}
    total = max(int(d["num_shards"]) for d in sharded)
    present = sorted({int(d.get("shard", 0)) for d in sharded})
    missing = [i for i in range(total) if i not in present]
    versions = [int(d.get("version") or 0) for d in sharded]
    return (
        f"shards: {len(present)}/{total} present"
        + (f", MISSING {missing}" if missing else "")
        + f", partition {', '.join(sorted(map(str, partitions)))}"
        + ("  (DIFFERENT PARTITIONS)" if len(partitions) > 1 else "")
        + f", versions {min(versions)}..{max(versions)}"
    )


def render_cluster(docs: dict[str, dict[str, Any]]) -> str:
    """Several servers as one cluster: totals, a line per server, each dynamic table with a
    line per shard (``table_blocks``), a merged row per worker."""
    ok = {ep: d for ep, d in docs.items() if "error" not in d}
    models = {(d.get("model"), d.get("fingerprint")) for d in ok.values()}
    updates = sum(int(d.get("updates_applied") or 0) for d in ok.values())
    rate = sum(float(d.get("updates_per_s") or 0.0) for d in ok.values())
    st_count = sum(int((d.get("staleness") or {}).get("count", 0)) for d in ok.values())
    st_sum = sum(float((d.get("staleness") or {}).get("sum", 0.0)) for d in ok.values())
    st_max = max((float((d.get("staleness") or {}).get("max", 0)) for d in ok.values()), default=0)
    rejected = sum(int(d.get("rejected_total") or 0) for d in ok.values())
    model = ", ".join(sorted(str(m) for m, _ in models)) or "?"
    lines = [
        f"cluster: {len(ok)}/{len(docs)} servers answering, model {model}"
        + ("" if len(models) <= 1 else "  (DIFFERENT MODELS: not shards of one model)"),
    ]
    if (shards := shard_summary(ok)) is not None:
        lines.append(shards)
    lines += [
        f"updates applied {updates}  updates/s {_fmt(rate)}  staleness mean "
        f"{_fmt(st_sum / st_count if st_count else None)} max {_fmt(st_max)}  "
        f"rejected {rejected}",
        "",
        f"{'server':<28} {'shard':>5} {'version':>8} {'updates/s':>9} {'loss':>8} "
        f"{'stale mean':>10} {'rejected':>8} {'held-out':>8}",
    ]
    for ep, d in docs.items():
        if "error" in d:
            lines.append(f"{ep:<28} unreachable: {d['error']}")
            continue
        ev = d.get("eval") or {}
        shard = f"{d.get('shard', 0)}/{d.get('num_shards', 1)}"
        lines.append(
            f"{ep:<28} {shard:>5} {d.get('version', 0):>8} {_fmt(d.get('updates_per_s')):>9} "
            f"{_fmt(d.get('loss')):>8} {_fmt((d.get('staleness') or {}).get('mean')):>10} "
            f"{d.get('rejected_total', 0):>8} {_fmt(eval_score(ev)[1]):>8}"
        )
    lines += table_blocks(docs)
    workers = merge_workers(ok)
    lines += _notice_lines(workers)
    lines += ["", WORKER_HEADER + f" {'shards':>6}"]
    for wid, w in sorted(workers.items()):
        lines.append(_worker_row(wid, w, f" {w['shards']:>3}/{len(ok):<2}"))
    return "\n".join(lines)


def main(
    targets: list[str],
    as_json: bool,
    watch: float | None,
    timeout_s: float,
    keys: ClientKeys | None = None,
    count: int | None = None,
) -> int:
    """Print status for the targets; with ``watch``, refresh every that many seconds
    (``count`` times, or until Ctrl-C). Exit 1 if an endpoint did not answer (last round)."""
    rounds = 0
    tty = sys.stdout.isatty()
    try:
        while True:
            docs = {}
            for t in targets:
                ep = normalise_endpoint(t)
                try:
                    docs[ep] = fetch_status(ep, timeout_s, keys)
                except Exception as exc:  # report every endpoint, then fail
                    docs[ep] = {"error": str(exc)}
            rounds += 1
            out = docs if len(docs) > 1 else next(iter(docs.values()))
            if as_json:
                # --watch: JSON Lines, one compact document per refresh
                print(json.dumps(out, indent=None if watch else 2))
            else:
                if watch and tty:
                    print("\x1b[2J\x1b[H", end="")  # redraw in place
                elif watch:
                    print(f"--- {time.strftime('%H:%M:%S')}")
                if len(docs) > 1:
                    print(render_cluster(docs))
                else:
                    ep, doc = next(iter(docs.items()))
                    print(f"== {ep}")
                    print(doc["error"] if "error" in doc else render(doc))
            sys.stdout.flush()
            failed = any("error" in d for d in docs.values())
            if not watch or (count is not None and rounds >= count):
                return 1 if failed else 0
            time.sleep(watch)  # the refresh period the user asked for
    except KeyboardInterrupt:
        return 0
