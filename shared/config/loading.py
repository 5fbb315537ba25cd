"""One settings object per service, from four layers, driven by the service's declared options.

Precedence, lowest first::

    1. built-in defaults       each ``Option``'s default (``downpour.config.settings``)
    2. a TOML file             ``--config FILE`` (or ``DOWNPOUR_CONFIG``); top-level keys, and
                               a ``[server]`` / ``[worker]`` table that wins for that service
    3. ``TF_CONFIG``           the settings a server's or worker's task implies (its shard,
                               ports, worker index, the ps list: ``downpour.config.tf_config``)
    4. environment variables   ``DOWNPOUR_<NAME>``, e.g. ``DOWNPOUR_PUSH_PORT=6000``
    5. command-line flags      ``--push-port 6000``

A setting's NAME is its option's name (``push_port``; ``push-port`` is accepted in TOML). The
options a service declares are its settings, so an option added to the table later is
configurable from the file and the environment at once. The flags actually given are found by
parsing the command line again with every default suppressed.

A file or environment value goes through the option's own ``type`` (its range) and
``choices``, as a flag does; a bad value stops the service at start with the setting's name
and the allowed range. Keys and secrets are never values here, only paths to files
(``--keys DIR``, ``--key FILE``).
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import tomllib
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from downpour.config import tf_config
from downpour.config.settings import ENV_PREFIX, ConfigError, Option, add_options

CONFIG_ENV = "DOWNPOUR_CONFIG"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}

__all__ = ["ConfigError", "Setting", "Settings", "load", "service_parser", "add_config_option"]


@dataclass(frozen=True)
class Setting:
    """One effective setting: its value and where that value came from."""

    name: str
    flag: str
    value: Any
    source: str  # "default", "file PATH", "TF_CONFIG (ps 1)", "env DOWNPOUR_X" or "flag --x"
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
    tf_task: str | None = None  # the TF_CONFIG task whose role gave settings, e.g. "ps 1"

    def values(self) -> dict[str, Any]:
        """Setting name -> effective value (what the service's config is built from)."""
        return {name: s.value for name, s in self.items.items()}

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form (``downpour config show --json``)."""
        return {
            "service": self.service,
            "config_file": self.config_file,
            "config_source": self.config_source,
            "tf_config_task": self.tf_task,
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
        tf_layer = f" > {tf_config.TF_CONFIG_ENV}" if self.tf_task else ""
        head = (
            f"downpour {self.service}: effective settings "
            f"(precedence: flag > env {ENV_PREFIX}*{tf_layer} > file > default)\n"
            f"config file: {self.config_file or 'none'}"
            + (f" (from {self.config_source})" if self.config_source else "")
        )
        if self.tf_task:
            head += f"\n{tf_config.TF_CONFIG_ENV}: task {self.tf_task}"
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
        f"environment > {tf_config.TF_CONFIG_ENV} > file > defaults; see `downpour config show`",
    )


def service_parser(service: str, options: Sequence[Option]) -> argparse.ArgumentParser:
    """A stand-alone parser of one service's options, as ``downpour SERVICE`` has them."""
    p = argparse.ArgumentParser(prog=f"downpour {service}")
    add_options(p, options)
    add_config_option(p)
    return p


def given_flags(parser: argparse.ArgumentParser, argv: Sequence[str]) -> dict[str, Any]:
    """The options present on the command line: ``argv`` parsed with every default suppressed."""
    saved = [(a, a.default) for a in parser._actions]  # argparse has no public accessor
    try:
        for a, _ in saved:
            a.default = argparse.SUPPRESS
        return vars(parser.parse_args(list(argv)))
    finally:
        for a, default in saved:
            a.default = default


def convert(option: Option, raw: Any) -> Any:
    """A file or environment value for ``option``, converted and checked as a flag would be.

    Raises ValueError with what is allowed.
    """
    if option.is_switch:
        return _bool(raw)
    if isinstance(raw, bool) or not isinstance(raw, str | int | float):
        raise ValueError(f"{raw!r} is not a single value ({option.allowed or 'a string'})")
    text = raw.strip() if isinstance(raw, str) else str(raw)
    try:
        value = option.type(text)
    except argparse.ArgumentTypeError as exc:
        raise ValueError(str(exc)) from None
    except (TypeError, ValueError):
        name = getattr(option.type, "__name__", repr(option.type))
        raise ValueError(f"{raw!r} is not a valid {name}") from None
    if option.choices is not None and value not in option.choices:
        raise ValueError(f"{value!r} is not allowed: choose from {option.allowed}")
    return value


def _bool(raw: Any) -> bool:
    if isinstance(raw, bool):
        return raw
    if isinstance(raw, str) and raw.strip().lower() in _TRUE | _FALSE:
        return raw.strip().lower() in _TRUE
    raise ValueError(f"{raw!r} is not a boolean: allowed true | false (or 1 | 0)")


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
    options: Sequence[Option],
    argv: Sequence[str],
    environ: Mapping[str, str] | None = None,
    sections: Collection[str] = (),
) -> Settings:
    """The effective settings of ``service`` from defaults, file, environment and ``argv``.

    ``argv`` is the service's own arguments (after ``downpour SERVICE``); bad flags exit 2
    through argparse like any command line, bad file or environment values raise ConfigError.
    """
    environ = os.environ if environ is None else environ
    parser = service_parser(service, options)
    full = vars(parser.parse_args(list(argv)))  # defaults converted as argparse does
    given = given_flags(parser, argv)
    by_name = {o.name: o for o in options}

    config_file, config_source = given.get("config"), "--config"
    if config_file is None and environ.get(CONFIG_ENV):
        config_file, config_source = environ[CONFIG_ENV], CONFIG_ENV
    file_values: dict[str, Any] = {}
    if config_file is not None:
        raw = read_config_file(config_file, service, sections)
        for key, value in raw.items():
            name = key.replace("-", "_")
            if name not in by_name:
                near = difflib.get_close_matches(name, list(by_name), n=1)
                hint = f" (did you mean {near[0]!r}?)" if near else ""
                raise ConfigError(
                    f"config file {config_file}: {key!r} is not a {service} setting{hint}; "
                    f"see `downpour config show {service}`"
                )
            file_values[name] = value

    tf = tf_config.from_environ(environ) if service in ("server", "worker") else None
    tf_source = f"{tf_config.TF_CONFIG_ENV} ({tf.describe()})" if tf is not None else ""

    def resolve(name: str, implied: Mapping[str, Any]) -> Setting:
        """One setting through the layers: default < file < TF_CONFIG < env < flag."""
        option = by_name[name]
        value, source = full.get(name), "default"
        for raw, where, shown in (
            (file_values.get(name), f"file {config_file}", f"{name} = {{!r}} in {config_file}"),
            (implied.get(name), tf_source, f"{tf_source} gives {name} = {{!r}}"),
            (environ.get(option.env_var), f"env {option.env_var}", f"{option.env_var}={{}}"),
        ):
            if raw is None:
                continue
            try:
                value = convert(option, raw)
            except ValueError as exc:
                raise ConfigError(
                    f"setting {name} ({option.flag}): {shown.format(raw)}: {exc}"
                ) from None
            source = where
        if name in given:
            value, source = given[name], f"flag {option.flag}"
        return Setting(name, option.flag, value, source, option.allowed, option.help)

    implied: dict[str, Any] = {}
    if tf is not None:
        dispatch = resolve("data_dispatch", {}).value if "data_dispatch" in by_name else "none"
        implied = tf_config.role_settings(tf, service, dispatch)
    items = {name: resolve(name, implied) for name in by_name}

    known = {o.env_var for o in options} | {CONFIG_ENV}
    ignored = sorted(k for k in environ if k.startswith(ENV_PREFIX) and k not in known)
    return Settings(
        service,
        items,
        config_file,
        config_source if config_file is not None else None,
        ignored,
        tf.describe() if tf is not None and implied else None,
    )
