"""The server's parameters: variables, optimizer, the compiled apply step, versioned snapshots.

The apply step is a ``tf.function`` whose ``input_signature`` has one ``TensorSpec`` per
trainable variable: its graph's inputs are exactly those placeholders, fed with the arrays
received off the wire. The optimizer's slot variables are built before tracing, so it is
traced once.
"""

from __future__ import annotations

from collections.abc import Sequence

import keras
import numpy as np
import tensorflow as tf

from shared.models import ModelSpec, build_model, describe_variables, evaluate, fingerprint

OPTIMIZERS = {
    "adam": keras.optimizers.Adam,
    "adagrad": keras.optimizers.Adagrad,
    "sgd": keras.optimizers.SGD,
}


def make_optimizer(name: str, learning_rate: float) -> keras.optimizers.Optimizer:
    """One of OPTIMIZERS by name, with the given learning rate."""
    try:
        cls = OPTIMIZERS[name]
    except KeyError:
        raise ValueError(f"optimizer must be one of {sorted(OPTIMIZERS)}, got {name!r}") from None
    return cls(learning_rate=learning_rate)


class ParameterState:
    """Owns the model's variables and applies gradient lists to them, one version at a time.

    Not thread-safe: the server's loop thread is its only caller. Snapshots are immutable
    arrays; TensorFlow copies a variable's buffer before writing it while a read still holds
    it, so a snapshot is never torn by a later apply.
    """

    def __init__(
        self, spec: ModelSpec, optimizer: str = "adam", learning_rate: float = 1e-3, seed: int = 0
    ) -> None:
        self.spec = spec
        self.model = build_model(spec, seed)
        self.variables = list(self.model.trainable_variables)
        self.names = [v.path for v in self.variables]
        self.shapes = [tuple(int(d) for d in v.shape) for v in self.variables]
        self.dtypes = [np.dtype(str(v.dtype)) for v in self.variables]
        self.fingerprint = fingerprint(self.variables)
        self.description = describe_variables(self.variables)
        self.payload_bytes = sum(
            int(np.prod(s)) * d.itemsize for s, d in zip(self.shapes, self.dtypes, strict=True)
        )
        self.optimizer = make_optimizer(optimizer, learning_rate)
        self.optimizer.build(self.variables)
        self.version = 0
        self.apply_traces = 0
        self._snapshot: tuple[int, list[np.ndarray]] | None = None

        signature = [
            tf.TensorSpec(s, v.dtype) for s, v in zip(self.shapes, self.variables, strict=True)
        ]

        @tf.function(input_signature=signature)
        def apply_step(*grads: tf.Tensor) -> tf.Tensor:
            self.apply_traces += 1  # runs only while tracing
            self.optimizer.apply_gradients(zip(grads, self.variables, strict=True))
            return self.optimizer.iterations

        self._apply_step = apply_step

    def apply(self, grads: Sequence[np.ndarray]) -> int:
        """Apply one gradient list (in variable order); returns the new version."""
        self._apply_step(*grads)
        self.version += 1
        return self.version

    def weights(self) -> tuple[int, list[np.ndarray]]:
        """(version, arrays) — one snapshot per version, shared by every pull of it."""
        if self._snapshot is None or self._snapshot[0] != self.version:
            self._snapshot = (self.version, [v.numpy() for v in self.variables])
        return self._snapshot

    def evaluate(self, x: np.ndarray, y: np.ndarray) -> float:
        """The spec's metric on (x, y) with the current weights."""
        return evaluate(self.spec, self.model, x, y)
