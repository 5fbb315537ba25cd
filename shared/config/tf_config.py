"""Roles from ``TF_CONFIG``, the cluster description Kubeflow TFJob, JobSet and Volcano set.

``TF_CONFIG`` is JSON::

    {"cluster": {"chief": ["c0:2222"], "ps": ["ps0:2222", "ps1:2222"],
                 "worker": ["w0:2222", "w1:2222", "w2:2222"]},
     "task": {"type": "ps", "index": 1}}

The mapping to downpour (``role_settings``):

- ``ps`` task i -> ``downpour server``: ``shard`` i of ``num_shards`` = len(ps). ps[i]'s
  ``HOST:P`` gives the ports by convention: P the REP port (hello, weights), P+1 the push
  port, P+2 the status port, so a ps entry needs P <= 65533 and the three ports open. The
  bind host is HOST when it is an IP literal (an IPv6 one kept in brackets), 127.0.0.1 for
  ``localhost``, and 0.0.0.0 for any other name: a platform's name for a pod (a headless
  Service's DNS name) resolves to the pod but is not an address ZeroMQ can bind. When the
  cluster lists workers, ``job_workers`` = len(worker): the server ends its job once every
  worker has finished (``downpour.server.job``), whether it was started as ``downpour job``
  or as ``downpour server`` under the ps task's ``TF_CONFIG``.
- ``worker`` task i -> ``downpour worker``: ``worker_index`` i of ``num_workers`` =
  len(worker) (static sharding of the data), ``server`` = the ps list in order.
- ``chief`` (``master`` is TensorFlow's older name for it) -> the job's coordinator,
  ``evaluator`` -> the side-car (``downpour.cli.job.chief``, ``downpour.cli.job.evaluator``);
  both get the ps list as ``server`` and len(worker) as ``num_workers``. An evaluator need
  not be in the cluster (TensorFlow leaves it out); when it is, its index must be in range.

Every malformed or inconsistent ``TF_CONFIG`` raises ``ConfigError`` naming the field
(``TF_CONFIG: task.index 3 is out of range for 2 "worker" tasks``). Keys TensorFlow reads
that downpour has no use for (``environment``, ``rpc_layer``, ``task.trial``) are accepted and
ignored. This module imports neither TensorFlow nor Keras: a bad ``TF_CONFIG`` is refused at
once.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from downpour.config.settings import ConfigError

TF_CONFIG_ENV = "TF_CONFIG"
TASK_TYPES = ("chief", "master", "ps", "worker", "evaluator")
# task type -> what runs it: a service's name (`downpour server|worker`) or a job role
SERVICE_OF = {
    "ps": "server",
    "worker": "worker",
    "chief": "chief",
    "master": "chief",
    "evaluator": "evaluator",
}
PUSH_PORT_OFFSET = 1  # ps HOST:P -> push port P+1
STATUS_PORT_OFFSET = 2  # ps HOST:P -> status port P+2
_WILDCARD = "0.0.0.0"
_KNOWN = ", ".join(TASK_TYPES)

__all__ = [
    "TASK_TYPES",
    "TF_CONFIG_ENV",
    "TFConfig",
    "from_environ",
    "parse_tf_config",
    "role_settings",
    "ps_endpoints",
    "split_address",
    "status_endpoints",
]


@dataclass(frozen=True)
class TFConfig:
    """A checked ``TF_CONFIG``: the cluster (task type -> ``HOST:PORT`` list) and this task."""

    cluster: dict[str, list[str]]
    task_type: str
    task_index: int

    @property
    def service(self) -> str:
        """What runs this task: ``server``, ``worker``, ``chief`` or ``evaluator``."""
        return SERVICE_OF[self.task_type]

    def describe(self) -> str:
        """This task as ``config show`` names the source of its settings, e.g. ``ps 1``."""
        return f"{self.task_type} {self.task_index}"


def _error(message: str) -> ConfigError:
    return ConfigError(f"{TF_CONFIG_ENV}: {message}")


def split_address(address: str, field: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[V6]:PORT`` -> (host, port) with the port in 1..65535.

    The host keeps an IPv6 literal's brackets. Raises ConfigError naming ``field``.
    """
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port:
        raise _error(f"{field} {address!r} is not HOST:PORT (a port is needed)")
    if host.startswith("["):
        if not host.endswith("]"):
            raise _error(f"{field} {address!r}: an IPv6 address goes in brackets, [ADDR]:PORT")
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            raise _error(f"{field} {address!r}: {host} is not an IPv6 address") from None
    elif ":" in host:
        raise _error(f"{field} {address!r}: an IPv6 address goes in brackets, [ADDR]:PORT")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise _error(f"{field} {address!r}: the port must be an integer in 1..65535")
    return host, int(port)


def _cluster(raw: Any) -> dict[str, list[str]]:
    """The checked ``cluster`` map."""
    if raw is None:
        raise _error('"cluster" is missing: a map of task type -> list of "HOST:PORT"')
    if not isinstance(raw, dict):
        raise _error('"cluster" must be a map of task type -> list of "HOST:PORT"')
    cluster: dict[str, list[str]] = {}
    for task_type, addresses in raw.items():
        if task_type not in TASK_TYPES:
            raise _error(f"cluster.{task_type} is not a task type: known are {_KNOWN}")
        if not isinstance(addresses, list):
            raise _error(f'cluster.{task_type} must be a list of "HOST:PORT" strings')
        for i, address in enumerate(addresses):
            field = f"cluster.{task_type}[{i}]"
            if not isinstance(address, str):
                raise _error(f'{field} must be a "HOST:PORT" string, not {address!r}')
            split_address(address, field)
        cluster[task_type] = list(addresses)
    if not cluster.get("ps"):
        raise _error('cluster.ps is missing or empty: downpour needs parameter servers ("ps")')
    if "chief" in cluster and "master" in cluster:
        raise _error('cluster has both "chief" and "master": they name the same task')
    for chief in ("chief", "master"):
        if len(cluster.get(chief, ())) > 1:
            raise _error(f"cluster.{chief} lists {len(cluster[chief])} tasks: there is one")
    return cluster


def _task(raw: Any, cluster: Mapping[str, list[str]]) -> tuple[str, int]:
    """The checked ``task``: (type, index)."""
    if raw is None:
        raise _error('"task" is missing: {"type": ..., "index": ...}')
    if not isinstance(raw, dict):
        raise _error('"task" must be a map {"type": ..., "index": ...}')
    task_type, index = raw.get("type"), raw.get("index")
    if task_type is None:
        raise _error("task.type is missing")
    if task_type not in TASK_TYPES:
        raise _error(f"task.type {task_type!r} is not a task type: known are {_KNOWN}")
    if index is None:
        raise _error("task.index is missing")
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise _error(f"task.index {index!r} is not an integer >= 0")
    if task_type == "evaluator" and task_type not in cluster:
        return task_type, index  # TensorFlow keeps the evaluator out of the cluster
    count = len(cluster.get(task_type, ()))
    if index >= count:
        raise _error(f'task.index {index} is out of range for {count} "{task_type}" tasks')
    return task_type, index


def parse_tf_config(text: str) -> TFConfig:
    """The checked ``TF_CONFIG`` of JSON ``text``; ConfigError naming the field if malformed."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise _error(f"not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise _error('must be a JSON object {"cluster": ..., "task": ...}')
    cluster = _cluster(data.get("cluster"))
    task_type, index = _task(data.get("task"), cluster)
    return TFConfig(cluster, task_type, index)


def from_environ(environ: Mapping[str, str]) -> TFConfig | None:
    """The ``TF_CONFIG`` of ``environ``, or None when it is unset or empty (blank)."""
    text = environ.get(TF_CONFIG_ENV)
    if text is None or not text.strip():
        return None
    return parse_tf_config(text)


def _bind_host(host: str) -> str:
    """The address a ps task binds for its cluster entry's ``host`` (module docstring)."""
    if host.startswith("["):
        return host
    if host == "localhost":
        return "127.0.0.1"
    try:
        ipaddress.IPv4Address(host)
    except ValueError:
        return _WILDCARD
    return host


def status_endpoints(tf: TFConfig) -> list[str]:
    """Every ps task's status endpoint, ``HOST:P+2``, in shard order."""
    out = []
    for i, address in enumerate(tf.cluster["ps"]):
        host, port = split_address(address, f"cluster.ps[{i}]")
        out.append(f"{host}:{port + STATUS_PORT_OFFSET}")
    return out


def ps_endpoints(tf: TFConfig) -> tuple[list[str], list[str]]:
    """(every ps task's REP endpoint ``tcp://HOST:P``, its status endpoint
    ``tcp://HOST:P+2``), in shard order: where a job's clients find the servers."""
    reps, statuses = [], []
    for i, address in enumerate(tf.cluster.get("ps", ())):
        host, port = split_address(address, f"cluster.ps[{i}]")
        reps.append(f"tcp://{host}:{port}")
        statuses.append(f"tcp://{host}:{port + STATUS_PORT_OFFSET}")
    return reps, statuses


def _server_settings(tf: TFConfig) -> dict[str, Any]:
    field = f"cluster.ps[{tf.task_index}]"
    host, port = split_address(tf.cluster["ps"][tf.task_index], field)
    if port + STATUS_PORT_OFFSET > 65535:
        raise _error(
            f"{field} port {port}: a ps task serves on ports P, P+1 and P+2, so P must be "
            "at most 65533"
        )
    implied = {
        "shard": tf.task_index,
        "num_shards": len(tf.cluster["ps"]),
        "host": _bind_host(host),
        "port": port,
        "push_port": port + PUSH_PORT_OFFSET,
        "status_port": port + STATUS_PORT_OFFSET,
    }
    if workers := len(tf.cluster.get("worker", ())):
        implied["job_workers"] = workers  # the job ends when every listed worker finished
    return implied


def role_settings(tf: TFConfig, service: str, data_dispatch: str = "none") -> dict[str, Any]:
    """The settings (name -> value) this task implies for ``service``.

    A worker that takes its splits from the server (``data_dispatch`` ``server``) gets no
    ``worker_index``/``num_workers``: the splits replace the static shard. Raises ConfigError
    when ``service`` is not what runs this task (``downpour server`` under a worker's
    ``TF_CONFIG``).
    """
    if service != tf.service:
        runs = "`downpour job`"
        if tf.service in ("server", "worker"):
            runs = f"`downpour {tf.service}` or {runs}"
        raise _error(
            f'task.type "{tf.task_type}" is the {tf.service}\'s task: run it with {runs}, '
            f"not `downpour {service}`"
        )
    if service == "server":
        return _server_settings(tf)
    implied: dict[str, Any] = {"server": ",".join(tf.cluster["ps"])}
    if service == "worker" and data_dispatch == "server":
        return implied
    if service == "worker":
        implied["worker_index"] = tf.task_index
    implied["num_workers"] = len(tf.cluster.get("worker", ()))
    return implied
