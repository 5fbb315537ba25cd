"""The seed's TF1 graph: TensorFlow's "Deep MNIST for experts" in ``tf.compat.v1`` graph mode.

This is the network of the question downpour answers, written the way its author wrote it:
placeholders, ``get_variable``, ``tf.nn.conv2d``/``max_pool``/``matmul``, softmax
cross-entropy, and ``AdamOptimizer.compute_gradients`` split off from ``apply_gradients``
(the server applies). A worker started with ``--graph tf1`` runs it in a
``tf.compat.v1.Session`` and fetches the loss and the *whole* gradient list of a batch with one
``sess.run`` (``downpour.worker.tf1``), which is the answer to the question.

A model's TF1 graph is a plugin like its Keras model: ``ModelSpec.tf1_graph`` is a
function of no arguments returning a ``Tf1Graph``, built in a fresh ``tf.Graph`` so that
nothing leaks into the process's eager state. Its variables must have the Keras model's
paths, shapes and dtypes in the same order (the fingerprint the server checks at hello).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import tensorflow as tf

v1 = tf.compat.v1


@dataclass
class Tf1Graph:
    """A built graph-mode model: what a worker feeds, fetches and assigns.

    ``variables`` are in the Keras model's ``trainable_variables`` order and ``grads[i]`` is
    the gradient of ``loss`` for ``variables[i]``. ``assign_inputs[i]`` is a placeholder
    feeding ``variables[i]``; one run of ``assign_op`` loads them all. ``train_feed`` is fed
    with every training batch (e.g. the dropout keep probability); leaving it out evaluates
    in inference mode.
    """

    graph: tf.Graph
    x: tf.Tensor
    y: tf.Tensor
    logits: tf.Tensor
    loss: tf.Tensor
    grads: list[Any]  # tf.Tensor, or tf.IndexedSlices for a gathered variable
    variables: list[tf.Variable]
    assign_inputs: list[tf.Tensor]
    assign_op: tf.Operation
    init_op: tf.Operation
    train_feed: dict[tf.Tensor, Any] = field(default_factory=dict)

    @property
    def names(self) -> list[str]:
        """The variables' names without the ``:0`` output suffix (``conv1/kernel``)."""
        return [v.name.rsplit(":", 1)[0] for v in self.variables]


def finish(
    graph: tf.Graph,
    x: tf.Tensor,
    y: tf.Tensor,
    logits: tf.Tensor,
    loss: tf.Tensor,
    variables: list[tf.Variable],
    train_feed: dict[tf.Tensor, Any] | None = None,
) -> Tf1Graph:
    """Add the gradient list and the assign ops to a model graph (call inside ``graph``).

    The gradients come from ``AdamOptimizer.compute_gradients`` exactly as in the question;
    the optimizer's ``apply_gradients`` half lives on the server. Assign placeholders and
    ops are made here, once, so nothing is added to the graph per step.
    """
    optimizer = v1.train.AdamOptimizer(1e-4)  # its slots are never made: only the gradients
    grads_and_vars = optimizer.compute_gradients(loss, var_list=variables)
    missing = [v.name for g, v in grads_and_vars if g is None]
    if missing:
        raise ValueError(f"the loss does not depend on {', '.join(missing)}")
    grads = [g for g, _ in grads_and_vars]
    with tf.name_scope("assign"):
        inputs = [
            v1.placeholder(v.dtype.base_dtype, v.shape, name=f"w{i}")
            for i, v in enumerate(variables)
        ]
        assign_op = tf.group(
            *[v.assign(p, read_value=False) for v, p in zip(variables, inputs, strict=True)]
        )
    init_op = v1.variables_initializer(variables)
    return Tf1Graph(
        graph, x, y, logits, loss, grads, variables, inputs, assign_op, init_op, train_feed or {}
    )


def deep_mnist_graph() -> Tf1Graph:
    """The seed's Deep-MNIST CNN, the same function as ``downpour.models:deep_mnist``.

    As in the tutorial: ``x`` is ``[None, 784]`` (the worker feeds the loader's 28x28x1
    images flattened), reshaped to 28x28x1; conv 5x5x32 + ReLU + 2x2 max-pool, conv 5x5x64 +
    ReLU + 2x2 max-pool, fully connected 3136 -> 1024 + ReLU, dropout (``keep_prob`` 0.5 while
    training, 1.0 by default), fully connected 1024 -> 10 logits; mean softmax cross-entropy
    on one-hot labels. The labels are fed as the int64 class indices the loader yields and
    made one-hot in the graph. Variable scopes give the Keras paths (``conv1/kernel`` ...).
    """
    graph = tf.Graph()
    with graph.as_default():

        def weight_variable(shape: list[int]) -> tf.Variable:
            init = v1.truncated_normal_initializer(stddev=0.1)
            return v1.get_variable("kernel", shape, tf.float32, initializer=init)

        def bias_variable(shape: list[int]) -> tf.Variable:
            init = v1.constant_initializer(0.1)
            return v1.get_variable("bias", shape, tf.float32, initializer=init)

        def conv2d(x: tf.Tensor, w: tf.Variable) -> tf.Tensor:
            return tf.nn.conv2d(x, w, strides=[1, 1, 1, 1], padding="SAME")

        def max_pool_2x2(x: tf.Tensor) -> tf.Tensor:
            return tf.nn.max_pool2d(x, ksize=[1, 2, 2, 1], strides=[1, 2, 2, 1], padding="SAME")

        x = v1.placeholder(tf.float32, [None, 784], name="x")
        y_ = v1.placeholder(tf.int64, [None], name="y_")
        keep_prob = v1.placeholder_with_default(1.0, [], name="keep_prob")
        x_image = tf.reshape(x, [-1, 28, 28, 1])

        with v1.variable_scope("conv1"):
            w_conv1 = weight_variable([5, 5, 1, 32])
            b_conv1 = bias_variable([32])
        h_pool1 = max_pool_2x2(tf.nn.relu(conv2d(x_image, w_conv1) + b_conv1))

        with v1.variable_scope("conv2"):
            w_conv2 = weight_variable([5, 5, 32, 64])
            b_conv2 = bias_variable([64])
        h_pool2 = max_pool_2x2(tf.nn.relu(conv2d(h_pool1, w_conv2) + b_conv2))

        with v1.variable_scope("fc1"):
            w_fc1 = weight_variable([7 * 7 * 64, 1024])
            b_fc1 = bias_variable([1024])
        h_pool2_flat = tf.reshape(h_pool2, [-1, 7 * 7 * 64])
        h_fc1 = tf.nn.relu(tf.matmul(h_pool2_flat, w_fc1) + b_fc1)
        h_fc1_drop = tf.nn.dropout(h_fc1, rate=1.0 - keep_prob)

        with v1.variable_scope("logits"):
            w_fc2 = weight_variable([1024, 10])
            b_fc2 = bias_variable([10])
        y_conv = tf.matmul(h_fc1_drop, w_fc2) + b_fc2

        cross_entropy = tf.reduce_mean(
            tf.nn.softmax_cross_entropy_with_logits(labels=tf.one_hot(y_, 10), logits=y_conv)
        )
        variables = [w_conv1, b_conv1, w_conv2, b_conv2, w_fc1, b_fc1, w_fc2, b_fc2]
        return finish(graph, x, y_, y_conv, cross_entropy, variables, train_feed={keep_prob: 0.5})
