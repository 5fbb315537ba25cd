"""Initial values that depend only on (seed, variable, row): the same for any layout.

A variable's rows are generated in fixed blocks of rows; block ``b`` of variable ``name`` is
drawn by a stateless random op keyed by ``(seed, hash(name, b))``. The block size is a
function of the variable's shape alone, so the rows ``start:stop`` a shard holds are exactly
those rows of the whole variable an unsharded server or a worker builds, whatever the number
of shards, and a shard generates only (about) its own rows.

The initialiser the model chose sets the distribution and scale:

- ``Zeros``, ``Ones`` and a scalar ``Constant`` fill;
- ``RandomUniform``, ``RandomNormal`` and ``TruncatedNormal`` keep their parameters;
- ``VarianceScaling`` and its family (Glorot, He, LeCun) compute their scale from the whole
  variable's fans, as Keras does, then draw block by block;
- any other initialiser (``Orthogonal``, ``Identity``, a callable of the model's own) is
  called once for the whole variable, which is layout-independent too (every process builds
  the model with the same seeds) but allocates the whole variable: ``row_decomposable``
  says which variables need that, so a shard can warn.

A dynamic table (ids of any int64 value, rows created on first touch) has no row order to
block by: ``initial_rows`` draws each id's row from a counter-based generator (SplitMix64)
keyed by ``(seed, table, id, column)``, so a row is the same whatever the order, the batch or
the shard it is first touched in, with the same rules (``whole`` excepted).

``build_deferred`` builds a model without allocating its variables (Keras's deferred
initialisation under a ``StatelessScope``) and ``materialize`` gives one variable its
values, drawn block by block into the buffer the variable then owns: the peak is the
variable plus one block. This module is the
one place that touches Keras's deferred-variable internals (``_initializer``,
``_initialize``); tests/test_initial.py pins the behaviour they provide.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from downpour.memory.buffers import aligned_empty
from downpour.model.hashing import as_ids, mix64

log = logging.getLogger("downpour")

BLOCK_ELEMENTS = 1 << 18  # elements per generated block: 1 MiB of float32
TRUNCATED_STDDEV = 0.87962566103423978  # stddev of a unit normal truncated at 2 (Keras's)


@dataclass(frozen=True)
class Rule:
    """How one variable's values are drawn: ``kind`` is fill, uniform, normal, truncated or
    whole; ``a``/``b`` are (value, -), (min, max) or (mean, stddev)."""

    kind: str
    a: float = 0.0
    b: float = 0.0


def _same_call(init: Any, cls: type) -> bool:
    """True when ``init`` draws as ``cls`` does (its class has ``cls``'s ``__call__``)."""
    return isinstance(init, cls) and type(init).__call__ is cls.__call__


def rule_of(init: Any, shape: tuple[int, ...], dtype: str) -> Rule:
    """The rule for a variable of ``shape``/``dtype`` made by Keras initialiser ``init``."""
    from keras.src.initializers.random_initializers import compute_fans

    ki = keras.initializers
    if not tf.as_dtype(dtype).is_floating or len(shape) == 0:
        return Rule("whole")
    if _same_call(init, ki.Zeros):
        return Rule("fill", 0.0)
    if _same_call(init, ki.Ones):
        return Rule("fill", 1.0)
    if _same_call(init, ki.Constant) and np.ndim(init.value) == 0:
        return Rule("fill", float(init.value))
    if _same_call(init, ki.RandomUniform):
        return Rule("uniform", float(init.minval), float(init.maxval))
    if _same_call(init, ki.RandomNormal):
        return Rule("normal", float(init.mean), float(init.stddev))
    if _same_call(init, ki.TruncatedNormal):
        return Rule("truncated", float(init.mean), float(init.stddev))
    if _same_call(init, ki.VarianceScaling):
        fan_in, fan_out = compute_fans(
            shape,
            input_axes=getattr(init, "input_axes", None),
            output_axes=getattr(init, "output_axes", None),
        )
        fan = {"fan_in": fan_in, "fan_out": fan_out}.get(init.mode, (fan_in + fan_out) / 2.0)
        scale = init.scale / max(1.0, fan)
        if init.distribution == "truncated_normal":
            return Rule("truncated", 0.0, math.sqrt(scale) / TRUNCATED_STDDEV)
        if init.distribution == "untruncated_normal":
            return Rule("normal", 0.0, math.sqrt(scale))
        limit = math.sqrt(3.0 * scale)
        return Rule("uniform", -limit, limit)
    return Rule("whole")


def block_rows(shape: tuple[int, ...]) -> int:
    """Rows per generated block of a variable of ``shape`` (a function of the shape only)."""
    row = int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else 1
    return max(1, BLOCK_ELEMENTS // max(row, 1))


def block_seed(seed: int, name: str, block: int) -> tf.Tensor:
    """The stateless seed of block ``block`` of variable ``name`` in a run seeded ``seed``."""
    digest = hashlib.sha256(f"{name}\0{block}".encode()).digest()
    key = int.from_bytes(digest[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF
    return tf.constant([seed & 0x7FFF_FFFF_FFFF_FFFF, key], tf.int64)


def _draw(rule: Rule, shape: tuple[int, ...], dtype: tf.DType, seed: tf.Tensor) -> tf.Tensor:
    if rule.kind == "uniform":
        return tf.random.stateless_uniform(shape, seed, rule.a, rule.b, dtype=dtype)
    if rule.kind == "normal":
        return tf.random.stateless_normal(shape, seed, rule.a, rule.b, dtype=dtype)
    return tf.random.stateless_truncated_normal(shape, seed, rule.a, rule.b, dtype=dtype)


def blocks(
    rule: Rule, name: str, shape: tuple[int, ...], dtype: str, seed: int, start: int, stop: int
) -> Iterator[tuple[int, tf.Tensor]]:
    """Rows ``start:stop`` of the whole variable ``name`` of ``shape``, drawn by ``rule``
    (not ``whole``), as (offset from ``start``, rows) pieces of at most one block each."""
    per = block_rows(shape)
    dt = tf.as_dtype(dtype)
    for b in range(start // per, (stop - 1) // per + 1 if stop > start else 0):
        lo, hi = b * per, min((b + 1) * per, shape[0])
        rows = _draw(rule, (hi - lo, *shape[1:]), dt, block_seed(seed, name, b))
        a, z = max(lo, start), min(hi, stop)
        yield a - start, rows[a - lo : z - lo]


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # SplitMix64's increment
_UNIT = 2.0**-53  # one step of a 53-bit uniform


def name_key(name: str) -> int:
    """A stable 64-bit key of a name (the same in every process and Python version)."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")


def id_keys(seed: int, table: str, ids: np.ndarray) -> np.ndarray:
    """The generator key of each int64 id of ``table`` in a run seeded ``seed`` (uint64):
    distinct ids get distinct keys (``mix64`` is a bijection)."""
    base = mix64(np.array([seed & 0xFFFF_FFFF_FFFF_FFFF], np.uint64) ^ np.uint64(name_key(table)))
    return mix64(as_ids(ids).view(np.uint64) ^ mix64(base))


def _uniform01(keys: np.ndarray, counters: np.ndarray) -> np.ndarray:
    """Uniform draws in [0, 1) (float64, 53 bits): SplitMix64 output number ``counters + 1``
    of the stream that starts at each key (``keys`` and ``counters`` broadcast)."""
    with np.errstate(over="ignore"):
        words = mix64(keys + (counters.astype(np.uint64) + np.uint64(1)) * _GOLDEN)
    return (words >> np.uint64(11)).astype(np.float64) * _UNIT


def _normal01(keys: np.ndarray, counters: np.ndarray) -> np.ndarray:
    """Unit normal draws by Box-Muller from the uniform pair at counters ``2c`` and ``2c+1``."""
    u1 = 1.0 - _uniform01(keys, 2 * counters)  # in (0, 1]: the log is finite
    u2 = _uniform01(keys, 2 * counters + 1)
    return np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)


def initial_rows(
    rule: Rule, seed: int, table: str, ids: np.ndarray, dim: int, dtype: str = "float32"
) -> np.ndarray:
    """The initial rows (``len(ids)``, ``dim``) of the int64 ``ids`` of dynamic table
    ``table`` in a run seeded ``seed``, drawn by ``rule``: each row a function of (seed,
    table, id) only. Element (id, column) takes the SplitMix64 stream of ``id_keys`` at
    counter ``column`` (uniform) or the pair ``2 column``, ``2 column + 1`` (normal, Box-Muller);
    a truncated normal redraws the entries beyond 2 stddev at counter ``column + r dim`` in
    round ``r``, as Keras's ``TruncatedNormal`` redraws them. ValueError for a ``whole`` rule."""
    ids = as_ids(ids)
    if rule.kind == "fill":
        return np.full((ids.size, dim), rule.a, dtype)
    if rule.kind not in ("uniform", "normal", "truncated"):
        raise ValueError(f"no per-id initial value for rule {rule.kind!r}")
    keys = id_keys(seed, table, ids)[:, None]
    cols = np.arange(dim, dtype=np.int64)[None, :]
    if rule.kind == "uniform":
        return (rule.a + (rule.b - rule.a) * _uniform01(keys, cols)).astype(dtype)
    z = _normal01(keys, cols)
    if rule.kind == "truncated":
        bad_r, bad_c = np.nonzero(np.abs(z) > 2.0)
        r = 0
        while bad_r.size:
            r += 1
            z[bad_r, bad_c] = _normal01(keys[bad_r, 0], bad_c + r * dim)
            keep = np.abs(z[bad_r, bad_c]) > 2.0
            bad_r, bad_c = bad_r[keep], bad_c[keep]
    return (rule.a + rule.b * z).astype(dtype)


FALLBACK_KEY = "#fallback"  # a table's fallback rows draw as those of table + this key


def fallback_initial_rows(
    rule: Rule, seed: int, table: str, numbers: np.ndarray, dim: int, dtype: str = "float32"
) -> np.ndarray:
    """The initial values of fallback rows ``numbers`` (their number g over the table) of
    dynamic table ``table``: a function of (seed, table, g) only, as an id's row is, so any
    shard layout and the one process draw them alike."""
    return initial_rows(rule, seed, table + FALLBACK_KEY, numbers, dim, dtype)


def row_decomposable(variable: keras.Variable) -> bool:
    """True when deferred ``variable``'s rows can be drawn without drawing the others."""
    return _rule(variable).kind != "whole"


def _rule(variable: keras.Variable) -> Rule:
    shape = tuple(int(d) for d in variable.shape)
    return rule_of(variable._initializer, shape, str(variable.dtype))


def initial_value(
    source: keras.Variable, seed: int, start: int = 0, stop: int | None = None
) -> tf.Tensor:
    """Rows ``start:stop`` (all when ``stop`` is None) of deferred ``source``'s initial value
    as one tensor: drawn block by block into one 64-byte aligned buffer that the tensor
    shares (DLPack), so a variable made from it takes that buffer over: no second copy. (A
    variable written by a scatter op would be switched by TensorFlow to copy-on-read, and
    every later read of it would copy it whole.) A ``whole`` rule draws all of ``source`` once
    and slices it."""
    shape = tuple(int(d) for d in source.shape)
    dtype = str(source.dtype)
    rule = _rule(source)
    stop = (shape[0] if shape else 0) if stop is None else stop
    if rule.kind == "whole":
        whole = source._initializer(shape, dtype=dtype)
        return whole if not shape or (start, stop) == (0, shape[0]) else whole[start:stop]
    buf = aligned_empty((stop - start, *shape[1:]), np.dtype(dtype))
    if rule.kind == "fill":
        buf.fill(rule.a)
    else:
        for offset, rows in blocks(rule, source.path, shape, dtype, seed, start, stop):
            buf[offset : offset + int(rows.shape[0])] = rows.numpy()
    return tf.experimental.dlpack.from_dlpack(buf.__dlpack__())


def new_part(source: keras.Variable, seed: int, start: int, stop: int, name: str) -> keras.Variable:
    """A new Keras variable ``name`` holding rows ``start:stop`` of deferred ``source``'s
    initial value (a shard's piece of a split variable), allocated once."""
    shape = tuple(int(d) for d in source.shape)
    value = initial_value(source, seed, start, stop)
    return keras.Variable(
        lambda shape, dtype: value, shape=(stop - start, *shape[1:]), dtype=str(source.dtype),
        name=name,
    )  # fmt: skip


def materialize(variable: keras.Variable, seed: int) -> None:
    """Give deferred ``variable`` its initial value (allocated once)."""
    value = initial_value(variable, seed)
    variable._initialize(lambda: value)
    variable._initializer = None


def materialize_model(model: keras.Model, seed: int) -> None:
    """``materialize`` every variable of ``model`` still deferred (all of a model
    ``build_deferred`` made; none of one built allocated)."""
    for v in model.variables:
        if deferred(v):
            materialize(v, seed)


def build_deferred(build: Callable[[], keras.Model]) -> keras.Model:
    """``build()`` with every variable it creates left unallocated (Keras's deferred
    initialisation): shapes, dtypes, paths and initialisers known, no values. ValueError
    when the build assigns values (``set_weights``, loading saved weights): those would be
    lost; other failures (a build that reads values) are raised as they come."""
    from keras.src.backend.common import global_state
    from keras.src.backend.common.stateless_scope import StatelessScope

    scope = StatelessScope(initialize_variables=False)
    try:
        with scope:
            model = build()
    finally:  # nothing may initialise them behind our back (a later StatelessScope's exit)
        global_state.set_global_attribute("uninitialized_variables", [])
    if scope.state_mapping:
        raise ValueError(
            f"the build assigns values to {len(scope.state_mapping)} variable(s) "
            "(set_weights, loaded weights)"
        )
    return model


def deferred(variable: keras.Variable) -> bool:
    """True for a variable ``build_deferred`` left unallocated."""
    return getattr(variable, "_value", None) is None and variable._initializer is not None
