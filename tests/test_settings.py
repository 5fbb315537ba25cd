"""Settings declared once: each option's flag, config-show row and config attribute agree, and
the checks across settings refuse bad combinations before TensorFlow is imported.

Unit tests on the real declarations (``downpour.server.settings``, ``downpour.worker.settings``,
``downpour run-local``'s), and the real command in a fresh interpreter (``python -I``) to show
that a refused start never imports TensorFlow.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT, isolated_json
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from downpour import cli
from downpour.cli import local
from downpour.config import loading
from downpour.config.settings import ConfigError, Option, Range, to_argv
from downpour.runtime.device import parse_device
from downpour.server.settings import (
    OPTIMIZERS,
    SERVER_INTERNAL,
    SERVER_OPTIONS,
    ServerConfig,
    policy_text,
    validate_server,
)
from downpour.worker.settings import (
    WORKER_INTERNAL,
    WORKER_OPTIONS,
    WorkerConfig,
    compression_text,
    endpoint,
    endpoint_list,
    validate_worker,
)

SERVICES = {
    "server": (SERVER_OPTIONS, SERVER_INTERNAL, ServerConfig),
    "worker": (WORKER_OPTIONS, WORKER_INTERNAL, WorkerConfig),
}


def subparser(command: str) -> Any:
    """The real ``downpour COMMAND`` parser, as the console script builds it."""
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")  # argparse: no accessor
    return sub.choices[command]


def help_sections(text: str) -> dict[str, str]:
    """``--help`` output split into its sections: heading -> the lines under it."""
    sections: dict[str, str] = {}
    heading = None
    for line in text.splitlines():
        if line and not line.startswith(" ") and line.endswith(":"):
            heading = line[:-1]
            sections[heading] = ""
        elif heading is not None:
            sections[heading] += line + "\n"
    return sections


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_every_option_is_a_flag_a_setting_and_a_config_attribute_with_one_default(
    service: str,
) -> None:
    options, internal, config_type = SERVICES[service]
    parsed = vars(subparser(service).parse_args([]))
    shown = loading.load(service, options, [], {}, SERVICES).as_dict()["settings"]
    fields = {f.name: f for f in dataclasses.fields(config_type)}
    assert list(shown) == [o.name for o in options]  # config show: every option, in order
    assert set(fields) == {o.field for o in options} | {i.name for i in internal}
    for o in options:
        default = o.default_value()
        assert parsed[o.name] == default, o.name
        assert shown[o.name] == {
            "value": default,
            "source": "default",
            "flag": o.flag,
            "allowed": o.allowed,
        }
        assert fields[o.field].default == o.config_value(default), o.name
        assert fields[o.field].metadata["option"] is o
    assert config_type() == config_type.from_values({o.name: o.default for o in options})


@pytest.mark.parametrize("command", ["server", "worker", "run-local"])
def test_help_lists_each_flag_under_its_declared_section(command: str) -> None:
    options = {"server": SERVER_OPTIONS, "worker": WORKER_OPTIONS}.get(command, local.LOCAL_OPTIONS)
    sections = help_sections(subparser(command).format_help())
    for o in options:
        assert re.search(rf"^  {re.escape(o.flag)}\b", sections[o.section], re.M), (
            f"{o.flag} is not under '{o.section}'"
        )


@pytest.mark.parametrize("options", [SERVER_OPTIONS, WORKER_OPTIONS, local.LOCAL_OPTIONS])
def test_names_flags_and_attributes_are_unique(options: tuple[Option, ...]) -> None:
    for key in ("name", "flag", "field", "env_var"):
        values = [getattr(o, key) for o in options]
        assert len(values) == len(set(values)), key


def test_settings_files_and_environment_names_in_deploy_are_declared() -> None:
    """The deploy files set DOWNPOUR_* variables: each names a server or worker setting."""
    known = {o.env_var for o in (*SERVER_OPTIONS, *WORKER_OPTIONS)} | {loading.CONFIG_ENV}
    used: set[str] = set()
    for path in (ROOT / "deploy").rglob("*"):
        if path.is_file() and path.suffix in {".yaml", ".yml", ".env", ".service", ""}:
            used |= set(re.findall(r"\bDOWNPOUR_[A-Z0-9_]+", path.read_text(errors="replace")))
    assert used, "no DOWNPOUR_* variables found in deploy/"
    assert used <= known, sorted(used - known)


def test_config_objects_take_the_effective_values_under_their_attribute_names(
    tmp_path: Path,
) -> None:
    f = tmp_path / "c.toml"
    f.write_text('[worker]\nserver = "10.0.0.1:6000,10.0.0.2:6001"\npush_endpoint = "nat:7000"\n')
    w = WorkerConfig.from_values(
        loading.load(
            "worker", WORKER_OPTIONS, ["--config", str(f), "--no-prefetch", "--id", "a"], {}
        ).values()
    )
    assert w.endpoints() == (("10.0.0.1", 6000), ("10.0.0.2", 6001))
    assert w.push_endpoint == ("nat", 7000) and w.prefetch is False and w.resolved_id() == "a"
    s = ServerConfig.from_values(
        loading.load("server", SERVER_OPTIONS, ["--missing-after", "3", "--lr", "0.5"], {}).values()
    )
    assert (s.missing_after_s, s.learning_rate, s.keys) == (3.0, 0.5, None)


def refused(check: Any, cfg: Any) -> list[str]:
    """The problems ``check`` finds in ``cfg`` (empty if it accepts it)."""
    try:
        check(cfg)
    except ConfigError as exc:
        return exc.problems
    return []


def test_server_cross_setting_checks() -> None:
    ok = ServerConfig()
    assert refused(validate_server, ok) == []
    cases = {
        "--shard must be in 0..1 for --num-shards 2": {"shard": 2, "num_shards": 2},
        "--eval-every needs the whole model": {"num_shards": 2, "shard": 1, "eval_every": 10},
        "--key needs --keys DIR": {"key_file": "k.key_secret"},
        "refusing to bind 0.0.0.0 without authentication": {"host": "0.0.0.0"},
        "--missing-after must be < --gone-after": {"missing_after_s": 60.0, "gone_after_s": 60.0},
    }
    for needle, change in cases.items():
        problems = refused(validate_server, dataclasses.replace(ok, **change))
        assert len(problems) == 1 and needle in problems[0], (change, problems)
    # what makes a non-loopback bind acceptable: keys, or saying --insecure
    for change in ({"keys_dir": "keys"}, {"insecure": True}):
        assert refused(validate_server, dataclasses.replace(ok, host="0.0.0.0", **change)) == []
    for loopback in ("127.0.0.2", "localhost", "::1"):
        assert refused(validate_server, dataclasses.replace(ok, host=loopback)) == []
    # every problem at once, so one start names them all
    both = dataclasses.replace(ok, host="10.1.1.1", gone_after_s=5.0)
    assert len(refused(validate_server, both)) == 2
    # --show-partition serves nothing: only the shard index matters
    show = dataclasses.replace(ok, show_partition=True, host="0.0.0.0", num_shards=2)
    assert refused(validate_server, show) == []
    assert refused(validate_server, dataclasses.replace(show, shard=2)) != []


def test_worker_cross_setting_checks() -> None:
    assert refused(validate_worker, WorkerConfig()) == []
    both = WorkerConfig(key_file="w.key_secret", server_key_file="server.key")
    assert refused(validate_worker, both) == []
    for change in ({"key_file": "w.key_secret"}, {"server_key_file": "server.key"}):
        problems = refused(validate_worker, WorkerConfig(**change))
        assert problems and "--key and --server-key go together" in problems[0]
    # a push endpoint override names one server's gradient port: not one per shard
    relayed = WorkerConfig(push_endpoint=("nat", 7000))
    assert refused(validate_worker, relayed) == []
    sharded = dataclasses.replace(relayed, servers=(("a", 6000), ("b", 6001)))
    assert refused(validate_worker, sharded) == [
        "--push-endpoint works with one server, not with shards"
    ]


def test_optimizer_choices_are_the_optimizers_the_server_builds() -> None:
    """--optimizer's choices are the keys of the server's optimizer table (read from its
    source: importing it would import TensorFlow)."""
    tree = ast.parse((ROOT / "services" / "server" / "tables" / "rows.py").read_text())
    table = next(
        node.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        and [getattr(t, "id", None) for t in node.targets] == ["OPTIMIZERS"]
    )
    assert isinstance(table, ast.Dict)
    assert {ast.literal_eval(k) for k in table.keys if k is not None} == set(OPTIMIZERS)
    local_optimizer = next(o for o in local.LOCAL_OPTIONS if o.name == "optimizer")
    assert local_optimizer.choices == OPTIMIZERS


REFUSALS = [
    (["server", "--host", "0.0.0.0"], "refusing to bind 0.0.0.0"),
    (["server", "--host", "127.0.0.1.example.com"], "refusing to bind 127.0.0.1.example.com"),
    (["server", "--host", "localhost.example.com"], "refusing to bind localhost.example.com"),
    (["server", "--shard", "3", "--num-shards", "2"], "--shard must be in 0..1"),
    (["server", "--missing-after", "9", "--gone-after", "3"], "--missing-after must be <"),
    (["server", "--key", "x.key_secret"], "--key needs --keys DIR"),
    (["server", "--num-shards", "2", "--eval-every", "5"], "--eval-every needs the whole model"),
    (["worker", "--key", "x.key_secret"], "--key and --server-key go together"),
]

PROBE = """
import contextlib, io, json, sys
from downpour.cli import main
out = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(argv)
    out.append([code, err.getvalue(), "tensorflow" in sys.modules])
print(json.dumps(out))
"""


def test_refusals_happen_before_tensorflow_is_imported() -> None:
    """The real ``downpour`` command in an isolated interpreter: each bad combination exits 2
    with its reason, and TensorFlow is never imported."""
    results = isolated_json(PROBE, [argv for argv, _ in REFUSALS])
    for (argv, needle), (code, err, tf_loaded) in zip(REFUSALS, results, strict=True):
        assert code == 2, (argv, err)
        assert needle in err, (argv, err)
        assert not tf_loaded, argv


# ------------------------------------------------------------------ command lines from values

# Types whose values follow a grammar: a few texts of each, made canonical by the type itself.
GRAMMAR_SAMPLES: dict[Any, list[str]] = {
    policy_text: ["async", "staleness-aware", "bounded:3", "ssp:2", "sync:2/3", "dc:0.5"],
    compression_text: ["none", "bf16", "topk:0.01", "topk:0.5"],
    endpoint_list: ["127.0.0.1:1", "h:6000,h:6001", "[::1]:5570"],
    endpoint: ["10.0.0.1:6000", "tcp://example.org:1"],
    parse_device: ["auto", "cpu", "gpu", "gpu:3"],
}


def valid_values(option: Option) -> st.SearchStrategy[Any]:
    """Every value ``option``'s parser can produce (for a grammar, a sample of them)."""
    if option.is_switch:
        return st.booleans()
    if option.choices is not None:
        return st.sampled_from(option.choices)
    if isinstance(option.type, Range):
        r = option.type
        if r.kind is int:
            return st.integers(min_value=r.low, max_value=r.high)
        return st.floats(
            min_value=r.low, max_value=r.high, exclude_min=r.low_open, allow_nan=False,
            allow_infinity=False,
        )  # fmt: skip
    if option.type is int:
        return st.integers()
    if option.type is str:  # "-x", "", spaces, "=": a value whatever it looks like, except
        return st.text().filter(lambda t: t != "--")  # "--", which argparse drops (to_argv refuses)
    return st.sampled_from(GRAMMAR_SAMPLES[option.type]).map(option.type)


def some_settings(options: tuple[Option, ...]) -> st.SearchStrategy[dict[str, Any]]:
    """Any subset of ``options`` with valid values."""
    return st.fixed_dictionaries({}, optional={o.name: valid_values(o) for o in options})


@pytest.mark.parametrize("service", sorted(SERVICES))
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_to_argv_reads_back_as_the_same_settings(service: str, data: st.DataObject) -> None:
    """parse(to_argv(values)) == values, for any values of every option of the service."""
    options = SERVICES[service][0]
    given_values = data.draw(some_settings(options))
    values = {o.name: o.default_value() for o in options} | given_values
    argv = to_argv(options, given_values)
    assert loading.load(service, options, argv, {}, SERVICES).values() == values
    assert vars(subparser(service).parse_args(argv)) == values | {"config": None}


def test_to_argv_gives_only_what_differs_from_the_default_switches_as_their_flag() -> None:
    values = {"epochs": 1.0, "row_staleness": 3, "prefetch": False, "model": "-m"}
    assert to_argv(WORKER_OPTIONS, values) == [
        "--model=-m",
        "--row-staleness=3",
        "--no-prefetch",
    ]
    assert to_argv(SERVER_OPTIONS, {"allow_nonfinite": True}) == ["--allow-nonfinite"]


@pytest.mark.parametrize(
    ("values", "error"),
    [
        ({"row_stalenes": 3}, "not settings of these options: row_stalenes"),
        ({"epochs": None}, "--epochs: None cannot be given"),
        ({"epochs": [1.0]}, "--epochs: [1.0] cannot be given"),
        ({"epochs": -1.0}, "--epochs: -1.0 is not allowed"),
        ({"row_pulls": "sometimes"}, "--row-pulls: 'sometimes' does not read back"),
        ({"device": "GPU"}, "--device: 'GPU' does not read back as itself ('gpu')"),
        ({"prefetch": "no"}, "--no-prefetch: 'no' is not true or false"),
        ({"id": "--"}, "--id: '--' cannot be given"),
    ],
)
def test_to_argv_refuses_values_a_command_line_cannot_carry(
    values: dict[str, Any], error: str
) -> None:
    with pytest.raises(ValueError) as info:
        to_argv(WORKER_OPTIONS, values)
    assert error in str(info.value)
