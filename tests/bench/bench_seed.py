"""Section 2, the seed's question: gradients one variable at a time, or all in one pass.

The original TF1 code evaluated each gradient tensor on its own, one ``session.run`` per
variable, which re-runs the forward pass (and the backward pass down to that variable) every
time. Its TF2 form is one compiled function per variable, each returning one gradient. The
worker's ``GradientStep`` returns the loss and the whole list from one compiled evaluation.
Every compiled function must be traced exactly once, or the timing includes retracing.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf
from bench_util import median, time_ms

from downpour.inputs.data import Dataset
from downpour.model.build import build_model
from downpour.spec import ModelSpec
from downpour.worker.step import GradientStep


class PerVariableGradients:
    """One compiled function per variable, each returning that variable's gradient."""

    def __init__(self, spec: ModelSpec, model: Any, x_example: np.ndarray) -> None:
        self.traces: list[int] = []
        self.functions = []
        signature = [
            tf.TensorSpec((None, *x_example.shape[1:]), tf.as_dtype(x_example.dtype)),
            tf.TensorSpec((None,), spec.label_dtype),
        ]
        for i, var in enumerate(model.trainable_variables):
            self.traces.append(0)
            self.functions.append(
                tf.function(self._grad_of(spec, model, var, i), input_signature=signature)
            )

    def _grad_of(self, spec: ModelSpec, model: Any, var: Any, i: int) -> Any:
        """The Python function whose compiled form returns the gradient of ``var`` alone."""

        def grad_of(x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
            self.traces[i] += 1  # runs only while tracing
            with tf.GradientTape() as tape:
                loss = spec.loss(y, model(x, training=True))
            return tape.gradient(loss, [var])[0]

        return grad_of

    def __call__(self, x: np.ndarray, y: np.ndarray) -> list[np.ndarray]:
        """Every gradient as an array, one compiled evaluation per variable."""
        return [f(x, y).numpy() for f in self.functions]


def run(spec: ModelSpec, data: Dataset, reps: int) -> dict[str, Any]:
    """per_variable_ms and one_pass_ms per batch (medians, interleaved) and the speedup."""
    model = build_model(spec, seed=0)
    bs = spec.batch_size
    one_pass = GradientStep(spec, model, data.x_train[:1])
    per_var = PerVariableGradients(spec, model, data.x_train[:1])
    n_batches = len(data.x_train) // bs
    state = {"i": 0}

    def batch() -> tuple[np.ndarray, np.ndarray]:
        i = state["i"] % n_batches
        return data.x_train[i * bs : (i + 1) * bs], data.y_train[i * bs : (i + 1) * bs]

    def run_per_var() -> None:
        per_var(*batch())

    def run_one_pass() -> None:
        one_pass(*batch())

    time_ms(run_per_var, 0, warmup=2)
    time_ms(run_one_pass, 0, warmup=2)
    per_ms: list[float] = []
    one_ms: list[float] = []
    for r in range(reps):  # the same batch for both, interleaved
        state["i"] = r
        per_ms += time_ms(run_per_var, 1, warmup=0)
        one_ms += time_ms(run_one_pass, 1, warmup=0)
    if any(t != 1 for t in per_var.traces) or one_pass.traces != 1:
        raise RuntimeError(
            f"retracing: per-variable traces {per_var.traces}, one-pass traces {one_pass.traces}"
        )
    p, o = median(per_ms), median(one_ms)
    return {
        "variables": len(per_var.functions),
        "per_variable_ms": p,
        "one_pass_ms": o,
        "speedup": p / o,
        "traces_per_variable": per_var.traces,
        "traces_one_pass": one_pass.traces,
        "reps": reps,
    }
