"""The server's parameters: variables, optimizer, the compiled apply step; with its parts,
the dynamic tables (``downpour.server.tables.shard``) and versioned snapshots
(``downpour.server.snapshots``).

The apply step is a ``tf.function`` whose ``input_signature`` has one ``TensorSpec`` per
trainable variable: its graph's inputs are exactly those placeholders, fed with the arrays
received off the wire. The optimizer's slot variables are built before tracing, so it is
traced once.

By default the step is compiled with XLA (``jit_compile=True``): XLA fuses the optimizer's
element-wise update into one pass over each variable and its slots, about twice as fast as
the op-by-op graph for Adam on the Deep-MNIST CNN (``make bench`` measures both). Received
arrays sit at arbitrary addresses inside ZeroMQ's buffers, and TensorFlow needs aligned ones,
so they are copied once into pre-allocated, 64-byte aligned staging buffers and handed over
through DLPack without another copy (the usual NumPy conversion allocates a fresh tensor per
call and copies into it, about three times slower).

The step's first input is the learning rate of that one update, a float32 scalar assigned to
``optimizer.learning_rate`` inside the step: a staleness policy scales it per update
(``downpour.server.policies.base``; scaling the gradient would not scale an Adam step) without a
retrace or an eager assign. ``apply(grads)`` feeds the base rate, so unscaled updates are
exactly what they were without the input.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import keras
import numpy as np
import tensorflow as tf

from downpour.layers import DynamicEmbedding, served
from downpour.memory.buffers import aligned_empty
from downpour.model import initial
from downpour.model.build import (
    define_model,
    describe_variables,
    dynamic_tables,
    embedding_tables,
    evaluate,
    fingerprint,
    zero_inputs,
)
from downpour.model.partition import Part, Partition, make_partition, message_bytes
from downpour.server.policies.base import ALL, DENSE, ROWS, ApplyPart
from downpour.server.snapshots import Snapshots
from downpour.server.tables.rows import ROW_WISE, make_optimizer, row_optimizer, row_update
from downpour.server.tables.shard import ShardTables, TableOptions
from downpour.server.tables.table import DynamicTable
from downpour.spec import ModelSpec
from downpour.wire import (
    Keyed,
    Sparse,
    WireTensor,
    all_finite,
    is_rows,
    logical_shape,
    unique_rows,
    values_of,
)

log = logging.getLogger("downpour.server")

FLAT_CALL_ARGS = ["tensor_inputs", "captured_inputs"]  # ConcreteFunction._call_flat's


def flat_call_problem() -> str | None:
    """Why an apply step cannot be called through ``ConcreteFunction._call_flat`` (None: it
    can). A call through the public structured signature binds and type-checks every input
    again, a fixed cost per apply that dominates a rows-only apply of a few hundred rows; the
    inputs here are built by ``ParameterState._feed`` from gradients the handler checked, so
    the flat call, which skips that binding, is taken when this TensorFlow has it."""
    from tensorflow.python.eager.polymorphic_function import concrete_function

    call_flat = getattr(concrete_function.ConcreteFunction, "_call_flat", None)
    if call_flat is None:
        return f"TensorFlow {tf.__version__} has no ConcreteFunction._call_flat"
    params = list(inspect.signature(call_flat).parameters)[1:]
    if params != FLAT_CALL_ARGS:
        return f"TensorFlow {tf.__version__}'s ConcreteFunction._call_flat takes {params}"
    return None


STAGE_CHUNK = 1 << 16  # elements staged and checked at a time: 256 KiB of float32 stay in L2


DYNAMIC_OPTIMIZER = {  # --optimizer -> its dynamic tables' row-wise kind (Adam's: lazy)
    "adam": "lazy_adam",
    "lazy_adam": "lazy_adam",
    "adagrad": "adagrad",
    "sgd": "sgd",
}


class _Unheld:
    """What a server's ``DynamicEmbedding`` reads in place of rows: none (the shard's
    ``DynamicTable`` holds them); an id -> slot table for tracing the model."""

    def __init__(self, layer: DynamicEmbedding) -> None:
        self.capacity = layer.declared_rows  # the declared shape: the fingerprint's
        self.table = tf.lookup.experimental.MutableHashTable(tf.int64, tf.int32, default_value=-1)


@dataclass(frozen=True)
class RowSparsity:
    """Which trainable variables get row-sparse gradients, and why none could be found.

    ``problem`` is None when the probe ran; otherwise it says why it could not, and every
    variable is applied and served whole (``sparse`` all False)."""

    sparse: list[bool]
    problem: str | None = None


def sparse_gradients(model: keras.Model) -> RowSparsity:
    """Which trainable variables get row-sparse gradients (``tf.IndexedSlices``, from an
    Embedding), found by tracing, not running, the gradient of the sum of the outputs on one
    example in the model's own input structure (a tensor, a list, a dict, nested) through
    ``stateless_call``: no data, no labels and no variable values needed, so it works on a
    model whose variables are not allocated (``downpour.model.build.define_model``). A model
    that cannot be probed that way (no declared inputs, a call that fails) is logged at warning
    level, naming its Embedding tables, which are then applied and served whole."""
    trainable, other = model.trainable_variables, model.non_trainable_variables
    kinds: list[bool] = []

    def specs(vs: Sequence[keras.Variable]) -> list[tf.TensorSpec]:
        return [tf.TensorSpec(v.shape, v.dtype) for v in vs]

    @tf.function
    def probe(tv: list[tf.Tensor], ntv: list[tf.Tensor], xs: object) -> tf.Tensor:
        with tf.GradientTape() as tape:
            tape.watch(tv)
            out, _ = model.stateless_call(tv, ntv, xs, training=False)
            total = tf.add_n([tf.reduce_sum(tf.cast(o, tf.float32)) for o in tf.nest.flatten(out)])
        kinds.extend(isinstance(g, tf.IndexedSlices) for g in tape.gradient(total, tv))
        return total

    try:
        xs = tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape, t.dtype), zero_inputs(model))
        probe.get_concrete_function(specs(trainable), specs(other), xs)
    except Exception as exc:  # noqa: BLE001 - any failure is reported, and the model applied densely
        reason = " ".join(str(exc).split())[:300] or type(exc).__name__
        tables = sorted(embedding_tables(model)) or ["(no Embedding tables)"]
        problem = f"cannot probe model {model.name!r} for row-sparse gradients: {reason}"
        log.warning("%s; applied and served whole: %s", problem, ", ".join(tables))
        return RowSparsity([False] * len(trainable), problem)
    return RowSparsity(kinds)


def _slices(it: Iterator[tf.Tensor], shape: tuple[int, ...]) -> tf.IndexedSlices:
    """The next (indices, values) pair of the apply step's inputs as IndexedSlices."""
    indices = next(it)
    values = next(it)
    return tf.IndexedSlices(values, indices, dense_shape=tf.constant(shape, tf.int64))


def _momentum_variable(optimizer: keras.optimizers.Optimizer) -> tf.Variable | None:
    """Make a Keras 3 optimizer's ``beta_1`` (a Python float, baked into a traced step as a
    constant) a float32 variable that the step reads on every call, so ``set_momentum`` can
    change it without a retrace; None for an optimizer without ``beta_1``. A plain
    ``tf.Variable``, not a Keras one: it stays out of ``optimizer.variables`` (checkpoints)."""
    beta_1 = getattr(optimizer, "beta_1", None)
    if not isinstance(beta_1, float):
        return None
    var = tf.Variable(beta_1, trainable=False, dtype=tf.float32, name="beta_1")
    optimizer.beta_1 = var
    return var


def _own_parts(
    full: Sequence[keras.Variable], parts: Sequence[Part], seed: int, shard: int
) -> list[keras.Variable]:
    """One variable per part this shard holds, allocated at the part's size and given the
    rows it covers of the whole variable's initial value (``downpour.model.initial``: the same rows
    any layout gives). A variable ``define_model`` had to allocate whole is sliced, and its
    whole-variable initialiser is named at warning level when it is split (the shard then
    draws all its rows to keep some)."""
    out = []
    for j, p in enumerate(parts):
        v = full[p.var]
        name = f"shard{shard}_part{j}"  # Keras names may not contain "/": the wire name apart
        if not initial.deferred(v):
            out.append(keras.Variable(v.numpy()[p.start : p.stop], dtype=p.dtype, name=name))
            continue
        if not p.whole and not initial.row_decomposable(v):
            log.warning(
                "%s: initialiser %s draws the whole variable at once; this shard draws all "
                "%d rows to keep rows %d:%d",
                v.path,
                type(v._initializer).__name__,
                p.shape[0],
                p.start,
                p.stop,
            )
        out.append(initial.new_part(v, seed, p.start, p.stop, name))
    return out


def stage_into(dst: np.ndarray, src: np.ndarray, check: bool = True) -> bool:
    """Copy ``src`` into the aligned buffer ``dst`` of the same shape ``STAGE_CHUNK`` elements
    at a time and, with ``check``, test each chunk for NaN/Inf while it is still in cache;
    False if a value is not finite. The server pays this one copy per received gradient
    because TensorFlow's kernels need 64-byte aligned buffers (one handed over unaligned
    through DLPack aborts the process in ``Tensor::IsAligned``) and libzmq's receive buffers
    are not aligned: checking on the way costs a read of cached data, not a second pass."""
    finite = True
    flat_src, flat_dst = src.reshape(-1), dst.reshape(-1)
    for i in range(0, flat_dst.size, STAGE_CHUNK):
        chunk = flat_dst[i : i + STAGE_CHUNK]
        np.copyto(chunk, flat_src[i : i + STAGE_CHUNK], casting="same_kind")
        if check and finite and not all_finite(chunk):
            finite = False
    return finite


class ParameterState:
    """Owns the model's variables and applies gradient lists to them, one version at a time.

    Not thread-safe: the server's loop thread is its only caller. Snapshots are immutable
    arrays; TensorFlow copies a variable's buffer before writing it while a read still holds
    it, so a snapshot is never torn by a later apply.

    ``jit`` compiles the apply step with XLA (the default: faster, same result within float
    tolerance, see tests/test_apply_jit.py); ``jit=False`` runs the op-by-op graph.
    Variables with row-sparse gradients (``sparse``, found by ``sparse_gradients``) are
    applied to the rows a push touched only; ``sparse_apply=False`` applies them densely.

    With ``num_shards`` > 1 the state holds only shard ``shard``'s parts of the model
    (``downpour.model.partition``): one variable per part, allocated at the part's size, nothing
    else of the model; initial values are a function of (seed, variable, row) only
    (``downpour.model.initial``), so the shards together start from exactly the unsharded weights.
    ``names`` are then the parts' wire names and ``model`` is None (a shard cannot evaluate).

    Its parts: the fixed variables and the compiled apply are here; the dynamic tables are
    ``shard_tables`` (``downpour.server.tables.shard``), what pulls read of each version
    ``snapshots`` (``downpour.server.snapshots``).
    """

    def __init__(
        self,
        spec: ModelSpec,
        optimizer: str = "adam",
        learning_rate: float = 1e-3,
        seed: int = 0,
        jit: bool = True,
        shard: int = 0,
        num_shards: int = 1,
        sparse_apply: bool = True,
        table_options: TableOptions | None = None,
    ) -> None:
        if not 0 <= shard < num_shards:  # this class's own arguments (the settings' check
            # of --shard against --num-shards is validate_server's)
            raise ValueError(f"shard must be in 0..{num_shards - 1}, got {shard}")
        self.spec = spec
        self.shard = shard
        self.learning_rate = float(learning_rate)
        self.optimizer_name = optimizer
        self.optimizer = make_optimizer(optimizer, learning_rate)
        # the dynamic tables' row-wise optimizer, with this Keras optimizer's hyperparameters
        self.table_optimizer = row_optimizer(DYNAMIC_OPTIMIZER[optimizer], self.optimizer)
        options = table_options or TableOptions()
        parts, row_sparse = self._build(spec, seed, shard, num_shards, sparse_apply, options)
        self._lay_out(parts, row_sparse, jit)
        self._build_optimizer()
        self.version = 0
        self.apply_traces = 0
        self.snapshots = Snapshots(self._var, self.shapes, self.dtypes, self.sparse)
        self._prepare_apply()

    def _build(
        self,
        spec: ModelSpec,
        seed: int,
        shard: int,
        num_shards: int,
        sparse_apply: bool,
        table_options: TableOptions,
    ) -> tuple[tuple[Part, ...], list[bool]]:
        """Declare the model, probe it, partition it and allocate this shard's variables (the
        whole model unsharded) and its dynamic tables: sets the model's identity,
        ``partition``, ``model``, ``variables`` and ``shard_tables``; returns this shard's
        parts and which of the model's variables are row-sparse."""
        with served(_Unheld):  # a DynamicEmbedding's rows are this shard's DynamicTable's
            model = define_model(spec, seed)  # declared, not allocated (downpour.model.initial)
        full = list(model.trainable_variables)
        layers = dynamic_tables(model)
        # None with --sparse-apply off: nothing served by row, by the operator's choice
        self.row_sparsity = sparse_gradients(model) if sparse_apply else None
        row_sparse = self.row_sparsity.sparse if self.row_sparsity else [False] * len(full)
        self.fingerprint = fingerprint(full)
        self.description = describe_variables(full)
        self.partition: Partition = make_partition(
            [v.path for v in full],
            [tuple(int(d) for d in v.shape) for v in full],
            [str(v.dtype) for v in full],
            num_shards,
            self.fingerprint,
            [v.path in layers for v in full],
        )
        self.partition_paths = [v.path for v in full]
        parts = self.partition.shards[shard]
        self._fixed = [i for i, p in enumerate(parts) if not p.dynamic]
        self._keyed = [i for i, p in enumerate(parts) if p.dynamic]
        self.parts = [parts[i] for i in self._fixed]  # what checkpoints hold as arrays
        # wire index -> the dynamic table's path (the table is looked up in ``tables`` on
        # each use: a restore replaces it there)
        paths = {i: full[parts[i].var].path for i in self._keyed}
        self.shard_tables = ShardTables(
            layers, paths, self.table_optimizer, table_options, shard, num_shards
        )
        # a shard evaluates nothing; nor does a server whose rows are in dynamic tables
        self.model: keras.Model | None = model if num_shards == 1 and not layers else None
        if num_shards == 1:
            for v in full:
                if initial.deferred(v) and v.path not in layers:
                    initial.materialize(v, seed)
            self.variables = [full[p.var] for p in self.parts]
        else:
            self.variables = _own_parts(full, self.parts, seed, shard)
        return parts, row_sparse

    def _lay_out(self, parts: Sequence[Part], row_sparse: Sequence[bool], jit: bool) -> None:
        """Every wire index's name, kind, shape and dtype, and the bytes of a push."""
        self.names = [p.wire_name for p in parts]
        self.index = {name: i for i, name in enumerate(self.names)}
        self.dynamic = [p.dynamic for p in parts]
        # wire index -> this shard's TF variable (fixed parts)
        self._var = dict(zip(self._fixed, self.variables, strict=True))
        # Variables whose gradients are row-sparse (an Embedding's) are applied sparsely: only
        # the rows a push touched. Their row count varies per push, which XLA would compile
        # anew for each size, so such a model's step runs as a graph without XLA.
        self.sparse = [row_sparse[p.var] or p.dynamic for p in parts]
        self.jit = jit and not any(self.sparse)
        self.shapes = [
            tuple(int(d) for d in (p.shape if p.dynamic else self._var[i].shape))
            for i, p in enumerate(parts)
        ]
        self.dtypes = [np.dtype(p.dtype) for p in parts]
        self.payload_bytes = sum(
            message_bytes(s, d, dyn)
            for s, d, dyn in zip(self.shapes, self.dtypes, self.dynamic, strict=True)
        )

    def _build_optimizer(self) -> None:
        """The Keras optimizer's slots, built before tracing, and its momentum as a
        variable the step reads."""
        # row-sparse tables updated row-wise here (downpour.server.tables.rows), the rest by Keras
        self.row_wise = [self.sparse[i] and self.optimizer_name in ROW_WISE for i in self._fixed]
        self.momentum = _momentum_variable(self.optimizer)  # before tracing: the step reads it
        self.optimizer.build(self.variables)
        self.slot_bytes = sum(  # the optimizer's arrays the size of a variable (not scalars)
            int(np.prod(v.shape)) * np.dtype(str(v.dtype)).itemsize
            for v in self.optimizer.variables
            if len(v.shape) > 0
        )

    def _prepare_apply(self) -> None:
        """The staging buffers, which variables each kind of apply updates, and the apply
        step of them all, traced here."""
        # One staging buffer per dense variable, reused by every apply (the step is
        # synchronous); a row-sparse one is fed its rows, never staged: a zero-stride view
        # standing for its shape and dtype, holding no memory.
        self._staging = [
            np.broadcast_to(np.empty((), d), s) if sparse else aligned_empty(s, d)
            for s, d, sparse in zip(self.shapes, self.dtypes, self.sparse, strict=True)
        ]
        # The variables each kind of apply updates (``apply``'s ``part``): all, or a hybrid
        # policy's halves, the dense variables or the row-sparse ones (fixed and dynamic).
        self.row_parts = tuple(i for i, s in enumerate(self.sparse) if s)
        self.dense_parts = tuple(i for i, s in enumerate(self.sparse) if not s)
        self._part_of = {ALL: tuple(range(len(self.names))), DENSE: self.dense_parts}
        self._part_of[ROWS] = self.row_parts
        # per part: its fixed variables (the compiled step's) and its dynamic tables
        members = {part: set(indices) for part, indices in self._part_of.items()}
        self._fixed_by_part = {p: [i for i in self._fixed if i in m] for p, m in members.items()}
        self._keyed_by_part = {p: [i for i in self._keyed if i in m] for p, m in members.items()}
        # None: apply steps are called flat; else why each apply binds its inputs again
        self.apply_call_problem = flat_call_problem()
        if self.apply_call_problem:
            log.warning(
                "%s: every apply binds its inputs through the structured signature, a fixed "
                "cost per apply",
                self.apply_call_problem,
            )
        self._steps = {ALL: self._trace_apply_step(self._fixed)}  # the halves' on first use

    @property
    def tables(self) -> dict[str, DynamicTable]:
        """This shard's dynamic tables by variable path (``ShardTables.tables``)."""
        return self.shard_tables.tables

    def table_config(self, path: str) -> dict[str, object]:
        """The keyword arguments that rebuild table ``path`` (``DynamicTable.from_state``)."""
        return self.shard_tables.config(path)

    def _trace_apply_step(self, fixed: Sequence[int]) -> tf.types.experimental.ConcreteFunction:
        """The compiled apply step of the fixed variables ``fixed`` (wire indices), traced
        here, once (see the module docstring). Keras optimizers update any subset of the
        variables they were built on; each step increments ``iterations`` once."""
        lr_dtype = tf.as_dtype(self.optimizer.learning_rate.dtype)
        self._base_lr = tf.constant(self.learning_rate, lr_dtype)
        signature = [tf.TensorSpec((), lr_dtype)]
        row_wise = dict(zip(self._fixed, self.row_wise, strict=True))
        inputs = [(self.shapes[i], self._var[i], self.sparse[i], row_wise[i]) for i in fixed]
        for shape, v, sparse, _ in inputs:
            if sparse:  # unique row indices, and those rows' values
                signature += [
                    tf.TensorSpec((None,), tf.int64),
                    tf.TensorSpec((None, *shape[1:]), v.dtype),
                ]
            else:
                signature.append(tf.TensorSpec(shape, v.dtype))

        @tf.function(input_signature=signature, jit_compile=self.jit)
        def apply_step(lr: tf.Tensor, *flat: tf.Tensor) -> tf.Tensor:
            self.apply_traces += 1  # runs only while tracing
            self.optimizer.learning_rate.assign(lr)  # this update's rate (staleness policies)
            it = iter(flat)
            grads = [  # the flat inputs, in order: one tensor per dense variable, two per sparse
                _slices(it, shape) if sparse else next(it) for shape, _, sparse, _ in inputs
            ]
            rest = []
            for g, (_, v, _, rows) in zip(grads, inputs, strict=True):
                if rows:  # before apply_gradients: it increments the step Adam reads
                    row_update(self.optimizer_name, self.optimizer, v, g.indices, g.values, lr)
                else:
                    rest.append((g, v))
            if rest:
                self.optimizer.apply_gradients(rest)
            else:
                self.optimizer.iterations.assign_add(1)
            return self.optimizer.iterations

        # Calling the concrete function skips tf.function's per-call argument matching: a few
        # hundred microseconds per apply with eight tensors.
        return apply_step.get_concrete_function()

    def stage(
        self, grads: Sequence[np.ndarray | Sparse], check: bool = True
    ) -> tuple[list[np.ndarray | Sparse], str | None]:
        """Copy each dense gradient into the staging buffer the apply reads and, with
        ``check``, test it for NaN/Inf chunk by chunk while the chunk is still in cache: one
        pass over the received bytes instead of a check pass and a later copy pass.

        Returns the gradients with every dense one replaced by its staging buffer (``apply``
        then copies nothing) and the name of the first gradient that is not finite (None: all
        are). The buffers are overwritten by the next ``stage`` or ``apply``: the caller
        applies or hands on what it staged before staging another push (the server's loop
        does; a policy that keeps gradients copies them at ``offer``)."""
        out: list[np.ndarray | Sparse] = []
        bad: str | None = None
        for name, buf, g, sparse in zip(self.names, self._staging, grads, self.sparse, strict=True):
            if sparse or is_rows(g) or np.shape(g) != buf.shape:
                if check and bad is None and not all_finite(values_of(g)):
                    bad = name
                out.append(g)
                continue
            if not stage_into(buf, np.asarray(g), check and bad is None):
                bad = name
            out.append(buf)
        return out, bad

    def _feed(
        self, grads: Sequence[np.ndarray | Sparse | None], fixed: Sequence[int]
    ) -> list[tf.Tensor]:
        """Tensors for the apply step of the fixed variables ``fixed``: aliases of the staging
        buffers (a gradient not staged yet is copied in), and a sparse variable's gradient as
        (unique rows, their values).

        The gradients are the model's, in variable order: the gradient handler's
        ``check_gradients`` has checked count, names, shapes and dtypes, and only a row-sparse
        variable's gradient may be ``Sparse``; that is asserted here, not checked again. A
        dense array that was not staged is still compared with its buffer's shape, as
        ``np.copyto`` would broadcast a wrong one silently (no pass over the data)."""
        tensors = []
        for i in fixed:
            name, buf, g, sparse = self.names[i], self._staging[i], grads[i], self.sparse[i]
            assert g is not None, name
            if sparse:  # rows summed; a dense gradient (after top-k, a sync average): every row
                assert logical_shape(g) == buf.shape, (name, logical_shape(g))
                rows, values = unique_rows(g)
                tensors += [tf.constant(rows), tf.constant(values.astype(buf.dtype, copy=False))]
                continue
            assert not is_rows(g), name
            if g is not buf:  # not staged (``stage``): copied in
                if np.shape(g) != buf.shape:
                    raise ValueError(f"{name}: gradient shape {np.shape(g)} != {buf.shape}")
                np.copyto(buf, g, casting="same_kind")  # received frames sit at any address
            tensors.append(tf.experimental.dlpack.from_dlpack(buf.__dlpack__()))
        return tensors

    def apply(
        self, grads: Sequence[np.ndarray | Sparse], lr_scale: float = 1.0, part: ApplyPart = ALL
    ) -> int:
        """Apply one gradient list with the learning rate times ``lr_scale`` (a staleness
        policy's scale; 1.0: the base rate); returns the new version, one more.

        ``part`` says which variables ``grads`` are for, in variable order: ``all`` of them;
        or a hybrid policy's half, ``dense`` (the variables of ``dense_parts``) or ``rows``
        (those of ``row_parts``: row-sparse tables and dynamic tables), the other half left
        untouched. Each apply is one version step whatever its part, so a pull's version and
        a row cache's staleness bound count every change of the weights."""
        indices = self._part_of[part]
        if part != ALL:  # the half's gradients at their variables' places
            placed: list[np.ndarray | Sparse | None] = [None] * len(self.names)
            for i, g in zip(indices, grads, strict=True):
                placed[i] = g
            grads = placed  # type: ignore[assignment]
        rate = self.learning_rate * float(lr_scale)
        lr = self._base_lr if lr_scale == 1.0 else tf.constant(rate, self._base_lr.dtype)
        fn, inputs = self._step(part), [lr, *self._feed(grads, self._fixed_by_part[part])]
        if self.apply_call_problem is None:
            step = fn._call_flat(inputs, fn.captured_inputs)
        else:
            step = fn(*inputs)
        self.version += 1
        keyed = self._keyed_by_part[part]
        if keyed:
            self.shard_tables.apply(grads, keyed, rate, self.version, int(step.numpy()))
        return self.version

    def _step(self, part: ApplyPart) -> tf.types.experimental.ConcreteFunction:
        """The apply step of ``part``; a half's is traced at its first apply (only a hybrid
        policy applies halves)."""
        if part not in self._steps:
            self._steps[part] = self._trace_apply_step(self._fixed_by_part[part])
        return self._steps[part]

    def set_momentum(self, beta_1: float) -> bool:
        """Use ``beta_1`` as the optimizer's momentum from the next apply on (the
        ``momentum-aware`` policy); False if the optimizer has none (sgd, adagrad). The traced
        step reads the variable, so nothing is retraced; it is assigned only when it changes."""
        if self.momentum is None:
            return False
        if float(self.momentum.numpy()) != np.float32(beta_1):
            self.momentum.assign(beta_1)
        return True

    def weights(self) -> tuple[int, list[np.ndarray]]:
        """(version, arrays) — one snapshot per version, shared by every pull of it. O(model):
        for whole pulls, evaluation and tests; a row pull uses ``dense_weights`` and
        ``gather`` (``Snapshots.weights``)."""
        return self.snapshots.weights(self.version)

    def weights_bf16(self) -> tuple[int, list[WireTensor]]:
        """(version, tensors) for a whole pull in bfloat16 (``--pull-compress bf16``), one
        list per version shared by every pull of it, the float32 variables rounded by
        TensorFlow without a float32 snapshot (``Snapshots.weights_bf16``)."""
        return self.snapshots.weights_bf16(self.version)

    def held_bytes(self) -> tuple[int, int]:
        """(parameter bytes, optimizer slot bytes) this shard holds now: its variables and
        their slots, and its dynamic tables' live rows and their slots."""
        fixed = sum(int(np.prod(self.shapes[i])) * self.dtypes[i].itemsize for i in self._fixed)
        rows, slots = self.shard_tables.held_bytes()
        return fixed + rows, self.slot_bytes + slots

    def table_status(self) -> dict[str, dict[str, object]]:
        """Per dynamic table (by path): its live rows, bytes, counters and settings."""
        return self.shard_tables.status()

    def array(self, i: int) -> np.ndarray | Keyed:
        """Variable ``i`` at this version (a snapshot shared by every pull of it)."""
        return self.snapshots.array(self.version, i)

    def dense_variables(self) -> list[keras.Variable]:
        """This shard's TF variables that are not row-sparse (what a row pull sends whole)."""
        return [self._var[i] for i in self._fixed if not self.sparse[i]]

    def dense_weights(self) -> tuple[int, list[np.ndarray | None]]:
        """(version, arrays) of the variables that are not row-sparse; None for row-sparse
        ones, which are not snapshotted: a row pull gathers their rows (``gather``)."""
        return self.snapshots.dense_weights(self.version)

    def gather(self, i: int, ids: np.ndarray) -> np.ndarray:
        """Rows ``ids`` (int64, in range: the caller checks) of row-sparse variable ``i`` at
        this version, as a fresh array: O(len(ids)), the table is not copied. A dynamic
        table's ids are any int64; one it does not hold reads its initial value."""
        if i in self.shard_tables.path_of:
            return self.shard_tables.gather(i, ids)
        return self.snapshots.gather(i, ids)

    def evaluate(self, x: np.ndarray, y: np.ndarray) -> float:
        """The spec's metric on (x, y) with the current weights (unsharded only)."""
        if self.model is None:
            raise ValueError("a shard holds part of the model and cannot evaluate it")
        return evaluate(self.spec, self.model, x, y)
