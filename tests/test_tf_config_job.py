"""Slow tier: a job launched the way Kubeflow's TFJob launches it, from TF_CONFIG alone.

A chief, an evaluator, two parameter servers and two workers, each a real ``downpour job``
process in its own network namespace with its own address, each given the TF_CONFIG a TFJob
would inject (the cluster's "host:port" lists and its task; the evaluator, as TensorFlow
does, outside the cluster), the same command (``--model M --state-dir ROOT``), the CURVE keys
its Secret would mount and its role's own flags. The job trains, every process exits 0 on its
own and none more than ``AFTER_CHIEF_S`` after the chief, the chief prints the held-out score
and exports the final model. A second run kills a worker
mid-job and restarts it with the same TF_CONFIG: the job still completes, every process
exits 0.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import netns
import pytest
from conftest import ROOT, env, wait_until

from downpour.checkpoints.store import CheckpointStore
from downpour.net import security

REASON = netns.available()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(REASON is not None, reason=f"no network namespaces: {REASON}"),
]

PORT = 2222  # TFJob's default port; a ps serves gradients on PORT+1 and status on PORT+2
MODEL = "tiny_models:tiny"
EXIT_S = 300.0
# The evaluator reads the servers' job state every second and the chief's job-end record:
# it ends with the job (without it, it retried for --wait-servers, 600 s, then failed).
AFTER_CHIEF_S = 10.0
ACCURACY_BAR = 0.8  # the tiny MLP on its blobs (chance 0.25)


class Job:
    """The job's processes: each role in its namespace, started with its TF_CONFIG."""

    def __init__(self, network: netns.Network, tmp: Path) -> None:
        self.tmp = tmp
        self.keys = tmp / "keys"
        security.generate_keys(self.keys, ["pool"], ["status"])
        names = ("chief", "ev", "ps0", "ps1", "w0", "w1")
        self.hosts = {name: network.add(name) for name in names}
        self.cluster = {
            "chief": [f"{self.hosts['chief'].addr}:{PORT}"],
            "ps": [f"{self.hosts[f'ps{i}'].addr}:{PORT}" for i in range(2)],
            "worker": [f"{self.hosts[f'w{i}'].addr}:{PORT}" for i in range(2)],
        }
        self.procs: dict[str, subprocess.Popen] = {}
        self.state = tmp / "state"

    def tf_config(self, task_type: str, index: int) -> str:
        """The TF_CONFIG a TFJob injects (an evaluator is not in the cluster it lists)."""
        return json.dumps({"cluster": self.cluster, "task": {"type": task_type, "index": index}})

    def start(self, name: str, task_type: str, index: int, *flags: str) -> subprocess.Popen:
        """``downpour job`` in host ``name`` as task (type, index); its log in tmp."""
        host = self.hosts[name]
        log = open(self.tmp / f"{name}-{len(self.procs)}.log", "wb")  # noqa: SIM115 - kept open
        proc = subprocess.Popen(
            [*host.exec_args(), sys.executable, "-m", "downpour", "job", "--model", MODEL,
             *flags],
            env={**env(), "TF_CONFIG": self.tf_config(task_type, index)},
            cwd=ROOT, stdout=subprocess.PIPE if task_type == "chief" else log, stderr=log,
        )  # fmt: skip
        self.procs[name] = proc
        return proc

    def start_all(self, epochs: int, evaluator: bool = False) -> None:
        server_key = str(self.keys / security.SERVER_PUBLIC)
        worker_key = str(self.keys / "clients" / "pool.key_secret")
        for i in range(2):
            self.start(f"ps{i}", "ps", i, "--state-dir", str(self.state), "--keys",
                       str(self.keys), "--checkpoint-secs", "0")  # fmt: skip
        for i in range(2):
            self.worker(i, epochs)
        self.start("chief", "chief", 0, "--state-dir", str(self.state), "--key", worker_key,
                   "--server-key", server_key)  # fmt: skip
        if evaluator:
            self.start("ev", "evaluator", 0, "--state-dir", str(self.state), "--key",
                       worker_key, "--server-key", server_key,
                       "--eval-every-secs", "5")  # fmt: skip

    def worker(self, i: int, epochs: int) -> subprocess.Popen:
        server_key = str(self.keys / security.SERVER_PUBLIC)
        worker_key = str(self.keys / "clients" / "pool.key_secret")
        return self.start(f"w{i}", "worker", i, "--id", f"pool/w{i}", "--epochs", str(epochs),
                          "--key", worker_key, "--server-key", server_key)  # fmt: skip

    def status(self, i: int) -> dict[str, Any]:
        """ps i's status, read from inside its host with the status reader's key."""
        host = self.hosts[f"ps{i}"]
        out = subprocess.run(
            [*host.exec_args(), sys.executable, "-m", "downpour", "status", "--json",
             "--timeout", "5", "--key", str(self.keys / "clients" / "status.key_secret"),
             "--server-key", str(self.keys / security.SERVER_PUBLIC),
             f"{host.addr}:{PORT + 2}"],
            capture_output=True, env=env(), cwd=ROOT, timeout=60,
        )  # fmt: skip
        return json.loads(out.stdout) if out.returncode == 0 else {}

    def wait_all(self) -> dict[str, int]:
        """Each process's exit code; ``exited`` gets the moment each one exited."""
        self.exited: dict[str, float] = {}

        def wait(name: str, proc: subprocess.Popen) -> None:
            proc.wait(timeout=EXIT_S)
            self.exited[name] = time.monotonic()

        threads = [threading.Thread(target=wait, args=item) for item in self.procs.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join(EXIT_S + 10)
        return {name: p.wait(timeout=1) for name, p in self.procs.items()}

    def logs(self) -> str:
        return "\n".join(f"--- {f.name}\n{f.read_text(errors='replace')[-3000:]}"
                         for f in sorted(self.tmp.glob("*.log")))  # fmt: skip

    def kill(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.fixture
def job(tmp_path: Path) -> Any:
    with netns.Network(net=79) as network:
        j = Job(network, tmp_path)
        try:
            yield j
        finally:
            j.kill()


def _check_completed(job: Job) -> float:
    """Every process exited 0; both final checkpoints and the chief's export are on disk;
    the chief's held-out score."""
    codes = job.wait_all()
    assert all(c == 0 for c in codes.values()), (codes, job.logs())
    out = job.procs["chief"].stdout.read().decode()  # type: ignore[union-attr]
    found = re.search(r"held-out accuracy: ([0-9.]+)", out)
    assert found, out + job.logs()
    final = [CheckpointStore(job.state / f"shard-{i}").latest() for i in range(2)]
    assert all(c is not None and c.version > 0 for c in final), job.logs()
    exports = [p for p in (job.state / "export").iterdir() if p.name.isdigit()]
    assert exports and (exports[0] / "saved_model.pb").exists(), out
    print(f"chief: {out.strip()}")
    return float(found.group(1))


def test_a_job_from_tf_config_alone_completes_with_every_process_exiting_0(job: Job) -> None:
    job.start_all(epochs=3, evaluator=True)
    assert _check_completed(job) >= ACCURACY_BAR
    late = {n: round(t - job.exited["chief"], 1) for n, t in job.exited.items()}
    assert all(s <= AFTER_CHIEF_S for s in late.values()), (late, job.logs())
    print(f"seconds after the chief: {late}")


def test_a_worker_killed_mid_job_and_restarted_with_its_tf_config_lets_the_job_complete(
    job: Job,
) -> None:
    job.start_all(epochs=20)
    wait_until(lambda: job.status(1).get("version", 0) >= 30, 180, "training under way")
    victim = job.procs["w1"]
    victim.send_signal(signal.SIGKILL)
    assert victim.wait(timeout=30) == -signal.SIGKILL
    job.worker(1, epochs=20)  # the platform restarts the pod: same TF_CONFIG, same id
    assert _check_completed(job) >= ACCURACY_BAR
