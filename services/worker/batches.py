"""A worker's training batches: its share of the data, epoch after epoch, at most ``--steps``.

The share is a static shard (worker ``i`` of ``N``, ``downpour.inputs.context``) or, with
``--data-dispatch server``, the splits shard 0 hands out (``downpour.worker.splits``). The
first dataset is built before anything is sent to a server, so the step can be traced on it
and bad input is refused first (InputError); a static shard's first batch is read then
too, so a worker whose share is empty is refused before its hello. The batches keep the
epoch of the one read last, which the worker's summary reports.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import tensorflow as tf

from downpour import wire
from downpour.inputs.context import InputContext
from downpour.inputs.pipeline import (
    InputError,
    InputFn,
    build_dataset,
    epoch_batches,
    known_batches,
)
from downpour.net.client import ShardClient
from downpour.worker.settings import WorkerConfig
from downpour.worker.splits import SplitFeed, probe_universe


class TrainingBatches:
    """The training batches of ``train`` for the worker ``ctx`` describes, as ``config``
    says (``--data-dispatch``, ``--epochs``, ``--steps``, ``--split-size``, ``--graph``);
    ``model`` names the model in errors. In order: ``first_dataset`` (the step is traced on
    it), ``prime`` with it, then ``from_splits`` under dispatch once the shards' clients
    exist; ``batches`` yields them, ``close`` ends the input."""

    def __init__(self, train: InputFn, ctx: InputContext, config: WorkerConfig, model: str):
        self.train = train
        self.ctx = ctx
        self.config = config
        self.model = model
        self.dispatched = config.data_dispatch == "server"
        self.planned_per_epoch: int | None = None  # batches in an epoch, when tf.data knows
        self.epoch = 0  # the epoch of the batch computed last
        self.feed: SplitFeed | None = None  # --data-dispatch server: splits from shard 0
        self._universe: wire.DataUniverse | None = None
        self._input_stream: Iterator[tuple[int, Any]] | None = None
        self._batches: Iterator[tuple[int, Any]] | None = None

    def first_dataset(self) -> Any:
        """The first epoch's dataset (InputError: refused); under dispatch, the whole data,
        probed for what the server is to divide."""
        if self.dispatched:
            self._universe, first = probe_universe(self.train, self.ctx, self.config.split_size)
            return first
        return build_dataset(self.train, self.ctx)

    def prime(self, first: Any) -> None:
        """A static shard's batches, epoch after epoch, with the first one read already from
        ``first``: a worker whose share is empty is refused before its hello. Nothing under
        dispatch (``from_splits``)."""
        if self.dispatched:
            return
        self.planned_per_epoch = known_batches(first)
        cfg = self.config
        epochs = None if cfg.steps is not None else cfg.epochs
        stream = epoch_batches(self.train, self.ctx, epochs, first)
        try:
            head = next(stream)
        except StopIteration:  # epochs > 0 always yields or raises; kept for safety
            raise InputError("input_fn gave no batch") from None
        except (tf.errors.OpError, ValueError, TypeError) as exc:
            if isinstance(exc, InputError):
                raise
            raise InputError(
                f"model {self.model!r}: reading input_fn's first batch: {exc}"
            ) from None

        def chained() -> Iterator[tuple[int, Any]]:
            yield head
            yield from stream

        self._input_stream = stream  # closed by close() even when chained never started
        self._batches = chained()

    def from_splits(self, client: ShardClient, stop: threading.Event) -> None:
        """Under dispatch: the batches of the splits shard 0 hands out, asked for through
        ``client`` (the first after the hello); ``stop`` ends a wait for one."""
        assert self._universe is not None, "first_dataset before from_splits"
        cfg = self.config
        self.feed = SplitFeed(
            self.train,
            self.ctx,
            self._universe,
            client,
            epochs=0 if cfg.steps is not None else int(cfg.epochs),
            stop=stop,
        )
        self._batches = self.feed.batches()  # asks for its first split after the hello

    def joined(self, index: int, known: int) -> None:
        """Under dispatch: this worker is number ``index`` of at least ``known`` in shard 0's
        order (its hello reply), which the input context then carries."""
        self.ctx = replace(self.ctx, worker_index=index, num_workers=known)
        if self.feed is not None:
            self.feed.ctx = self.ctx

    def total_steps(self) -> int | None:
        """--steps, or --epochs worth of this worker's batches (None: tf.data cannot tell
        how many batches an epoch has before reading it)."""
        if self.config.steps is not None:
            return self.config.steps
        if self.planned_per_epoch is None:
            return None
        return max(1, int(round(self.config.epochs * self.planned_per_epoch)))

    def batches(self) -> Iterator[tuple[Any, Any]]:
        """The training batches, ``(features, labels)`` as the step takes them (NumPy for
        tf1), at most ``--steps`` of them."""
        assert self._batches is not None, "prime or from_splits before batches"
        limit = self.config.steps
        n = 0
        while limit is None or n < limit:  # checked first: a split feed asks for no split more
            item = next(self._batches, None)
            if item is None:
                return
            n += 1
            epoch, (x, y) = item
            self.epoch = epoch
            if self.config.graph == "tf1":
                yield x.numpy(), y.numpy()
            else:
                yield x, y

    def close(self) -> None:
        """Close the input generators, so their tf.data iterators go now: a worker sits in
        reference cycles, and a cyclic GC long after would delete them all at once."""
        if self._batches is not None:
            self._batches.close()
        if self._input_stream is not None:
            self._input_stream.close()
