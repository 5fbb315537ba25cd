"""Where a service computes (``--device``) and GPU memory growth.

``--device`` takes ``auto`` (TensorFlow's placement: the first GPU if there is one, else the
CPU), ``cpu`` (GPUs hidden from the process), ``gpu`` (the first GPU; an error without one) or
``gpu:N`` (GPU N only; the others are hidden, so inside the process it is ``/GPU:0``).

``configure_device`` enables memory growth on every GPU before TensorFlow's runtime starts, so a
process takes GPU memory as it needs it instead of all of it at once: ``downpour run-local``'s
server, workers and evaluator can then share one GPU. It is called first thing by the server's
and the worker's constructors. Parsing (``parse_device``) does not import TensorFlow, so a bad
``--device`` is refused at once; a missing GPU is found when TensorFlow is loaded
(``DeviceError``, exit code 2).
"""

from __future__ import annotations

import argparse
import logging
import re

log = logging.getLogger("downpour.runtime.device")

DEVICE_FORMS = "auto, cpu, gpu or gpu:N"


class DeviceError(ValueError):
    """The requested ``--device`` does not exist in this process (no GPU, or no GPU N).

    Recovery: none at run time; choose another ``--device`` (``cpu``), or make the GPU visible
    to TensorFlow (a CUDA build of TensorFlow, the driver, ``--gpus`` for a container). The
    service refuses to start (exit code 2).
    """


def parse_device(text: str) -> str:
    """argparse type of ``--device``: the canonical form (``auto``, ``cpu``, ``gpu``, ``gpu:N``)."""
    value = str(text).strip().lower()
    if value in ("auto", "cpu", "gpu"):
        return value
    match = re.fullmatch(r"gpu:(\d+)", value)
    if match:
        return f"gpu:{int(match.group(1))}"
    raise argparse.ArgumentTypeError(f"{text!r} is not a device: use {DEVICE_FORMS}")


def configure_device(device: str) -> str:
    """Enable memory growth on every GPU, then make only ``device`` visible; return where the
    process computes, in words. Raises DeviceError when ``device`` names a GPU that is not there.

    Call before TensorFlow runs its first op. Calling again with the same device is harmless
    (in-process tests build several services in one process); once TensorFlow's runtime has
    started, visibility can no longer change, and a different request is refused.
    """
    import tensorflow as tf

    device = parse_device(device)
    gpus = tf.config.list_physical_devices("GPU")
    for gpu in gpus:
        try:
            tf.config.experimental.set_memory_growth(gpu, True)
        except RuntimeError:  # the runtime has started: growth is whatever was set before
            log.debug("memory growth of %s left as it is: TensorFlow already started", gpu.name)
    if device == "auto":
        return f"GPU {gpus[0].name} (TensorFlow's placement)" if gpus else "CPU (no GPU)"
    if device == "cpu":
        _show(tf, [])
        return "CPU"
    index = 0 if device == "gpu" else int(device.split(":")[1])
    if not gpus:
        raise DeviceError(
            f"--device {device}: TensorFlow sees no GPU in this process (a CPU-only TensorFlow, "
            "no driver, or a container started without GPUs); use --device cpu or auto"
        )
    if index >= len(gpus):
        raise DeviceError(
            f"--device {device}: TensorFlow sees {len(gpus)} GPU(s), gpu:0 .. gpu:{len(gpus) - 1}"
        )
    _show(tf, [gpus[index]])
    return f"GPU {gpus[index].name}"


def _show(tf: object, wanted: list) -> None:
    """Make exactly ``wanted`` GPUs visible; DeviceError if the runtime already shows others."""
    config = tf.config  # type: ignore[attr-defined]
    if config.get_visible_devices("GPU") == wanted:
        return  # nothing to change (always so on a machine without a GPU)
    try:
        config.set_visible_devices(wanted, "GPU")
    except RuntimeError as exc:
        raise DeviceError(
            f"cannot choose the device: TensorFlow already started in this process ({exc})"
        ) from None
