"""MkDocs hook: let mkdocstrings find the ``downpour`` package, laid out by a package-dir map.

``pyproject.toml`` installs ``shared/`` as ``downpour`` and ``services/<name>/`` as
``downpour.<name>``. griffe (mkdocstrings-python's loader) reads source statically and looks
for a ``downpour/`` folder on its search path; it reads setuptools' editable finder only when
the folder's name is the package's. So at build time this hook builds that folder in a temporary
directory, from symlinks to the real files, and gives it to the python handler as its ``paths``
(searched before ``sys.path``). Nothing is imported, so no TensorFlow is loaded, and no editable
install is needed: the map is read from ``pyproject.toml`` itself.
"""

from __future__ import annotations

import shutil
import tempfile
import tomllib
from pathlib import Path
from typing import Any

from mkdocs.plugins import event_priority

_tree: Path | None = None


def build_tree(root: Path, dest: Path) -> None:
    """Lay out every package of ``[tool.setuptools.package-dir]`` under ``dest`` as symlinks."""
    with open(root / "pyproject.toml", "rb") as f:
        mapping: dict[str, str] = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    targets = {pkg: dest.joinpath(*pkg.split(".")) for pkg in mapping}
    for target in targets.values():
        target.mkdir(parents=True, exist_ok=True)
    for pkg, src in mapping.items():
        for child in sorted((root / src).iterdir()):
            link = targets[pkg] / child.name
            if child.name == "__pycache__" or link.exists():
                continue  # a mapped subpackage of the same name wins
            link.symlink_to(child.resolve(), target_is_directory=child.is_dir())


@event_priority(100)  # before mkdocstrings' own on_config, which creates the handler
def on_config(config: Any) -> Any:
    """Build the tree once per process and make it the python handler's search path."""
    global _tree
    if _tree is None:
        _tree = Path(tempfile.mkdtemp(prefix="downpour-docs-"))
        build_tree(Path(config["config_file_path"]).resolve().parent, _tree)
    handlers = config["plugins"]["mkdocstrings"].config["handlers"]
    handlers.setdefault("python", {})["paths"] = [str(_tree)]
    return config


def on_shutdown() -> None:
    """Remove the temporary tree."""
    global _tree
    if _tree is not None:
        shutil.rmtree(_tree, ignore_errors=True)
        _tree = None
