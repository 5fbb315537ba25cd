"""``downpour worker``: start a worker from its settings (``downpour.worker.settings``).

Settings are checked (``validate_worker``) and keys loaded before TensorFlow is imported.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from downpour.config.settings import passes
from downpour.runtime.logs import setup_logging
from downpour.worker.settings import WORKER_OPTIONS, WorkerConfig, validate_worker

log = logging.getLogger("downpour.worker")
OPTIONS = WORKER_OPTIONS  # what `downpour worker` and `downpour config show worker` take


def start(values: Mapping[str, Any]) -> int:
    """Build the config from the settings' ``values`` (name -> value), check it, run."""
    return run(WorkerConfig.from_values(values))


def run(cfg: WorkerConfig) -> int:
    """Check the settings, load keys, build the worker, train, print a one-line JSON summary."""
    setup_logging("worker", cfg.log_level, cfg.log_format)
    if not passes(validate_worker, cfg, log):
        return 2
    from downpour.net.security import SecurityError, client_keys_from_args, may_speak_as

    try:  # before TensorFlow is imported: bad keys fail at once
        keys = client_keys_from_args(cfg.key_file, cfg.server_key_file)
    except SecurityError as exc:
        log.error("refusing to start: %s", exc)
        return 2
    cfg = replace(cfg, keys=keys)
    if keys is not None and not cfg.worker_id:
        cfg = replace(cfg, worker_id=keys.keypair.name)  # the server binds pushes to it
    elif keys is not None and not may_speak_as(keys.keypair.name, cfg.worker_id):
        log.warning(
            "--id %s is neither the key's name %s nor NAME/INSTANCE: the server refuses a "
            "worker id that is not the name its key is listed under",
            cfg.worker_id,
            keys.keypair.name,
        )
    from downpour.inputs.pipeline import InputError
    from downpour.spec import load_spec
    from downpour.worker.service import Worker, WorkerError

    spec = load_spec(cfg.model)
    try:  # the input is built and checked against the model here, before any hello
        worker = Worker(spec, cfg)
    except (WorkerError, ValueError) as exc:  # bad input; more shards than the model can take
        log.error("refusing to start: %s", exc)
        return 2
    worker.install_signal_handlers()
    try:
        summary = worker.run()
    except InputError as exc:  # a later epoch's input failed
        log.error("%s", exc)
        return 2
    except WorkerError as exc:
        log.error("%s", exc)
        return 3
    finally:
        worker.close()
    log.info(
        "worker %s done: %d steps in %.1f s (%.2f steps/s), %d pushes, last loss %.4f",
        summary["worker"],
        summary["steps"],
        summary["seconds"],
        summary["steps_per_s"],
        summary["pushes"],
        summary["loss"],
    )
    print(json.dumps({"summary": summary}), flush=True)
    return 0
