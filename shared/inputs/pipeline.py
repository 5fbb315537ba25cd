"""A model's input functions resolved, called and checked (needs TensorFlow).

Every reader of data goes through here: the worker (training batches, epoch after epoch), the
server's ``--eval-every``, run-local's evaluator and export (held-out batches, and the first
training batches for BatchNorm statistics). ``resolve_inputs`` gives a spec's two functions:
its own ``input_fn`` / ``held_out_fn``, or those of the NumPy ``Dataset`` its ``load_data``
returns (``downpour.inputs.data.dataset_input_fn``).

``build_dataset`` calls a function and refuses anything but a ``tf.data.Dataset``; a training
function that called neither sharding helper of its ``InputContext`` gets its batches sharded
here (batch ``j`` to worker ``j mod N``). ``check_element_spec`` refuses batches that cannot
fit the model (not ``(features, labels)``, a missing dict key, a wrong rank or shape, strings
for numbers) with the two specs in the message; the worker does all this before its hello.
"""

from __future__ import annotations

import logging
import queue
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import keras
import tensorflow as tf

from downpour.inputs.context import InputContext
from downpour.inputs.data import dataset_held_out_fn, dataset_input_fn
from downpour.model.build import model_inputs
from downpour.spec import ModelSpec

log = logging.getLogger("downpour.inputs.context")

InputFn = Callable[[InputContext], tf.data.Dataset]


class _Retirer:
    """One daemon thread that drops the iterators handed to it (see the module docstring)."""

    def __init__(self) -> None:
        self._queue: queue.Queue[Any] = queue.Queue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def retire(self, iterator: Any) -> None:
        """Delete ``iterator`` on the retiring thread; the caller must drop its references.
        While the interpreter shuts down no thread can start: the caller deletes it."""
        if sys.is_finalizing():
            return
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="downpour-retire-iterators", daemon=True
                )
                self._thread.start()
        self._queue.put(iterator)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            del item  # the last reference: tf.data's destructor runs here
            self._queue.task_done()

    def join(self) -> None:
        """Wait until every iterator handed over so far is deleted."""
        self._queue.join()


_retirer = _Retirer()
retire = _retirer.retire
join_retired = _retirer.join


class InputError(ValueError):
    """A model's input cannot be trained on: the message says what and how to fix it."""


@dataclass(frozen=True)
class Inputs:
    """A spec's training ``input_fn`` and its ``held_out_fn`` (None: no held-out set)."""

    train: InputFn
    held_out: InputFn | None


def resolve_inputs(spec: ModelSpec, data_dir: str | None = None) -> Inputs:
    """The spec's input functions; a spec with ``load_data`` only gets its Dataset's (the
    arrays are loaded once, here)."""
    if spec.input_fn is not None:
        held = spec.held_out_fn
        if held is None and spec.load_data is not None:
            held = dataset_held_out_fn(spec.load_data(data_dir), spec.label_dtype)
        return Inputs(spec.input_fn, held)
    if spec.load_data is None:  # ModelSpec refuses this; a hand-edited spec may not
        raise InputError(f"model {spec.name!r} has neither input_fn nor load_data")
    data = spec.load_data(data_dir)
    held = spec.held_out_fn
    if held is None and len(data.x_test):
        held = dataset_held_out_fn(data, spec.label_dtype)
    return Inputs(dataset_input_fn(data, spec.label_dtype), held)


def context(spec: ModelSpec, data_dir: str | None = None, seed: int = 0, **kw: Any) -> InputContext:
    """An InputContext for ``spec`` (its batch size); ``kw``: worker_index, num_workers."""
    return InputContext(seed=seed, data_dir=data_dir, batch_size=spec.batch_size, **kw)


def build_dataset(fn: InputFn, ctx: InputContext, what: str = "input_fn") -> tf.data.Dataset:
    """``fn(ctx)``, refused unless it is a ``tf.data.Dataset``; sharded by batch when a
    training function with several workers called neither ``ctx.shard_files`` nor
    ``ctx.shard``."""
    try:
        ds = fn(ctx)
    except InputError:
        raise
    except Exception as exc:  # the model's own code: reported as bad input, not a crash
        raise InputError(f"{what} failed: {type(exc).__name__}: {exc}") from exc
    if not isinstance(ds, tf.data.Dataset):
        raise InputError(
            f"{what} returned {type(ds).__module__}.{type(ds).__qualname__}, not a "
            "tf.data.Dataset of (features, labels) batches"
        )
    if what == "input_fn" and not ctx.used and ctx.num_workers > 1 and ctx.split is None:
        ds = ds.shard(ctx.num_workers, ctx.worker_index)
    return ds


def _describe(spec: Any) -> str:
    return str(tf.nest.map_structure(lambda s: f"{s.dtype.name}{list(s.shape)}", spec)).replace(
        "'", ""
    )


def check_element_spec(element_spec: Any, model: keras.Model, what: str = "input_fn") -> None:
    """Refuse batches that cannot fit ``model``'s inputs (InputError naming both)."""
    if not isinstance(element_spec, tuple) or len(element_spec) != 2:
        raise InputError(
            f"{what} yields {_describe(element_spec)}; it must yield (features, labels) pairs"
        )
    features, labels = element_spec
    for s in tf.nest.flatten(labels):
        if not isinstance(s, tf.TensorSpec):
            raise InputError(f"{what} yields {type(s).__name__} labels; labels must be dense")
    for s in tf.nest.flatten(features):
        if not isinstance(s, tf.TensorSpec | tf.RaggedTensorSpec | tf.SparseTensorSpec):
            raise InputError(
                f"{what} yields a {type(s).__name__}; features are dense, ragged or sparse tensors"
            )
    if any(s.shape.rank == 0 for s in tf.nest.flatten(element_spec)):
        raise InputError(f"{what} yields scalars {_describe(element_spec)}: batch the dataset")
    wanted = model_inputs(model)
    if wanted is None:
        return  # the trace (GradientStep) checks a subclassed model
    if isinstance(wanted, (list, tuple)) and len(wanted) == 1 and not isinstance(features, tuple):
        wanted = wanted[0]
    head = f"{what}'s features {_describe(features)} do not fit model inputs {_describe_k(wanted)}"
    pairs = _feature_pairs(features, wanted, head, "")
    for name, f, w in pairs:
        kind = _kind(f)
        if kind != ("ragged" if getattr(w, "ragged", False) else
                    "sparse" if getattr(w, "sparse", False) else "dense"):  # fmt: skip
            raise InputError(f"{head}: feature {name} is {kind}, its model input is not")
        got, want = f.shape[1:], tuple(w.shape[1:])
        if not _shape_fits(got, want):
            raise InputError(f"{head}: feature {name} has shape {list(f.shape)}")
        if (f.dtype == tf.string) != (tf.as_dtype(w.dtype) == tf.string):
            raise InputError(f"{head}: feature {name} is {f.dtype.name}")


def _kind(spec: Any) -> str:
    """``dense``, ``ragged`` or ``sparse``: what a feature's spec is."""
    if isinstance(spec, tf.RaggedTensorSpec):
        return "ragged"
    return "sparse" if isinstance(spec, tf.SparseTensorSpec) else "dense"


def _feature_pairs(features: Any, wanted: Any, head: str, path: str) -> list[tuple[str, Any, Any]]:
    """(name, feature spec, model input) for every input of ``wanted``, matched by key in
    dicts (at any depth; extra features are allowed) and by position elsewhere; InputError
    (``head`` and the reason) where the structures differ."""
    if isinstance(wanted, dict):
        if not isinstance(features, dict):
            where = f" at {path}" if path else ""
            raise InputError(f"{head}: the model takes a dict of named inputs{where}")
        missing = sorted(set(wanted) - set(features))
        if missing:
            raise InputError(f"{head}: no feature {', '.join(repr(path + k) for k in missing)}")
        return [
            pair
            for k in sorted(wanted)
            for pair in _feature_pairs(features[k], wanted[k], head, f"{path}{k}/")
        ]
    try:
        tf.nest.assert_same_structure(
            features, tf.nest.map_structure(lambda _: 0, wanted), check_types=False
        )
    except (ValueError, TypeError):
        raise InputError(f"{head}: another structure") from None
    if path and not isinstance(wanted, list | tuple):
        return [(path.rstrip("/"), features, wanted)]
    return [
        (f"{path}{i}", f, w)
        for i, (f, w) in enumerate(
            zip(tf.nest.flatten(features), tf.nest.flatten(wanted), strict=True)
        )
    ]


def _describe_k(wanted: Any) -> str:
    return str(
        tf.nest.map_structure(lambda k: f"{tf.as_dtype(k.dtype).name}{list(k.shape)}", wanted)
    ).replace("'", "")


def _shape_fits(got: tf.TensorShape, want: tuple[int | None, ...]) -> bool:
    """A feature's per-example shape fits a Keras input's (None: any; Keras also adds or
    drops a trailing dimension of 1)."""
    got_t = tuple(got.as_list()) if got.rank is not None else None
    if got_t is None:
        return True
    if len(got_t) + 1 == len(want) and want[-1] == 1:
        want = want[:-1]
    elif len(got_t) == len(want) + 1 and got_t[-1] == 1:
        got_t = got_t[:-1]
    if len(got_t) != len(want):
        return False
    return all(w is None or g is None or g == w for g, w in zip(got_t, want, strict=True))


def known_batches(ds: tf.data.Dataset) -> int | None:
    """How many batches ``ds`` yields, when tf.data knows without reading it."""
    n = int(ds.cardinality())
    return n if n >= 0 else None


def _opened(ds: tf.data.Dataset) -> list[Any]:
    """``[dataset, iterator, first batch]`` (batch None: it has none). A list, so that
    whoever takes the iterator can empty it: a future's result would otherwise keep the
    iterator alive, and delete it wherever the future dies."""
    it = iter(ds)
    return [ds, it, next(it, None)]


def _open_epoch(fn: InputFn, ctx: InputContext, epoch: int) -> list[Any]:
    """``_opened`` for epoch ``epoch`` of ``fn``."""
    return _opened(build_dataset(fn, ctx.for_epoch(epoch)))


def _take(opened: list[Any]) -> tuple[tf.data.Dataset, Any, Any]:
    ds, it, head = opened
    opened.clear()
    return ds, it, head


def epoch_batches(
    fn: InputFn,
    ctx: InputContext,
    epochs: float | None = None,
    first: tf.data.Dataset | None = None,
) -> Iterator[tuple[int, Any]]:
    """``(epoch, batch)`` of pass after pass of ``fn`` (``ctx.epoch`` counting from 0):
    ``epochs`` passes (a fraction of a pass: that share of its batches), or without end.
    ``first`` is epoch 0's dataset when the caller built it already. An epoch without a
    batch raises InputError: this worker's share is empty.

    While an epoch is read, a background thread builds the next one's pipeline and reads its
    first batch (filling its shuffle buffer), so an epoch boundary costs the step nothing;
    two pipelines are alive for that while. Finished iterators go to ``retire``."""
    epoch, per_epoch = 0, None
    pool = ThreadPoolExecutor(1, thread_name_prefix="downpour-next-epoch")
    ahead: Future[list[Any]] | None = None
    it: Any = None
    try:
        while epochs is None or epoch < epochs:
            if ahead is not None:
                ds, it, head = _take(ahead.result())
                ahead = None
            elif epoch == 0 and first is not None:
                ds, it, head = _take(_opened(first))
            else:
                ds, it, head = _take(_open_epoch(fn, ctx, epoch))
            limit = None
            if epochs is not None and epochs - epoch < 1:
                n = per_epoch if per_epoch is not None else known_batches(ds)
                limit = max(1, round((epochs - epoch) * n)) if n is not None else None
            if epochs is None or epoch + 1 < epochs:
                ahead = pool.submit(_open_epoch, fn, ctx, epoch + 1)
            count = 0
            batch = head
            while batch is not None:
                yield epoch, batch
                count += 1
                if limit is not None and count >= limit:
                    break
                batch = next(it, None)
            retire(it)
            it = batch = head = None
            if count == 0:
                raise InputError(
                    f"worker {ctx.worker_index} of {ctx.num_workers}: input_fn gave no batch "
                    f"in epoch {epoch} (this worker's share of the data is empty: fewer "
                    "examples or files than workers?)"
                )
            per_epoch = count if limit is None else per_epoch
            epoch += 1
    finally:
        if it is not None:  # closed mid-epoch
            retire(it)
            it = None
        if ahead is not None:  # closed: the next epoch is not read; its opening is awaited
            try:
                retire(_take(ahead.result())[1])
            except Exception as exc:  # noqa: BLE001 - a failure to open what nobody reads
                log.debug("the epoch read ahead failed to open: %s", exc)
        pool.shutdown()


def training_features(fn: InputFn, ctx: InputContext, max_batches: int) -> list[Any]:
    """The features of the first ``max_batches`` batches of ``fn`` (epoch 0): what BatchNorm
    statistics are recomputed from."""
    ds = build_dataset(fn, ctx).take(max_batches)
    return [features for features, _ in ds]
