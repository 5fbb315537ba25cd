"""The trained model out of the servers' checkpoints, for plain TensorFlow (``downpour export``).

The server's checkpoint (``shared/checkpoints/store.py``) holds every trainable variable as
``model/<variable path>`` (and the optimizer's slots as ``optimizer/...``, ignored here). Export
reads the newest checkpoint of each ``--state-dir``, checks its fingerprint against the model
built from ``--model``, assigns the arrays to that model's trainable variables and writes

- ``PATH.keras``: a Keras archive (``keras.models.load_model``), or
- any other ``PATH``: a TensorFlow SavedModel directory (``tf.saved_model.load``; the
  ``serve`` endpoint and the ``serving_default`` signature take a batch of inputs and return
  the model's outputs).

Neither needs downpour to load. The written file is loaded back and its outputs compared with
the model's before export reports success.

Sharded servers (one state directory per shard) store only their parts, a row range of a
split variable as ``model/<path>[start:stop]``; ``--state-dir`` is then given once per shard,
and the parts are joined by the row ranges each checkpoint records
(``downpour.checkpoints.layout``), whatever number of shards wrote them. Rows no checkpoint holds
are an error naming the variable.

A model with ``downpour.layers.DynamicEmbedding`` layers exports to a SavedModel directory
whose lookups read each table's rows from every shard's checkpoint
(``downpour.serving.saved_model``); with ``--delta-from`` a full export of it, ``--out`` is
instead a delta directory: the rows changed since that export and the ids gone
(``downpour.serving.delta``).
"""

from __future__ import annotations

import contextlib
import logging
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from downpour.checkpoints.layout import MODEL_PREFIX

if TYPE_CHECKING:
    import keras

    from downpour.checkpoints.store import Checkpoint
    from downpour.spec import ModelSpec

log = logging.getLogger("downpour.export")

# Outputs of the reloaded file must match the in-memory model's to this (relative) tolerance.
RTOL = 1e-5


class ExportError(Exception):
    """Export refused: no checkpoint, another model, a missing variable, a bad output path."""


@dataclass
class ExportResult:
    """What was written, from what, and how the reloaded file scored."""

    path: Path
    format: str  # "keras" or "saved_model"
    model_ref: str
    checkpoints: list[tuple[str, int]]  # (file, version) per state directory
    accuracy: float | None = None  # the spec's metric on the held-out set, reloaded model
    metric: str = "accuracy"  # the spec's metric_name: what ``accuracy`` holds
    max_abs_diff: float | None = None  # reloaded vs in-memory outputs
    custom_objects: list[str] = field(default_factory=list)
    non_trainable: list[str] = field(default_factory=list)
    batchnorm_recalibrated: int = 0  # BatchNormalization layers whose statistics were recomputed


def load_checkpoints(state_dirs: Sequence[str | Path]) -> list[Checkpoint]:
    """The newest loadable checkpoint of each state directory (one per shard)."""
    from downpour.checkpoints.dirs import newest_each
    from downpour.checkpoints.store import CheckpointError

    if not state_dirs:
        raise ExportError("give at least one --state-dir")
    try:
        return newest_each(state_dirs)
    except CheckpointError as exc:
        raise ExportError(f"--state-dir {exc}") from None


def check_shards(checkpoints: Sequence[Checkpoint]) -> None:
    """Refuse a set of checkpoints that is not exactly one whole model.

    One unsharded checkpoint, or one checkpoint per shard of the same partition.
    """
    partitions = {c.meta.get("partition") for c in checkpoints}
    if len(partitions) > 1:
        raise ExportError(
            "the checkpoints come from different partitions of the model: "
            + ", ".join(f"{c.path} (partition {c.meta.get('partition')})" for c in checkpoints)
        )
    num_shards = {int(c.meta.get("num_shards", 1)) for c in checkpoints}
    if len(num_shards) > 1:
        raise ExportError(f"the checkpoints disagree on the number of shards: {sorted(num_shards)}")
    n = num_shards.pop()
    shards = sorted(int(c.meta.get("shard", 0)) for c in checkpoints)
    if shards != list(range(n)):
        missing = sorted(set(range(n)) - set(shards))
        twice = sorted({i for i in shards if shards.count(i) > 1})
        problems = ([f"missing {missing}"] if missing else []) + (
            [f"shard(s) {twice} given twice"] if twice else []
        )
        raise ExportError(
            f"need one checkpoint of each of the {n} shard(s), got shard(s) {shards} "
            f"({', '.join(problems)}): pass each shard's state directory once, "
            "--state-dir DIR per shard"
        )


def _pieces(checkpoints: Sequence[Checkpoint], variables: Sequence[keras.Variable]) -> list:
    """Every weights array of the set with the rows it covers: as each checkpoint's metadata
    records them, or, for a checkpoint without records, by the partition it names (which
    must be this model's over its number of shards)."""
    from downpour.checkpoints.layout import WEIGHTS, pieces_of_set
    from downpour.net.cluster import partition_of

    try:
        pieces, unknown = pieces_of_set(checkpoints, lambda n: partition_of(variables, n))
    except ValueError as exc:
        raise ExportError(str(exc)) from None
    for path, keys in unknown.items():
        lacking = sorted(k[len(MODEL_PREFIX) :] for k in keys if k.startswith(MODEL_PREFIX))
        if lacking:
            raise ExportError(f"{path} holds variables this model lacks: {lacking}")
    return [p for p in pieces if p.slot == WEIGHTS]


def gather_variables(
    checkpoints: Sequence[Checkpoint], variables: Sequence[keras.Variable]
) -> list[np.ndarray]:
    """One array per variable, joined by row range from the checkpoints' pieces (whatever
    number of shards wrote them). Optimizer entries are ignored; a variable or rows no
    checkpoint holds, overlapping pieces, an entry the model lacks, or a shape or dtype
    mismatch is an ExportError."""
    from downpour.checkpoints.layout import WEIGHTS, assemble, plan_rows

    pieces = _pieces(checkpoints, variables)
    names = {v.path for v in variables}
    unknown = sorted({p.key[len(MODEL_PREFIX) :] for p in pieces if p.variable not in names})
    if unknown:
        raise ExportError(f"the checkpoints hold variables this model lacks: {unknown}")
    held = {p.variable for p in pieces}
    sources = [c.arrays for c in checkpoints]
    out = []
    for v in variables:
        shape, dtype = tuple(int(d) for d in v.shape), np.dtype(str(v.dtype)).name
        if v.path not in held:
            raise ExportError(
                f"variable {v.path!r} {shape} is in no checkpoint given"
                " (a shard's --state-dir missing?)"
            )
        rows = shape[0] if shape else 0
        try:
            copies = plan_rows(v.path, WEIGHTS, 0, rows, shape, dtype, pieces)
        except ValueError as exc:
            raise ExportError(f"variable {exc}") from None
        out.append(np.asarray(assemble(copies, sources, shape, dtype)))
    return out


def model_candidates(meta: dict[str, Any]) -> list[str]:
    """Model references to try when --model is not given, most specific first.

    The checkpoint records the spec's *name* (``model``); it resolves when it is a
    ``module:function`` reference or a built-in model of ``downpour.model.build``. A ``model_ref``
    entry, if a server records one, comes first.
    """
    from downpour.spec import DEFAULT_MODEL

    refs = []
    if isinstance(meta.get("model_ref"), str):
        refs.append(meta["model_ref"])
    name = meta.get("model")
    if isinstance(name, str) and name:
        refs.append(name if ":" in name else f"downpour.models:{name}")
    refs.append(DEFAULT_MODEL)
    return list(dict.fromkeys(refs))


def resolve_spec(model_ref: str | None, meta: dict[str, Any]) -> tuple[str, ModelSpec]:
    """(reference, spec): ``--model`` if given, else the first candidate that loads."""
    from downpour.spec import load_spec

    if model_ref is not None:
        try:
            return model_ref, load_spec(model_ref)
        except (ImportError, AttributeError, ValueError, TypeError) as exc:
            raise ExportError(f"--model {model_ref}: {exc}") from None
    for ref in model_candidates(meta):
        try:
            return ref, load_spec(ref)
        except (ImportError, AttributeError, ValueError, TypeError):
            continue
    raise ExportError("no model: pass --model module:function (the server's --model)")


def custom_objects(model: keras.Model) -> list[str]:
    """Classes in the model's Keras config that are not Keras's own.

    A ``.keras`` file names them, and loading it needs them importable (or ``custom_objects``);
    a SavedModel directory does not.
    """
    import keras

    found: set[str] = set()

    def walk(o: Any) -> None:
        if isinstance(o, dict):
            if "class_name" in o and "module" in o:
                module = o.get("module")
                if not (isinstance(module, str) and module.split(".")[0] == "keras"):
                    found.add(f"{module}.{o['class_name']}" if module else str(o["class_name"]))
            for v in o.values():
                walk(v)
        elif isinstance(o, list):
            for v in o:
                walk(v)

    walk(keras.saving.serialize_keras_object(model))
    return sorted(found)


def write_model(model: keras.Model, out: Path) -> str:
    """Write ``out`` as a .keras archive or a SavedModel directory; return the format."""
    if out.suffix == ".keras":
        model.save(out)
        return "keras"
    model.export(str(out), format="tf_saved_model", verbose=False)
    return "saved_model"


def reload_fn(out: Path, fmt: str) -> Any:
    """A callable batch -> outputs from the written file, as plain TensorFlow/Keras loads it."""
    import keras
    import tensorflow as tf

    if fmt == "keras":
        loaded = keras.models.load_model(out, compile=False)
        return lambda x: loaded(x, training=False)
    loaded = tf.saved_model.load(str(out))  # must outlive the call: it owns the variables
    return lambda x: loaded.serve(tf.nest.map_structure(tf.convert_to_tensor, x))


@dataclass
class Loaded:
    """A checkpoint set's model: built from its spec, its variables (all but dynamic tables)
    given the checkpoints' values, BatchNorm statistics recomputed for them."""

    spec: ModelSpec
    ref: str
    model: keras.Model
    checkpoints: list[Checkpoint]
    dynamic: list[Any]
    recalibrated: int


def load_model(
    checkpoints: list[Checkpoint], model_ref: str | None, data_dir: str | None
) -> Loaded:
    """The model of the newest checkpoint of each shard (``load_checkpoints``), checked
    against the checkpoints' fingerprint; ExportError when it does not fit them."""
    from downpour.inputs.pipeline import context, resolve_inputs, training_features
    from downpour.model.build import (
        batchnorm_layers,
        build_model,
        fingerprint,
        recalibrate_batchnorm,
    )
    from downpour.serving.saved_model import dense_variables, dynamic_layers

    check_shards(checkpoints)
    ref, spec = resolve_spec(model_ref, checkpoints[0].meta)
    try:
        model = build_model(spec)
    except ValueError as exc:
        raise ExportError(f"model {ref}: {exc}") from None
    dynamic = dynamic_layers(model)
    fixed = {id(v) for v in dense_variables(model)}
    variables = [v for v in model.trainable_variables if id(v) in fixed]
    fp = fingerprint(model.trainable_variables)  # a dynamic table's as declared, as servers do
    for c in checkpoints:
        if c.meta.get("fingerprint") != fp:
            raise ExportError(
                f"{c.path} was written for model {c.meta.get('model')!r} (fingerprint "
                f"{c.meta.get('fingerprint')}), but {ref} ({spec.name!r}) has fingerprint {fp}: "
                "pass the server's --model module:function"
            )
    for v, a in zip(variables, gather_variables(checkpoints, variables), strict=True):
        v.assign(a)
    recalibrated = 0
    if batchnorm_layers(model):  # their statistics are recomputed for these weights
        try:
            first = training_features(
                resolve_inputs(spec, data_dir).train, context(spec, data_dir), 20
            )
            recalibrated = recalibrate_batchnorm(model, first)
        except (OSError, ValueError) as exc:
            raise ExportError(
                f"the model has BatchNormalization layers, whose statistics are recomputed "
                f"from the training data, and that does not load: {exc} (pass --data-dir)"
            ) from None
    return Loaded(spec, ref, model, list(checkpoints), dynamic, recalibrated)


def export(
    state_dirs: Sequence[str | Path],
    out: str | Path,
    model_ref: str | None = None,
    data_dir: str | None = None,
    verify: bool = True,
    delta_from: str | None = None,
) -> ExportResult:
    """Export the newest checkpoint(s) of ``state_dirs`` to ``out``; see the module docstring.

    With ``verify`` the file is loaded back, its outputs compared with the in-memory model on
    (up to 256) held-out examples, and the spec's metric computed on the whole held-out set.
    """
    out = Path(out)
    if out.exists():
        raise ExportError(f"{out} exists: remove it or choose another --out")
    if not out.parent.is_dir():
        raise ExportError(f"{out.parent}: no such directory")
    checkpoints = load_checkpoints(state_dirs)
    if delta_from is not None:
        check_delta_from(delta_from, checkpoints[0].meta)
    loaded = load_model(checkpoints, model_ref, data_dir)
    spec, model, ref, dynamic = loaded.spec, loaded.model, loaded.ref, loaded.dynamic
    if (dynamic or delta_from) and out.suffix == ".keras":
        raise ExportError("a model with dynamic tables exports to a SavedModel directory: "
                          "an --out without .keras")  # fmt: skip
    if delta_from is not None and not dynamic:
        raise ExportError(f"--delta-from: model {ref} has no dynamic table (DynamicEmbedding)")
    recalibrated = loaded.recalibrated
    try:
        if dynamic:
            return _export_tables(spec, model, out, ref, checkpoints, data_dir, verify, delta_from)
        return _write_and_verify(spec, model, out, ref, checkpoints, recalibrated, data_dir, verify)
    except BaseException as exc:  # nothing half-written stays behind, whatever stopped it
        _remove(out)
        if isinstance(exc, ExportError) and out.suffix == ".keras":
            raise ExportError(
                f"{str(exc).rstrip('.')}; removed it. A SavedModel directory (an --out without "
                f".keras, e.g. --out {out.with_suffix('')}) holds the traced computation and "
                "loads without the model's Python code (Lambda layers, classes of its own)"
            ) from None
        raise


def _remove(out: Path) -> None:
    """Remove what an export began to write at ``out`` (a file or a directory)."""
    if out.is_dir() and not out.is_symlink():
        shutil.rmtree(out, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            out.unlink()


def _write_and_verify(
    spec: ModelSpec,
    model: keras.Model,
    out: Path,
    ref: str,
    checkpoints: Sequence[Checkpoint],
    recalibrated: int,
    data_dir: str | None,
    verify: bool,
) -> ExportResult:
    """Write ``out`` and, with ``verify``, load it back and compare (see ``export``)."""
    try:
        fmt = write_model(model, out)
    except (OSError, ValueError, TypeError, NotImplementedError) as exc:
        raise ExportError(f"cannot write {out}: {exc}") from None
    result = ExportResult(
        path=out,
        format=fmt,
        model_ref=ref,
        checkpoints=[(str(c.path), c.version) for c in checkpoints],
        custom_objects=custom_objects(model),
        non_trainable=[
            v.path for v in model.non_trainable_variables if "seed_generator" not in v.path
        ],
        batchnorm_recalibrated=recalibrated,
    )
    if not verify:
        return result
    ds, held, sample = held_out_sample(spec, data_dir, out)
    try:
        fn = reload_fn(out, result.format)
    except Exception as exc:  # noqa: BLE001 - any load failure is reported, with the reason
        if result.custom_objects:
            why = (
                f"it needs the model's own classes {result.custom_objects}: export a SavedModel "
                "directory instead (an --out without .keras), or register the classes with "
                "@keras.saving.register_keras_serializable() and import them before loading"
            )
        else:
            why = " ".join(str(exc).split())[:500]
        raise ExportError(f"{out} was written but does not load back: {why}") from None
    compare(result, np.asarray(model(sample, training=False)), np.asarray(fn(sample)))
    if held:
        labels, outputs = zip(*((np.asarray(y), np.asarray(fn(f))) for f, y in ds), strict=True)
        result.accuracy = spec.metric(np.concatenate(labels), np.concatenate(outputs))
        result.metric = spec.metric_name
    return result


def held_out_sample(spec: ModelSpec, data_dir: str | None, out: Path) -> tuple[Any, bool, Any]:
    """(dataset, whether it is the held-out set, a batch of up to 256 of its features) to
    check the written ``out`` with; ExportError when the data does not load or is empty."""
    from downpour.inputs.pipeline import build_dataset, context, resolve_inputs

    try:
        inputs = resolve_inputs(spec, data_dir)
        held = inputs.held_out is not None
        ds = build_dataset(
            inputs.held_out or inputs.train,
            context(spec, data_dir),
            "held_out_fn" if held else "input_fn",
        )
        sample = next(iter(ds.map(lambda f, _y: f).unbatch().take(256).batch(256)), None)
    except (OSError, ValueError) as exc:
        raise ExportError(
            f"{out} was written, but the model's data for checking it does not load: {exc} "
            "(pass --data-dir, or --no-verify)"
        ) from None
    if sample is None:
        raise ExportError(f"{out} was written, but the model's data has no example to check it")
    return ds, held, sample


def compare(result: ExportResult, want: np.ndarray, got: np.ndarray) -> None:
    """Record the reloaded outputs' distance from the expected ones in ``result``;
    ExportError beyond ``RTOL``."""
    result.max_abs_diff = float(np.max(np.abs(got.astype(np.float64) - want))) if len(got) else 0.0
    if result.max_abs_diff > RTOL * (1.0 + float(np.max(np.abs(want), initial=0.0))):
        raise ExportError(
            f"{result.path}: the reloaded model's outputs differ from the checkpoint's by "
            f"{result.max_abs_diff:g}"
        )


def check_delta_from(delta_from: str, meta: dict[str, Any]) -> None:
    """ExportError unless ``delta_from`` is a full export of the checkpoints' model."""
    from downpour.serving.saved_model import ServingError, read_export

    try:
        old, _ = read_export(delta_from)
    except ServingError as exc:
        raise ExportError(f"--delta-from {exc}") from None
    if old["fingerprint"] != meta.get("fingerprint"):
        raise ExportError(
            f"--delta-from {delta_from} is an export of model {old['model']!r} (fingerprint "
            f"{old['fingerprint']}); the checkpoints are of {meta.get('model')!r} (fingerprint "
            f"{meta.get('fingerprint')})"
        )


def _export_tables(
    spec: ModelSpec,
    model: keras.Model,
    out: Path,
    ref: str,
    checkpoints: Sequence[Checkpoint],
    data_dir: str | None,
    verify: bool,
    delta_from: str | None,
) -> ExportResult:
    """Write the serving export of a model with dynamic tables, or with ``delta_from`` the
    delta from that export; with ``verify`` the export is loaded back and its outputs on
    held-out examples compared with the model holding the tables' rows."""
    import tensorflow as tf

    from downpour.checkpoints.tables import tables_from_checkpoints
    from downpour.model.build import fingerprint
    from downpour.serving import saved_model as dyn
    from downpour.serving.delta import write_delta

    fixed = dyn.dense_variables(model)
    fp = fingerprint(model.trainable_variables)
    ordered = sorted(checkpoints, key=lambda c: int(c.meta.get("shard", 0)))
    versions = [c.version for c in ordered]
    try:
        tables = {p: dyn.as_table(s) for p, s in tables_from_checkpoints(ordered).items()}
        if delta_from is not None:
            dense = {v.path: np.asarray(v.numpy()) for v in fixed}
            write_delta(delta_from, out, tables, dense, versions, fp)
        else:
            dyn.write_export(model, tables, out, versions, fp, spec.name)
    except ValueError as exc:  # a ServingError, or a CheckpointError of the tables
        raise ExportError(str(exc)) from None
    result = ExportResult(
        path=out,
        format="delta" if delta_from is not None else "saved_model",
        model_ref=ref,
        checkpoints=[(str(c.path), c.version) for c in ordered],
    )
    if verify and delta_from is None:
        _, _, sample = held_out_sample(spec, data_dir, out)
        loaded = tf.saved_model.load(str(out))
        got = np.asarray(loaded.serve(tf.nest.map_structure(tf.convert_to_tensor, sample)))
        compare(result, dyn.reference_outputs(model, tables, sample), got)
    return result
