"""The code map and the API reference name every module of the package, and nothing else.

The code map (``## Code map`` in docs/development.md) has one table row per module of the
installed package ``downpour``, its first cell the module's name in backticks (a link into the
API reference); the API reference (docs/api/*.md) has a ``::: downpour.x`` entry per module.
The modules are read from the source folders that pyproject.toml's
``[tool.setuptools.package-dir]`` maps to the package, with pkgutil and without importing
anything, so a module added to any of those folders fails here, by name, until both pages
name it. A code map row naming a module that does not exist fails too.
"""

from __future__ import annotations

import pkgutil
import re
import tomllib
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CODE_MAP_PAGE = Path("docs/development.md")
API_DIR = Path("docs/api")

_SECTION = re.compile(r"^## Code map\n(.*?)(?=^## |\Z)", re.M | re.S)
_ROW = re.compile(r"^\|\s*\[?`([\w.]+)`", re.M)
_AUTODOC = re.compile(r"^::: ([\w.]+)\s*$", re.M)


def package_modules(root: Path) -> set[str]:
    """Every module and package of ``downpour``, from the package-dir map of ``root``."""
    with open(root / "pyproject.toml", "rb") as f:
        mapping: dict[str, str] = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    found: set[str] = set()

    def walk(package: str, folder: Path) -> None:
        found.add(package)
        for info in pkgutil.iter_modules([str(folder)]):
            name = f"{package}.{info.name}"
            if not info.ispkg:
                found.add(name)
            elif name not in mapping:  # a mapped subpackage is walked from its own folder
                walk(name, folder / info.name)

    for package, source in mapping.items():
        walk(package, root / source)
    return found


def code_map_rows(root: Path) -> list[str]:
    """The module named by each row of the code map, in page order."""
    text = (root / CODE_MAP_PAGE).read_text(encoding="utf-8")
    section = _SECTION.search(text)
    assert section, f"{CODE_MAP_PAGE} has no '## Code map' section"
    return _ROW.findall(section.group(1))


def api_entries(root: Path) -> set[str]:
    """The identifiers of every ``:::`` entry of the API reference's pages."""
    pages = sorted((root / API_DIR).glob("*.md"))
    return {m for page in pages for m in _AUTODOC.findall(page.read_text(encoding="utf-8"))}


def code_map_problems(root: Path) -> list[str]:
    """Modules without a code map row, rows naming no module, modules with two rows."""
    modules, rows = package_modules(root), code_map_rows(root)
    problems = [
        f"{m}: no line in the code map ({CODE_MAP_PAGE})" for m in sorted(modules) if m not in rows
    ]
    problems += [
        f"{m}: in the code map, but there is no such module" for m in rows if m not in modules
    ]
    problems += [f"{m}: {n} lines in the code map" for m, n in Counter(rows).items() if n > 1]
    return problems


def api_problems(root: Path) -> list[str]:
    """Modules without a ``:::`` entry in the API reference."""
    entries = api_entries(root)
    return [
        f"{m}: no '::: {m}' in {API_DIR}/*.md"
        for m in sorted(package_modules(root))
        if m not in entries
    ]


def test_the_walk_finds_modules_of_every_source_folder() -> None:
    modules = package_modules(ROOT)
    for name in (
        "downpour",
        "downpour.wire",
        "downpour.__main__",
        "downpour.examples.wine",
        "downpour.server.dispatch",
        "downpour.worker.rows.cache",
        "downpour.cli.status",
        "downpour.cli.__main__",
    ):
        assert name in modules, f"{name} not found by the walk: {sorted(modules)}"
    assert "downpour.examples.server" not in modules and "downpour.server.server" not in modules


def test_the_code_map_names_every_module_once_and_nothing_else() -> None:
    problems = code_map_problems(ROOT)
    assert not problems, "the code map and the package disagree:\n" + "\n".join(problems)


def test_the_api_reference_has_an_entry_for_every_module() -> None:
    problems = api_problems(ROOT)
    assert not problems, "modules missing from the API reference:\n" + "\n".join(problems)


def _tree(tmp_path: Path, code_map: str, api: str) -> Path:
    """A package ``downpour`` of two folders, with a code map page and an API page."""
    (tmp_path / "pyproject.toml").write_text(
        '[tool.setuptools.package-dir]\ndownpour = "lib"\n"downpour.svc" = "services/svc"\n',
        encoding="utf-8",
    )
    for path in (
        "lib/__init__.py",
        "lib/wire.py",
        "services/svc/__init__.py",
        "services/svc/loop.py",
    ):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text('"""A module."""\n', encoding="utf-8")
    (tmp_path / API_DIR).mkdir(parents=True)
    (tmp_path / CODE_MAP_PAGE).write_text(code_map, encoding="utf-8")
    (tmp_path / API_DIR / "index.md").write_text(api, encoding="utf-8")
    return tmp_path


def test_the_checks_name_a_missing_and_an_unknown_module(tmp_path: Path) -> None:
    code_map = (
        "# Dev\n\n## Code map\n\n| module | owns |\n|---|---|\n"
        "| [`downpour`](api/index.md#downpour) | the API |\n"
        "| `downpour.wire` | the wire |\n| `downpour.wire` | again |\n"
        "| `downpour.svc.gone` | nothing |\n| `downpour.svc` | the service |\n\n"
        "## Test tiers\n\n| `downpour.svc.loop` | outside the section |\n"
    )
    api = "# API\n\n::: downpour\n\n::: downpour.svc\n    options:\n      members: []\n"
    root = _tree(tmp_path, code_map, api)
    assert package_modules(root) == {
        "downpour",
        "downpour.wire",
        "downpour.svc",
        "downpour.svc.loop",
    }
    assert code_map_problems(root) == [
        f"downpour.svc.loop: no line in the code map ({CODE_MAP_PAGE})",
        "downpour.svc.gone: in the code map, but there is no such module",
        "downpour.wire: 2 lines in the code map",
    ]
    assert api_problems(root) == [
        f"downpour.svc.loop: no '::: downpour.svc.loop' in {API_DIR}/*.md",
        f"downpour.wire: no '::: downpour.wire' in {API_DIR}/*.md",
    ]


MAX_MODULES_PER_FOLDER = 20


def test_no_source_folder_holds_more_than_twenty_modules() -> None:
    """Folders group modules by concept; one that grows past this is split into subpackages."""
    counts = Counter(m.rpartition(".")[0] for m in package_modules(ROOT) if m != "downpour")
    crowded = {pkg: n for pkg, n in counts.items() if n > MAX_MODULES_PER_FOLDER}
    assert not crowded, f"folders over {MAX_MODULES_PER_FOLDER} modules: {crowded}"
