"""griffe extension: render the docstrings' reST literal-block markers as Markdown reads them.

The project's docstrings introduce a literal block the reStructuredText way, a paragraph
ending in ``::`` followed by an indented block. Markdown already shows the indented block as
code; this turns the ``::`` that ends the paragraph into the single colon reST would display.
The docstrings in the source stay as they are.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_LITERAL_MARKER = re.compile(r"(?<=\S)::$", re.M)


class RstLiterals(griffe.Extension):
    """Replace a paragraph's trailing ``::`` with ``:`` in every docstring."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _LITERAL_MARKER.sub(":", obj.docstring.value)

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        self.on_object(obj=pkg)
