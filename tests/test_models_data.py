"""Model specs, fingerprints and the data loaders."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np
import pytest

from downpour.inputs.data import load_mnist_5k, load_mnist_idx, read_idx
from downpour.model.build import build_model, fingerprint
from downpour.models import deep_mnist
from downpour.spec import load_spec


def test_deep_mnist_has_the_tutorial_architecture() -> None:
    model = build_model(deep_mnist())
    assert model.count_params() == 3_274_634
    shapes = [tuple(v.shape) for v in model.trainable_variables]
    assert shapes == [
        (5, 5, 1, 32),
        (32,),
        (5, 5, 32, 64),
        (64,),
        (3136, 1024),
        (1024,),
        (1024, 10),
        (10,),
    ]


def test_fingerprint_is_stable_and_tells_models_apart() -> None:
    a = fingerprint(build_model(load_spec("tiny_models:tiny")).trainable_variables)
    b = fingerprint(build_model(load_spec("tiny_models:tiny"), seed=5).trainable_variables)
    c = fingerprint(build_model(load_spec("tiny_models:tiny_other")).trainable_variables)
    assert a == b  # weights do not matter, only names, shapes and dtypes
    assert a != c


def test_load_spec_rejects_bad_references() -> None:
    with pytest.raises(ValueError, match="module:function"):
        load_spec("no_colon")
    with pytest.raises(TypeError, match="not a ModelSpec"):
        load_spec("downpour.inputs.data:load_mnist_5k")


def test_mnist_5k_is_shuffled_split_and_scaled() -> None:
    d = load_mnist_5k()
    assert d.x_train.shape == (4000, 28, 28, 1) and d.x_test.shape == (1000, 28, 28, 1)
    assert d.x_train.dtype == np.float32 and d.x_train.min() >= 0.0 and d.x_train.max() <= 1.0
    # the file is sorted by label; a shuffled split has every digit on both sides
    assert set(np.unique(d.y_train)) == set(range(10)) == set(np.unique(d.y_test))
    assert np.array_equal(load_mnist_5k().y_test, d.y_test)  # fixed seed: same split every time


def _write_idx(path: Path, arr: np.ndarray, gz: bool) -> None:
    header = struct.pack(">BBBB", 0, 0, 0x08, arr.ndim) + b"".join(
        struct.pack(">I", d) for d in arr.shape
    )
    data = header + arr.astype(np.uint8).tobytes()
    if gz:
        path = path.with_name(path.name + ".gz")
        path.write_bytes(gzip.compress(data))
    else:
        path.write_bytes(data)


@pytest.mark.parametrize("gz", [False, True])
def test_idx_loader_reads_the_standard_files(tmp_path: Path, gz: bool) -> None:
    rng = np.random.default_rng(0)
    imgs = rng.integers(0, 256, (7, 28, 28))
    labels = rng.integers(0, 10, 7)
    _write_idx(tmp_path / "train-images-idx3-ubyte", imgs, gz)
    _write_idx(tmp_path / "train-labels-idx1-ubyte", labels, gz)
    _write_idx(tmp_path / "t10k-images-idx3-ubyte", imgs[:3], gz)
    _write_idx(tmp_path / "t10k-labels-idx1-ubyte", labels[:3], gz)
    d = load_mnist_idx(tmp_path)
    assert d.x_train.shape == (7, 28, 28, 1) and d.y_test.tolist() == labels[:3].tolist()
    assert np.allclose(d.x_train[..., 0] * 255, imgs)


def test_idx_loader_rejects_truncated_files(tmp_path: Path) -> None:
    p = tmp_path / "x"
    _write_idx(p, np.zeros((4, 2), np.uint8), gz=False)
    p.write_bytes(p.read_bytes()[:-1])
    with pytest.raises(ValueError, match="payload bytes"):
        read_idx(p)
    p.write_bytes(b"\x01\x02\x08\x01")
    with pytest.raises(ValueError, match="magic"):
        read_idx(p)
