"""The server's parameters: variables, optimizer, the compiled apply step, versioned snapshots.

The apply step is a ``tf.function`` whose ``input_signature`` has one ``TensorSpec`` per
trainable variable: its graph's inputs are exactly those placeholders, fed with the arrays
received off the wire. The optimizer's slot variables are built before tracing, so it is
traced once.

By default the step is compiled with XLA (``jit_compile=True``): XLA fuses the optimizer's
element-wise update into one pass over each variable and its slots, about twice as fast as
the op-by-op graph for Adam on the Deep-MNIST CNN (``make bench`` measures both). Received
arrays sit at arbitrary addresses inside ZeroMQ's buffers, and TensorFlow needs aligned ones,
so they are copied once into pre-allocated, 64-byte aligned staging buffers and handed over
through DLPack without another copy (the usual NumPy conversion allocates a fresh tensor per
call and copies into it, about three times slower).
"""

from __future__ import annotations

from collections.abc import Sequence

import keras
import numpy as np
import tensorflow as tf

from shared.models import ModelSpec, build_model, describe_variables, evaluate, fingerprint
from shared.partition import Partition, make_partition

OPTIMIZERS = {
    "adam": keras.optimizers.Adam,
    "adagrad": keras.optimizers.Adagrad,
    "sgd": keras.optimizers.SGD,
}

# TensorFlow's kernels CHECK-fail on a tensor that is not aligned like its own allocator's
# buffers (EIGEN_MAX_ALIGN_BYTES, at most 64), so arrays are staged at this alignment.
ALIGN_BYTES = 64


def make_optimizer(name: str, learning_rate: float) -> keras.optimizers.Optimizer:
    """One of OPTIMIZERS by name, with the given learning rate."""
    try:
        cls = OPTIMIZERS[name]
    except KeyError:
        raise ValueError(f"optimizer must be one of {sorted(OPTIMIZERS)}, got {name!r}") from None
    return cls(learning_rate=learning_rate)


def aligned_empty(shape: tuple[int, ...], dtype: np.dtype, align: int = ALIGN_BYTES) -> np.ndarray:
    """An uninitialised C-contiguous array whose data starts on an ``align``-byte boundary."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + align, dtype=np.uint8)
    offset = (-raw.ctypes.data) % align
    return raw[offset : offset + nbytes].view(dtype).reshape(shape)


class ParameterState:
    """Owns the model's variables and applies gradient lists to them, one version at a time.

    Not thread-safe: the server's loop thread is its only caller. Snapshots are immutable
    arrays; TensorFlow copies a variable's buffer before writing it while a read still holds
    it, so a snapshot is never torn by a later apply.

    ``jit`` compiles the apply step with XLA (the default: faster, same result within float
    tolerance, see tests/test_apply_jit.py); ``jit=False`` runs the op-by-op graph.

    With ``num_shards`` > 1 the state holds only shard ``shard``'s parts of the model
    (``shared.partition``): one variable per part, initialised from the same seeded model
    every shard builds, so the shards together start from exactly the unsharded weights.
    ``names`` are then the parts' wire names and ``model`` is None (a shard cannot evaluate).
    """

    def __init__(
        self,
        spec: ModelSpec,
        optimizer: str = "adam",
        learning_rate: float = 1e-3,
        seed: int = 0,
        jit: bool = True,
        shard: int = 0,
        num_shards: int = 1,
    ) -> None:
        if not 0 <= shard < num_shards:
            raise ValueError(f"shard must be in 0..{num_shards - 1}, got {shard}")
        self.spec = spec
        self.jit = jit
        self.shard = shard
        model = build_model(spec, seed)
        full = list(model.trainable_variables)
        self.fingerprint = fingerprint(full)
        self.description = describe_variables(full)
        self.partition: Partition = make_partition(
            [v.path for v in full],
            [tuple(int(d) for d in v.shape) for v in full],
            [str(v.dtype) for v in full],
            num_shards,
            self.fingerprint,
        )
        parts = self.partition.shards[shard]
        self.model: keras.Model | None = model if num_shards == 1 else None
        if num_shards == 1:
            self.variables = full
        else:  # Keras variable names may not contain "/": a safe name, the wire name kept apart
            self.variables = [
                keras.Variable(
                    full[p.var].numpy()[p.start : p.stop] if not p.whole else full[p.var].numpy(),
                    dtype=p.dtype,
                    name=f"shard{shard}_part{j}",
                )
                for j, p in enumerate(parts)
            ]
        self.names = [p.wire_name for p in parts]
        self.shapes = [tuple(int(d) for d in v.shape) for v in self.variables]
        self.dtypes = [np.dtype(str(v.dtype)) for v in self.variables]
        self.payload_bytes = sum(
            int(np.prod(s)) * d.itemsize for s, d in zip(self.shapes, self.dtypes, strict=True)
        )
        self.optimizer = make_optimizer(optimizer, learning_rate)
        self.optimizer.build(self.variables)
        self.version = 0
        self.apply_traces = 0
        self._snapshot: tuple[int, list[np.ndarray]] | None = None
        # One staging buffer per variable, reused by every apply (the step is synchronous).
        self._staging = [aligned_empty(s, d) for s, d in zip(self.shapes, self.dtypes, strict=True)]

        signature = [
            tf.TensorSpec(s, v.dtype) for s, v in zip(self.shapes, self.variables, strict=True)
        ]

        @tf.function(input_signature=signature, jit_compile=jit)
        def apply_step(*grads: tf.Tensor) -> tf.Tensor:
            self.apply_traces += 1  # runs only while tracing
            self.optimizer.apply_gradients(zip(grads, self.variables, strict=True))
            return self.optimizer.iterations

        # Traced here, once. Calling the concrete function skips tf.function's per-call
        # argument matching: a few hundred microseconds per apply with eight tensors.
        self._apply_step = apply_step.get_concrete_function()

    def _feed(self, grads: Sequence[np.ndarray]) -> list[tf.Tensor]:
        """Copy the gradients into the staging buffers; tensors that alias those buffers."""
        if len(grads) != len(self._staging):
            raise ValueError(f"{len(grads)} gradients for {len(self._staging)} variables")
        tensors = []
        for name, buf, g in zip(self.names, self._staging, grads, strict=True):
            if tuple(np.shape(g)) != buf.shape:
                raise ValueError(f"{name}: gradient shape {np.shape(g)} != {buf.shape}")
            np.copyto(buf, g, casting="same_kind")  # received frames sit at any address
            tensors.append(tf.experimental.dlpack.from_dlpack(buf.__dlpack__()))
        return tensors

    def apply(self, grads: Sequence[np.ndarray]) -> int:
        """Apply one gradient list (in variable order); returns the new version."""
        self._apply_step(*self._feed(grads))
        self.version += 1
        return self.version

    def weights(self) -> tuple[int, list[np.ndarray]]:
        """(version, arrays) — one snapshot per version, shared by every pull of it."""
        if self._snapshot is None or self._snapshot[0] != self.version:
            self._snapshot = (self.version, [v.numpy() for v in self.variables])
        return self._snapshot

    def evaluate(self, x: np.ndarray, y: np.ndarray) -> float:
        """The spec's metric on (x, y) with the current weights (unsharded only)."""
        if self.model is None:
            raise ValueError("a shard holds part of the model and cannot evaluate it")
        return evaluate(self.spec, self.model, x, y)
