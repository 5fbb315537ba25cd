"""``--device`` and GPU memory growth, on whatever this machine has (CI: no GPU).

- The flag parses (``auto``, ``cpu``, ``gpu``, ``gpu:N``) for the server, the worker and
  ``run-local``, from a flag or ``DOWNPOUR_DEVICE``; anything else is refused before
  TensorFlow is imported.
- ``--device cpu`` trains: an in-process server and worker built with it.
- Without a GPU, ``--device gpu`` makes the real ``downpour worker`` and ``downpour server``
  exit 2 with a message that says there is no GPU.
- The memory-growth code runs without error where there is no GPU (and, where there is one,
  leaves every GPU with memory growth on).

``make check-gpu`` trains ``run-local`` on a GPU where one exists.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest
from conftest import ROOT, env, wait_until
from inproc import serving, train

from downpour.cli import build_parser
from downpour.cli.status import fetch_status
from downpour.config import loading
from downpour.config.settings import ConfigError
from downpour.runtime.device import DeviceError, configure_device, parse_device
from downpour.server.settings import SERVER_OPTIONS
from downpour.worker.settings import WORKER_OPTIONS


def has_gpu() -> bool:
    import tensorflow as tf

    return bool(tf.config.list_physical_devices("GPU"))


@pytest.mark.parametrize(
    ("text", "canonical"),
    [("auto", "auto"), ("cpu", "cpu"), ("CPU", "cpu"), ("gpu", "gpu"), ("gpu:1", "gpu:1")],
)
def test_device_forms_parse(text: str, canonical: str) -> None:
    assert parse_device(text) == canonical


@pytest.mark.parametrize("text", ["tpu", "gpu:", "gpu:-1", "gpu:x", "cuda:0", ""])
def test_other_devices_are_refused_naming_the_forms(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="auto, cpu, gpu or gpu:N"):
        parse_device(text)


@pytest.mark.parametrize("command", ["server", "worker"])
def test_server_and_worker_take_device_as_flag_and_environment(command: str) -> None:
    options = SERVER_OPTIONS if command == "server" else WORKER_OPTIONS
    assert loading.load(command, options, [], {}).values()["device"] == "auto"
    assert loading.load(command, options, ["--device", "GPU:1"], {}).values()["device"] == "gpu:1"
    env_values = loading.load(command, options, [], {"DOWNPOUR_DEVICE": "cpu"}).values()
    assert env_values["device"] == "cpu"
    with pytest.raises(ConfigError, match="is not a device"):
        loading.load(command, options, [], {"DOWNPOUR_DEVICE": "tpu"})


def test_run_local_takes_device_for_all_its_processes() -> None:
    args = build_parser().parse_args(["run-local", "--device", "cpu"])
    assert args.device == "cpu"


def test_a_bad_device_is_refused_before_tensorflow_is_imported() -> None:
    probe = (
        "import sys\nfrom downpour.cli import main\n"
        "try:\n    main(['worker', '--device', 'tpu'])\nexcept SystemExit as e:\n"
        "    print(e.code, 'tensorflow' in sys.modules)\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, env=env()
    )
    assert r.stdout.split() == ["2", "False"], r.stdout + r.stderr
    assert "is not a device" in r.stderr


def test_memory_growth_and_cpu_placement_run_without_a_gpu() -> None:
    import tensorflow as tf

    where = configure_device("auto")
    assert where.startswith("GPU") == has_gpu()
    for gpu in tf.config.list_physical_devices("GPU"):
        assert tf.config.experimental.get_memory_growth(gpu)
    if not has_gpu():
        assert configure_device("cpu") == "CPU"
        assert "CPU" in tf.constant(1.0).device


def test_device_cpu_trains() -> None:
    with serving(device="cpu") as server:
        summary = train(server.port, steps=5, device="cpu")
        assert summary["steps"] == 5 and summary["pushes"] == 5
        wait_until(lambda: fetch_status(server.status)["version"] == 5, 30, "5 updates")


def test_device_gpu_without_a_gpu_raises_device_error() -> None:
    if has_gpu():
        pytest.skip("this machine has a GPU: make check-gpu trains on it")
    for device in ("gpu", "gpu:0", "gpu:3"):
        with pytest.raises(DeviceError, match="no GPU"):
            configure_device(device)


@pytest.mark.slow  # two processes importing TensorFlow
@pytest.mark.parametrize("command", ["worker", "server"])
def test_device_gpu_without_a_gpu_exits_2_saying_so(command: str) -> None:
    if has_gpu():
        pytest.skip("this machine has a GPU: make check-gpu trains on it")
    argv = [
        sys.executable,
        "-m",
        "downpour",
        command,
        "--device",
        "gpu",
        "--model",
        "tiny_models:tiny",
    ]
    argv += (
        ["--server", "127.0.0.1:9"]
        if command == "worker"
        else ["--port", "0", "--push-port", "0", "--status-port", "0"]
    )
    r = subprocess.run(argv, capture_output=True, text=True, timeout=180, env=env(), cwd=ROOT)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "--device gpu" in r.stderr and "no GPU" in r.stderr, r.stderr[-2000:]
