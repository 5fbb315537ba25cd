"""The code map and the API reference name every module of the package, and nothing else;
and no class or function of the package grows past its size limit.

The code map (``## Code map`` in docs/development.md) has one table row per module of the
installed package ``downpour``, its first cell the module's name in backticks (a link into the
API reference); the API reference (docs/api/*.md) has a ``::: downpour.x`` entry per module.
The modules are read from the source folders that pyproject.toml's
``[tool.setuptools.package-dir]`` maps to the package, with pkgutil and without importing
anything, so a module added to any of those folders fails here, by name, until both pages
name it. A code map row naming a module that does not exist fails too.

The same walk finds the source files whose classes and functions are measured
(``oversized``): a class is split along its responsibilities before it passes
``MAX_CLASS_LINES`` lines, a function (a method, a nested one) before ``MAX_FUNCTION_LINES``.
"""

from __future__ import annotations

import ast
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


def package_files(root: Path) -> dict[str, Path]:
    """Every module and package of ``downpour`` and its source file, from the package-dir
    map of ``root``."""
    with open(root / "pyproject.toml", "rb") as f:
        mapping: dict[str, str] = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    found: dict[str, Path] = {}

    def walk(package: str, folder: Path) -> None:
        found[package] = folder / "__init__.py"
        for info in pkgutil.iter_modules([str(folder)]):
            name = f"{package}.{info.name}"
            if not info.ispkg:
                found[name] = folder / f"{info.name}.py"
            elif name not in mapping:  # a mapped subpackage is walked from its own folder
                walk(name, folder / info.name)

    for package, source in mapping.items():
        walk(package, root / source)
    return found


def package_modules(root: Path) -> set[str]:
    """Every module and package of ``downpour``, from the package-dir map of ``root``."""
    return set(package_files(root))


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


MAX_CLASS_LINES = 420  # the guide: about 400
MAX_FUNCTION_LINES = 85  # the guide: about 80


def oversized(root: Path) -> list[str]:
    """Classes over ``MAX_CLASS_LINES`` and functions over ``MAX_FUNCTION_LINES`` in the
    package's source files, as ``module:Qualified.name: N lines (limit L)``. A definition's
    lines run from its ``class`` or ``def`` line (decorators not counted) to its last line,
    as ``ast`` gives them; the docstring counts."""
    out = []

    def visit(node: ast.AST, module: str, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                name = f"{prefix}{child.name}"
                limit = MAX_CLASS_LINES if isinstance(child, ast.ClassDef) else MAX_FUNCTION_LINES
                assert child.end_lineno is not None
                n = child.end_lineno - child.lineno + 1
                if n > limit:
                    out.append(f"{module}:{name}: {n} lines (limit {limit})")
                visit(child, module, f"{name}.")
            else:
                visit(child, module, prefix)

    for module, path in sorted(package_files(root).items()):
        visit(ast.parse(path.read_text(encoding="utf-8"), str(path)), module, "")
    return out


def test_no_class_or_function_of_the_package_passes_its_size_limit() -> None:
    """A class past about 400 lines or a function past about 80 is split along its
    responsibilities (a collaborator object, a helper per step), not merely shortened."""
    problems = oversized(ROOT)
    assert not problems, "split these along their responsibilities:\n" + "\n".join(problems)


def _lines(head: str, n: int, indent: str = "    ") -> str:
    """A definition ``head`` of ``n`` lines in all."""
    return head + "\n" + f"{indent}x = 0\n" * (n - 1)


def test_the_size_check_names_each_class_and_function_past_its_limit(tmp_path: Path) -> None:
    """One line over names it (a method and a nested function by their qualified names);
    exactly at the limit passes."""
    root = _tree(tmp_path, "", "")
    (root / "lib/wire.py").write_text(
        _lines("class Big:", MAX_CLASS_LINES - MAX_FUNCTION_LINES)
        + _lines("    def long(self) -> None:", MAX_FUNCTION_LINES + 1, "        ")
        + "\n"
        + _lines("class Fits:", MAX_CLASS_LINES)
        + _lines("def fits() -> None:", MAX_FUNCTION_LINES),
        encoding="utf-8",
    )
    (root / "services/svc/loop.py").write_text(
        _lines("def outer() -> None:", 2)
        + _lines("    def inner() -> None:", MAX_FUNCTION_LINES + 1, "        "),
        encoding="utf-8",
    )
    assert oversized(root) == [
        f"downpour.svc.loop:outer: {MAX_FUNCTION_LINES + 3} lines (limit {MAX_FUNCTION_LINES})",
        f"downpour.svc.loop:outer.inner: {MAX_FUNCTION_LINES + 1} lines "
        f"(limit {MAX_FUNCTION_LINES})",
        f"downpour.wire:Big: {MAX_CLASS_LINES + 1} lines (limit {MAX_CLASS_LINES})",
        f"downpour.wire:Big.long: {MAX_FUNCTION_LINES + 1} lines (limit {MAX_FUNCTION_LINES})",
    ]
