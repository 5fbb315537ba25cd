"""Docker and Kubernetes deployment files, checked offline: no engine, no cluster.

- Dockerfile: hadolint reports nothing at warning level or above.
- compose.yaml and its podman override compose.podman.yaml: valid against the Compose
  specification schema (check-jsonschema's vendored copy); compose.yaml also for static
  sharding: workers worker-0 .. worker-(N-1), each with its own index and the same count N.
  tests/test_containers.py builds and runs them for real (slow tier, podman).
- deploy/k8s/*.yaml: every object valid for KUBERNETES_VERSIONS (kubernetes-validate, strict:
  unknown fields are errors), plus the shape the README promises.

The linters come from PyPI with the test extra (``pip install -e '.[test]'``); a test whose
tool is missing is skipped and says so.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import ROOT

DOCKER = ROOT / "deploy" / "docker"
K8S = ROOT / "deploy" / "k8s"
# The oldest Kubernetes release we state support for, and the newest the validator knows.
KUBERNETES_VERSIONS = ["1.29.0", "1.37.0"]


def tool(name: str) -> str:
    """A linter from this virtualenv or PATH, or skip the test saying how to install it."""
    here = Path(sys.prefix) / "bin" / name
    found = str(here) if os.access(here, os.X_OK) else shutil.which(name)
    if found is None:
        pytest.skip(f"{name} not installed: pip install -e '.[test]' (make test does)")
    return found


def run(*args: str) -> subprocess.CompletedProcess:
    """Run a checker; bounded."""
    return subprocess.run(args, capture_output=True, text=True, timeout=120, cwd=ROOT)


def documents(path: Path) -> list[dict[str, Any]]:
    """The YAML documents of a file."""
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


# ---------------------------------------------------------------- Docker


def test_dockerfile_has_no_hadolint_warnings() -> None:
    r = run(tool("hadolint"), "--failure-threshold", "warning", str(DOCKER / "Dockerfile"))
    assert r.returncode == 0 and r.stdout.strip() == "", r.stdout + r.stderr


def test_dockerfile_is_multi_stage_non_root_with_a_status_healthcheck() -> None:
    lines = [ln.strip() for ln in (DOCKER / "Dockerfile").read_text().splitlines()]
    froms = [ln for ln in lines if ln.startswith("FROM ")]
    # every stage starts from the BASE build argument, whose default is the slim image users pull
    assert "ARG BASE=python:3.11-slim-bookworm" in lines
    assert len(froms) >= 2 and froms[-1] == "FROM ${BASE}"
    assert all(ln.startswith(("FROM ${BASE}", "FROM deps ")) for ln in froms)
    assert any(ln.startswith("COPY --from=deps /opt/downpour") for ln in lines)
    user = next(ln for ln in reversed(lines) if ln.startswith("USER "))
    assert user.split()[1].split(":")[0] not in ("0", "root")
    i = next(i for i, ln in enumerate(lines) if ln.startswith("HEALTHCHECK"))
    assert '"downpour", "status"' in " ".join(lines[i : i + 3])


RESET = object()  # the Compose specification's `!reset` tag: the key is removed when merged


class ComposeLoader(yaml.SafeLoader):
    """YAML with the Compose specification's ``!reset`` tag (which check-jsonschema cannot read)."""


ComposeLoader.add_constructor("!reset", lambda loader, node: RESET)


def without_resets(value: Any) -> Any:
    """``value`` with every key or item tagged ``!reset`` left out."""
    if isinstance(value, dict):
        return {k: without_resets(v) for k, v in value.items() if v is not RESET}
    if isinstance(value, list):
        return [without_resets(v) for v in value if v is not RESET]
    return value


def compose_document(name: str) -> dict[str, Any]:
    return without_resets(yaml.load((DOCKER / name).read_text(), ComposeLoader))


@pytest.mark.parametrize("name", ["compose.yaml", "compose.podman.yaml"])
def test_compose_file_matches_the_compose_specification(name: str, tmp_path: Path) -> None:
    checker = tool("check-jsonschema")
    resolved = tmp_path / f"{name}.json"  # the file as merged over another: !reset keys gone
    resolved.write_text(json.dumps(compose_document(name)))
    r = run(checker, "--builtin-schema", "vendor.compose-spec", str(resolved))
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_compose_schema_check_does_catch_mistakes(tmp_path: Path) -> None:
    broken = tmp_path / "compose.yaml"
    text = (DOCKER / "compose.yaml").read_text()
    broken.write_text(text.replace("stop_grace_period:", "stop_grace_perod:"))
    r = run(tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(broken))
    assert r.returncode != 0 and "stop_grace_perod" in r.stdout


def test_compose_shards_the_data_and_keeps_keys_and_state_out_of_the_image() -> None:
    doc = documents(DOCKER / "compose.yaml")[0]
    server = doc["services"]["server"]
    workers = {k: v for k, v in doc["services"].items() if k.startswith("worker")}
    assert len(workers) >= 2
    # worker I of N reads shard I: the indices are 0 .. N-1 and every worker says N
    for name, worker in workers.items():
        env = worker["environment"]
        assert name == f"worker-{env['DOWNPOUR_WORKER_INDEX']}"
        assert env["DOWNPOUR_NUM_WORKERS"] == str(len(workers))
        assert env["DOWNPOUR_ID"] == f"pool/{name}"
        assert env["DOWNPOUR_KEY"].startswith("/run/secrets/")
        assert "ports" not in worker
    assert sorted(int(w["environment"]["DOWNPOUR_WORKER_INDEX"]) for w in workers.values()) == (
        list(range(len(workers)))
    )
    assert any(v.startswith("state:") for v in server["volumes"]) and "state" in doc["volumes"]
    secrets = {s["source"] for s in server["secrets"]}
    secrets |= {s["source"] for w in workers.values() for s in w["secrets"]}
    assert secrets == set(doc["secrets"])
    assert server["environment"]["DOWNPOUR_KEY"].startswith("/run/secrets/")
    assert server["healthcheck"]["test"][1:3] == ["downpour", "status"]


def test_the_podman_override_keeps_every_service_on_the_hosts_loopback() -> None:
    base = documents(DOCKER / "compose.yaml")[0]["services"]
    override = compose_document("compose.podman.yaml")["services"]
    assert set(override) == set(base)  # every service, and no new one
    server_port = base["server"]["healthcheck"]["test"][-1].rsplit(":", 1)[1]  # status port
    assert server_port == "5572"
    for name, service in override.items():
        assert service["network_mode"] == "host", name
        assert {"nofile", "nproc"} <= set(service["ulimits"]), name
        env = service["environment"]
        if name == "server":
            assert env["DOWNPOUR_HOST"] == "127.0.0.1"
            assert "ports" not in service  # !reset: nothing published with host networking
        else:
            assert env["DOWNPOUR_SERVER"] == "127.0.0.1:5570"


# ---------------------------------------------------------------- Kubernetes


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_kubernetes_manifests_validate(version: str) -> None:
    manifests = sorted(str(p) for p in K8S.glob("*.yaml"))
    assert len(manifests) >= 3
    r = run(tool("kubernetes-validate"), "--strict", "-k", version, *manifests)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "passed" in r.stdout + r.stderr


def test_the_kubernetes_check_does_catch_mistakes(tmp_path: Path) -> None:
    broken = tmp_path / "server.yaml"
    text = (K8S / "server.yaml").read_text()
    broken.write_text(text.replace("terminationGracePeriodSeconds:", "terminationGracePeriod:"))
    r = run(tool("kubernetes-validate"), "--strict", "-k", KUBERNETES_VERSIONS[0], str(broken))
    assert r.returncode != 0 and "terminationGracePeriod" in r.stdout + r.stderr


def test_kubernetes_objects_are_the_ones_the_readme_describes() -> None:
    objects = {
        (d["kind"], d["metadata"]["name"]): d for p in K8S.glob("*.yaml") for d in documents(p)
    }
    service = objects[("Service", "downpour-server")]
    assert service["spec"]["clusterIP"] == "None"  # headless: downpour-server-N.downpour-server
    sts = objects[("StatefulSet", "downpour-server")]["spec"]
    assert sts["serviceName"] == "downpour-server"
    assert sts["volumeClaimTemplates"][0]["metadata"]["name"] == "state"
    server = sts["template"]["spec"]["containers"][0]
    for probe in ("readinessProbe", "livenessProbe"):
        assert server[probe]["exec"]["command"][:2] == ["downpour", "status"]
    assert server["resources"]["requests"]
    worker_sts = objects[("StatefulSet", "downpour-worker")]["spec"]
    assert worker_sts["serviceName"] == "downpour-worker"
    assert objects[("Service", "downpour-worker")]["spec"]["clusterIP"] == "None"
    workers = worker_sts["template"]["spec"]
    worker = workers["containers"][0]
    assert worker["resources"]["requests"]
    # sharded: pod N serves shard N of replicas, and the workers list every shard in order
    server_env = {e["name"]: e for e in server["env"]}
    shards = int(server_env["DOWNPOUR_NUM_SHARDS"]["value"])
    assert sts["replicas"] == shards
    assert server_env["DOWNPOUR_SHARD"]["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.labels['apps.kubernetes.io/pod-index']"
    )
    env = {e["name"]: e.get("value") for e in worker["env"]}
    assert env["DOWNPOUR_SERVER"].split(",") == [
        f"downpour-server-{i}.downpour-server:5570" for i in range(shards)
    ]
    assert env["DOWNPOUR_ID"] == "pool/$(POD_NAME)"  # one id per pod, one shared key
    # static sharding: worker pod N reads shard N of replicas
    worker_env = {e["name"]: e for e in worker["env"]}
    assert int(worker_env["DOWNPOUR_NUM_WORKERS"]["value"]) == worker_sts["replicas"]
    assert worker_env["DOWNPOUR_WORKER_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.labels['apps.kubernetes.io/pod-index']"
    )
    kinds = {kind for kind, _ in objects}
    assert "Secret" in kinds
    for spec in (sts["template"]["spec"], workers):
        assert spec["securityContext"]["runAsNonRoot"] is True


# ---------------------------------------------------------------- data dispatch


def test_every_deploy_file_passes_the_data_dispatch_setting_through_its_environment() -> None:
    """``--data-dispatch`` reaches the server and the workers the way every other setting
    does (DOWNPOUR_DATA_DISPATCH, or ``data_dispatch`` in the systemd TOML files), with a
    value the setting accepts and the same value on both sides."""
    from downpour.cli import SERVICES
    from downpour.config import loading
    from downpour.config.settings import DISPATCH_MODES

    compose = documents(DOCKER / "compose.yaml")[0]["services"]
    k8s = {
        d["metadata"]["name"]: d["spec"]["template"]["spec"]["containers"][0]
        for p in K8S.glob("*.yaml")
        for d in documents(p)
        if d["kind"] == "StatefulSet"
    }
    envs = {
        "server": [
            compose["server"]["environment"],
            {e["name"]: e.get("value") for e in k8s["downpour-server"]["env"]},
        ],
        "worker": [
            *(v["environment"] for k, v in compose.items() if k.startswith("worker")),
            {e["name"]: e.get("value") for e in k8s["downpour-worker"]["env"]},
        ],
    }
    values = set()
    for service, service_envs in envs.items():
        options = SERVICES[service].OPTIONS
        for env in service_envs:
            value = env["DOWNPOUR_DATA_DISPATCH"]
            assert value in DISPATCH_MODES
            loaded = loading.load(service, options, [], {"DOWNPOUR_DATA_DISPATCH": value})
            assert loaded.values()["data_dispatch"] == value
            values.add(value)
        toml = ROOT / "deploy" / "systemd" / f"{service}.toml"
        loaded = loading.load(service, options, ["--config", str(toml)], {})
        assert loaded.items["data_dispatch"].source == f"file {toml}"
        values.add(loaded.values()["data_dispatch"])
    assert len(values) == 1  # the server and its workers agree
