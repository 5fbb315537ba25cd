"""Section 6, input: is reading TFRecord files ever the bottleneck of a worker's step?

The same model and the worker's ``GradientStep`` (loss and the whole gradient list in one
compiled evaluation, the gradients copied out as the worker sends them), fed two ways in
the same run:

- memory: batches sliced from NumPy arrays of MNIST-5k held in memory, reshuffled every
  epoch (no tf.data at all: the floor any input pipeline is measured against);
- tfrecord: ``downpour.examples.mnist_tfrecord.input_fn`` over the same 4,000 examples
  written by ``downpour data tfrecord`` (4 files, interleave, shuffle, parse, prefetch), read
  epoch after epoch by the worker's own ``epoch_batches``.

Windows of a fixed number of steps alternate between the two, each round starting with the
other one; ``tfrecord_vs_memory`` is the median of the per-round ratios of steps/s. In the
full plan a window is two whole epochs, so every window pays for the same number of epoch
openings, and nine rounds keep one slow spell of a shared machine from setting the median.

The section runs in a process of its own (``python bench_input.py PLAN`` prints its result
as JSON), as a worker does: nothing left by the bench's other sections (their threads, their
models, their garbage) shares its cores or its interpreter.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from bench_e2e import batches as memory_batches
from bench_util import Plan, Procs, median

from downpour import InputContext
from downpour.cli.data import mnist5k, write
from downpour.examples import mnist_tfrecord
from downpour.inputs.data import load_mnist_5k
from downpour.inputs.pipeline import epoch_batches
from downpour.model.build import build_model
from downpour.spec import load_spec
from downpour.worker.step import GradientStep

HERE = Path(__file__).resolve().parent
# (rounds, steps per window, warm-up steps) per plan; None: WINDOW_EPOCHS whole epochs
SIZES = {"smoke": (1, 4, 2), "quick": (2, 15, 5), "full": (9, None, 10)}
WINDOW_EPOCHS = 2


def tfrecord_batches(data_dir: str, batch_size: int) -> Iterator[tuple[Any, Any]]:
    """Endless batches of the TFRecord example's input_fn, one dataset per epoch, as the
    worker reads them."""
    ctx = InputContext(seed=0, data_dir=data_dir, batch_size=batch_size)
    return (batch for _, batch in epoch_batches(mnist_tfrecord.input_fn, ctx))


def steps_per_s(step: GradientStep, source: Iterator[tuple[Any, Any]], steps: int) -> float:
    """Steps per second over ``steps`` steps, each fed the next batch of ``source``."""
    t0 = time.perf_counter()
    for _ in range(steps):
        step(*next(source))
    return steps / (time.perf_counter() - t0)


def run(plan: Plan, procs: Procs) -> dict[str, Any]:
    """The section's result, measured in a child process (see the module docstring)."""
    return procs.run_json([str(HERE / "bench_input.py"), plan.name], "input", timeout_s=900)


def measure(plan_name: str) -> dict[str, Any]:
    """memory_steps_per_s, tfrecord_steps_per_s (medians) and tfrecord_vs_memory."""
    spec = load_spec("downpour.models:deep_mnist")
    data = load_mnist_5k()
    rounds, steps, warmup = SIZES[plan_name]
    if steps is None:
        steps = WINDOW_EPOCHS * (len(data.x_train) // spec.batch_size)
    with tempfile.TemporaryDirectory(prefix="downpour-bench-input-") as tmp:
        out = Path(tmp) / "mnist"
        out.mkdir()
        write(out, "tfrecord", mnist5k(), shards=4)
        step = GradientStep(spec, build_model(spec, seed=0), data.x_train[:1])
        sources = {
            "memory": memory_batches(data, spec.batch_size, seed=0),
            "tfrecord": tfrecord_batches(str(out), spec.batch_size),
        }
        for source in sources.values():
            steps_per_s(step, source, warmup)
        rates: dict[str, list[float]] = {name: [] for name in sources}
        for r in range(rounds):
            order = list(sources) if r % 2 == 0 else list(sources)[::-1]
            for name in order:
                rates[name].append(steps_per_s(step, sources[name], steps))
    ratios = [t / m for t, m in zip(rates["tfrecord"], rates["memory"], strict=True)]
    return {
        "memory_steps_per_s": median(rates["memory"]),
        "tfrecord_steps_per_s": median(rates["tfrecord"]),
        "tfrecord_vs_memory": median(ratios),
        "tfrecord_vs_memory_per_round": [float(np.round(x, 3)) for x in ratios],
        "rounds": rounds,
        "steps_per_window": steps,
        "traces": step.traces,
    }


if __name__ == "__main__":
    print(json.dumps(measure(sys.argv[1])))
