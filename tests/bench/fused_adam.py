"""Adam as TensorFlow's fused kernel, ``ResourceApplyAdam``: one op per variable.

The op ``tf.compat.v1.train.AdamOptimizer`` emits, written out here so that it works on the
``tf.Variable`` behind any Keras 3 variable, under ``ParameterServerStrategy`` too (the
slots are created where the strategy places variables, and each apply op runs on the device
of the variable it updates: the parameter server). Keras 3's Adam runs the same update as a
chain of small element-wise ops; the fused kernel reads and writes each buffer once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf


def backing(variable: Any) -> tf.Variable:
    """The ``tf.Variable`` behind a Keras 3 variable (the variable itself otherwise)."""
    return (
        getattr(variable, "value", variable) if not isinstance(variable, tf.Variable) else variable
    )


class FusedAdam:
    """``apply(grads)``: one Adam step (same defaults as Keras: eps 1e-7) on ``variables``."""

    def __init__(
        self,
        variables: Sequence[Any],
        learning_rate: float = 1e-3,
        beta1: float = 0.9,
        beta2: float = 0.999,
        epsilon: float = 1e-7,
    ) -> None:
        self.variables = [backing(v) for v in variables]
        self.m = [tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False) for v in self.variables]
        self.v = [tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False) for v in self.variables]
        self.iterations = tf.Variable(0.0, trainable=False, dtype=tf.float32)
        self.hyper = [tf.constant(x, tf.float32) for x in (learning_rate, beta1, beta2, epsilon)]

    def apply(self, grads: Sequence[tf.Tensor]) -> None:
        """One step; call inside a ``tf.function``."""
        lr, b1, b2, eps = self.hyper
        step = self.iterations.assign_add(1.0)
        b1p, b2p = tf.pow(b1, step), tf.pow(b2, step)
        for var, m, v, g in zip(self.variables, self.m, self.v, grads, strict=True):
            tf.raw_ops.ResourceApplyAdam(
                var=var.handle,
                m=m.handle,
                v=v.handle,
                beta1_power=b1p,
                beta2_power=b2p,
                lr=lr,
                beta1=b1,
                beta2=b2,
                epsilon=eps,
                grad=g,
            )
