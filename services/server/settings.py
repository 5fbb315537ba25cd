"""The server's settings: every ``downpour server`` option, ``ServerConfig``, ``validate_server``.

``SERVER_OPTIONS`` is the one declaration (see ``downpour.config.settings`` for the naming rule);
``ServerConfig`` is derived from it plus a few attributes that are not settings. Importing this
module does not import TensorFlow, so ``downpour server`` refuses bad settings at once.

``validate_server`` holds every check across settings, the policy's among them: what a policy
may go with is read from its capabilities (``downpour.config.policy``). The checks that need
the model (what dynamic tables cannot go with) run when it is given ``ModelFacts``: the
server calls it once more with them, once its state is built.
"""

from __future__ import annotations

import argparse
import dataclasses

from downpour import wire
from downpour.config.policy import POLICY_HELP
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
    Internal,
    Option,
    at_least,
    config_class,
    non_negative,
    positive,
    refuse,
)
from downpour.net import security
from downpour.net.transport import is_loopback
from downpour.server.job import JOB_TIMEOUT_S, LINGER_AFTER_DONE_S
from downpour.server.policies.base import Policy, parse_policy
from downpour.server.registry import FORGET_AFTER_S, MAX_WORKERS
from downpour.tables.policy import ADMISSIONS, ADMIT_INITS, ADMIT_MAX, EVICT_POLICIES

OPTIMIZERS = ("adam", "adagrad", "sgd", "lazy_adam")  # --optimizer; downpour.server.state
BETA_1_OPTIMIZERS = ("adam", "lazy_adam")  # those with a beta_1 (a Keras Adam) to set
MAX_PULL_ROWS = 1 << 20


def policy_text(text: str) -> str:
    """argparse type of --policy: the canonical text of a valid policy, or a clear error."""
    try:
        return parse_policy(text).spec
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


_NET = "network"
_TRAIN = "model and training"
_SHARDS = "shards (see docs: several-machines.md)"
_SEC = "security (see docs: security.md)"
_CKPT = "checkpoints"
_WORKERS = "workers"
_OBS = "observability (see docs: observability.md)"
_DYN = "dynamic tables (see docs: models.md)"
_EXPORT = "serving exports (see docs: models.md)"
_JOB = "a job that completes (see docs: reliability.md)"

OPTIMIZER = Option(
    "optimizer",
    "adam",
    "the optimizer that applies gradients; a row-sparse table (an Embedding) is updated on "
    "the rows a gradient touches, slots too, with sgd and adagrad; lazy_adam: Adam whose "
    "moments and rows change only where touched (adam keeps Keras's dense moments); see "
    "docs: models.md",
    _TRAIN,
    choices=OPTIMIZERS,
)
METRICS_PORT = Option(
    "metrics_port",
    None,
    "serve Prometheus metrics on http://METRICS_HOST:PORT/metrics (0 = any port)",
    _OBS,
    type=PORT,
    metavar="PORT",
)
LR = Option("lr", 1e-3, "learning rate", _TRAIN, type=positive(), attr="learning_rate")

SERVER_OPTIONS: tuple[Option, ...] = (
    dataclasses.replace(MODEL, attr="model_ref"),
    Option("host", "127.0.0.1", "address to bind (default loopback)", _NET),
    Option("port", 5570, "REP port for hello and weights (0 = any)", _NET, type=PORT),
    Option("push_port", 5571, "PULL port for gradients (0 = any)", _NET, type=PORT),
    Option("status_port", 5572, "REP port for status (0 = any)", _NET, type=PORT),
    OPTIMIZER,
    LR,
    dataclasses.replace(SEED, default=0, help="initialisation seed"),
    DEVICE,
    Option(
        "policy",
        "async",
        POLICY_HELP,
        _TRAIN,
        type=policy_text,
        metavar="POLICY",
    ),
    Option(
        "data_dispatch",
        "none",
        "server: hand out the training data's splits (files or element ranges) to workers "
        "that ask, each split once per epoch, taken back from workers that are gone or "
        "restart; none: workers shard statically. With shards only shard 0 dispatches",
        _TRAIN,
        choices=DISPATCH_MODES,
    ),
    Option(
        "num_shards",
        1,
        "servers the model is partitioned over; start one server per shard",
        _SHARDS,
        type=at_least(1),
    ),
    Option("shard", 0, "this server's shard index, 0..NUM_SHARDS-1", _SHARDS, type=at_least(0)),
    Option(
        "show_partition",
        False,
        "print which variables (and row ranges) each shard holds, then exit",
        _SHARDS,
        bool,
    ),
    Option("ready_file", None, "write bound ports as JSON here once serving", _NET),
    Option(
        "max_pull_rows",
        MAX_PULL_ROWS,
        "most row ids a row pull may ask of one table; a larger request is refused (rows_too_many)",
        _NET,
        type=at_least(1),
        metavar="N",
    ),
    Option(
        "table_rows_per_shard",
        None,
        "rows each dynamic table keeps on this shard, its own and its fallback rows (default: "
        "the layer's max_rows split over the shards)",
        _DYN,
        type=at_least(1),
        metavar="ROWS",
    ),
    Option(
        "fallback_rows",
        None,
        "each dynamic table's fallback rows over all shards, shared by hashing as "
        "keras.layers.Hashing shares bins: a count, or a fraction of max_rows below 1 "
        "(default: the layer's)",
        _DYN,
        type=non_negative(),
        metavar="N|FRACTION",
    ),
    Option(
        "evict_policy",
        None,
        "which row a full dynamic table gives up: least recently updated (lru) or least "
        "frequently touched, by its decayed count (lfu) (default: the layer's)",
        _DYN,
        choices=EVICT_POLICIES,
    ),
    Option(
        "admission",
        None,
        "what a new id must do to take a row from a full dynamic table: beat the victim's "
        "frequency (victim) or nothing (always) (default: the layer's)",
        _DYN,
        choices=ADMISSIONS,
    ),
    Option(
        "admit_after",
        None,
        "touches an id needs before it may take a row of its own; until then it reads and "
        "trains its fallback row, or reads its initial value (default: the layer's)",
        _DYN,
        type=at_least(1),
        metavar="N",
    ),
    Option(
        "admit_init",
        None,
        "what a newly admitted row starts from: its fallback row's value (fallback) or its "
        "own initial value (initial) (default: the layer's)",
        _DYN,
        choices=ADMIT_INITS,
    ),
    Option(
        "evict_idle_versions",
        None,
        "evict a dynamic table's rows not updated for this many versions (default: never)",
        _DYN,
        type=at_least(1),
        metavar="N",
    ),
    Option(
        "missing_after",
        10.0,
        "seconds of silence before a worker shows as missing",
        _WORKERS,
        type=positive(),
        attr="missing_after_s",
    ),
    Option(
        "gone_after",
        60.0,
        "seconds of silence before a worker shows as gone",
        _WORKERS,
        type=positive(),
        attr="gone_after_s",
    ),
    Option(
        "max_workers",
        MAX_WORKERS,
        "worker ids the server tracks at most; a new id beyond it takes the place of a gone "
        "worker, or is refused (hello: an error; push: dropped) and counted as too_many_workers",
        _WORKERS,
        type=at_least(1),
        metavar="N",
    ),
    Option(
        "forget_after",
        FORGET_AFTER_S,
        "seconds of silence before a worker's record is forgotten (its last seq is kept, so "
        "replays are still refused); 0 = only when a new worker needs its place",
        _WORKERS,
        type=non_negative(),
        attr="forget_after_s",
    ),
    Option(
        "allow_nonfinite", False, "apply gradients with NaN/Inf (default: reject)", _TRAIN, bool
    ),
    Option(
        "insecure",
        False,
        "allow binding a non-loopback address without authentication",
        _SEC,
        bool,
    ),
    Option(
        "keys",
        None,
        "CURVE keys (from `downpour keygen DIR`): server.key_secret, workers/*.key and "
        "readers/*.key; every socket then encrypts and admits only listed keys",
        _SEC,
        metavar="DIR",
        attr="keys_dir",
    ),
    dataclasses.replace(
        KEY,
        help="the server's secret key file, if not DIR/server.key_secret (e.g. a credential)",
        section=_SEC,
        attr="key_file",
    ),
    Option("state_dir", None, "directory for checkpoints; the newest is restored at start", _CKPT),
    Option(
        "checkpoint_every",
        500,
        "updates between checkpoints (0 = off)",
        _CKPT,
        type=at_least(0),
    ),
    Option(
        "checkpoint_secs",
        60.0,
        "seconds between checkpoints (0 = off)",
        _CKPT,
        type=non_negative(),
    ),
    Option(
        "restore_from",
        None,
        "when --state-dir holds no checkpoint of this shard's layout: restore from the "
        "checkpoints of another number of shards, DIR[,DIR...] each an old shard's state dir "
        "(or one parent of run-local's shard-I dirs); every shard reads the rows it holds "
        "(see docs: reliability.md)",
        _CKPT,
        metavar="DIR[,DIR...]",
    ),
    Option("keep_checkpoints", 3, "how many checkpoints to keep", _CKPT, type=at_least(1)),
    Option(
        "drain_timeout",
        10.0,
        "on SIGTERM, seconds to apply gradients already received",
        _CKPT,
        type=non_negative(),
        attr="drain_timeout_s",
    ),
    Option(
        "export_dir",
        None,
        "write serving exports here while training, as TF Serving's --model_base_path reads "
        "them: DIR/<version>/ a SavedModel, DIR/deltas/<from>-<to>/ the rows changed between "
        "two (one shard only: with shards the chief exports)",
        _EXPORT,
        metavar="DIR",
    ),
    Option(
        "export_every",
        0,
        "updates between serving exports into --export-dir (0 = off)",
        _EXPORT,
        type=at_least(0),
        metavar="N",
    ),
    Option(
        "export_keep",
        5,
        "how many versions --export-dir keeps (and the deltas from them)",
        _EXPORT,
        type=at_least(1),
        metavar="K",
    ),
    Option(
        "job_workers",
        0,
        "end the job once this many distinct workers have finished their epochs or steps: "
        "apply what is held, write a final checkpoint, mark the status `job: done`, exit 0 "
        "(0 = off: serve until stopped)",
        _JOB,
        type=at_least(0),
        metavar="N",
    ),
    Option(
        "linger_after_done",
        LINGER_AFTER_DONE_S,
        "with --job-workers: seconds to keep serving weights and status after the job ended, "
        "unless a reader (the chief) acknowledges it sooner",
        _JOB,
        type=non_negative(),
        attr="linger_after_done_s",
    ),
    Option(
        "job_timeout",
        JOB_TIMEOUT_S,
        "with --job-workers: once a worker has finished, fail the job (final checkpoint, "
        "`job: failed`, exit 3) when every other worker is gone and none was heard from for "
        "this many seconds (0 = never)",
        _JOB,
        type=non_negative(),
        attr="job_timeout_s",
    ),
    METRICS_PORT,
    Option(
        "metrics_host",
        "127.0.0.1",
        "address for --metrics-port (plain HTTP, no authentication; default loopback)",
        _OBS,
    ),
    Option("logdir", None, "write TensorBoard scalars here", _OBS, metavar="DIR"),
    Option(
        "summary_secs",
        5.0,
        "seconds between TensorBoard points",
        _OBS,
        type=positive(),
        attr="summary_interval_s",
    ),
    Option(
        "eval_every",
        0,
        "evaluate the held-out set every N updates, off the apply loop (0 = off)",
        _OBS,
        type=at_least(0),
        metavar="N",
    ),
    dataclasses.replace(
        DATA_DIR, help="the held-out set for --eval-every: the model's --data-dir", section=_OBS
    ),
    LOG_FORMAT,
    LOG_LEVEL,
)

SERVER_INTERNAL: tuple[Internal, ...] = (
    Internal(
        "keys",
        security.ServerKeys | None,
        None,
        "CURVE on every socket when set: loaded from keys_dir (and key_file) at start",
    ),
    Internal("io_threads", int, 2, "ZeroMQ I/O threads"),
    Internal("publish_interval_s", float, 0.2, "seconds between status snapshots"),
    Internal(
        "status_max_per_s", float, 200.0, "status answers per second (bursts of 20); 0 = no cap"
    ),
)

ServerConfig = config_class(
    "ServerConfig",
    __name__,
    "Everything the server needs besides the model: one attribute per ``downpour server`` "
    "option (SERVER_OPTIONS) and the SERVER_INTERNAL ones.",
    SERVER_OPTIONS,
    SERVER_INTERNAL,
)


@dataclasses.dataclass(frozen=True)
class ModelFacts:
    """What the checks across settings need to know of the model, known once the server's
    state is built: the names of the dynamic tables this shard holds."""

    dynamic_tables: tuple[str, ...] = ()


def validate_server(cfg: ServerConfig, model: ModelFacts | None = None) -> None:
    """Refuse settings that contradict each other (ConfigError listing every problem).

    Ranges of single settings are their options' types; this holds the checks across
    settings. With ``show_partition`` only the shard check applies: nothing is served.
    With ``model`` (the server's second call, its state built) the settings are also
    checked against the model: what dynamic tables cannot go with.
    """
    problems: list[str] = []
    if cfg.shard >= cfg.num_shards:
        problems.append(
            f"--shard must be in 0..{cfg.num_shards - 1} for --num-shards {cfg.num_shards}"
        )
    if cfg.show_partition:
        refuse(problems)
        return
    if cfg.data_dispatch == "server" and cfg.shard != 0:
        problems.append(
            "--data-dispatch server belongs on shard 0 only: workers ask shard 0 for splits"
        )
    if cfg.num_shards > 1 and cfg.eval_every:
        problems.append(
            "--eval-every needs the whole model; a shard (--num-shards > 1) holds part of it"
        )
    if bool(cfg.export_dir) != bool(cfg.export_every):
        problems.append("--export-dir and --export-every N go together: where, and how often")
    if cfg.export_every and cfg.num_shards > 1:
        problems.append(
            "--export-every needs the whole model; a shard (--num-shards > 1) holds part of it: "
            "the job's chief exports from every shard (downpour job)"
        )
    fb = cfg.fallback_rows
    if fb is not None and fb >= 1 and fb != int(fb):
        problems.append(f"--fallback-rows is a count or a fraction below 1, not {fb:g}")
    if cfg.admit_after is not None and cfg.admit_after > ADMIT_MAX:
        problems.append(
            f"--admit-after counts up to {ADMIT_MAX} sightings of an id, not {cfg.admit_after}"
        )
    if cfg.restore_from and not cfg.state_dir:
        problems.append("--restore-from needs --state-dir: where the resharded state goes")
    if cfg.key_file and not cfg.keys_dir:
        problems.append("--key needs --keys DIR (the allow-lists)")
    if cfg.keys_dir is None and not is_loopback(cfg.host) and not cfg.insecure:
        problems.append(
            f"refusing to bind {cfg.host} without authentication: anyone who reaches the port "
            "can change the model. Pass --keys DIR (see `downpour keygen`), or --insecure "
            "to do it anyway."
        )
    if not cfg.missing_after_s < cfg.gone_after_s:
        problems.append("--missing-after must be < --gone-after")
    if cfg.max_workers > wire.MAX_STATUS_WORKERS:
        problems.append(
            f"--max-workers must be at most {wire.MAX_STATUS_WORKERS}: every worker has an entry "
            "in the status document"
        )
    if cfg.forget_after_s and not cfg.gone_after_s < cfg.forget_after_s:
        problems.append("--forget-after must be 0 (never) or > --gone-after")
    policy = _policy(cfg.policy)
    if policy is not None and policy.caps.sets_beta_1 and cfg.optimizer not in BETA_1_OPTIMIZERS:
        problems.append(
            f"--policy {policy.spec} sets the optimizer's beta_1: it needs --optimizer adam, "
            f"not {cfg.optimizer}"
        )
    if model is not None and model.dynamic_tables:
        problems += _dynamic_problems(cfg, policy, ", ".join(sorted(model.dynamic_tables)))
    refuse(problems)


def _policy(text: str) -> Policy | None:
    """The policy ``text`` says, for its capabilities and canonical text; None for a text
    that is none (``--policy``'s type refuses those; the server's ``parse_policy`` raises
    for one in a config built in code)."""
    try:
        return parse_policy(text)
    except ValueError:
        return None


def _dynamic_problems(cfg: ServerConfig, policy: Policy | None, names: str) -> list[str]:
    """What the dynamic tables ``names`` cannot go with. A policy that is ``dense_only``
    (sums gradients or reads whole weights) cannot update rows that exist only where
    touched, and one that sets ``beta_1`` is not followed by the tables' row-wise
    optimizer. A hybrid passes whatever its dense half: the tables' rows follow its rows
    half, which is ``row_safe``."""
    problems = []
    if policy is not None and policy.caps.dense_only:
        problems.append(
            f"--policy {policy.spec} cannot apply the dynamic tables {names}: it sums "
            "gradients densely or reads whole weights; use async, ssp:K, bounded:K, "
            "staleness-aware, or a hybrid whose dense half may be sync "
            "(dense=sync:K/N,rows=async)"
        )
    elif policy is not None and policy.caps.sets_beta_1:
        problems.append(
            f"--policy {policy.spec} changes Adam's beta_1, which the dynamic tables {names} "
            "do not follow; use async, ssp:K, bounded:K or staleness-aware"
        )
    if cfg.eval_every:
        problems.append(
            f"--eval-every evaluates the model in the server, whose dynamic tables ({names}) "
            "it does not hold as variables; workers report their held-out score, and "
            "`downpour export` writes the model to evaluate"
        )
    return problems
