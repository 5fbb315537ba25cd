"""The container image built and run for real with podman (``make test-containers``).

1. A local base image (``deploy/docker/podman-base.sh``: debootstrap bookworm + python3) is
   made once and kept in podman's storage as ``localhost/downpour-base:bookworm``.
2. ``deploy/docker/podman-build.py`` builds ``deploy/docker/Dockerfile`` on it, with this
   machine's pip settings as build secrets; the image must not keep them.
3. podman-compose runs ``compose.yaml`` + ``compose.podman.yaml`` (host network, 127.0.0.1) with
   CURVE keys from ``downpour keygen``: a server and 2 workers train.
4. The server's HEALTHCHECK passes and ``downpour status`` from the host answers.
5. ``podman stop`` (SIGTERM) drains the server and writes its checkpoint; the restarted
   container restores it: its version does not go back to 0 and status names the checkpoint.

Where containers cannot run (no podman or podman-compose, podman not working, debootstrap
failing, the compose ports taken) the test skips and says why.

Cost on 2 busy cores: warm (base image and build layers in /var/lib/containers) 2-4 minutes;
cold (nothing in podman's storage, as in a fresh CI machine) 12-16 minutes: debootstrap about
3.5, the build 4-10 (pip downloads and installs TensorFlow; podman commits a 2.5 GB layer),
the run 2. The image size and the time from ``compose up`` to the first applied update are
printed (``-s``, as ``make test-containers`` runs it) as ``containers: {...}``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT

from downpour.net import security
from downpour.net.client import fetch_status

pytestmark = [pytest.mark.slow, pytest.mark.containers, pytest.mark.timeout(1800)]

DOCKER = ROOT / "deploy" / "docker"
BASE = "localhost/downpour-base:bookworm"
IMAGE = "localhost/downpour:local"
PODMAN = ["podman", "--runtime", "runc", "--cgroup-manager", "cgroupfs"]
# what `podman run` may set here (the default ulimits are refused)
ULIMITS = ["--ulimit", "nofile=20000:20000", "--ulimit", "nproc=1024:1024"]
PROJECT = f"downpour-test-{os.getpid()}"
PORTS = (5570, 5571, 5572)  # compose.yaml's; on the host's loopback with host networking
STATUS = "tcp://127.0.0.1:5572"
DOWNPOUR = Path(sys.executable).parent / "downpour"  # the repository's .venv
COMPOSE = Path(sys.executable).parent / "podman-compose"  # the test extra's
UID = 10001  # the image's user, who must be able to read the mounted secret keys
TEST_OVERRIDE = """\
services:
  worker-0:
    environment: {DOWNPOUR_EPOCHS: "2"}
  worker-1:
    environment: {DOWNPOUR_EPOCHS: "2"}
"""
FIGURES: dict[str, Any] = {}


def build_script() -> Any:
    """deploy/docker/podman-build.py as a module (its name has a dash)."""
    spec = importlib.util.spec_from_file_location("podman_build", DOCKER / "podman-build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(
    cmd: list[str], timeout: float, check: bool = True, **kw: Any
) -> subprocess.CompletedProcess:
    """Run a command (bounded); with ``check``, fail the test showing its output."""
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    if check and r.returncode != 0:
        pytest.fail(
            f"{' '.join(cmd[:6])}... exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        )
    return r


def wait_for(what: str, probe: Any, timeout: float, interval: float = 1.0) -> Any:
    """Poll ``probe()`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(interval)  # polling a condition, bounded by the deadline
    pytest.fail(f"{what}: not within {timeout:.0f} s")


def podman_usable() -> str | None:
    """Why containers cannot run here, or None."""
    if shutil.which("podman") is None:
        return "podman not installed (Debian: apt-get install podman runc debootstrap uidmap)"
    if not COMPOSE.exists():
        return f"no {COMPOSE} (podman-compose >= 1.6: pip install -e '.[test]')"
    r = subprocess.run([*PODMAN, "info"], capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        return f"podman does not work here: {r.stderr.strip()[-300:]}"
    for port in PORTS:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ZeroMQ binds
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                return f"port {port} on 127.0.0.1 is in use (compose.podman.yaml needs 5570-5572)"
    return None


@pytest.fixture(scope="module")
def image() -> str:
    """The downpour image, built now on the local base (made when missing)."""
    reason = podman_usable()
    if reason:
        pytest.skip(reason)
    t0 = time.monotonic()
    base = run(["sh", str(DOCKER / "podman-base.sh"), BASE], timeout=1200, check=False)
    if base.returncode != 0:
        pytest.skip(f"no base image: {(base.stdout + base.stderr).strip()[-500:]}")
    FIGURES["base_s"] = round(time.monotonic() - t0, 1)
    t0 = time.monotonic()
    run([sys.executable, str(DOCKER / "podman-build.py"), "--tag", IMAGE, "--base", BASE], 1800)
    FIGURES["build_s"] = round(time.monotonic() - t0, 1)
    size = run(["podman", "image", "inspect", "--format", "{{.Size}}", IMAGE], 60).stdout
    FIGURES["image_mb"] = round(int(size) / 1e6)
    return IMAGE


def test_the_image_keeps_no_build_time_pip_settings(image: str) -> None:
    history = run(["podman", "history", "--no-trunc", "--format", "{{.CreatedBy}}", image], 60)
    inspect = run(["podman", "image", "inspect", image], 60)
    for text in (history.stdout, inspect.stdout):
        assert "pipconf" not in text and "pipca" not in text and "PIP_" not in text
        assert "/opt/pypi" not in text and "index-url" not in text
    # the local pip indexes and files this machine's settings name, and where settings hide
    script = build_script()
    local = [str(p) for p in script.local_paths(script.pip_settings())]
    leftovers = " ".join(["/run/secrets", "/etc/pip.conf", "/etc/xdg/pip", *local])
    found = run(
        [
            *PODMAN,
            "run",
            "--rm",
            *ULIMITS,
            "--entrypoint",
            "sh",
            image,
            "-c",
            f"for p in {leftovers}; do [ -e $p ] && echo present: $p; done; env | grep ^PIP_; true",
        ],
        120,
    ).stdout
    assert found.strip() == "", found
    # the build stage's venv works in the final image: the CLI answers without TensorFlow
    show = run([*PODMAN, "run", "--rm", *ULIMITS, image, "config", "show", "worker"], 120).stdout
    assert "device" in show and "server" in show


class Stack:
    """compose.yaml + compose.podman.yaml + a short-run override in a temporary directory,
    with CURVE keys; every command bounded, everything removed by ``down``."""

    def __init__(self, tmp: Path) -> None:
        self.dir = tmp
        for name in ("compose.yaml", "compose.podman.yaml"):
            shutil.copy(DOCKER / name, tmp / name)
        (tmp / "compose.test.yaml").write_text(TEST_OVERRIDE)
        # the compose header's steps: keygen (server, worker key "pool", reader "status"),
        # then the secret keys chowned to the image's user; the host keeps its own copy of
        # the reader key for `downpour status`
        run([str(DOWNPOUR), "keygen", str(tmp / "keys"), "--names", "pool"], 120)
        keys = tmp / "keys"
        self.reader_key = tmp / "status.key_secret"
        shutil.copy2(keys / "clients" / "status.key_secret", self.reader_key)
        self.server_key = keys / "server.key"
        self.keys = security.load_client_keys(self.reader_key, self.server_key)
        for secret in [keys / "server.key_secret", *(keys / "clients").iterdir()]:
            os.chown(secret, UID, UID)
        os.chmod(tmp, 0o755)

    def compose(
        self, *args: str, timeout: float = 300, check: bool = True
    ) -> subprocess.CompletedProcess:
        files = ["-f", "compose.yaml", "-f", "compose.podman.yaml", "-f", "compose.test.yaml"]
        cmd = [str(COMPOSE), "--podman-args", " ".join(PODMAN[1:]), "-p", PROJECT, *files]
        return run([*cmd, *args], timeout, check=check, cwd=self.dir)

    def container(self, service: str) -> str:
        return f"{PROJECT}_{service}_1"

    def status(self) -> dict[str, Any] | None:
        """The server's status document, fetched from the host with the reader key."""
        try:
            return fetch_status(STATUS, timeout_s=3.0, keys=self.keys)
        except Exception:  # not up (yet); the caller's wait is bounded
            return None

    def server_running(self) -> bool:
        """True while the server container runs; fails the test with its log once it exited."""
        state = run(
            ["podman", "inspect", "--format", "{{.State.Status}}", self.container("server")], 60
        ).stdout.strip()
        if state in ("exited", "stopped"):
            pytest.fail(f"the server container {state}:\n{self.logs('server')[-3000:]}")
        return state == "running"

    def logs(self, service: str) -> str:
        r = run(["podman", "logs", self.container(service)], 60, check=False)
        return r.stdout + r.stderr

    def down(self) -> None:
        """Remove this project's containers, network and state volume (bounded)."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.compose("down", "-v", "-t", "10", timeout=180, check=False)
        label = f"label=io.podman.compose.project={PROJECT}"
        ids = subprocess.run(
            ["podman", "ps", "-aq", "--filter", label], capture_output=True, text=True, timeout=60
        ).stdout.split()
        if ids:
            subprocess.run(
                ["podman", "rm", "-f", "-t", "5", *ids], capture_output=True, timeout=120
            )
        subprocess.run(
            ["podman", "volume", "rm", "-f", f"{PROJECT}_state"], capture_output=True, timeout=60
        )


@pytest.fixture
def stack(image: str, tmp_path: Path) -> Iterator[Stack]:
    s = Stack(tmp_path)
    yield s
    s.down()


def test_compose_trains_heals_and_resumes_from_the_checkpoint_after_a_stop(stack: Stack) -> None:
    t0 = time.monotonic()
    up = stack.compose("up", "-d", "--no-build", timeout=300)
    for service in ("server", "worker-0", "worker-1"):
        exists = run(["podman", "container", "exists", stack.container(service)], 60, check=False)
        assert exists.returncode == 0, f"no container {service}:\n{up.stdout}\n{up.stderr}"
    first = wait_for(
        "a first applied update",
        lambda: stack.server_running() and (d := stack.status()) and d["version"] >= 1 and d,
        600,
    )
    FIGURES["first_update_s"] = round(time.monotonic() - t0, 1)
    assert set(first["workers"]) <= {"pool/worker-0", "pool/worker-1"}
    # the HEALTHCHECK (the compose file's: status with the reader key) passes; as with the
    # engine's retries, a probe that times out on a busy machine is tried again (bounded)
    probes: list[subprocess.CompletedProcess] = []

    def healthy() -> bool:
        probes.append(run(["podman", "healthcheck", "run", stack.container("server")], 120, False))
        return probes[-1].returncode == 0

    deadline = time.monotonic() + 300
    while not healthy() and time.monotonic() < deadline:
        time.sleep(2)  # between probes, bounded by the deadline
    assert probes[-1].returncode == 0, probes[-1].stderr + stack.logs("server")[-3000:]
    FIGURES["healthcheck_probes"] = len(probes)
    # `downpour status` from the host answers, over CURVE with the reader key
    cli = run(
        [
            str(DOWNPOUR),
            "status",
            "--json",
            "--timeout",
            "10",
            "--key",
            str(stack.reader_key),
            "--server-key",
            str(stack.server_key),
            "127.0.0.1:5572",
        ],
        120,
    )
    doc = json.loads(cli.stdout)
    assert doc["service"] == "server" and doc["version"] >= 1
    # both workers train
    wait_for(
        "both workers' gradients applied",
        lambda: (
            (d := stack.status())
            and all(d["workers"].get(f"pool/worker-{i}", {}).get("applied", 0) > 0 for i in (0, 1))
        ),
        300,
    )
    # SIGTERM: the server drains and writes a final checkpoint, then exits 0
    stack_stop = run(["podman", "stop", "-t", "60", stack.container("server")], 120)
    assert stack_stop.returncode == 0
    code = run(
        ["podman", "inspect", "--format", "{{.State.ExitCode}}", stack.container("server")], 60
    ).stdout.strip()
    log = stack.logs("server")
    assert code == "0", log[-3000:]
    stopped = [ln for ln in log.splitlines() if "stopped at version" in ln]
    assert stopped, log[-3000:]
    version = int(stopped[-1].split("stopped at version")[1].split()[0])
    assert version >= 1
    # restarted, it restores that checkpoint: the version does not go back to 0
    run([*PODMAN, "start", stack.container("server")], 120)
    resumed = wait_for("the restarted server's status", stack.status, 300)
    assert resumed["restored_from"] == version, resumed
    assert resumed["version"] >= version
    assert f"restored version {version}" in stack.logs("server")
    print(f"containers: {json.dumps(FIGURES)}", flush=True)
