"""The documentation: a short README whose links all resolve, and a site that builds strictly.

Fast: README.md is at most 300 lines, and every relative link in README.md and docs/**/*.md
points at a file that exists and, with a ``#anchor`` into a Markdown file, at a heading of
that file (README links must work on GitHub and in the site, so the anchor must be the
heading's slug in both). Slow: ``mkdocs build --strict`` succeeds into a temporary directory,
the wire page carries the wire module's docstring, and a broken anchor fails the build.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
MAX_README_LINES = 300

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"!?\[[^\]\n]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)
_AUTODOC = re.compile(r"^\s*::: ([\w.]+)\s*$", re.M)


def _prose(text: str) -> str:
    """The text without fenced code blocks and inline code, where links are not links."""
    return _CODE.sub("", _FENCE.sub("", text))


def _heading_text(raw: str) -> str:
    """A heading as rendered: inline code and emphasis marks removed, links by their text."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", raw)
    return text.replace("`", "").replace("*", "")


def mkdocs_slug(heading: str) -> str:
    """Python-Markdown's toc slugify, which the site uses for heading ids."""
    text = unicodedata.normalize("NFKD", _heading_text(heading))
    text = re.sub(r"[^\w\s-]", "", text.encode("ascii", "ignore").decode()).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def github_slug(heading: str) -> str:
    """GitHub's heading anchors: lower case, punctuation dropped, each space a hyphen."""
    text = _heading_text(heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def links(path: Path) -> list[str]:
    """Relative link targets in a Markdown file (web and mail links left out)."""
    found = _LINK.findall(_prose(path.read_text(encoding="utf-8")))
    return [t for t in found if not re.match(r"^[a-z][a-z0-9+.-]*:", t, re.I)]


def markdown_files() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def anchor_ok(source: Path, target: Path, anchor: str) -> bool:
    """Whether ``anchor`` names a heading of ``target`` (or, in docs, a rendered object)."""
    text = _FENCE.sub("", target.read_text(encoding="utf-8"))
    headings = _HEADING.findall(text)
    if source == README:  # read on GitHub and in the site: both must agree
        return any(github_slug(h) == anchor == mkdocs_slug(h) for h in headings)
    if any(mkdocs_slug(h) == anchor for h in headings):
        return True
    # ``::: downpour.x`` renders the object (and its members) under ids of their paths
    idents = _AUTODOC.findall(text)
    return any(anchor == ident or anchor.startswith(ident + ".") for ident in idents)


def test_readme_is_at_most_300_lines() -> None:
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines, at most {MAX_README_LINES}"


def test_every_relative_link_resolves() -> None:
    broken = []
    checked = 0
    for source in markdown_files():
        for link in links(source):
            checked += 1
            path_part, _, anchor = link.partition("#")
            target = (source.parent / path_part).resolve() if path_part else source
            if not target.exists():
                broken.append(f"{source.relative_to(ROOT)}: {link}: no file {path_part}")
            elif anchor and target.suffix == ".md" and not anchor_ok(source, target, anchor):
                broken.append(f"{source.relative_to(ROOT)}: {link}: no heading #{anchor}")
    assert checked > 50, f"only {checked} links found: the link pattern no longer matches"
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_link_checker_sees_a_broken_anchor(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n## Keys and running with them\n", encoding="utf-8")
    assert anchor_ok(page, page, "keys-and-running-with-them")
    assert not anchor_ok(page, page, "keys")
    heading = "Policies: `downpour server --policy`"
    assert github_slug(heading) == "policies-downpour-server---policy"
    assert mkdocs_slug(heading) == "policies-downpour-server-policy"


def _require_docs_tools() -> None:
    """Skip, naming what is missing, when the docs extra is not installed."""
    missing = _docs_tools_missing()
    if missing:
        pytest.skip(f"not installed: {', '.join(missing)} (the docs extra: `make docs`)")


def _docs_tools_missing() -> list[str]:
    modules = {"mkdocs": "mkdocs", "material": "mkdocs-material"}
    modules["mkdocstrings_handlers.python"] = "mkdocstrings[python]"
    missing = []
    for module, package in modules.items():
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            missing.append(package)
    return missing


def _build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config)]
    return subprocess.run(
        [*cmd, "--site-dir", str(site)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=config.parent,
    )


@pytest.mark.slow
def test_mkdocs_build_strict(tmp_path: Path) -> None:
    _require_docs_tools()
    result = _build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert result.returncode == 0, result.stdout + result.stderr
    wire = (tmp_path / "site" / "wire" / "index.html").read_text(encoding="utf-8")
    assert "This module is the spec" in wire, "the wire page does not render downpour.wire"
    assert "PROTOCOL_VERSION" in wire


@pytest.mark.slow
def test_mkdocs_build_strict_fails_on_a_broken_anchor(tmp_path: Path) -> None:
    _require_docs_tools()
    # docs/index.md includes sections of README.md
    for name in ("pyproject.toml", "README.md", "shared", "services", "tests"):
        (tmp_path / name).symlink_to(ROOT / name)
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    shutil.copytree(DOCS, tmp_path / "docs", symlinks=True)
    with open(tmp_path / "docs" / "data.md", "a", encoding="utf-8") as f:
        f.write("\nSee [nowhere](wire.md#no-such-heading).\n")
    result = _build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert result.returncode != 0
    assert "no-such-heading" in result.stdout + result.stderr
