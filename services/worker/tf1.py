"""The worker's step for a TF1 graph-mode model (``--graph tf1``): one ``sess.run`` per batch.

The question downpour answers split ``optimizer.minimize()`` into ``compute_gradients`` on the
workers and ``apply_gradients`` on a server, then evaluated each gradient with its own
``sess.run``: the forward and backward pass ran once per variable. Fetching the whole list
``[g for g, v in grads_and_vars]`` (and the loss) in ONE ``sess.run``, with the batch fed to
the placeholders, runs them once. ``Tf1Step`` does exactly that, and loads pulled weights
with one more ``sess.run`` of assign ops fed by placeholders made once with the graph (the
graph is finalized: no op is ever added per step).

It has ``GradientStep``'s interface, so the worker's pull/push loop does not know which one
it drives. The graph runs in its own ``tf.Graph`` and ``Session``; eager execution stays on for
the rest of the process.
"""

from __future__ import annotations

import logging

import keras
import numpy as np
import tensorflow as tf

from downpour.model.build import describe_variables, fingerprint_of
from downpour.model.tf1 import Tf1Graph
from downpour.spec import ModelSpec
from downpour.wire import Sparse, Tensor, pushed_rows

log = logging.getLogger("downpour.worker")


def _to_wire(value: object) -> Tensor:
    """A fetched gradient as the protocol sends it: an ndarray, or Sparse for IndexedSlices
    (each row once, as ``wire.pushed_rows`` sends a table's rows)."""
    if hasattr(value, "indices") and hasattr(value, "dense_shape"):  # IndexedSlicesValue
        shape = tuple(int(d) for d in value.dense_shape)
        return pushed_rows(Sparse(np.asarray(value.indices), np.asarray(value.values), shape))
    return np.asarray(value)


class Tf1Step:
    """``step(x, y) -> (loss, [gradient per variable])`` with one ``sess.run`` per batch.

    ``model`` is the spec's Keras model: the TF1 graph's variables must have its paths,
    shapes and dtypes in its order, so this worker's fingerprint and partition are a TF2
    worker's; any difference is refused here with the first mismatch named.
    """

    def __init__(self, spec: ModelSpec, model: keras.Model) -> None:
        if spec.tf1_graph is None:
            raise ValueError(
                f"model {spec.name!r} has no TF1 graph: --graph tf1 needs a ModelSpec with "
                "tf1_graph set (a function returning a downpour.model.tf1.Tf1Graph, e.g. "
                "downpour.model.tf1.deep_mnist_graph); use --graph tf2"
            )
        self.g: Tf1Graph = spec.tf1_graph()
        self.described = [
            (name, [int(d) for d in v.shape], v.dtype.base_dtype.name)
            for name, v in zip(self.g.names, self.g.variables, strict=True)
        ]
        expected = describe_variables(model.trainable_variables)
        if self.described != expected:
            raise ValueError(_mismatch(spec.name, expected, self.described))
        self.names = [d[0] for d in self.described]
        self.fingerprint = fingerprint_of(self.described)
        self.sess = tf.compat.v1.Session(graph=self.g.graph)
        self.sess.run(self.g.init_op)
        self.g.graph.finalize()  # any op created after this raises: nothing is built per step
        self._fetches = [self.g.loss, *self.g.grads]
        self._x_shape = [-1, *(int(d) for d in self.g.x.shape[1:])]
        log.info(
            "TF1 graph of model %s: one sess.run per batch fetches the loss and all %d gradients",
            spec.name,
            len(self.g.grads),
        )

    def __call__(
        self, x: np.ndarray, y: np.ndarray, training: bool = True
    ) -> tuple[float, list[Tensor]]:
        """Loss as a float and the gradients as wire tensors, in variable order: ONE
        ``sess.run``. ``training=False`` leaves out the train feed (no dropout)."""
        feed = {self.g.x: np.reshape(x, self._x_shape), self.g.y: y}
        if training:
            feed.update(self.g.train_feed)
        loss, *grads = self.sess.run(self._fetches, feed_dict=feed)
        return float(loss), [_to_wire(g) for g in grads]

    def prepare(self, arrays: list[np.ndarray]) -> list[np.ndarray]:
        """As they are: ``sess.run`` feeds NumPy arrays."""
        return arrays

    def set_weights(self, arrays: list[np.ndarray]) -> None:
        """Load pulled weights into the graph's variables: one ``sess.run`` for all."""
        feed = dict(zip(self.g.assign_inputs, arrays, strict=True))
        self.sess.run(self.g.assign_op, feed_dict=feed)

    def get_weights(self) -> list[np.ndarray]:
        """The variables' current values, in order (one ``sess.run``)."""
        return list(self.sess.run(self.g.variables))

    def close(self) -> None:
        """Release the session."""
        self.sess.close()


def check_tf1_inputs(spec: ModelSpec, element_spec: object) -> None:
    """Refuse input a TF1 graph cannot be fed: it has one input placeholder and one label
    placeholder, so the batches must be ``(tensor, tensor)``."""
    ok = (
        isinstance(element_spec, tuple)
        and len(element_spec) == 2
        and all(isinstance(s, tf.TensorSpec) for s in element_spec)
    )
    if not ok:
        raise ValueError(
            f"model {spec.name!r}: --graph tf1 feeds one input tensor and one label tensor, "
            f"but the input_fn yields {element_spec}: use --graph tf2 for tuple or dict features"
        )


def _mismatch(
    name: str,
    keras_vars: list[tuple[str, list[int], str]],
    tf1_vars: list[tuple[str, list[int], str]],
) -> str:
    """Why a TF1 graph does not match the Keras model, naming the first difference."""
    head = f"model {name!r}: the TF1 graph's variables differ from the Keras model's"
    if len(keras_vars) != len(tf1_vars):
        return f"{head}: {len(tf1_vars)} variables, the Keras model has {len(keras_vars)}"
    for i, (k, t) in enumerate(zip(keras_vars, tf1_vars, strict=True)):
        if k != t:
            return (
                f"{head}: variable {i} is {t[0]} {t[1]} {t[2]} in the TF1 graph, "
                f"{k[0]} {k[1]} {k[2]} in the Keras model (same names, shapes, dtypes and "
                "order are needed: the server checks the fingerprint)"
            )
    return head
