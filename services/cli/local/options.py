"""``downpour run-local``'s options and its children's settings, derived from the services' tables.

run-local offers every ``downpour server`` and ``downpour worker`` option (``SERVER_OPTIONS``,
``WORKER_OPTIONS``) except the few it decides for each child itself (``SERVER_DECIDES``,
``WORKER_DECIDES``, a reason each), so an option added to a service's table is a run-local
option at once. An option both services declare (``--model``, ``--seed``, ``--device`` ...) is
one run-local option that goes to both. The server's ``--eval-every`` (updates) is
``--server-eval-every`` here: run-local's own ``--eval-every`` is seconds between its
evaluations. Where run-local's default or help differs from the service's, ``OVERRIDES``
replaces it in the declaration.

``plan_children`` turns run-local's parsed options into each child's settings values, checks
them with the services' own ``validate_server`` / ``validate_worker``, and ``Child.argv`` is
the command line (``downpour.config.settings.to_argv``) run-local starts it with.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from downpour.checkpoints.dirs import run_local_dir, run_local_layout, shard_dir
from downpour.config.settings import ConfigError, Option, at_least, refuse, to_argv
from downpour.net import security
from downpour.server.settings import SERVER_OPTIONS, ServerConfig, validate_server
from downpour.worker.settings import WORKER_OPTIONS, WorkerConfig, validate_worker

_RUN = "run-local"
_BOTH = "the server and the workers (as their options)"
_WORKERS = "the workers (as their options)"
_SERVER = "the server (as its options)"

# run-local's own options: how many processes, where the run's files go, what it shows.
RUN_OPTIONS: tuple[Option, ...] = (
    Option("workers", 2, "worker processes to start", _RUN, type=at_least(1)),
    Option(
        "shards",
        1,
        "server shards the model is partitioned over (one process each)",
        _RUN,
        type=at_least(1),
    ),
    Option("run_dir", None, "where logs, history and plots go (default runs/<time>)", _RUN),
    Option("eval_every", 10.0, "seconds between held-out evaluations", _RUN, type=float),
    Option("no_progress", False, "plain log lines instead of bars", _RUN, bool),
    Option(
        "secure",
        False,
        "generate CURVE keys into RUN_DIR/keys and encrypt + authenticate every socket",
        _RUN,
        bool,
    ),
)

# Server settings run-local sets for each shard itself, and why it does not offer them.
SERVER_DECIDES: dict[str, str] = {
    "host": "every process runs on this machine: the servers bind loopback",
    "port": "0: each shard binds free ports and reports them in its ready file",
    "push_port": "0, as --port",
    "status_port": "0, as --port",
    "ready_file": "RUN_DIR/server[-I].json, which run-local waits for",
    "num_shards": "from --shards",
    "shard": "each shard's own index",
    "show_partition": "prints the partition and exits: nothing would train",
    "insecure": "loopback needs no exception from authentication",
    "keys": "--secure generates the keys into RUN_DIR/keys",
    "key": "--secure: the server's key is RUN_DIR/keys/server.key_secret",
    "metrics_host": "loopback, as --host",
    "logdir": "RUN_DIR/tensorboard (a directory per shard with --shards > 1)",
    "restore_from": "--state-dir: checkpoints of another --shards there are resharded",
}

# Worker settings run-local sets for each worker itself, and why it does not offer them.
WORKER_DECIDES: dict[str, str] = {
    "server": "the shards' loopback ports, from their ready files",
    "id": "worker-I",
    "num_workers": "--workers (static shards; not used with --data-dispatch server)",
    "worker_index": "I: worker I reads static shard I",
    "push_endpoint": "the server's announced push port is reachable on loopback",
    "key": "--secure: RUN_DIR/keys/clients/worker-I.key_secret",
    "server_key": "--secure: RUN_DIR/keys/server.key",
}

# A server option under another run-local name: run-local's --eval-every is its own.
SERVER_RENAMED: dict[str, str] = {"eval_every": "server_eval_every"}

# Where run-local's declaration differs from the service's (run-local name -> fields).
OVERRIDES: dict[str, dict[str, Any]] = {
    "model": {"help": "module:function returning a ModelSpec (the server, workers, evaluator)"},
    "data_dir": {"help": "standard MNIST IDX files (default: embedded MNIST-5k)"},
    "device": {
        "help": "where the server, the workers and the evaluator compute: auto, cpu, gpu or "
        "gpu:N (GPU memory grows as needed, so they share one GPU)"
    },
    "seed": {"help": "the server's initialisation seed and the workers' data-order seed"},
    "data_dispatch": {
        "help": "server: the server hands out splits of the training data and the workers take "
        "them (exactly-once epochs, --epochs counted by the server, whole epochs only); "
        "none: worker i reads static shard i of --workers"
    },
    "epochs": {
        "default": 6.0,
        "help": "passes over the training set: each worker reads its shard this often (with "
        "MNIST-5k and 2 workers, 6 passes are 480 updates of batch 50)",
    },
    "steps": {"help": "steps per worker (overrides --epochs)"},
    "log_every": {"default": 0, "help": "steps between the workers' log lines (0 = none)"},
    "server_eval_every": {
        "default": 100,
        "help": "the server also evaluates the held-out set every N updates (0 = off; a shard "
        "holds part of the model, so with --shards > 1 only run-local evaluates)",
    },
    "metrics_port": {"default": 0, "help": "the server's Prometheus port (0 = any)"},
    "state_dir": {
        "help": "the server's checkpoints (with --shards N, DIR/shard-I for each shard); the "
        "newest is restored at start, and the last lines say how to export it"
    },
}


def _offered(
    options: Sequence[Option], decides: Mapping[str, str], renamed: Mapping[str, str]
) -> dict[str, Option]:
    """A service's options run-local offers, by run-local name."""
    return {renamed.get(o.name, o.name): o for o in options if o.name not in decides}


_SERVER_OFFERED = _offered(SERVER_OPTIONS, SERVER_DECIDES, SERVER_RENAMED)
_WORKER_OFFERED = _offered(WORKER_OPTIONS, WORKER_DECIDES, {})


def _local_option(name: str, option: Option, section: str) -> Option:
    """The service's declaration as run-local offers it: its name, section and overrides."""
    return dataclasses.replace(
        option, name=name, section=section, attr=None, **OVERRIDES.get(name, {})
    )


LOCAL_OPTIONS: tuple[Option, ...] = (
    *RUN_OPTIONS,
    *(_local_option(n, o, _BOTH) for n, o in _SERVER_OFFERED.items() if n in _WORKER_OFFERED),
    *(
        _local_option(n, o, _WORKERS)
        for n, o in _WORKER_OFFERED.items()
        if n not in _SERVER_OFFERED
    ),
    *(_local_option(n, o, _SERVER) for n, o in _SERVER_OFFERED.items() if n not in _WORKER_OFFERED),
)


def keys_dir(run_dir: Path) -> Path:
    """Where ``--secure`` generates the run's CURVE keys."""
    return run_dir / "keys"


def client_secret(key_dir: Path, name: str) -> Path:
    """The secret key file of client ``name`` (a worker, the evaluator, the status reader)."""
    return key_dir / security.CLIENTS_DIR / f"{name}.key_secret"


@dataclasses.dataclass(frozen=True)
class Child:
    """One process run-local starts: ``downpour SERVICE`` with these settings values."""

    service: str  # "server" or "worker"
    name: str  # "server", "server-I" or "worker-I": its log and ready file names
    values: dict[str, Any]  # setting name -> value, the options not given keep their defaults

    @property
    def argv(self) -> list[str]:
        """The child's arguments after ``downpour``: only values that are not the default."""
        options = SERVER_OPTIONS if self.service == "server" else WORKER_OPTIONS
        return [self.service, *to_argv(options, self.values)]


@dataclasses.dataclass(frozen=True)
class Children:
    """Every process of one run-local run, in start order within each kind."""

    servers: list[Child]
    workers: list[Child]

    @property
    def state_dirs(self) -> list[str]:
        """Each shard's checkpoint directory (empty without --state-dir)."""
        return [s.values["state_dir"] for s in self.servers if s.values["state_dir"]]


def server_settings(args: argparse.Namespace, run_dir: Path, shard: int) -> Child:
    """The settings of server shard ``shard`` of ``args.shards``."""
    shards = args.shards
    values = {o.name: getattr(args, n) for n, o in _SERVER_OFFERED.items()}
    name = "server" if shards == 1 else f"server-{shard}"
    values.update(
        port=0,
        push_port=0,
        status_port=0,
        ready_file=str(run_dir / f"{name}.json"),
        logdir=str(
            shard_dir(run_dir / "tensorboard", shard) if shards > 1 else run_dir / "tensorboard"
        ),
    )
    if shards > 1:  # each shard its own checkpoints; only shard 0 dispatches and serves metrics
        values.update(shard=shard, num_shards=shards, eval_every=0)
        if values["state_dir"]:
            values["state_dir"] = str(run_local_dir(values["state_dir"], shard, shards))
    if args.state_dir and (old := run_local_layout(Path(args.state_dir))) and old[0] != shards:
        values["restore_from"] = ",".join(str(d) for d in old[1])
    if shard != 0:
        values.update(data_dispatch="none", metrics_port=0)
    if args.secure:
        values["keys"] = str(keys_dir(run_dir))
    return Child("server", name, values)


def worker_settings(args: argparse.Namespace, run_dir: Path, index: int, servers: str) -> Child:
    """The settings of worker ``index``; ``servers`` is its --server (every shard's HOST:PORT)."""
    values = {o.name: getattr(args, n) for n, o in _WORKER_OFFERED.items()}
    values.update(server=servers, id=f"worker-{index}")
    if args.data_dispatch != "server":  # static sharding: worker i reads shard i of N
        values.update(num_workers=args.workers, worker_index=index)
    if args.secure:
        values["key"] = str(client_secret(keys_dir(run_dir), f"worker-{index}"))
        values["server_key"] = str(keys_dir(run_dir) / security.SERVER_PUBLIC)
    return Child("worker", f"worker-{index}", values)


# Before the servers have bound their ports, the workers' --server is this placeholder.
PENDING_SERVERS = "127.0.0.1:0"


def plan_children(args: argparse.Namespace, run_dir: Path, servers: str = "") -> Children:
    """Every child's settings, checked as each service checks its own (ConfigError).

    ``servers`` is the workers' --server once the shards have bound their ports: one entry per
    shard (``PENDING_SERVERS`` each, for the check before they start).
    """
    servers = servers or ",".join([PENDING_SERVERS] * args.shards)
    children = Children(
        [server_settings(args, run_dir, i) for i in range(args.shards)],
        [worker_settings(args, run_dir, i, servers) for i in range(args.workers)],
    )
    problems: list[str] = []
    for child in [*children.servers, *children.workers]:
        options, config_type, validate = (
            (SERVER_OPTIONS, ServerConfig, validate_server)
            if child.service == "server"
            else (WORKER_OPTIONS, WorkerConfig, validate_worker)
        )
        values = {o.name: o.default_value() for o in options} | child.values
        try:
            validate(config_type.from_values(values))
        except ConfigError as exc:
            problems += [p for p in exc.problems if p not in problems]
    refuse(problems)
    return children
