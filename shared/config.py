"""One settings object per service, from four layers, driven by the service's argparse options.

Precedence, lowest first::

    1. built-in defaults       the ``default=`` of each ``add_argument``
    2. a TOML file             ``--config FILE`` (or ``DOWNPOUR_CONFIG``); top-level keys, and
                               a ``[server]`` / ``[worker]`` table that wins for that service
    3. environment variables   ``DOWNPOUR_<NAME>``, e.g. ``DOWNPOUR_PUSH_PORT=6000``
    4. command-line flags      ``--push-port 6000``

A setting's NAME is its argparse ``dest`` (``push_port``; ``push-port`` is accepted in TOML).
Nothing is declared twice: the options a service's ``add_arguments`` defines are its settings,
so an option added there later is configurable from the file and the environment at once. The
flags actually given are found by parsing the command line again with every default
suppressed.

Allowed ranges are declared once, as the option's ``type=`` (``PORT``, ``at_least(1)``,
``positive()``...): argparse applies it to flags, this module to file and environment values,
and a bad value stops the service at start with the setting's name and the allowed range.
Keys and secrets are never values here, only paths to files (``--keys DIR``, ``--key FILE``).
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import tomllib
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

ENV_PREFIX = "DOWNPOUR_"
CONFIG_ENV = "DOWNPOUR_CONFIG"
_NOT_SETTINGS = {"help", "config"}
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


class ConfigError(Exception):
    """A setting has a value outside its range, or the config file cannot be used.

    Recovery: none at run time; the message names the setting, where the value came from and
    what is allowed. The service refuses to start (exit code 2).
    """


class Range:
    """An argparse ``type=``: a number of ``kind`` within bounds, refused with the range.

    ``Range(int, 0, 65535)`` accepts 0..65535; ``Range(float, 0, low_open=True)`` accepts
    numbers > 0. The same object checks flags (argparse) and file/environment values.
    """

    def __init__(
        self,
        kind: type[int] | type[float],
        low: float | None = None,
        high: float | None = None,
        *,
        low_open: bool = False,
    ) -> None:
        self.kind = kind
        self.low = low
        self.high = high
        self.low_open = low_open
        self.__name__ = self.describe()  # argparse names the type in some messages

    def describe(self) -> str:
        """The allowed values in words, e.g. 'an integer in 0..65535' or 'a number > 0'."""
        what = "an integer" if self.kind is int else "a number"
        if self.low is not None and self.high is not None:
            return f"{what} in {self.low}..{self.high}"
        if self.low is not None:
            return f"{what} {'>' if self.low_open else '>='} {self.low}"
        if self.high is not None:
            return f"{what} <= {self.high}"
        return what

    def __call__(self, text: str | int | float) -> int | float:
        """Convert and check one value; raise argparse.ArgumentTypeError naming the range."""
        if isinstance(text, bool):
            raise argparse.ArgumentTypeError(f"{text!r} is not {self.describe()}")
        try:
            value = self.kind(text if isinstance(text, str) else str(text))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {self.describe()}") from None
        too_low = self.low is not None and (
            value <= self.low if self.low_open else value < self.low
        )
        if too_low or (self.high is not None and value > self.high):
            raise argparse.ArgumentTypeError(f"{value} is out of range: allowed {self.describe()}")
        return value

    def __repr__(self) -> str:
        return f"Range({self.describe()})"


PORT = Range(int, 0, 65535)


def at_least(low: int) -> Range:
    """An integer >= ``low`` (counts: ``at_least(1)`` for n_fetch, ``at_least(0)`` for 'off')."""
    return Range(int, low)


def positive() -> Range:
    """A number > 0 (timeouts, intervals, rates)."""
    return Range(float, 0, low_open=True)


def non_negative() -> Range:
    """A number >= 0 (seconds where 0 means 'off' or 'do not wait')."""
    return Range(float, 0)


@dataclass(frozen=True)
class Setting:
    """One effective setting: its value and where that value came from."""

    name: str
    flag: str
    value: Any
    source: str  # "default", "file PATH", "env DOWNPOUR_X" or "flag --x"
    allowed: str | None = None
    help: str | None = None


@dataclass
class Settings:
    """The effective settings of one service, in the order its options are declared."""

    service: str
    items: dict[str, Setting]
    config_file: str | None = None
    config_source: str | None = None
    ignored_env: list[str] = field(default_factory=list)

    def namespace(self) -> argparse.Namespace:
        """The settings as the argparse.Namespace the service's ``run()`` expects."""
        values = {name: s.value for name, s in self.items.items()}
        return argparse.Namespace(command=self.service, config=self.config_file, **values)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form (``downpour config show --json``)."""
        return {
            "service": self.service,
            "config_file": self.config_file,
            "config_source": self.config_source,
            "settings": {
                n: {"value": s.value, "source": s.source, "flag": s.flag, "allowed": s.allowed}
                for n, s in self.items.items()
            },
            "ignored_env": self.ignored_env,
        }

    def render(self) -> str:
        """A table for people: setting, value, source, allowed values."""

        def fmt(v: Any) -> str:
            return "-" if v is None else json.dumps(v)

        rows = [(n, fmt(s.value), s.source, s.allowed or "") for n, s in self.items.items()]
        widths = [
            max(len(r[i]) for r in [("setting", "value", "source", ""), *rows]) for i in (0, 1, 2)
        ]
        head = (
            f"downpour {self.service}: effective settings "
            f"(precedence: flag > env {ENV_PREFIX}* > file > default)\n"
            f"config file: {self.config_file or 'none'}"
            + (f" (from {self.config_source})" if self.config_source else "")
        )
        lines = [head, ""]
        lines.append(
            f"{'setting':<{widths[0]}}  {'value':<{widths[1]}}  {'source':<{widths[2]}}  allowed"
        )
        for n, v, src, allowed in rows:
            line = f"{n:<{widths[0]}}  {v:<{widths[1]}}  {src:<{widths[2]}}  {allowed}"
            lines.append(line.rstrip())
        for var in self.ignored_env:
            lines.append(f"ignored: {var} is not a {self.service} setting")
        return "\n".join(lines).rstrip()


def add_config_option(p: argparse.ArgumentParser) -> None:
    """The ``--config FILE`` option every configurable service has."""
    p.add_argument(
        "--config",
        metavar="FILE",
        help=f"TOML settings file (or ${CONFIG_ENV}); precedence: flags > {ENV_PREFIX}* "
        "environment > file > defaults; see `downpour config show`",
    )


def service_parser(
    service: str, add_arguments: Callable[[argparse.ArgumentParser], None]
) -> argparse.ArgumentParser:
    """A stand-alone parser of one service's options, as ``downpour SERVICE`` has them."""
    p = argparse.ArgumentParser(prog=f"downpour {service}")
    add_arguments(p)
    add_config_option(p)
    return p


def _settings_actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """dest -> the option defining it (first one wins; positionals are not settings)."""
    actions: dict[str, argparse.Action] = {}
    for a in parser._actions:  # argparse has no public accessor; _actions is stable
        if a.option_strings and a.dest not in _NOT_SETTINGS and a.dest != argparse.SUPPRESS:
            actions.setdefault(a.dest, a)
    return actions


def given_flags(parser: argparse.ArgumentParser, argv: Sequence[str]) -> dict[str, Any]:
    """The options present on the command line: ``argv`` parsed with every default suppressed."""
    saved = [(a, a.default) for a in parser._actions]
    try:
        for a, _ in saved:
            a.default = argparse.SUPPRESS
        return vars(parser.parse_args(list(argv)))
    finally:
        for a, default in saved:
            a.default = default


def _flag(action: argparse.Action) -> str:
    return max(action.option_strings, key=len)


def _allowed(action: argparse.Action) -> str | None:
    if action.choices is not None:
        return " | ".join(str(c) for c in action.choices)
    if isinstance(action.type, Range):
        return action.type.describe()
    if _is_bool(action):
        return "true | false"
    return {int: "an integer", float: "a number"}.get(action.type)  # type: ignore[call-overload]


def _is_bool(action: argparse.Action) -> bool:
    return isinstance(
        action,
        argparse._StoreTrueAction | argparse._StoreFalseAction | argparse.BooleanOptionalAction,
    )


def convert(action: argparse.Action, raw: Any) -> Any:
    """A file or environment value for ``action``, converted and checked like a flag would be.

    Raises ValueError with what is allowed.
    """
    if _is_bool(action):
        return _bool(raw)
    if isinstance(action, argparse._CountAction):
        try:
            return at_least(0)(raw)
        except argparse.ArgumentTypeError as exc:
            raise ValueError(str(exc)) from None
    if isinstance(action, argparse._StoreConstAction):
        return action.const if _bool(raw) else action.default
    many = isinstance(action, argparse._AppendAction) or action.nargs not in (None, "?")
    if many:
        items = raw.split(",") if isinstance(raw, str) else raw
        if not isinstance(items, list):
            raise ValueError(f"{raw!r} is not a list")
        return [_scalar(action, item) for item in items]
    return _scalar(action, raw)


def _bool(raw: Any) -> bool:
    if isinstance(raw, bool):
        return raw
    if isinstance(raw, str) and raw.strip().lower() in _TRUE | _FALSE:
        return raw.strip().lower() in _TRUE
    raise ValueError(f"{raw!r} is not a boolean: allowed true | false (or 1 | 0)")


def _scalar(action: argparse.Action, raw: Any) -> Any:
    if isinstance(raw, bool) or not isinstance(raw, str | int | float):
        raise ValueError(f"{raw!r} is not a single value ({_allowed(action) or 'a string'})")
    text = raw.strip() if isinstance(raw, str) else str(raw)
    try:
        value = action.type(text) if callable(action.type) else text
    except argparse.ArgumentTypeError as exc:
        raise ValueError(str(exc)) from None
    except (TypeError, ValueError):
        name = getattr(action.type, "__name__", repr(action.type))
        raise ValueError(f"{raw!r} is not a valid {name}") from None
    if action.choices is not None and value not in action.choices:
        raise ValueError(f"{value!r} is not allowed: choose from {_allowed(action)}")
    return value


def read_config_file(path: str, service: str, sections: Collection[str]) -> dict[str, Any]:
    """Top-level keys of a TOML file, overlaid with its ``[service]`` table.

    Tables named after other services (``sections``) are skipped, so one file can hold the
    settings of all of them; any other table is an error (a typo would otherwise be silent).
    """
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"config file {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path}: not valid TOML: {exc}") from None
    values = {k: v for k, v in data.items() if not isinstance(v, dict)}
    for key, table in data.items():
        if isinstance(table, dict) and key != service and key not in sections:
            raise ConfigError(
                f"config file {path}: unknown table [{key}]; tables are "
                + ", ".join(f"[{s}]" for s in sorted({service, *sections}))
            )
    own = data.get(service)
    if isinstance(own, dict):
        values.update(own)
    return values


def load(
    service: str,
    add_arguments: Callable[[argparse.ArgumentParser], None],
    argv: Sequence[str],
    environ: Mapping[str, str] | None = None,
    sections: Collection[str] = (),
) -> Settings:
    """The effective settings of ``service`` from defaults, file, environment and ``argv``.

    ``argv`` is the service's own arguments (after ``downpour SERVICE``); bad flags exit 2
    through argparse like any command line, bad file or environment values raise ConfigError.
    """
    environ = os.environ if environ is None else environ
    parser = service_parser(service, add_arguments)
    full = vars(parser.parse_args(list(argv)))  # defaults converted as argparse does
    given = given_flags(parser, argv)
    actions = _settings_actions(parser)

    config_file, config_source = given.get("config"), "--config"
    if config_file is None and environ.get(CONFIG_ENV):
        config_file, config_source = environ[CONFIG_ENV], CONFIG_ENV
    file_values: dict[str, Any] = {}
    if config_file is not None:
        raw = read_config_file(config_file, service, sections)
        for key, value in raw.items():
            name = key.replace("-", "_")
            if name not in actions:
                near = difflib.get_close_matches(name, list(actions), n=1)
                hint = f" (did you mean {near[0]!r}?)" if near else ""
                raise ConfigError(
                    f"config file {config_file}: {key!r} is not a {service} setting{hint}; "
                    f"see `downpour config show {service}`"
                )
            file_values[name] = value

    items: dict[str, Setting] = {}
    for name, action in actions.items():
        value, source = full.get(name), "default"
        env_var = ENV_PREFIX + name.upper()
        for raw, where, shown in (
            (file_values.get(name), f"file {config_file}", f"{name} = {{!r}} in {config_file}"),
            (environ.get(env_var), f"env {env_var}", f"{env_var}={{}}"),
        ):
            if raw is None:
                continue
            try:
                value = convert(action, raw)
            except ValueError as exc:
                raise ConfigError(
                    f"setting {name} ({_flag(action)}): {shown.format(raw)}: {exc}"
                ) from None
            source = where
        if name in given:
            value, source = given[name], f"flag {_flag(action)}"
        items[name] = Setting(name, _flag(action), value, source, _allowed(action), action.help)

    known = {ENV_PREFIX + n.upper() for n in actions} | {CONFIG_ENV}
    ignored = sorted(k for k in environ if k.startswith(ENV_PREFIX) and k not in known)
    return Settings(
        service,
        items,
        config_file,
        config_source if config_file is not None else None,
        ignored,
    )
