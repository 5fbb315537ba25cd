"""Registries of text forms: one table per choice a user spells as text (``--policy``,
``--compress``), from which its parser, its list of forms and its help text all derive.

A ``Form`` is one entry: ``parse`` splits a lower-cased text into the constructor's keyword
arguments (None: the text is not this form), ``build`` is the constructor, which owns every
range check (raising ValueError), ``help`` says what the form does and ``params`` what its
parameters must be. ``Forms`` is the table, keyed by the form as users read it
(``bounded:K``, ``topk:RATIO``, ``lookahead[:A]``); its ``summary``, ``help`` and ``table``
are the list of forms for errors, the option's help and the documentation's table.

Errors name the text and say what was expected: a constructor's range error is prefixed with
the text; a text whose words are a parameterised form's (``bounded:x``, ``ssp``) gets that
form and its parameters; anything else gets the whole list of forms.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

T = TypeVar("T")

Parser = Callable[[str], dict[str, Any] | None]  # text -> keyword arguments, or None

_PARAMETERS = re.compile(r"\[?:[^+]*")  # ":K", "[:B]", ":0.5/3": a form's parameters


def words(text: str) -> str:
    """A form or a text without its parameters: ``sync:K/N`` and ``sync:a/b`` -> ``sync``,
    ``momentum-aware[:B]+lookahead[:A]`` -> ``momentum-aware+lookahead``."""
    return _PARAMETERS.sub("", text)


def literal(word: str) -> Parser:
    """A parser for a form without parameters: exactly ``word``, no arguments."""
    return lambda text: {} if text == word else None


def pattern(regex: str, **convert: Callable[[str], Any]) -> Parser:
    """A parser for a form with parameters: ``regex`` (matched whole) names each parameter as
    a group, ``convert`` turns its text into the constructor's argument (int, float). A
    group left out (an optional parameter) is not passed: the constructor's default holds.
    A conversion that fails makes the text not this form (its error names the form)."""
    compiled = re.compile(regex)

    def parse(text: str) -> dict[str, Any] | None:
        m = compiled.fullmatch(text)
        if m is None:
            return None
        try:
            return {k: convert[k](v) for k, v in m.groupdict().items() if v is not None}
        except ValueError:
            return None

    return parse


@dataclass(frozen=True)
class Form(Generic[T]):
    """One form: its parser, its constructor (which checks ranges), what it does, and what its
    parameters must be ("" for a form without any)."""

    parse: Parser
    build: Callable[..., T]
    help: str
    params: str = ""


class Forms(Generic[T]):
    """A registry of forms for one choice (``what``: "policy", "compression")."""

    def __init__(self, what: str, forms: Mapping[str, Form[T]]) -> None:
        self.what = what
        self.forms = dict(forms)

    @property
    def summary(self) -> str:
        """Every form with its parameters' bounds, comma-separated (for errors and help)."""
        return ", ".join(f"{k} ({f.params})" if f.params else k for k, f in self.forms.items())

    def help(self, lead: str) -> str:
        """``lead``, then every form with what it does, semicolon-separated (option help)."""
        return f"{lead}: " + "; ".join(f"{k} ({f.help})" for k, f in self.forms.items())

    def table(self) -> str:
        """The forms as a Markdown table: form, parameters, what it does (the documentation
        carries it, and a test compares the two)."""
        rows = ["| form | parameters | what it does |", "| --- | --- | --- |"]
        rows += [f"| `{k}` | {f.params or '-'} | {f.help} |" for k, f in self.forms.items()]
        return "\n".join(rows)

    def parse(self, text: str) -> T:
        """The object ``text`` (case and surrounding spaces ignored) describes; ValueError
        saying what was expected for anything else."""
        if not isinstance(text, str):
            raise ValueError(f"{self.what} must be a string, got {type(text).__name__}")
        t = text.strip().lower()
        for form in self.forms.values():
            if (kwargs := form.parse(t)) is not None:
                try:
                    return form.build(**kwargs)
                except ValueError as exc:
                    raise ValueError(f"{self.what} {text!r}: {exc}") from None
        near = [(k, f) for k, f in self.forms.items() if f.params and words(k) == words(t)]
        if near:
            expected = " or ".join(f"{k} with {f.params}" for k, f in near)
            raise ValueError(f"{self.what} {text!r}: expected {expected}")
        raise ValueError(f"unknown {self.what} {text!r}: expected one of {self.summary}")
