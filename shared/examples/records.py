"""The on-disk layout that ``downpour data`` writes and the file examples read.

A data directory holds one ``dataset.json`` and the shards of two splits::

    dataset.json                          what is in the files (below)
    train-00000-of-00004.tfrecord ...     the training split, in --shards files
    held_out-00000-of-00001.tfrecord      the held-out split, one file

(``.csv`` instead of ``.tfrecord`` for CSV). Every example has an integer ``id``, unique
across both splits, so a test can check that an epoch saw each example once.

- TFRecord: one ``tf.train.Example`` per record with ``image`` (the raw uint8 pixels, row
  major, as bytes), ``label`` (int64) and ``id`` (int64).
- CSV: a header ``id,label,p0,p1,...`` and one row per example, pixels as integers.

``dataset.json`` names the data set, the image shape, the divisor that maps pixels to [0, 1]
(``scale``), the number of classes and the counts. Reading it needs no TensorFlow.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

META = "dataset.json"
TRAIN = "train"
HELD_OUT = "held_out"
SPLITS = (TRAIN, HELD_OUT)
SUFFIX = {"tfrecord": ".tfrecord", "csv": ".csv"}


@dataclass(frozen=True)
class Meta:
    """What ``dataset.json`` says about a data directory."""

    dataset: str
    format: str
    shape: tuple[int, ...]
    scale: float
    classes: int
    train: int
    held_out: int
    shards: int
    seed: int

    def write(self, directory: str | os.PathLike[str]) -> None:
        """Write ``dataset.json`` into ``directory``."""
        text = json.dumps({**asdict(self), "shape": list(self.shape)}, indent=2)
        (Path(directory) / META).write_text(text + "\n")


def shard_name(split: str, index: int, count: int, fmt: str) -> str:
    """``train-00001-of-00004.tfrecord``: sorted names are the shards in order."""
    return f"{split}-{index:05d}-of-{count:05d}{SUFFIX[fmt]}"


def read_meta(data_dir: str | os.PathLike[str] | None, fmt: str) -> Meta:
    """``dataset.json`` of ``data_dir``; ValueError saying how to make one when it is missing
    or describes another format."""
    if not data_dir:
        raise ValueError(
            f"this example reads {fmt} files: write them with `downpour data {fmt} DIR` "
            "and pass --data-dir DIR"
        )
    path = Path(data_dir) / META
    if not path.is_file():
        raise ValueError(
            f"{data_dir}: no {META}; write the files with `downpour data {fmt} {data_dir}`"
        )
    raw = json.loads(path.read_text())
    meta = Meta(**{**raw, "shape": tuple(raw["shape"])})
    if meta.format != fmt:
        raise ValueError(f"{data_dir} holds {meta.format} files, this example reads {fmt}")
    return meta


def split_files(data_dir: str | os.PathLike[str], split: str, fmt: str) -> list[str]:
    """The shard files of one split, in order; ValueError if there are none."""
    files = sorted(str(p) for p in Path(data_dir).glob(f"{split}-*-of-*{SUFFIX[fmt]}"))
    if not files:
        raise ValueError(f"{data_dir}: no {split} files (*{SUFFIX[fmt]})")
    return files
