"""``downpour export``: the command; the export itself is ``downpour.serving.export``."""

from __future__ import annotations

import argparse
import logging
import sys

from downpour.serving.export import ExportError, export


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``downpour export`` options."""
    p.add_argument(
        "--state-dir",
        action="append",
        required=True,
        metavar="DIR",
        help="the server's --state-dir (its newest checkpoint is exported); "
        "a sharded server: once per shard",
    )
    p.add_argument(
        "--out",
        required=True,
        metavar="PATH",
        help="PATH.keras: a Keras archive; any other PATH: a SavedModel directory",
    )
    p.add_argument(
        "--model",
        metavar="MODULE:FUNCTION",
        help="the server's --model (default: the model the checkpoint names, if it resolves, "
        "else downpour.models:deep_mnist)",
    )
    p.add_argument("--data-dir", help="the model's --data-dir, for the check after writing")
    p.add_argument(
        "--no-verify",
        action="store_true",
        help="do not load the written file back and score it on the held-out set",
    )
    p.add_argument(
        "--delta-from",
        metavar="EXPORT_DIR",
        help="a model with dynamic tables: write to --out not a full export but the delta "
        "from this full export of the same model (rows changed since, ids evicted since, "
        "dense variables); apply it with downpour.serving.delta.apply_delta",
    )


def main(args: argparse.Namespace) -> int:
    """Run ``downpour export``; 0 on success, 2 when refused."""
    from downpour.runtime.logs import setup_logging

    if not logging.getLogger().handlers:  # leave an embedding program's logging alone
        setup_logging("export", "INFO", "text")
    try:
        r = export(
            args.state_dir,
            args.out,
            args.model,
            args.data_dir,
            not args.no_verify,
            args.delta_from,
        )
    except ExportError as exc:
        print(f"downpour export: {exc}", file=sys.stderr)
        return 2
    for path, version in r.checkpoints:
        print(f"checkpoint {path} (version {version})")
    kinds = {"keras": "Keras archive", "delta": "delta export directory"}
    kind = kinds.get(r.format, "SavedModel directory")
    print(f"model {r.model_ref}: wrote {kind} {r.path}")
    if r.custom_objects and r.format == "keras":
        print(f"note: loading {r.path} needs these classes importable: {r.custom_objects}")
    if r.batchnorm_recalibrated:
        print(
            f"BatchNorm statistics of {r.batchnorm_recalibrated} layer(s) recomputed for the "
            "exported weights from the training data (docs: models.md, BatchNorm)"
        )
    elif r.non_trainable:
        print(
            "note: non-trainable variables are exported as the model's build() made them "
            f"(downpour trains and checkpoints trainable variables only): {r.non_trainable}"
        )
    if r.max_abs_diff is not None:
        print(f"reloaded: outputs match (max abs diff {r.max_abs_diff:.2g})")
    if r.accuracy is not None:
        print(f"held-out {r.metric}: {r.accuracy:.4f}")
    return 0
