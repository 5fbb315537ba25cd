#!/usr/bin/env python3
"""Build deploy/docker/Dockerfile with podman, handing the build this machine's pip settings.

    deploy/docker/podman-build.py [--tag localhost/downpour:local]
        [--base localhost/downpour-base:bookworm] [--tf-package tensorflow]

pip inside the build needs what pip on this machine uses: its index URLs and options
(``pip config list`` and the PIP_* variables) and its CA bundle (PIP_CERT, else
SSL_CERT_FILE). They reach the build as the Dockerfile's build secrets ``pipconf`` (a pip.conf
written to a temporary directory) and ``pipca``. Secrets are not stored in any layer, so the
image holds none of it (``podman image inspect`` / ``podman history`` show no index or CA).
Settings that name local files (a ``file://`` index, find-links folders, constraint files) are
left out: a bind mount would leave its mount point in every stage's layers, and the indexes
they mirror are reachable over the network.

podman runs with ``PODMAN_OPTS`` (default ``--runtime runc --cgroup-manager cgroupfs``: crun
refuses hybrid cgroups) and builds on the host network. Standard library only.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PODMAN_OPTS = "--runtime runc --cgroup-manager cgroupfs"
ULIMITS = ["--ulimit", "nofile=20000:20000", "--ulimit", "nproc=1024:1024"]
SKIP = {"cert", "client-cert", "require-virtualenv", "user", "no-cache-dir", "cache-dir"}
PATH_KEYS = {"find-links", "extra-index-url", "index-url", "constraint", "requirement"}


def pip_settings() -> dict[str, str]:
    """This machine's effective pip settings (key -> value): config files, then PIP_* vars."""
    out = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    ).stdout
    found: dict[str, str] = {}
    env_found: dict[str, str] = {}
    for line in out.splitlines():
        name, _, value = line.partition("=")
        scope, _, key = name.rpartition(".")
        value = value.strip().strip("'\"")
        if key and value:
            (env_found if scope.startswith(":env:") else found)[key] = value
    found.update(env_found)  # pip: environment variables win over files
    return {k: v for k, v in found.items() if k not in SKIP}


def local_paths(settings: dict[str, str]) -> list[Path]:
    """Existing local files and directories the settings name (none may reach the image)."""
    paths = []
    for key in PATH_KEYS & settings.keys():
        for item in settings[key].split():
            path = Path(item.removeprefix("file://"))
            if path.is_absolute() and path.exists():
                paths.append(path.parent if key.endswith("index-url") else path)
    return sorted(set(paths))


def ca_bundle() -> Path | None:
    """The CA bundle pip trusts here, if one is configured."""
    for var in ("PIP_CERT", "SSL_CERT_FILE", "REQUESTS_CA_BUNDLE"):
        if os.environ.get(var) and Path(os.environ[var]).is_file():
            return Path(os.environ[var])
    return None


def without_local(settings: dict[str, str]) -> dict[str, str]:
    """``settings`` without the local files and folders they name (no use inside a build)."""
    kept = {}
    for key, value in settings.items():
        items = value.split() if key in PATH_KEYS else [value]
        remote = [i for i in items if not (i.startswith("file:") or i.startswith("/"))]
        if remote:
            kept[key] = " ".join(remote)
    return kept


def build_command(args: argparse.Namespace, tmp: Path) -> list[str]:
    """The podman build command line (writes the pip.conf secret into ``tmp``)."""
    settings = without_local(pip_settings())
    conf = tmp / "pip.conf"
    conf.write_text("[global]\n" + "".join(f"{k} = {v}\n" for k, v in settings.items()))
    cmd = ["podman", *shlex.split(os.environ.get("PODMAN_OPTS", PODMAN_OPTS)), "build"]
    # docker format: OCI images have no HEALTHCHECK
    cmd += ["--format", "docker", "--network", "host", *ULIMITS, "--layers", "--pull=never"]
    cmd += ["-f", str(ROOT / "deploy/docker/Dockerfile"), "-t", args.tag]
    cmd += ["--ignorefile", str(ROOT / "deploy/docker/Dockerfile.dockerignore")]
    cmd += ["--build-arg", f"BASE={args.base}", "--build-arg", f"TF_PACKAGE={args.tf_package}"]
    cmd += ["--secret", f"id=pipconf,src={conf}"]
    ca = ca_bundle()
    if ca is not None:
        cmd += ["--secret", f"id=pipca,src={ca}"]
    return [*cmd, str(ROOT)]


def main() -> int:
    """Build; exit with podman's status."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tag", default="localhost/downpour:local")
    p.add_argument("--base", default="localhost/downpour-base:bookworm")
    p.add_argument("--tf-package", default="tensorflow", help='or "tensorflow[and-cuda]"')
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="downpour-build-") as tmp:
        cmd = build_command(args, Path(tmp))
        print("+", shlex.join(cmd), flush=True)
        return subprocess.run(cmd, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
