"""What a model's ``input_fn`` is told, and how a worker's share of the data is chosen.

A model's input is ``ModelSpec.input_fn(ctx) -> tf.data.Dataset`` of ``(features, labels)``
batches: one pass (one epoch) over this worker's share of the training data. Features may be a
tensor, a tuple or a dict; labels any rank and dtype the loss takes. The worker calls
``input_fn`` again for every epoch, with ``ctx.epoch`` counting up, so a shuffle seeded with
``ctx.seed + ctx.epoch`` reshuffles every epoch and is the same on every worker.

The input function says how its data divides, by calling one of two helpers:

- ``ctx.shard_files(files)`` where the data is in files: the files this worker reads;
- ``ctx.shard(dataset)`` where it is not: this worker's elements of ``dataset``.

Statically (the default), worker ``i`` of ``N`` gets every ``N``-th file or element from the
``i``-th, so the ``N`` workers together see each example once per epoch. Under server dispatch
(``--data-dispatch server``) the server hands out splits (a file, or a range of elements) and
``ctx.split`` is the one this dataset must read; the same two helpers then return that split.
A function that calls neither helper gets its batches sharded by the worker (batch ``j`` to
worker ``j mod N``), which is correct but reads and discards the other workers' batches;
under dispatch it is refused, since the server cannot divide what it cannot see.

Before asking for splits, a dispatched worker calls ``input_fn`` once with ``probe`` set: the
helpers then return everything (all files, all elements) and record in ``found`` what the
data is (``files``: the file list; ``elements``: the dataset's cardinality), which the worker
sends to the server as the data universe.

This module imports no TensorFlow at import time (``import downpour`` stays light).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import tensorflow as tf

FILES: Literal["files"] = "files"
ELEMENTS: Literal["elements"] = "elements"


@dataclass(frozen=True)
class Split:
    """One unit of work the server's dispatcher hands out: a file, or ``[start, stop)`` of the
    elements, identified by ``index`` within its epoch. ``skip``: batches of it already
    trained by a worker that died while reading it; the worker reading it now starts after
    them (the split's batches come in the same order on every read)."""

    index: int
    file: str | None = None
    start: int = 0
    stop: int = 0
    skip: int = 0

    @property
    def kind(self) -> str:
        return FILES if self.file is not None else ELEMENTS


@dataclass(frozen=True)
class InputContext:
    """What ``input_fn`` gets: which worker it runs in, the epoch, and where the data is.

    ``worker_id`` is the worker's ``--worker-id``. Statically ``worker_index`` of
    ``num_workers`` chooses the share; under server dispatch (which chooses the share itself)
    ``worker_index`` is the worker's index in the order the dispatching server first heard of
    each worker id, stable while the server knows the id, and ``num_workers`` the number of
    ids it knew when this worker said hello (at least ``worker_index + 1``).
    ``seed`` is the same on every worker (``--seed``); ``epoch`` counts passes from 0;
    ``data_dir`` is ``--data-dir``; ``batch_size`` is the spec's. ``split`` is set only under
    server dispatch. ``used`` records which sharding helper the function called (``files``,
    ``elements`` or neither), for the worker to check and report. With ``probe`` set the
    helpers also record what they were given in ``found`` (see the module docstring).
    """

    worker_index: int = 0
    num_workers: int = 1
    seed: int = 0
    epoch: int = 0
    data_dir: str | None = None
    batch_size: int = 50
    split: Split | None = None
    probe: bool = False
    worker_id: str = ""
    used: list[str] = field(default_factory=list, compare=False, repr=False)
    found: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {self.num_workers}")
        if not 0 <= self.worker_index < self.num_workers:
            raise ValueError(
                f"worker_index must be in 0..{self.num_workers - 1}, got {self.worker_index}"
            )

    def for_epoch(self, epoch: int, split: Split | None = None) -> InputContext:
        """This context for another epoch (and, under dispatch, another split)."""
        return replace(self, epoch=epoch, split=split, used=[], found={})

    def shard_files(self, files: Sequence[str]) -> list[str]:
        """The files this worker reads: its static share (``files[i::N]``, in the order
        given), or under dispatch the split's file. Raises ValueError when the share is
        empty (more workers than files), so a worker never trains on nothing."""
        self.used.append(FILES)
        files = list(files)
        if self.probe:
            self.found[FILES] = tuple(str(f) for f in files)
        if self.split is not None:
            if self.split.file is None:
                raise ValueError("the dispatcher handed out an element range, not a file")
            return [self.split.file]
        mine = files[self.worker_index :: self.num_workers]
        if not mine:
            raise ValueError(
                f"worker {self.worker_index} of {self.num_workers} has no file to read: "
                f"{len(files)} file(s) for {self.num_workers} workers"
            )
        return mine

    def shard(self, dataset: tf.data.Dataset) -> tf.data.Dataset:
        """This worker's elements of ``dataset``: every N-th from the i-th, or under dispatch
        the split's ``[start, stop)``. Call it before batching, after a shuffle seeded the
        same on every worker."""
        self.used.append(ELEMENTS)
        if self.probe:
            self.found[ELEMENTS] = int(dataset.cardinality())  # < 0: unknown or infinite
        if self.split is not None:
            if self.split.file is not None:
                raise ValueError("the dispatcher handed out a file, not an element range")
            return dataset.skip(self.split.start).take(self.split.stop - self.split.start)
        if self.num_workers == 1:
            return dataset
        return dataset.shard(self.num_workers, self.worker_index)
