"""``downpour run-local``: the demo. A server and N workers as separate processes on loopback.

The workers read static shards of the training data (worker i of N), or, with
``--data-dispatch server``, take splits from the server (shard 0) for exactly-once epochs.

Shows progress bars while training, evaluates the held-out set with the server's weights,
writes ``history.csv``, ``workers.csv``, every shard's final status (``status-shard-I.json``;
``status.json`` is shard 0's), TensorBoard events and PNG plots (``downpour plot``) into a run
directory, and prints ``held-out accuracy: 0.xxxx`` as its last line (``held-out <name>: ...``
for a model whose ``metric_name`` is another: ``auc``). Ctrl-C stops every process it started.

Its options are the server's and the workers' (``downpour.cli.local.options``): each
process's command line is built from them, checked first by the services' own checks. With
``--state-dir`` the servers stop after training (their last checkpoint), and the lines before
the held-out one say where each checkpoint is and the ``downpour export`` command for them.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import ctypes
import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from downpour.cli.local.options import (
    LOCAL_OPTIONS,
    Children,
    client_secret,
    keys_dir,
    plan_children,
)
from downpour.cli.status import fetch_status, table_blocks
from downpour.config.loading import CONFIG_ENV
from downpour.config.settings import ConfigError, add_options
from downpour.config.tf_config import TF_CONFIG_ENV
from downpour.net import security
from downpour.net.transport import Deadline, tcp
from downpour.server.settings import SERVER_OPTIONS
from downpour.worker.settings import WORKER_OPTIONS

if TYPE_CHECKING:
    from downpour.serving.scoring import Evaluator

log = logging.getLogger("downpour.run_local")

__all__ = ["LOCAL_OPTIONS", "add_arguments", "run", "spawn", "wait_ready"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``downpour run-local``: its own, and the server's and workers' it passes on."""
    add_options(p, LOCAL_OPTIONS)


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    """Linux: the child gets SIGTERM if this process dies, so nothing is left behind."""
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def settings_variables(environ: Mapping[str, str]) -> list[str]:
    """The ``DOWNPOUR_*`` variables in ``environ`` that would set a server or worker setting
    (and ``DOWNPOUR_CONFIG``, ``TF_CONFIG``): run-local's children start without them."""
    names = {o.env_var for o in (*SERVER_OPTIONS, *WORKER_OPTIONS)} | {CONFIG_ENV, TF_CONFIG_ENV}
    return sorted(k for k in environ if k in names)


def spawn(args: list[str], log_path: Path, stdout: int | None = None) -> subprocess.Popen:
    """Start ``downpour ARGS`` with this interpreter, stderr to a log file.

    The child's settings are exactly ``args``: a setting left at its default is not on the
    command line, so a ``DOWNPOUR_*`` variable of this environment would otherwise set it.
    """
    env = dict(os.environ, PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="2")
    for name in settings_variables(env):
        del env[name]
    with open(log_path, "wb") as err:
        return subprocess.Popen(
            [sys.executable, "-m", "downpour", *args],
            stdout=stdout if stdout is not None else subprocess.DEVNULL,
            stderr=err,
            env=env,
            preexec_fn=_die_with_parent,
        )


def wait_ready(
    proc: subprocess.Popen, ready_file: Path, timeout_s: float, log_path: Path
) -> dict[str, Any]:
    """Wait for the server's ready file; fail early if the server exits."""
    deadline = Deadline(timeout_s)
    while not deadline.expired():
        if ready_file.exists():
            return json.loads(ready_file.read_text())
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; see {log_path}")
        time.sleep(0.1)  # polling the file for a bounded time, not synchronising on a guess
    raise RuntimeError(f"server not ready after {timeout_s:.0f} s; see {log_path}")


def steps_per_worker(evaluator: Evaluator, workers: int, epochs: float) -> int | None:
    """Batches each of ``workers`` statically sharded workers computes in ``epochs``
    (the largest share), or None when tf.data cannot tell without reading."""
    from downpour.inputs.pipeline import build_dataset, context, known_batches

    counts = []
    for i in range(workers):
        ctx = context(evaluator.spec, evaluator.data_dir, worker_index=i, num_workers=workers)
        n = known_batches(build_dataset(evaluator.inputs.train, ctx))
        if n is None:
            return None
        counts.append(n)
    return max(1, int(round(epochs * max(counts))))


def run(args: argparse.Namespace) -> int:
    """The whole demo; returns the exit code."""
    run_dir = Path(args.run_dir or Path("runs") / time.strftime("%Y%m%d-%H%M%S"))
    try:  # the children's settings, checked as each service checks its own, before any starts
        plan_children(args, run_dir)
    except ConfigError as exc:
        for problem in exc.problems:
            print(f"downpour run-local: error: {problem}", file=sys.stderr)
        return 2
    if ignored := settings_variables(os.environ):
        log.warning(
            "run-local gives its processes every setting as a flag: %s not passed on to them",
            ", ".join(ignored),
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    procs: list[subprocess.Popen] = []
    try:
        return _run(args, run_dir, procs)
    except KeyboardInterrupt:
        print("\ninterrupted: stopping every process", file=sys.stderr)
        return 130
    finally:
        _stop(procs)


def _stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM every process still running, then wait for each (killed after 15 s)."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _make_keys(
    args: argparse.Namespace, run_dir: Path
) -> tuple[security.ClientKeys | None, security.ClientKeys | None]:
    """With --secure: a worker key each, one for the evaluator, a reader key for status; the
    (status, evaluator) client keys. (None, None) without."""
    if not args.secure:
        return None, None
    key_dir = keys_dir(run_dir)
    names = [f"worker-{i}" for i in range(args.workers)]
    security.generate_keys(key_dir, [*names, "run-local-eval"], ["run-local"])
    server_pub = key_dir / security.SERVER_PUBLIC
    return (
        security.load_client_keys(client_secret(key_dir, "run-local"), server_pub),
        security.load_client_keys(client_secret(key_dir, "run-local-eval"), server_pub),
    )


def _progress_bars(workers: int, per_worker: int | None, disable: bool) -> dict[str, Any]:
    """A tqdm bar per worker id (``worker-i``), of ``per_worker`` steps when known."""
    from tqdm import tqdm

    return {
        f"worker-{i}": tqdm(
            total=per_worker,
            desc=f"worker-{i}",
            position=i,
            leave=True,
            disable=disable,
            dynamic_ncols=True,
        )
        for i in range(workers)
    }


def _history_row(doc: dict[str, Any], t: float, metric: str) -> dict[str, Any]:
    """A history.csv row from a status document at ``t`` seconds (the metric not scored)."""
    return {
        "t": t,
        "version": doc["version"],
        "loss": doc["loss"],
        "staleness_mean": doc["staleness"]["mean"],
        "updates_per_s": doc["updates_per_s"],
        metric: None,
        **_eval_columns(doc, metric),
    }


def _spawn_servers(
    children: Any, run_dir: Path, procs: list[subprocess.Popen]
) -> tuple[list[subprocess.Popen], list[Path], list[Path]]:
    """Start every server child at once: (processes, their logs, their ready files)."""
    ready_files = [Path(c.values["ready_file"]) for c in children.servers]
    server_logs = [run_dir / f"{c.name}.log" for c in children.servers]
    servers = []
    for child, ready_file, log_path in zip(children.servers, ready_files, server_logs, strict=True):
        ready_file.unlink(missing_ok=True)
        servers.append(spawn(child.argv, log_path))
        procs.append(servers[-1])
    return servers, server_logs, ready_files


def _print_endpoints(args: argparse.Namespace, run_dir: Path, eps: list[dict[str, Any]]) -> None:
    """Where to watch the run: status, metrics and TensorBoard."""
    status_line = " ".join(f"127.0.0.1:{e['status_port']}" for e in eps)
    print(
        f"status: downpour status --watch 2 {status_line}"
        f"{'  (with --key/--server-key)' if args.secure else ''}\n"
        f"metrics: http://127.0.0.1:{eps[0]['metrics_port']}/metrics\n"
        f"tensorboard: tensorboard --logdir {run_dir / 'tensorboard'}",
        flush=True,
    )


def _write_run_files(
    run_dir: Path,
    docs: list[dict[str, Any]],
    history: list[dict[str, Any]],
    worker_rows: list[dict[str, Any]],
) -> None:
    """The run directory's status documents, history.csv, workers.csv and plots: every
    shard's final status as ``status-shard-I.json`` (``docs`` in shard order), and shard 0's
    again as ``status.json``, the one ``downpour plot`` reads."""
    from downpour.cli.plot import plot_run

    for i, doc in enumerate(docs):
        (run_dir / f"status-shard-{i}.json").write_text(json.dumps(doc, indent=2))
    (run_dir / "status.json").write_text(json.dumps(docs[0], indent=2))
    _write_history(run_dir / "history.csv", history)
    if worker_rows:
        _write_history(run_dir / "workers.csv", worker_rows)
    for png in plot_run(run_dir):
        print(f"plot: {png}")


def _run(args: argparse.Namespace, run_dir: Path, procs: list[subprocess.Popen]) -> int:
    """Start the servers, then the workers; watch them train; then report, score and write
    the run directory. The exit code: 1 when a worker failed."""
    status_keys, eval_keys = _make_keys(args, run_dir)
    children = plan_children(args, run_dir)
    if old := children.servers[0].values.get("restore_from"):
        log.info(
            "--state-dir %s holds checkpoints of another number of shards: the %d shard(s) "
            "restore from %s",
            args.state_dir,
            args.shards,
            old,
        )
    servers, server_logs, ready_files = _spawn_servers(children, run_dir, procs)
    print(f"run directory: {run_dir}", flush=True)
    loaded = _load_evaluator(args)  # import TensorFlow and load data while the servers start
    eps = [
        wait_ready(p, f, 180.0, lg)
        for p, f, lg in zip(servers, ready_files, server_logs, strict=True)
    ]
    _print_endpoints(args, run_dir, eps)
    workers = _spawn_workers(args, run_dir, eps, procs)
    cluster = _Cluster(servers, server_logs, eps, workers, status_keys, eval_keys)
    evaluator = loaded()
    metric = evaluator.spec.metric_name
    history, worker_rows, t_start = _watch(args, cluster, evaluator)
    failed = [w.returncode for w in workers if w.returncode != 0]
    _print_worker_summaries(workers)
    doc = cluster.status()
    version, acc = cluster.score(evaluator)
    history.append(
        _history_row(doc, round(time.monotonic() - t_start, 2), metric)
        | {"version": version, metric: acc}
    )
    docs = [doc] + [cluster.status(shard) for shard in range(1, len(eps))]
    _write_run_files(run_dir, docs, history, worker_rows)
    _print_server_lines(docs)
    if failed:
        print(
            f"{len(failed)} worker(s) failed (exit codes {failed}); see {run_dir}", file=sys.stderr
        )
    if children.state_dirs:  # the servers' last checkpoint is written as they stop
        _stop(servers)
        _report_checkpoints(args, children, run_dir, version)
    print(f"held-out {metric}: {acc:.4f}", flush=True)
    return 1 if failed else 0


@dataclass
class _Cluster:
    """What run-local started, and how it reads it: the server and worker processes, the
    servers' endpoints (their ready files, in shard order) and run-local's own keys for
    status and evaluation."""

    servers: list[subprocess.Popen]
    server_logs: list[Path]
    eps: list[dict[str, Any]]
    workers: list[subprocess.Popen]
    status_keys: security.ClientKeys | None
    eval_keys: security.ClientKeys | None
    host: str = "127.0.0.1"

    def status(self, shard: int = 0) -> dict[str, Any]:
        """Shard ``shard``'s status document."""
        endpoint = tcp(self.host, self.eps[shard]["status_port"])
        return fetch_status(endpoint, timeout_s=10.0, keys=self.status_keys)

    def score(self, evaluator: Evaluator) -> tuple[int, float]:
        """(version, held-out metric) of the servers' weights now."""
        ports = [e["port"] for e in self.eps]
        return evaluator.score(self.host, ports if len(ports) > 1 else ports[0], self.eval_keys)

    def check_servers(self) -> None:
        """RuntimeError, naming its log, when a server has exited."""
        for srv, srv_log in zip(self.servers, self.server_logs, strict=True):
            if srv.poll() is not None:
                raise RuntimeError(f"server exited with {srv.returncode}; see {srv_log}")


def _load_evaluator(args: argparse.Namespace) -> Callable[[], Evaluator]:
    """Load the held-out evaluator (TensorFlow, the model, the data) on a thread; the call
    returned waits for it (at most 300 s)."""
    box: dict[str, Any] = {}

    def load() -> None:
        from downpour.serving.scoring import Evaluator

        box.setdefault("e", Evaluator(args.model, args.data_dir, args.device))

    loader = threading.Thread(target=load, daemon=True)
    loader.start()

    def loaded() -> Evaluator:
        loader.join(timeout=300)
        return box["e"]

    return loaded


def _spawn_workers(
    args: argparse.Namespace,
    run_dir: Path,
    eps: list[dict[str, Any]],
    procs: list[subprocess.Popen],
) -> list[subprocess.Popen]:
    """Start every worker child, given the servers' REP endpoints in shard order."""
    endpoints = ",".join(f"127.0.0.1:{e['port']}" for e in eps)
    workers = []
    for child in plan_children(args, run_dir, endpoints).workers:
        workers.append(spawn(child.argv, run_dir / f"{child.name}.log", stdout=subprocess.PIPE))
        procs.append(workers[-1])
    return workers


def _watch(
    args: argparse.Namespace, cluster: _Cluster, evaluator: Evaluator
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], float]:
    """Until every worker has exited: a progress bar per worker and a history row per refresh
    (with workers.csv rows) from shard 0's status, the held-out metric every
    ``--eval-every`` seconds; RuntimeError when a server exits. Returns (history rows,
    workers.csv rows, the monotonic time their ``t`` counts from)."""
    metric = evaluator.spec.metric_name
    # a dispatched worker's share is whatever splits it gets: no per-worker total then
    per_worker = args.steps or (
        None
        if args.data_dispatch == "server"
        else steps_per_worker(evaluator, args.workers, args.epochs)
    )
    bars = _progress_bars(args.workers, per_worker, args.no_progress)
    history: list[dict[str, Any]] = []
    worker_rows: list[dict[str, Any]] = []  # workers.csv: per-worker throughput over time
    t_start = time.monotonic()
    last_eval = t_start
    while any(w.poll() is None for w in cluster.workers):
        cluster.check_servers()
        doc = cluster.status()
        row = _history_row(doc, round(time.monotonic() - t_start, 2), metric)
        worker_rows += _worker_rows(row["t"], doc)
        for wid, w in doc["workers"].items():
            if wid in bars:
                bars[wid].n = w["steps"] if per_worker is None else min(w["steps"], per_worker)
                bars[wid].set_postfix(
                    loss=f"{w['loss'] or 0:.3f}", stale=w["staleness"], refresh=False
                )
                bars[wid].refresh()
        if time.monotonic() - last_eval >= args.eval_every:
            row["version"], row[metric] = cluster.score(evaluator)
            last_eval = time.monotonic()
            if args.no_progress:
                print(
                    f"t={row['t']:.0f}s version {row['version']} loss {row['loss']} "
                    f"held-out {metric} {row[metric]:.4f}",
                    flush=True,
                )
        history.append(row)
        _wait_any(cluster.workers, 0.5)
    for bar in bars.values():
        bar.close()
    return history, worker_rows, t_start


def _print_worker_summaries(workers: list[subprocess.Popen]) -> None:
    """One line per finished worker from the JSON summary it printed on stdout."""
    for i, w in enumerate(workers):
        out = w.stdout.read().decode() if w.stdout else ""
        for line in out.splitlines():
            if line.startswith("{"):
                s = json.loads(line)["summary"]
                cache = (
                    f", row cache of {s['row_cache_rows']} rows: "
                    f"{s['row_cache_evictions']} evictions"
                    if s.get("row_cache_rows")
                    else ""
                )
                print(
                    f"worker-{i}: {s['steps']} steps, {s['steps_per_s']:.2f} steps/s, "
                    f"last loss {s['loss']:.4f}{cache}"
                )


def _print_server_lines(docs: list[dict[str, Any]]) -> None:
    """One line per server shard from its final status (shard order), shard 0's
    dispatcher's if it dispatched, and each dynamic table per shard as ``downpour status``
    shows a cluster's."""
    for i, d in enumerate(docs):
        st = d["staleness"]
        print(
            f"{'server' if len(docs) == 1 else f'shard {i}/{len(docs)}'}: version {d['version']}, "
            f"{d['updates_applied']} updates, staleness mean {st['mean']:.2f} max "
            f"{st['max']:.0f}, rejected {d['rejected_total']}"
        )
    if (d := docs[0].get("dispatch")) is not None:
        print(
            f"dispatch: {d['epochs_done']} epoch(s) done of {d['max_epochs'] or 'unbounded'}, "
            f"{d['acked']} splits acknowledged ({d['splits_total']} per epoch), "
            f"{d['released']} released"
        )
    for line in table_blocks({str(i): d for i, d in enumerate(docs)}):
        print(line)


def _report_checkpoints(
    args: argparse.Namespace, children: Children, run_dir: Path, version: int
) -> None:
    """Print each shard's newest checkpoint and the ``downpour export`` command for them;
    warn if a shard wrote none or one of another version than run-local scored."""
    from downpour.checkpoints.store import CheckpointStore

    for state_dir in children.state_dirs:
        found = CheckpointStore(state_dir).list()
        if not found:
            log.warning("no checkpoint in %s: see the server's log in %s", state_dir, run_dir)
            return
        ckpt_version, path = found[-1]
        print(f"checkpoint: {path} (version {ckpt_version})")
        if ckpt_version != version:
            log.warning(
                "%s holds version %d, the held-out score below is of version %d",
                path,
                ckpt_version,
                version,
            )
    command = ["downpour", "export", *(f"--state-dir={d}" for d in children.state_dirs)]
    command += [f"--out={run_dir / 'model'}", f"--model={args.model}"]
    command += [f"--data-dir={args.data_dir}"] if args.data_dir else []
    print(f"export: {shlex.join(command)}", flush=True)


def _wait_any(procs: list[subprocess.Popen], timeout_s: float) -> None:
    """Return when a running process exits or after ``timeout_s`` (the UI refresh period)."""
    running = [p for p in procs if p.poll() is None]
    if running:
        with contextlib.suppress(subprocess.TimeoutExpired):
            running[0].wait(timeout=timeout_s)


def _eval_columns(doc: dict[str, Any], metric: str) -> dict[str, Any]:
    """history.csv columns of the server's last held-out evaluation (--eval-every)."""
    ev = doc.get("eval") or {}
    return {"eval_version": ev.get("version"), f"eval_{metric}": ev.get(metric)}


def _worker_rows(t: float, doc: dict[str, Any]) -> list[dict[str, Any]]:
    """workers.csv rows: one per worker at time ``t``."""
    return [
        {
            "t": t,
            "worker": wid,
            "state": w.get("state"),
            "steps": w.get("steps"),
            "steps_per_s": (w.get("reported") or {}).get("steps_per_s"),
            "loss": w.get("loss"),
            "staleness": w.get("staleness"),
            "applied": w.get("applied"),
        }
        for wid, w in sorted(doc["workers"].items())
    ]


def _write_history(path: Path, rows: list[dict[str, Any]]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
