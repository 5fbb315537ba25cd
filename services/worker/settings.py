"""The worker's settings: every ``downpour worker`` option, ``WorkerConfig``, ``validate_worker``.

``WORKER_OPTIONS`` is the one declaration (see ``downpour.config.settings`` for the naming rule);
``WorkerConfig`` is derived from it plus a few attributes that are not settings. Importing this
module does not import TensorFlow.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import socket

from downpour.config.settings import (
    DATA_DIR,
    DEVICE,
    DISPATCH_MODES,
    KEY,
    LOG_FORMAT,
    LOG_LEVEL,
    MODEL,
    PORT,
    SEED,
    SERVER_KEY,
    Internal,
    Option,
    at_least,
    config_class,
    non_negative,
    positive,
    refuse,
)
from downpour.net import security
from downpour.worker.compress import COMPRESSION_HELP, parse_compression

PULL_COMPRESSIONS = ("none", "bf16")  # --pull-compress
ROW_PULL_MODES = ("auto", "off")  # --row-pulls
GRAPHS = ("tf2", "tf1")  # --graph


def compression_text(text: str) -> str:
    """argparse type of --compress: the canonical text of a valid mode, or a clear error."""
    try:
        return parse_compression(text).spec
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_server(s: str) -> tuple[str, int]:
    """HOST:PORT (or tcp://HOST:PORT, [v6]:PORT) -> (host, port)."""
    s = s.removeprefix("tcp://")
    host, sep, port = s.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"--server must be HOST:PORT, got {s!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


def endpoint(s: str) -> str:
    """argparse type of --server and --push-endpoint: HOST:PORT with a port in 0..65535."""
    try:
        PORT(parse_server(s)[1])
    except (ValueError, argparse.ArgumentTypeError):
        raise argparse.ArgumentTypeError(
            f"{s!r} is not HOST:PORT with a port in 0..65535"
        ) from None
    return s


def endpoint_list(s: str) -> str:
    """argparse type of --server: one HOST:PORT or a comma-separated list of them."""
    for part in s.split(","):
        endpoint(part.strip())
    return s


def parse_servers(s: str) -> tuple[tuple[str, int], ...]:
    """``--server`` -> ((host, port), ...) in shard order."""
    return tuple(parse_server(part.strip()) for part in s.split(","))


_CONN = "connection"
_TRAIN = "model and training"
_SEC = "security (see docs: security.md)"
_LOG = "logging"

STEPS = Option("steps", None, "steps to train (overrides --epochs)", _TRAIN, type=at_least(1))
EPOCHS = Option(
    "epochs", 1.0, "passes over this worker's share of the training set", _TRAIN, type=positive()
)
NUM_WORKERS = Option(
    "num_workers",
    1,
    "workers sharing the training set: each reads its own shard (its files, or every "
    "N-th example), so together they see each example once per epoch",
    _TRAIN,
    type=at_least(1),
)
WORKER_INDEX = Option(
    "worker_index", 0, "this worker's shard, 0 .. --num-workers - 1", _TRAIN, type=at_least(0)
)
DATA_DISPATCH = Option(
    "data_dispatch",
    "none",
    "server: ask server shard 0 for splits of the training data (a file, or a range of "
    "elements), each split read once per epoch across workers that come and go; --epochs is "
    "then the number of epochs, counted by the server, and --num-workers/--worker-index are "
    "not used. none: read this worker's static shard",
    _TRAIN,
    choices=DISPATCH_MODES,
)
SPLIT_SIZE = Option(
    "split_size",
    None,
    "with --data-dispatch server and an input_fn that shards elements: elements per split "
    "(default 20 batches)",
    _TRAIN,
    type=at_least(1),
)
N_FETCH = Option("n_fetch", 1, "pull weights every N steps", _TRAIN, type=at_least(1))
PULL_BOUND = Option(
    "pull_bound",
    0.0,
    "B > 0: take new weights only when the server estimates they moved by more than B of "
    "their norm since the version held, else compute on from the held ones (fewer bytes, "
    "older weights; its measured cost is in docs/policies.md); 0 (the default): take every "
    "new version. Off under sync:K/N and ssp:K, whose rounds and holds count versions, and "
    "under lookahead, whose pulls are extrapolated",
    _TRAIN,
    type=non_negative(),
    metavar="B",
)
N_PUSH = Option("n_push", 1, "push gradients every N steps (averaged)", _TRAIN, type=at_least(1))
GRAPH = Option(
    "graph",
    "tf2",
    "tf2: a compiled tf.function; tf1: the model's tf.compat.v1 graph in a Session, "
    "loss and all gradients in one sess.run (the spec's tf1_graph)",
    _TRAIN,
    choices=GRAPHS,
)
COMPRESS = Option(
    "compress",
    "bf16",
    COMPRESSION_HELP + ". The default is bf16: the convergence study found it free (the "
    "same updates to its targets at 1, 4 and 8 workers, for half the bytes of every dense "
    "gradient and of every row's values: docs/policies.md); none pushes float32",
    _TRAIN,
    type=compression_text,
    metavar="MODE",
)
PULL_COMPRESS = Option(
    "pull_compress",
    "bf16",
    "bf16 (the default): ask for the weights, and the rows of row pulls, in bfloat16 (half "
    "the bytes of every pull; the server keeps and updates float32, the worker computes at "
    "the rounded weights, as mixed precision training does; the convergence study found it "
    "free: docs/policies.md); none: float32 pulls",
    _TRAIN,
    choices=PULL_COMPRESSIONS,
)
ROW_PULLS = Option(
    "row_pulls",
    "auto",
    "auto: pull only the rows of row-sparse tables (Embeddings) that the coming batches "
    "gather, found ahead from the input pipeline; off: pull every table whole (see docs: "
    "models.md)",
    _TRAIN,
    choices=ROW_PULL_MODES,
)
ROW_STALENESS = Option(
    "row_staleness",
    0,
    "with row pulls: a cached row fetched at most K versions before the server's current "
    "one is used without pulling it again (0: every batch's rows at the current version)",
    _TRAIN,
    type=at_least(0),
    metavar="K",
)
ROW_CACHE_ROWS = Option(
    "row_cache_rows",
    None,
    "with row pulls: keep each Embedding table of more than N rows as a cache of N rows "
    "instead of a full replica (tables larger than the worker holds; a batch may gather "
    "at most N distinct rows of a table; see docs: models.md)",
    _TRAIN,
    type=at_least(1),
    metavar="N",
)

WORKER_OPTIONS: tuple[Option, ...] = (
    Option(
        "server",
        "127.0.0.1:5570",
        "HOST:PORT of the server's REP port; with shards, every shard's, comma-separated "
        "in shard order (HOST0:PORT0,HOST1:PORT1,...)",
        _CONN,
        type=endpoint_list,
        attr="servers",
        to_config=parse_servers,
    ),
    Option("id", "", "worker id (default hostname-pid)", _CONN, attr="worker_id"),
    MODEL,
    GRAPH,
    DATA_DIR,
    STEPS,
    EPOCHS,
    NUM_WORKERS,
    WORKER_INDEX,
    DATA_DISPATCH,
    SPLIT_SIZE,
    N_FETCH,
    PULL_BOUND,
    N_PUSH,
    dataclasses.replace(
        SEED,
        default=0,
        help="data-order seed, the same on every worker: each epoch's shuffle is seeded "
        "with SEED + epoch, so the shards divide one permutation",
    ),
    DEVICE,
    COMPRESS,
    PULL_COMPRESS,
    ROW_PULLS,
    ROW_STALENESS,
    ROW_CACHE_ROWS,
    Option(
        "sync_wait",
        5.0,
        "with a sync:K/N server (or a hybrid's dense=sync:K/N): longest wait, in seconds, "
        "for the round's update after a push (a second gradient from the same weights "
        "would be dropped); 0: never wait",
        _CONN,
        type=non_negative(),
        attr="sync_wait_s",
    ),
    Option(
        "request_timeout",
        10.0,
        "seconds to wait for one reply",
        _CONN,
        type=positive(),
        attr="request_timeout_s",
    ),
    Option(
        "server_timeout",
        120.0,
        "give up after the server is away this long",
        _CONN,
        type=positive(),
        attr="server_timeout_s",
    ),
    Option(
        "push_timeout",
        1.0,
        "send timeout of one push at the high-water mark",
        _CONN,
        type=positive(),
        attr="push_timeout_s",
    ),
    Option(
        "push_endpoint",
        None,
        "send gradients here instead of the port the server announces (NAT, port "
        "mappings, proxies)",
        _CONN,
        type=endpoint,
        metavar="HOST:PORT",
        to_config=parse_server,
    ),
    Option(
        "prefetch",
        True,
        "pull weights synchronously instead of overlapping the pull with computation",
        _CONN,
        bool,
    ),
    Option(
        "heartbeat",
        2.0,
        "seconds of silence before a heartbeat",
        _CONN,
        type=positive(),
        attr="heartbeat_s",
    ),
    dataclasses.replace(
        KEY,
        help="this worker's CURVE secret key (clients/NAME.key_secret from downpour keygen); "
        "the default --id is its NAME",
        section=_SEC,
        attr="key_file",
    ),
    dataclasses.replace(SERVER_KEY, section=_SEC, attr="server_key_file"),
    Option("log_every", 50, "steps between log lines", _LOG, type=at_least(0)),
    LOG_LEVEL,
    LOG_FORMAT,
)

WORKER_INTERNAL: tuple[Internal, ...] = (
    Internal(
        "keys",
        security.ClientKeys | None,
        None,
        "CURVE on every socket when set: loaded from key_file and server_key_file at start",
    ),
    Internal("push_hwm", int, 4, "send high-water mark of each push socket"),
    Internal("push_linger_s", float, 30.0, "seconds a closing push socket may flush"),
    Internal("io_threads", int, 1, "ZeroMQ I/O threads"),
)


def _resolved_id(self: WorkerConfig) -> str:
    """The configured id, or hostname-pid."""
    return self.worker_id or f"{socket.gethostname()}-{os.getpid()}"


def _endpoints(self: WorkerConfig) -> tuple[tuple[str, int], ...]:
    """The servers' REP endpoints, one per shard in shard order."""
    return self.servers


WorkerConfig = config_class(
    "WorkerConfig",
    __name__,
    "Everything a worker needs besides the model: one attribute per ``downpour worker`` "
    "option (WORKER_OPTIONS) and the WORKER_INTERNAL ones.",
    WORKER_OPTIONS,
    WORKER_INTERNAL,
    {"resolved_id": _resolved_id, "endpoints": _endpoints},
)


def validate_worker(cfg: WorkerConfig) -> None:
    """Refuse settings that contradict each other (ConfigError listing every problem)."""
    problems: list[str] = []
    if bool(cfg.key_file) != bool(cfg.server_key_file):
        problems.append("--key and --server-key go together (own secret key, server.key)")
    if cfg.worker_index >= cfg.num_workers:
        problems.append(
            f"--worker-index {cfg.worker_index} is not below --num-workers {cfg.num_workers} "
            "(worker indices count from 0)"
        )
    if cfg.data_dispatch == "server":
        if (cfg.num_workers, cfg.worker_index) != (1, 0):
            problems.append(
                "--data-dispatch server hands out the splits: leave --num-workers and "
                "--worker-index at 1 and 0"
            )
        if cfg.steps is None and cfg.epochs != int(cfg.epochs):
            problems.append(
                f"--data-dispatch server counts whole epochs: --epochs {cfg.epochs} is not one"
            )
    elif cfg.split_size is not None:
        problems.append("--split-size goes with --data-dispatch server")
    if cfg.row_cache_rows is not None:
        if cfg.row_pulls != "auto":
            problems.append("--row-cache-rows needs row pulls (--row-pulls auto)")
        if cfg.graph != "tf2":
            problems.append(
                "--row-cache-rows works with --graph tf2 (a tf1 graph holds its tables)"
            )
    if cfg.push_endpoint is not None and len(cfg.servers) > 1:
        problems.append("--push-endpoint works with one server, not with shards")
    refuse(problems)
