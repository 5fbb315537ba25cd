"""Section 4, end to end: training steps/s of four set-ups on the same model, batch and data.

* local: one process, the model and Adam (1e-3) in one compiled ``tf.function`` per batch.
* downpour 1 worker / 2 workers: a real ``downpour server`` and ``downpour worker`` processes
  on 127.0.0.1; steps/s is the sum over workers of the steps they report with each push,
  read from the server's status socket over timed windows after a warm-up (so start-up and
  tracing are not in the figure); each worker's own summary line is kept too.
* TensorFlow's ParameterServerStrategy with a ClusterCoordinator: a PS task and a worker task
  (``tf.distribute.Server``) and the coordinator as the chief, three processes on loopback
  (see ``tf_pss.py``).
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from bench_util import (
    Plan,
    Procs,
    cpu_seconds,
    free_port,
    log,
    median,
    server_ready,
    service_args,
    start_server,
    status_endpoint,
)

from downpour.cli.status import fetch_status
from downpour.inputs.data import Dataset
from downpour.model.build import build_model
from downpour.net import security
from downpour.spec import ModelSpec

HERE = Path(__file__).resolve().parent
SETUPS = ("local", "downpour_1w", "downpour_2w", "tf_pss_1w", "downpour_1w_curve")
# the bf16 lever, measured by the full plan (Plan.e2e_bf16)
BF16_SETUPS = ("downpour_1w_bf16", "downpour_1w_curve_bf16")


def batches(data: Dataset, batch_size: int, seed: int) -> Any:
    """Endless shuffled full batches of the training set (as a worker draws them)."""
    rng = np.random.default_rng(seed)
    n = len(data.x_train)
    while True:
        order = rng.permutation(n)
        for i in range(0, n - batch_size + 1, batch_size):
            idx = np.sort(order[i : i + batch_size])
            yield data.x_train[idx], data.y_train[idx]


def local_training(spec: ModelSpec, data: Dataset, plan: Plan) -> dict[str, Any]:
    """Steps/s of single-process training: forward, backward and Adam in one tf.function."""
    model = build_model(spec, seed=0)
    variables = list(model.trainable_variables)
    optimizer = keras.optimizers.Adam(1e-3)
    optimizer.build(variables)
    traces = [0]
    signature = [
        tf.TensorSpec((None, *data.x_train.shape[1:]), tf.as_dtype(data.x_train.dtype)),
        tf.TensorSpec((None,), spec.label_dtype),
    ]

    @tf.function(input_signature=signature)
    def train_step(x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
        traces[0] += 1
        with tf.GradientTape() as tape:
            loss = spec.loss(y, model(x, training=True))
        optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables, strict=True))
        return loss

    it = batches(data, spec.batch_size, seed=0)
    loss = train_step(*next(it))
    for _ in range(plan.e2e_warmup_steps):
        loss = train_step(*next(it))
    float(loss)
    rates = []
    cpu0, wall0 = cpu_seconds(), time.perf_counter()
    for _ in range(plan.e2e_windows):
        t0 = time.perf_counter()
        for _ in range(plan.local_window_steps):
            loss = train_step(*next(it))
        float(loss)  # wait for the last step
        rates.append(plan.local_window_steps / (time.perf_counter() - t0))
    if traces[0] != 1:
        raise RuntimeError(f"local train step traced {traces[0]} times")
    cores = (cpu_seconds() - cpu0) / (time.perf_counter() - wall0)
    return {"steps_per_s": median(rates), "windows": rates, "loss": float(loss), "cpu_cores": cores}


def _worker_steps(doc: dict[str, Any], ids: list[str]) -> int:
    workers = doc.get("workers", {})
    return sum(int(workers.get(w, {}).get("steps") or 0) for w in ids)


def _summary(out: Path) -> dict[str, Any] | None:
    for line in out.read_text(errors="replace").splitlines():
        if line.startswith('{"summary"'):
            return json.loads(line)["summary"]
    return None


def downpour(
    plan: Plan,
    procs: Procs,
    n_workers: int,
    curve: bool = False,
    bf16: bool = False,
    server_cpus: list[int] | None = None,
    worker_cpus: list[int] | None = None,
    worker_settings: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Aggregate steps/s of ``n_workers`` downpour workers against one server.

    ``curve``: keys generated for the run, every socket encrypted and authenticated.
    ``bf16``: the workers run with ``--compress bf16 --pull-compress bf16`` (half the bytes of
    every push and every pull). ``server_cpus`` / ``worker_cpus``: the cores each process is
    pinned to (emulated hosts); None leaves them free. ``worker_settings``: more worker settings
    by name (``{"n_fetch": 4}``).
    """
    port = free_port()  # workers start with the server and retry until it answers
    ids = [f"bench-w{i}" for i in range(n_workers)]
    status_keys = None
    server_settings: dict[str, Any] = {}
    if curve:
        key_dir = procs.logdir / f"keys-{len(procs.procs):02d}"
        security.generate_keys(key_dir, ids, ["bench-status"])
        server_settings = {"keys": str(key_dir)}
        status_keys = security.load_client_keys(
            key_dir / security.CLIENTS_DIR / "bench-status.key_secret",
            key_dir / security.SERVER_PUBLIC,
        )
    tag = f"server-{n_workers}w" + ("-curve" if curve else "") + ("-bf16" if bf16 else "")
    server, pending = start_server(
        procs, tag, port=port, wait=False, settings=server_settings, cpus=server_cpus
    )
    workers = []
    for wid in ids:
        settings: dict[str, Any] = {"server": f"127.0.0.1:{port}", "id": wid}
        settings.update(steps=1000000, log_every=0, log_level="WARNING")
        if bf16:
            settings.update(compress="bf16", pull_compress="bf16")
        settings.update(worker_settings or {})
        if curve:
            settings["key"] = str(key_dir / security.CLIENTS_DIR / f"{wid}.key_secret")
            settings["server_key"] = str(key_dir / security.SERVER_PUBLIC)
        workers.append(procs.start(service_args("worker", **settings), wid, cpus=worker_cpus))
    try:
        info = server_ready(procs, server, Path(pending["ready_file"]))
        endpoint = status_endpoint(info)
        log(f"e2e: server ready, warming up {n_workers} worker(s)")
        deadline = time.monotonic() + 180.0
        while True:  # warm-up: every worker has pushed its first steps (tracing done)
            doc = fetch_status(endpoint, timeout_s=10.0, keys=status_keys)
            steps = [int(doc.get("workers", {}).get(w, {}).get("steps") or 0) for w in ids]
            if min(steps) >= plan.e2e_warmup_steps:
                break
            for proc, _ in workers:
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"worker exited with {proc.returncode}:\n{procs.log_tail(proc)}"
                    )
            if time.monotonic() > deadline:
                raise RuntimeError(f"workers not warmed up after 180 s (steps {steps})")
            time.sleep(0.2)
        log("e2e: measuring")
        rates, updates = [], []
        pids = [server.pid] + [proc.pid for proc, _ in workers]
        cpu0, wall0 = [cpu_seconds(p) for p in pids], time.monotonic()
        last = fetch_status(endpoint, timeout_s=10.0, keys=status_keys)
        for _ in range(plan.e2e_windows):
            time.sleep(plan.e2e_window_s)  # the measurement window itself
            doc = fetch_status(endpoint, timeout_s=10.0, keys=status_keys)
            dt = doc["uptime_s"] - last["uptime_s"]
            if dt > 0:
                rates.append((_worker_steps(doc, ids) - _worker_steps(last, ids)) / dt)
                updates.append((doc["version"] - last["version"]) / dt)
            last = doc
        wall = time.monotonic() - wall0
        cores = [(cpu_seconds(p) - c) / wall for p, c in zip(pids, cpu0, strict=True)]
        for proc, _ in workers:  # SIGTERM: finish the step, print the summary
            procs.stop(proc, timeout_s=60.0)
        summaries = [_summary(out) for _, out in workers]
    finally:
        for proc, _ in workers:
            procs.stop(proc)
        procs.stop(server)
    staleness = last.get("staleness", {})
    return {
        "steps_per_s": median(rates),
        "windows": rates,
        "updates_per_s": median(updates),
        "server_cpu_cores": cores[0],
        "worker_cpu_cores": cores[1:],
        "staleness_mean": staleness.get("mean"),
        "rejected_total": last.get("rejected_total"),
        "worker_summaries": summaries,
    }


def _wait_started(proc: subprocess.Popen[bytes], out: Path, procs: Procs, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while "started" not in out.read_text(errors="replace"):
        if proc.poll() is not None:
            raise RuntimeError(f"TF task exited with {proc.returncode}:\n{procs.log_tail(proc)}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"TF task not started after {timeout_s:.0f} s")
        time.sleep(0.1)


def tf_parameter_server(
    plan: Plan,
    procs: Procs,
    variants: str = "keras:1",
    cpus: dict[str, list[int]] | None = None,
) -> dict[str, Any]:
    """Steps/s of TensorFlow's ParameterServerStrategy: 1 PS, 1 worker, coordinator as chief.

    ``variants``: optimizer:steps-per-schedule pairs (see ``tf_pss.py``), the fastest is the
    figure. ``cpus``: the cores of each role ("ps", "worker", "chief"); None leaves them free.
    """
    cpus = cpus or {}
    cluster = {
        "chief": [f"127.0.0.1:{free_port()}"],
        "worker": [f"127.0.0.1:{free_port()}"],
        "ps": [f"127.0.0.1:{free_port()}"],
    }
    spec = json.dumps(cluster)
    script = str(HERE / "tf_pss.py")
    tasks = [
        procs.start([script, role, "--cluster", spec], f"tf-{role}", cpus=cpus.get(role))
        for role in ("ps", "worker")
    ]
    chief = None
    try:
        for proc, out in tasks:
            _wait_started(proc, out, procs, 120.0)
        log("e2e: TF tasks serving, starting the coordinator")
        args = [script, "chief", "--cluster", spec, "--warmup", str(plan.pss_warmup_steps)]
        args += ["--window-steps", str(plan.pss_window_steps), "--windows", str(plan.e2e_windows)]
        args += ["--variants", variants]
        chief, out = procs.start(args, "tf-chief", cpus=cpus.get("chief"))
        try:
            code = chief.wait(timeout=600)
        except subprocess.TimeoutExpired:
            raise RuntimeError("TF ParameterServerStrategy chief did not finish in 600 s") from None
        if code != 0:
            raise RuntimeError(f"TF chief exited with {code}:\n{procs.log_tail(chief)}")
        result = json.loads(out.read_text().strip().splitlines()[-1])
    finally:
        if chief is not None:
            procs.stop(chief)
        for proc, _ in tasks:
            procs.stop(proc)
    return result


def run(plan: Plan, procs: Procs, spec: ModelSpec, data: Dataset) -> dict[str, Any]:
    """All four set-ups, ``plan.e2e_rounds`` rounds in turn, and the issue's ratios.

    Each set-up's figure is the median over rounds of its per-round median window.
    """
    setups = SETUPS + (BF16_SETUPS if plan.e2e_bf16 else ())
    rounds: dict[str, list[dict[str, Any]]] = {k: [] for k in setups}
    for r in range(plan.e2e_rounds):
        tag = f"e2e round {r + 1}/{plan.e2e_rounds}"
        log(f"{tag}: local training")
        rounds["local"].append(local_training(spec, data, plan))
        log(f"{tag}: downpour, 1 worker")
        rounds["downpour_1w"].append(downpour(plan, procs, 1))
        log(f"{tag}: downpour, 2 workers")
        rounds["downpour_2w"].append(downpour(plan, procs, 2))
        log(f"{tag}: TF ParameterServerStrategy")
        rounds["tf_pss_1w"].append(tf_parameter_server(plan, procs))
        log(f"{tag}: downpour, 1 worker, CURVE on every socket")
        rounds["downpour_1w_curve"].append(downpour(plan, procs, 1, curve=True))
        if "downpour_1w_bf16" in rounds:
            log(f"{tag}: downpour, 1 worker, bf16 pushes and pulls")
            rounds["downpour_1w_bf16"].append(downpour(plan, procs, 1, bf16=True))
            log(f"{tag}: downpour, 1 worker, CURVE, bf16 pushes and pulls")
            rounds["downpour_1w_curve_bf16"].append(downpour(plan, procs, 1, curve=True, bf16=True))
    log("e2e: done")
    rate = {k: median([x["steps_per_s"] for x in v]) for k, v in rounds.items()}
    per_round = [{k: rounds[k][i]["steps_per_s"] for k in SETUPS} for i in range(plan.e2e_rounds)]
    bf16: dict[str, float] = {}
    if "downpour_1w_bf16" in rate:
        bf16 = {
            "downpour_1w_bf16_steps_per_s": rate["downpour_1w_bf16"],
            "ratio_1w_bf16_vs_local": rate["downpour_1w_bf16"] / rate["local"],
            "ratio_1w_bf16_vs_tf_pss": rate["downpour_1w_bf16"] / rate["tf_pss_1w"],
            # the lever for CURVE: half the bytes to encrypt, against plaintext
            # uncompressed
            "downpour_1w_curve_bf16_steps_per_s": rate["downpour_1w_curve_bf16"],
            "ratio_1w_curve_bf16_vs_plain": rate["downpour_1w_curve_bf16"] / rate["downpour_1w"],
            # what encryption alone costs when both sides move bf16
            "ratio_1w_curve_bf16_vs_bf16": rate["downpour_1w_curve_bf16"]
            / rate["downpour_1w_bf16"],
        }
    return {
        **bf16,
        "local_steps_per_s": rate["local"],
        "downpour_1w_steps_per_s": rate["downpour_1w"],
        "downpour_2w_steps_per_s": rate["downpour_2w"],
        "tf_pss_1w_steps_per_s": rate["tf_pss_1w"],
        "downpour_1w_curve_steps_per_s": rate["downpour_1w_curve"],
        "ratio_1w_curve_vs_plain": rate["downpour_1w_curve"] / rate["downpour_1w"],
        "ratio_1w_vs_local": rate["downpour_1w"] / rate["local"],
        "ratio_1w_vs_tf_pss": rate["downpour_1w"] / rate["tf_pss_1w"],
        "ratio_2w_vs_local": rate["downpour_2w"] / rate["local"],
        "tf_pss_vs_local": rate["tf_pss_1w"] / rate["local"],
        "ratio_1w_vs_local_per_round": [x["downpour_1w"] / x["local"] for x in per_round],
        "ratio_1w_vs_tf_pss_per_round": [x["downpour_1w"] / x["tf_pss_1w"] for x in per_round],
        # cores busy while training: 2.0 saturate this machine
        "local_cpu_cores": median([x["cpu_cores"] for x in rounds["local"]]),
        "downpour_1w_cpu_cores": median(
            [x["server_cpu_cores"] + sum(x["worker_cpu_cores"]) for x in rounds["downpour_1w"]]
        ),
        "downpour_2w_cpu_cores": median(
            [x["server_cpu_cores"] + sum(x["worker_cpu_cores"]) for x in rounds["downpour_2w"]]
        ),
        "rounds": plan.e2e_rounds,
        "detail": rounds,
    }
