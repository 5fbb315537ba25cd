"""Trainable variables that are not float32: float16 and float64 train through a real server
and worker; what cannot travel (bfloat16, integers) or be told apart (one path twice) is
refused by both services at start, naming the variable."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import Cluster, pull_weights
from inproc import InprocServer, Services, make_worker, settle

from downpour.model.build import build_model, check_variables, evaluate
from downpour.spec import load_spec


@pytest.mark.parametrize(
    ("ref", "message"),
    [
        ("dtype_models:bfloat16", r"'brain/kernel' has dtype bfloat16.*'mixed_bfloat16'"),
        ("dtype_models:int_trainable", r"'shift/offset' has dtype int32.*trainable=False"),
        ("dtype_models:twin_paths", r"two trainable variables have the path 'twin/scale'"),
    ],
)
def test_build_model_refuses_variables_downpour_cannot_train(ref: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_model(load_spec(ref))


def test_float16_float64_and_int_state_pass_the_check() -> None:
    model = build_model(load_spec("dtype_models:mixed"))
    check_variables(model)
    assert {v.path: str(v.dtype) for v in model.trainable_variables} == {
        "half/kernel": "float16",
        "half/bias": "float16",
        "double/kernel": "float64",
        "double/bias": "float64",
        "logits/kernel": "float32",
        "logits/bias": "float32",
    }
    assert [(v.path, str(v.dtype)) for v in model.non_trainable_variables] == [
        ("steps/count", "int64")
    ]


def test_float16_and_float64_variables_train_through_server_and_worker(
    services: Services,
) -> None:
    ref = "dtype_models:mixed"
    server = services.server(ref, learning_rate=0.01)
    settle(server.status, services.train(server.port, 1, ref, steps=80))
    version, weights = pull_weights(server.rep)
    assert version == 80
    assert [a.dtype.name for a in weights] == [
        "float16", "float16", "float64", "float64", "float32", "float32"
    ]  # fmt: skip
    assert all(np.isfinite(a).all() for a in weights)

    spec = load_spec(ref)
    model = build_model(spec)
    for v, a in zip(model.trainable_variables, weights, strict=True):
        v.assign(a)
    data = spec.load_data(None)
    assert evaluate(spec, model, data.x_test, data.y_test) >= 0.8  # chance: 0.25


def test_server_and_worker_refuse_a_bfloat16_model_in_process() -> None:
    ref = "dtype_models:bfloat16"
    message = "trainable variable 'brain/kernel' has dtype bfloat16"
    with pytest.raises(ValueError, match=message):
        InprocServer(ref)
    with pytest.raises(ValueError, match=message):
        make_worker(1, ref)


@pytest.mark.slow
def test_server_and_worker_refuse_a_bfloat16_model_at_start(cluster: Cluster) -> None:
    ref = "dtype_models:bfloat16"
    server = cluster.server(model=ref, wait=False)
    worker = cluster.worker(1, "--server-timeout", "5", model=ref)  # fails before any hello
    assert server.wait(timeout=90) == 2
    assert worker.wait(timeout=90) == 2
    for service in (server, worker):
        assert "trainable variable 'brain/kernel' has dtype bfloat16" in service.log_text()
