"""``downpour server``: start the server from its settings (``downpour.server.settings``).

Settings are checked (``validate_server``) and keys loaded before TensorFlow is imported, so a
bad setting or key is refused at once.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from downpour.config.settings import ConfigError, passes
from downpour.memory.malloc import limit_arenas
from downpour.net.transport import is_loopback
from downpour.runtime.logs import setup_logging
from downpour.server.settings import (
    SERVER_OPTIONS,
    ServerConfig,
    validate_server,
)

log = logging.getLogger("downpour.server")
OPTIONS = SERVER_OPTIONS  # what `downpour server` and `downpour config show server` take


def show_partition(model_ref: str, num_shards: int) -> int:
    """Print the partition of the model over ``num_shards`` shards (``--show-partition``)."""
    from downpour.model.build import define_model, fingerprint
    from downpour.model.partition import make_partition
    from downpour.spec import load_spec

    variables = define_model(load_spec(model_ref)).trainable_variables
    try:
        part = make_partition(
            [v.path for v in variables],
            [tuple(int(d) for d in v.shape) for v in variables],
            [str(v.dtype) for v in variables],
            num_shards,
            fingerprint(variables),
        )
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    print(part.describe(), flush=True)
    return 0


def start(values: Mapping[str, Any]) -> int:
    """Build the config from the settings' ``values`` (name -> value), check it, run."""
    return run(ServerConfig.from_values(values))


def run(cfg: ServerConfig) -> int:
    """Check the settings, load keys, build the server, serve until SIGTERM/SIGINT or the
    job's end (``--job-workers``); the exit code."""
    setup_logging("server", cfg.log_level, cfg.log_format)
    if not passes(validate_server, cfg, log):
        return 2
    if cfg.show_partition:
        return show_partition(cfg.model_ref, cfg.num_shards)
    limit_arenas()  # before TensorFlow's threads allocate: docs/reliability.md
    from downpour.net.security import SecurityError, load_server_keys

    if cfg.keys_dir:  # before TensorFlow is imported: bad keys fail at once
        try:
            cfg = replace(cfg, keys=load_server_keys(cfg.keys_dir, cfg.key_file))
        except SecurityError as exc:
            log.error("refusing to start: %s", exc)
            return 2
    if cfg.keys is None and not is_loopback(cfg.host):
        log.warning("serving %s WITHOUT authentication (--insecure)", cfg.host)
    elif cfg.keys is None:
        log.warning(
            "no --keys: serving %s without authentication or encryption; any local process "
            "can push gradients",
            cfg.host,
        )
    if cfg.metrics_port is not None and not is_loopback(cfg.metrics_host):
        log.warning(
            "serving Prometheus metrics on %s without authentication: anyone who reaches "
            "the port can read worker names, losses and rates",
            cfg.metrics_host,
        )
    from downpour.server.service import Server
    from downpour.spec import load_spec

    try:
        server = Server(load_spec(cfg.model_ref), cfg)
    except SecurityError as exc:  # e.g. the ZAP authenticator did not start
        log.error("refusing to start: %s", exc)
        return 2
    except ConfigError as exc:  # settings the model contradicts (validate_server's model checks)
        for problem in exc.problems:
            log.error("cannot start: %s", problem)
        return 2
    except (OSError, ValueError) as exc:  # e.g. --metrics-port in use, too many shards
        log.error("cannot start: %s", exc)
        return 2
    server.install_signal_handlers()
    return server.run()  # 3: a job that failed (--job-workers; docs: reliability.md)
