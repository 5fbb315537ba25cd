"""Initial values that depend only on (seed, variable, row): any layout starts the same."""

from __future__ import annotations

import logging
import math

import keras
import numpy as np
import pytest

from downpour.inputs.data import Dataset
from downpour.model import initial
from downpour.model.build import build_model, define_model
from downpour.server.checkpointing.capture import capture
from downpour.server.state import ParameterState
from downpour.spec import ModelSpec, load_spec

ROWS = 3000  # several blocks for a width of 200: block_rows((3000, 200)) == 1310


def _model(init: object, rows: int = ROWS, dim: int = 200) -> keras.Model:
    inp = keras.Input((2,), dtype="int32")
    e = keras.layers.Embedding(rows, dim, embeddings_initializer=init, name="table")(inp)
    out = keras.layers.Dense(3, name="head")(keras.layers.Flatten()(e))
    return keras.Model(inp, out, name="init_model")


def _ids(_d: str | None) -> Dataset:
    x, y = np.zeros((8, 2), np.int32), np.zeros(8, np.int64)
    return Dataset(x, y, x, y)


def _spec(init: object, rows: int = ROWS, dim: int = 200) -> ModelSpec:
    return ModelSpec(name="init_model", build=lambda: _model(init, rows, dim), load_data=_ids)


INITS = {
    "uniform": lambda: keras.initializers.RandomUniform(-0.2, 0.3),
    "normal": lambda: keras.initializers.RandomNormal(0.5, 0.1),
    "truncated": lambda: keras.initializers.TruncatedNormal(0.0, 0.2),
    "glorot": lambda: keras.initializers.GlorotUniform(),
    "he_normal": lambda: keras.initializers.HeNormal(),
    "constant": lambda: keras.initializers.Constant(0.25),
    "orthogonal": lambda: keras.initializers.Orthogonal(),
}


def _table(spec: ModelSpec, seed: int = 0) -> np.ndarray:
    return build_model(spec, seed).get_layer("table").embeddings.numpy()


@pytest.mark.parametrize("kind", sorted(INITS))
def test_any_row_range_is_those_rows_of_the_whole_variable(kind: str) -> None:
    whole = _table(_spec(INITS[kind]()))
    table = define_model(_spec(INITS[kind]())).get_layer("table").embeddings
    assert initial.deferred(table)
    for start, stop in [(0, 1), (1, 1309), (1300, 1320), (1310, 2620), (2999, 3000), (7, 3000)]:
        part = initial.new_part(table, 0, start, stop, f"p{start}")
        assert part.shape == (stop - start, 200)
        np.testing.assert_array_equal(part.numpy(), whole[start:stop])


def test_values_depend_on_the_seed_and_the_variable_name() -> None:
    a, b = _table(_spec("uniform"), seed=0), _table(_spec("uniform"), seed=1)
    assert not np.array_equal(a, b)
    np.testing.assert_array_equal(a, _table(_spec("uniform"), seed=0))
    blocks = [initial.block_seed(0, "x", 0), initial.block_seed(0, "y", 0)]
    assert not np.array_equal(blocks[0].numpy(), blocks[1].numpy())


def test_the_distribution_and_scale_are_the_initialisers() -> None:
    """The moments of each family match the initialiser's (large samples, fixed seeds)."""
    cases = {  # kind: (mean, std, low, high)
        "uniform": (0.05, 0.5 / math.sqrt(12), -0.2, 0.3),
        "normal": (0.5, 0.1, -np.inf, np.inf),
        "truncated": (0.0, 0.2 * 0.87962566, -0.4, 0.4),
        "glorot": (0.0, math.sqrt(6 / (ROWS + 200)) / math.sqrt(3), *(
            s * math.sqrt(6 / (ROWS + 200)) for s in (-1, 1))),
        "he_normal": (0.0, math.sqrt(2 / ROWS) * 0.87962566 / 0.87962566103423978,
                      -2 * math.sqrt(2 / ROWS) / 0.87962566103423978,
                      2 * math.sqrt(2 / ROWS) / 0.87962566103423978),
    }  # fmt: skip
    for kind, (mean, std, low, high) in cases.items():
        t = _table(_spec(INITS[kind]()))
        assert t.min() >= low and t.max() <= high, kind
        assert abs(t.mean() - mean) < 0.01 * max(std, 0.1), kind
        assert abs(t.std() - std) < 0.01 * std, kind
    assert np.all(_table(_spec(INITS["constant"]())) == np.float32(0.25))


def test_define_model_allocates_nothing_and_probes_still_work() -> None:
    model = define_model(load_spec("tiny_models:embedding_dict"))
    assert model.variables and all(initial.deferred(v) for v in model.variables)
    state = ParameterState(load_spec("tiny_models:embedding_dict"), num_shards=2, shard=0)
    assert state.row_sparsity is not None and state.row_sparsity.problem is None
    assert any(state.row_sparsity.sparse)


def test_a_build_that_sets_weights_keeps_them_and_says_it_allocated(
    caplog: pytest.LogCaptureFixture,
) -> None:
    pretrained = [np.full((3, 4), 0.5, np.float32), np.arange(4, dtype=np.float32)]

    def build() -> keras.Model:
        inp = keras.Input((3,))
        m = keras.Model(inp, keras.layers.Dense(4, name="d")(inp))
        m.set_weights(pretrained)  # e.g. weights loaded from a file
        return m

    with caplog.at_level(logging.WARNING, "downpour"):
        model = build_model(ModelSpec(name="pretrained", build=build, load_data=_ids))
    for got, want in zip(model.get_weights(), pretrained, strict=True):
        np.testing.assert_array_equal(got, want)
    assert "'pretrained' cannot be built without allocating its variables" in caplog.text
    assert "assigns values to 2 variable(s)" in caplog.text


def _joined(states: list[ParameterState]) -> list[np.ndarray]:
    n = len(states[0].description)
    per_shard = [[v.numpy() for v in s.variables] for s in states]
    return states[0].partition.join(per_shard, n)


@pytest.mark.parametrize("ref", ["tiny_models:embedding_list", "tiny_models:wide"])
def test_one_and_three_shards_start_from_identical_weights(ref: str) -> None:
    spec = load_spec(ref)
    one = ParameterState(spec, seed=3)
    three = [ParameterState(spec, seed=3, shard=k, num_shards=3) for k in range(3)]
    assert any(not p.whole for parts in three[0].partition.shards for p in parts)
    for a, b in zip([v.numpy() for v in one.variables], _joined(three), strict=True):
        assert a.tobytes() == b.tobytes()
    # a shard holds its parts only, each at the part's size
    for s in three:
        assert s.model is None
        assert [v.shape for v in s.variables] == [p.part_shape for p in s.partition.shards[s.shard]]


def test_adagrad_slots_start_as_keras_adagrads() -> None:
    state = ParameterState(load_spec("tiny_models:embedding"), optimizer="adagrad", seed=0)
    slots = {k: a for k, a in capture(state).items() if "accumulator" in k}
    assert slots and all(np.all(a == np.float32(0.1)) for a in slots.values())
    reference = keras.optimizers.Adagrad()
    reference.build(state.variables)
    assert sorted(v.name for v in reference.variables) == sorted(
        v.name for v in state.optimizer.variables
    )
