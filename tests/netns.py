"""Test hosts in Linux network namespaces: several "machines" on one box, joined by a bridge.

Each host is a namespace with one veth link to a hub namespace that holds a bridge, so the
hosts reach each other by address and nothing touches the machine's own interfaces. All
addresses live inside these namespaces only. Needs root and iproute2; ``available()`` says why
not when they are missing, so tests can skip with the reason.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from dataclasses import dataclass, field

SUBNET = "10.231.{net}.{host}"


def _ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = ["ip", *(["netns", "exec", ns, "ip"] if ns else []), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=check)


def available() -> str | None:
    """None if namespaces can be made here, else the reason they cannot."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2 (ip) is not installed"
    probe = f"dp-probe-{uuid.uuid4().hex[:6]}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        return f"cannot create a network namespace: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30)
    return None


@dataclass
class Host:
    """One namespace: its name, its address, and the name of its link."""

    ns: str
    addr: str
    dev: str

    def exec_args(self) -> list[str]:
        """Prefix that runs a command inside this host."""
        return ["ip", "netns", "exec", self.ns]

    def link(self, up: bool) -> None:
        """Take this host's only link down (a partition) or bring it back."""
        _ip("link", "set", self.dev, "up" if up else "down", ns=self.ns)

    def rate_limit(self, rate: str = "20mbit") -> None:
        """Token-bucket rate limit on this host's outgoing traffic (tbf; netem is absent here)."""
        subprocess.run(
            ["ip", "netns", "exec", self.ns, "tc", "qdisc", "replace", "dev", self.dev, "root",
             "tbf", "rate", rate, "burst", "64kb", "latency", "500ms"],
            capture_output=True, text=True, timeout=30, check=True,
        )  # fmt: skip


@dataclass
class Network:
    """A hub namespace with a bridge, and hosts attached to it. Use as a context manager."""

    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:6])
    net: int = 77
    hosts: dict[str, Host] = field(default_factory=dict)

    @property
    def hub(self) -> str:
        return f"dp-{self.tag}-hub"

    def __enter__(self) -> Network:
        subprocess.run(["ip", "netns", "add", self.hub], check=True, timeout=30)
        _ip("link", "add", "br0", "type", "bridge", ns=self.hub)
        _ip("link", "set", "br0", "up", ns=self.hub)
        return self

    def add(self, name: str) -> Host:
        """A new host on the bridge, with the next free address."""
        n = len(self.hosts) + 1
        ns = f"dp-{self.tag}-{name}"
        outer, inner = f"v{self.tag}{n}h", f"v{self.tag}{n}"
        subprocess.run(["ip", "netns", "add", ns], check=True, timeout=30)
        _ip("link", "add", inner, "type", "veth", "peer", "name", outer, ns=self.hub)
        _ip("link", "set", inner, "netns", ns, ns=self.hub)
        _ip("link", "set", outer, "master", "br0", ns=self.hub)
        _ip("link", "set", outer, "up", ns=self.hub)
        addr = SUBNET.format(net=self.net, host=n)
        _ip("addr", "add", f"{addr}/24", "dev", inner, ns=ns)
        _ip("link", "set", inner, "up", ns=ns)
        _ip("link", "set", "lo", "up", ns=ns)
        host = self.hosts[name] = Host(ns, addr, inner)
        return host

    def __exit__(self, *exc: object) -> None:
        for host in self.hosts.values():
            subprocess.run(["ip", "netns", "del", host.ns], capture_output=True, timeout=30)
        subprocess.run(["ip", "netns", "del", self.hub], capture_output=True, timeout=30)
