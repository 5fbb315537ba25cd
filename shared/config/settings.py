"""Settings declared once: every option of a service is one ``Option``.

An ``Option`` holds a setting's name, type, default, help and help section. Everything else is
derived from the services' tables of options (``downpour.server.settings``,
``downpour.worker.settings``, and ``downpour run-local``'s): the argparse options
(``add_options``), the file and environment layering and ``downpour config show``
(``downpour.config.loading``), and the services' config objects (``config_class``).

Naming rule: an option's ``name`` is the setting's one name. It is the argparse dest, the TOML
key (``push_port``; ``push-port`` is accepted too), the environment variable
(``DOWNPOUR_PUSH_PORT``) and the flag (``--push-port``; a switch that is on by default is turned
off with ``--no-NAME``). The config object's attribute has the same name unless the option
declares ``attr``: the services' code reads a few settings under a name with their unit
(``missing_after_s`` for ``--missing-after``) or a fuller word (``learning_rate`` for ``--lr``).
An option with ``to_config`` hands the config object a parsed value (the worker's ``--server``
text becomes a tuple of endpoints).

A program that starts a service writes its command line with ``to_argv(options, values)``: the
flag of every setting whose value is not the default, which the service's parser reads back as
the same values.

Allowed ranges are part of the type (``PORT``, ``at_least(1)``, ``positive()``...): argparse
applies it to flags, ``downpour.config.loading`` to file and environment values. Checks across
settings are one function per service (``validate_server``, ``validate_worker``) that raises
``ConfigError``; none of this imports TensorFlow, so a bad setting is refused at once.

Options used by more than one command (``MODEL``, ``DATA_DIR``, ``SEED``, ``DEVICE``, ``KEY``,
``SERVER_KEY``, ``LOG_LEVEL``, ``LOG_FORMAT``) are declared here; a command that explains one
differently reuses it with ``dataclasses.replace(OPTION, help=...)``.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from downpour.runtime.device import parse_device
from downpour.runtime.logs import LOG_FORMATS

ENV_PREFIX = "DOWNPOUR_"  # a setting NAME's environment variable is DOWNPOUR_<NAME>


class ConfigError(Exception):
    """A setting has a value outside its range, settings contradict each other, or the config
    file cannot be used.

    Recovery: none at run time; the message names the setting(s), where a value came from and
    what is allowed. The service refuses to start (exit code 2). ``problems`` lists every
    contradiction found, one sentence each.
    """

    def __init__(self, message: str, problems: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.problems = list(problems) or [message]


def passes(validate: Callable[[Any], None], config: Any, log: logging.Logger) -> bool:
    """Run a service's cross-setting check on ``config``; False after logging every problem
    at error level (the service then exits 2)."""
    try:
        validate(config)
    except ConfigError as exc:
        for problem in exc.problems:
            log.error("%s", problem)
        return False
    return True


def refuse(problems: Sequence[str]) -> None:
    """Raise ConfigError listing ``problems`` if there are any (the end of a validate_*)."""
    if problems:
        raise ConfigError("; ".join(problems), problems)


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


@dataclasses.dataclass(frozen=True)
class Option:
    """One setting of a service: the single declaration everything else is derived from.

    ``type`` converts and checks a text value (a ``Range``, ``int``, ``str`` or a function
    raising argparse.ArgumentTypeError); ``bool`` makes a switch. ``section`` is the help
    section (argparse argument group) the option is listed under.
    """

    name: str
    default: Any
    help: str
    section: str
    type: Callable[[str], Any] = str
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    attr: str | None = None  # the config object's attribute, if not ``name``
    to_config: Callable[[Any], Any] | None = None  # value -> the config object's value

    @property
    def is_switch(self) -> bool:
        """A boolean that a bare flag turns on (or, if on by default, ``--no-NAME`` off)."""
        return self.type is bool

    @property
    def flag(self) -> str:
        """The command-line flag: ``--name-with-dashes``, or ``--no-...`` for a switch that
        is on by default."""
        dashed = self.name.replace("_", "-")
        return f"--no-{dashed}" if self.is_switch and self.default else f"--{dashed}"

    @property
    def env_var(self) -> str:
        """The environment variable: ``DOWNPOUR_NAME``."""
        return ENV_PREFIX + self.name.upper()

    @property
    def field(self) -> str:
        """The config object's attribute."""
        return self.attr or self.name

    @property
    def allowed(self) -> str | None:
        """The allowed values in words, for errors and ``downpour config show``."""
        if self.choices is not None:
            return " | ".join(self.choices)
        if isinstance(self.type, Range):
            return self.type.describe()
        if self.is_switch:
            return "true | false"
        return {int: "an integer", float: "a number"}.get(self.type)  # type: ignore[call-overload]

    def default_value(self) -> Any:
        """The default as a flag's value has it (argparse converts text defaults by ``type``)."""
        if isinstance(self.default, str) and self.type not in (str, bool):
            return self.type(self.default)
        return self.default

    def config_value(self, value: Any) -> Any:
        """A setting's value as the config object holds it."""
        return self.to_config(value) if self.to_config and value is not None else value

    def annotation(self) -> Any:
        """The config attribute's type, for the derived dataclass."""
        if self.to_config is not None:
            return Any
        base = self.type.kind if isinstance(self.type, Range) else self.type
        if base not in (bool, int, float, str):
            base = str
        return base if self.default is not None else base | None

    def add_to(self, group: argparse._ActionsContainer) -> None:
        """Add this option to an argparse parser or argument group."""
        if self.is_switch:
            action = "store_false" if self.default else "store_true"
            group.add_argument(self.flag, dest=self.name, action=action, help=self.help)
            return
        group.add_argument(
            self.flag,
            dest=self.name,
            type=None if self.type is str else self.type,
            default=self.default,
            choices=self.choices,
            metavar=self.metavar,
            help=self.help,
        )


def add_options(parser: argparse.ArgumentParser, options: Iterable[Option]) -> None:
    """Add ``options`` to ``parser``, one argument group per section, in declaration order."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for option in options:
        if option.section not in groups:
            groups[option.section] = parser.add_argument_group(option.section)
        option.add_to(groups[option.section])


def to_argv(
    options: Iterable[Option], values: Mapping[str, Any], always: Iterable[str] = ()
) -> list[str]:
    """The command line that gives a service the settings ``values`` (name -> value).

    ``values`` are settings' values as the service's parser makes them (argparse, or
    ``downpour.config.loading.Settings.values()``); an option missing from them keeps its default.
    Each value that differs from its option's default becomes ``--name=TEXT`` (the ``=``
    keeps a value starting with ``-`` a value), a switch its bare flag (``--name``, or
    ``--no-name`` when on by default). Raises ValueError for a name no option has, and for a
    value the parser would not read back as the same value (None where the default is not,
    a list, a choice not allowed). The settings named in ``always`` are written even at
    their default, so that no lower layer (a ``DOWNPOUR_*`` variable, a config file) can
    change what the command line says.
    """
    by_name = {o.name: o for o in options}
    always = frozenset(always)
    unknown = sorted(set(values) - set(by_name))
    if unknown:
        raise ValueError(f"not settings of these options: {', '.join(unknown)}")
    argv: list[str] = []
    for name, option in by_name.items():
        if name not in values or (values[name] == option.default_value() and name not in always):
            continue
        value = values[name]
        if option.is_switch:
            if not isinstance(value, bool):
                raise ValueError(f"{option.flag}: {value!r} is not true or false")
            if value != option.default_value():
                argv.append(option.flag)  # the flag that turns the default over
            continue
        argv.append(f"--{name.replace('_', '-')}={_flag_text(option, value)}")
    return argv


def _flag_text(option: Option, value: Any) -> str:
    """``value`` as the text ``option``'s parser reads back as ``value``; ValueError if none."""
    dashed = "--" + option.name.replace("_", "-")
    if not isinstance(value, str | int | float) or isinstance(value, bool):
        raise ValueError(f"{dashed}: {value!r} cannot be given as a flag's value")
    text = str(value)
    if text == "--":  # argparse drops a bare "--" even as --name=--, reading it as nothing
        raise ValueError(f"{dashed}: '--' cannot be given as a flag's value")
    try:
        back = text if option.type is str else option.type(text)
    except (argparse.ArgumentTypeError, TypeError, ValueError) as exc:
        raise ValueError(f"{dashed}: {value!r} is not allowed: {exc}") from None
    if back != value or (option.choices is not None and back not in option.choices):
        raise ValueError(f"{dashed}: {value!r} does not read back as itself ({back!r})")
    return text


@dataclasses.dataclass(frozen=True)
class Internal:
    """A config attribute that is not a setting: set by the service's start-up code (loaded
    keys) or fixed tuning that code and tests may change (socket high-water marks)."""

    name: str
    annotation: Any
    default: Any
    help: str


def config_class(
    name: str,
    module: str,
    doc: str,
    options: Sequence[Option],
    internal: Sequence[Internal] = (),
    methods: Mapping[str, Any] | None = None,
) -> type:
    """A dataclass with one attribute per option (its ``field``, defaulting to the option's
    default) and one per ``internal`` entry; ``from_values(values)`` builds one from the
    settings' values by name. Each attribute's ``metadata`` holds its Option or its help."""
    fields: list[tuple[str, Any, Any]] = [
        (
            o.field,
            o.annotation(),
            dataclasses.field(default=o.config_value(o.default_value()), metadata={"option": o}),
        )
        for o in options
    ]
    fields += [
        (i.name, i.annotation, dataclasses.field(default=i.default, metadata={"help": i.help}))
        for i in internal
    ]

    def from_values(cls: type, values: Mapping[str, Any]) -> Any:
        """The config of the settings ``values`` (setting name -> value)."""
        return cls(**{o.field: o.config_value(values[o.name]) for o in options})

    namespace = {"from_values": classmethod(from_values), **(methods or {})}
    cls = dataclasses.make_dataclass(name, fields, namespace=namespace)
    cls.__module__ = module
    cls.__doc__ = doc
    return cls


# ------------------------------------------------------------ options shared by several commands

DISPATCH_MODES = ("none", "server")  # --data-dispatch, the same for server and worker

MODEL = Option(
    "model",
    "downpour.models:deep_mnist",
    "module:function returning a ModelSpec",
    "model and training",
)
DATA_DIR = Option(
    "data_dir",
    None,
    "directory with the standard MNIST IDX files (default: embedded MNIST-5k)",
    "model and training",
)
SEED = Option("seed", None, "random seed", "model and training", type=int)
DEVICE = Option(
    "device",
    "auto",
    "where this process computes: auto (a GPU if there is one), cpu, gpu (the first GPU) or "
    "gpu:N; GPU memory grows as needed, so several processes can share one GPU",
    "model and training",
    type=parse_device,
    metavar="auto|cpu|gpu|gpu:N",
)
KEY = Option("key", None, "own CURVE secret key file", "security", metavar="FILE")
SERVER_KEY = Option(
    "server_key",
    None,
    "the server's CURVE public key (server.key)",
    "security",
    metavar="FILE",
)
LOG_LEVEL = Option(
    "log_level", "INFO", "logging threshold: DEBUG, INFO, WARNING or ERROR", "logging"
)
LOG_FORMAT = Option(
    "log_format",
    "text",
    "text: one line per event; json: one JSON object per line",
    "logging",
    choices=LOG_FORMATS,
)
