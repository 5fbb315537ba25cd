"""A synthetic click log with a planted signal: the data of the recommendation example.

Nothing is downloaded: ``generate(config)`` draws the log from a fixed seed, the same arrays in
every process for the same ``ClickConfig``. Each event is one impression ``(user, item)`` and a
0/1 click:

- **Ids are Zipf-distributed.** User ids and item ids are drawn independently with
  ``P(rank k) ∝ 1 / k ** exponent`` over ``1..users`` (``1..items``), and ranks are mapped to
  ids by a seeded permutation, so the hot ids are scattered over the table (as hashed ids are),
  not packed at its start.
- **The signal is planted.** Every user and item gets a latent factor vector of ``rank``
  dimensions, and every item a popularity bias. An event's logit is
  ``z = dot(u_f, i_f) + i_b + offset``; its click is drawn with probability
  ``sigmoid(z + e)``, ``e ~ Normal(0, noise)`` per event. ``signal`` is the standard deviation of
  ``dot(u_f, i_f)``, ``item_bias`` that of ``i_b``; ``offset`` sets the click rate.
- **The best achievable AUC is known.** No model can rank held-out events better than the
  true ``z`` (the noise and the Bernoulli draw are unpredictable, and ``sigmoid(z + e)``'s mean
  is monotone in ``z``): ``oracle_auc`` is the exact AUC of ``z`` on the held-out labels.
  A model that learns only item popularity reaches ``popularity_auc`` (the AUC of ``i_b``).
- **Ids can be 64-bit hashes.** With ``hashed=True`` the ids a model sees (``split``, the
  files) are ``hashed_ids`` of the indexes: a fixed seeded bijection of 64-bit words viewed
  as int64 (negative and huge values included), so the ids come from a space of 2**64, far
  larger than any table, as hashed user and item ids do; the planted truth, the Zipf law and
  the AUCs are those of the indexes. ``HASHED`` is a log with a long tail: a million users
  and 50,000 items for 240,000 impressions, so most ids are seen once and new ones keep
  arriving (what a dynamic table's admission is for).
- **The held-out split is disjoint.** ``held_out`` events, chosen by a seeded permutation,
  are held out; every event has an ``id`` (its index in the log) and the two splits share none.

``write_tfrecord`` writes a log as TFRecord shards (``downpour data clicks DIR``): the
``records`` layout (``train-*-of-*.tfrecord``, ``held_out-00000-of-00001.tfrecord``) with
``clicks.json`` (the config and counts) instead of ``dataset.json``; each record is a
``tf.train.Example`` with int64 ``user``, ``item``, ``id`` and a float ``click``.

This module imports TensorFlow only to write or read records.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from downpour.examples.records import HELD_OUT, TRAIN, shard_name
from downpour.model.hashing import mix64
from downpour.spec import auc

CLICKS_META = "clicks.json"


@dataclass(frozen=True)
class ClickConfig:
    """The generator's knobs; the defaults are the size the example's ``spec`` trains."""

    users: int = 20_000
    items: int = 5_000
    events: int = 240_000  # impressions in all, held-out ones included
    held_out: int = 20_000
    exponent: float = 1.1  # Zipf exponent of both id distributions
    rank: int = 4  # dimensions of the planted factors
    signal: float = 2.0  # std of dot(u_f, i_f)
    item_bias: float = 1.0  # std of the item bias
    offset: float = -0.5  # added to every logit: sets the click rate
    noise: float = 0.5  # std of the per-event logit noise
    seed: int = 0
    hashed: bool = False  # the ids a model sees are hashed_ids of the indexes

    def __post_init__(self) -> None:
        if min(self.users, self.items, self.rank) < 1:
            raise ValueError("users, items and rank must be >= 1")
        if not 0 < self.held_out < self.events:
            raise ValueError(f"held_out must be in 1..{self.events - 1}, got {self.held_out}")
        if self.exponent <= 0 or min(self.signal, self.item_bias, self.noise) < 0:
            raise ValueError("exponent must be > 0; signal, item_bias and noise >= 0")


SMALL = ClickConfig()  # downpour.examples.recsys:spec
LARGE = ClickConfig(users=100_000, items=50_000, events=2_000_000, held_out=100_000)  # :large
_ROLE_SALT = {"user": 0x243F6A8885A308D3, "item": 0x13198A2E03707344}  # digits of pi
HASHED = ClickConfig(users=1_000_000, items=50_000, hashed=True)  # recsys_hashed:spec


def hashed_ids(index: np.ndarray, role: str, seed: int = 0) -> np.ndarray:
    """The 64-bit ids (int64) of ``role``'s (``"user"``, ``"item"``) indexes in a log seeded
    ``seed``: ``mix64(index ^ salt)``, a bijection of 64-bit words, so distinct indexes keep
    distinct ids and the ids spread over all of int64; the salt, itself mixed from (role,
    seed), keeps the ids of other roles and seeds apart."""
    key = np.array([_ROLE_SALT[role] ^ (seed & 0xFFFF_FFFF_FFFF_FFFF)], np.uint64)
    salt = mix64(key)[0]
    return mix64(np.asarray(index, np.int64).view(np.uint64) ^ salt).view(np.int64)


@dataclass(frozen=True)
class ClickLog:
    """One generated log: the events of both splits and the planted truth.

    ``train`` and ``test`` are index arrays into the event arrays ``user``, ``item`` (the
    indexes of the planted truth, ``0..users-1`` and ``0..items-1``), ``click`` (float32 0/1)
    and ``logit`` (the true ``z``, without noise); ``bias`` holds the planted item biases.
    ``split`` gives the ids a model sees: the indexes, or their ``hashed_ids`` when
    ``config.hashed``.
    """

    config: ClickConfig
    user: np.ndarray
    item: np.ndarray
    click: np.ndarray
    logit: np.ndarray
    bias: np.ndarray
    train: np.ndarray
    test: np.ndarray

    def split(self, part: str) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """``({"user", "item", "id"}, clicks)`` of ``"train"`` or ``"held_out"``."""
        idx = self.train if part == TRAIN else self.test
        user, item = self.user[idx], self.item[idx]
        if self.config.hashed:
            seed = self.config.seed
            user, item = hashed_ids(user, "user", seed), hashed_ids(item, "item", seed)
        return {"user": user, "item": item, "id": idx.astype(np.int64)}, self.click[idx]

    def oracle_auc(self) -> float:
        """The best achievable held-out AUC: the true logit's (see the module)."""
        return auc(self.click[self.test], self.logit[self.test])

    def popularity_auc(self) -> float:
        """Held-out AUC of ranking by the true item bias alone (what popularity can get)."""
        return auc(self.click[self.test], self.bias[self.item[self.test]])


def zipf_ids(rng: np.random.Generator, n: int, exponent: float, size: int) -> np.ndarray:
    """``size`` ids in ``0..n-1`` with ``P(rank k) ∝ k ** -exponent``, ranks mapped to ids by
    a permutation drawn from ``rng`` (int64)."""
    weights = np.arange(1, n + 1, dtype=np.float64) ** -exponent
    cdf = np.cumsum(weights)
    ranks = np.searchsorted(cdf, rng.random(size) * cdf[-1], side="right")
    ranks = np.minimum(ranks, n - 1)  # a draw of exactly cdf[-1] (rounding) stays in range
    return rng.permutation(n).astype(np.int64)[ranks]


def generate(config: ClickConfig = ClickConfig()) -> ClickLog:
    """The log ``config`` describes, deterministic in ``config.seed`` (see the module)."""
    c = config
    rng = np.random.default_rng([c.seed, 20_18])
    user = zipf_ids(rng, c.users, c.exponent, c.events)
    item = zipf_ids(rng, c.items, c.exponent, c.events)
    scale = np.sqrt(c.signal / np.sqrt(c.rank))  # std of dot(u_f, i_f) = scale**2 * sqrt(rank)
    u_f = rng.normal(0.0, scale, (c.users, c.rank))
    i_f = rng.normal(0.0, scale, (c.items, c.rank))
    i_b = rng.normal(0.0, c.item_bias, c.items)
    logit = np.einsum("nk,nk->n", u_f[user], i_f[item]) + i_b[item] + c.offset
    p = 1.0 / (1.0 + np.exp(-(logit + rng.normal(0.0, c.noise, c.events))))
    click = (rng.random(c.events) < p).astype(np.float32)
    order = rng.permutation(c.events)
    test, train = np.sort(order[: c.held_out]), np.sort(order[c.held_out :])
    return ClickLog(c, user, item, click, logit.astype(np.float32), i_b, train, test)


def write_tfrecord(out: str | os.PathLike[str], log: ClickLog, shards: int = 4) -> Path:
    """Write ``log`` into the existing directory ``out`` as TFRecord shards and
    ``clicks.json``; returns the path of ``clicks.json``."""
    import tensorflow as tf

    out = Path(out)
    for part, count in ((TRAIN, shards), (HELD_OUT, 1)):
        features, clicks = log.split(part)
        bounds = np.linspace(0, len(clicks), count + 1).astype(int)
        for s in range(count):
            with tf.io.TFRecordWriter(str(out / shard_name(part, s, count, "tfrecord"))) as w:
                for j in range(bounds[s], bounds[s + 1]):
                    ex = tf.train.Example()
                    f = ex.features.feature
                    f["user"].int64_list.value.append(int(features["user"][j]))
                    f["item"].int64_list.value.append(int(features["item"][j]))
                    f["id"].int64_list.value.append(int(features["id"][j]))
                    f["click"].float_list.value.append(float(clicks[j]))
                    w.write(ex.SerializeToString(deterministic=True))
    meta = {
        "config": asdict(log.config),
        "train": len(log.train),
        "held_out": len(log.test),
        "shards": shards,
        "oracle_auc": round(log.oracle_auc(), 6),
        "click_rate": round(float(log.click.mean()), 6),
    }
    path = out / CLICKS_META
    path.write_text(json.dumps(meta, indent=2) + "\n")
    return path


def read_config(data_dir: str | os.PathLike[str]) -> ClickConfig:
    """The ``ClickConfig`` a directory written by ``write_tfrecord`` holds; ValueError saying
    how to write one when ``clicks.json`` is missing."""
    path = Path(data_dir) / CLICKS_META
    if not path.is_file():
        raise ValueError(f"{data_dir}: no {CLICKS_META}; write it with `downpour data clicks DIR`")
    return ClickConfig(**json.loads(path.read_text())["config"])
