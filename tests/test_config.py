"""Configuration: defaults < TOML file < DOWNPOUR_* environment < flags, per service.

Unit tests on the real option declarations of the server and the worker, and the command line
(``downpour config show``, refusals at start) as real processes: these exit before TensorFlow
is imported, so they take well under a second each.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, env

from downpour.config import loading, settings
from downpour.server.settings import SERVER_OPTIONS
from downpour.worker.settings import WORKER_OPTIONS

SECTIONS = ("server", "worker")


def load(service: str, argv: list[str], environ: dict[str, str]) -> loading.Settings:
    """The settings of the real ``downpour SERVICE`` options."""
    options = SERVER_OPTIONS if service == "server" else WORKER_OPTIONS
    return loading.load(service, options, argv, environ, SECTIONS)


def downpour(*args: str, extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``downpour ARGS`` in a clean DOWNPOUR_* environment; bounded."""
    clean = {k: v for k, v in env().items() if not k.startswith("DOWNPOUR_")}
    return subprocess.run(
        [sys.executable, "-m", "downpour", *args],
        env={**clean, **(extra_env or {})},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_each_layer_overrides_the_one_below(tmp_path: Path) -> None:
    f = tmp_path / "downpour.toml"
    f.write_text(
        'model = "tiny_models:tiny"\n'  # top level: every service reading the file
        "[server]\nlr = 0.01\nport = 6000\npush-port = 6001\nstatus_port = 6002\n"
        '[worker]\nn_fetch = 4\nmodel = "tiny_models:tiny_other"\n'  # a table wins
    )
    environ = {"DOWNPOUR_PORT": "7000", "DOWNPOUR_STATUS_PORT": "7002"}
    s = load("server", ["--config", str(f), "--status-port", "8002"], environ)

    def got(name: str) -> tuple[object, str]:
        return s.items[name].value, s.items[name].source

    assert got("optimizer") == ("adam", "default")
    assert got("model") == ("tiny_models:tiny", f"file {f}")
    assert got("lr") == (0.01, f"file {f}")
    assert got("push_port") == (6001, f"file {f}")  # the [server] table, '-' spelling
    assert got("port") == (7000, "env DOWNPOUR_PORT")
    assert got("status_port") == (8002, "flag --status-port")
    values = s.values()
    assert [values[k] for k in ("port", "push_port", "status_port", "lr")] == [
        7000,
        6001,
        8002,
        0.01,
    ]
    assert s.config_file == str(f) and s.config_source == "--config"
    assert "n_fetch" not in s.items  # the [worker] table is the worker's

    w = load("worker", [], {"DOWNPOUR_CONFIG": str(f)})
    assert w.items["n_fetch"].value == 4 and w.config_source == "DOWNPOUR_CONFIG"
    assert w.items["model"].value == "tiny_models:tiny_other"


def test_types_booleans_and_negated_flags() -> None:
    s = load("server", [], {"DOWNPOUR_INSECURE": "yes", "DOWNPOUR_CHECKPOINT_SECS": "0"})
    assert s.items["insecure"].value is True
    assert s.items["checkpoint_secs"].value == 0.0
    w = load("worker", [], {"DOWNPOUR_PREFETCH": "false", "DOWNPOUR_STEPS": "12"})
    assert w.items["prefetch"].value is False and w.items["steps"].value == 12
    assert load("worker", ["--no-prefetch"], {}).items["prefetch"].value is False
    assert load("worker", [], {}).items["prefetch"].value is True


@pytest.mark.parametrize(
    ("service", "environ", "needles"),
    [
        ("server", {"DOWNPOUR_PORT": "70000"}, ["port", "--port", "0..65535"]),
        ("server", {"DOWNPOUR_STATUS_PORT": "-1"}, ["status_port", "0..65535"]),
        ("server", {"DOWNPOUR_KEEP_CHECKPOINTS": "0"}, ["keep_checkpoints", ">= 1"]),
        ("server", {"DOWNPOUR_DRAIN_TIMEOUT": "-1"}, ["drain_timeout", ">= 0"]),
        ("server", {"DOWNPOUR_LR": "0"}, ["lr", "> 0"]),
        ("server", {"DOWNPOUR_OPTIMIZER": "rmsprop"}, ["optimizer", "adam | adagrad | sgd"]),
        ("server", {"DOWNPOUR_INSECURE": "maybe"}, ["insecure", "true | false"]),
        ("worker", {"DOWNPOUR_N_FETCH": "0"}, ["n_fetch", "--n-fetch", ">= 1"]),
        ("worker", {"DOWNPOUR_REQUEST_TIMEOUT": "0"}, ["request_timeout", "> 0"]),
        ("worker", {"DOWNPOUR_SERVER_TIMEOUT": "soon"}, ["server_timeout", "> 0"]),
        ("worker", {"DOWNPOUR_SERVER": "host:99999"}, ["server", "0..65535"]),
    ],
)
def test_bad_environment_values_name_the_setting_and_range(
    service: str, environ: dict[str, str], needles: list[str]
) -> None:
    with pytest.raises(loading.ConfigError) as err:
        load(service, [], environ)
    for needle in [*needles, next(iter(environ))]:
        assert needle in str(err.value)


def test_bad_file_values_and_unknown_names_are_refused(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text("port = 1.5\n")
    with pytest.raises(loading.ConfigError, match=r"port .*0\.\.65535"):
        load("server", ["--config", str(f)], {})
    f.write_text("prot = 5570\n")
    with pytest.raises(loading.ConfigError, match="did you mean 'port'"):
        load("server", ["--config", str(f)], {})
    f.write_text("[sever]\nport = 1\n")
    with pytest.raises(loading.ConfigError, match=r"unknown table \[sever\]"):
        load("server", ["--config", str(f)], {})
    f.write_text("port = \n")
    with pytest.raises(loading.ConfigError, match="not valid TOML"):
        load("server", ["--config", str(f)], {})
    with pytest.raises(loading.ConfigError, match="No such file"):
        load("server", ["--config", str(tmp_path / "missing.toml")], {})


def test_bad_flag_exits_2_with_name_and_range(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        load("server", ["--push-port", "65536"], {})
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--push-port" in err and "0..65535" in err


def test_options_added_later_are_settings_without_declaring_them_again() -> None:
    table = (
        *SERVER_OPTIONS,
        settings.Option("brand_new", 3, "a new count", "new", type=settings.at_least(2)),
        settings.Option("feature", False, "a new switch", "new", bool),
    )
    s = loading.load("server", table, ["--feature"], {"DOWNPOUR_BRAND_NEW": "5"}, SECTIONS)
    assert s.items["brand_new"].value == 5 and s.items["brand_new"].source.startswith("env")
    assert s.items["feature"].value is True and s.items["feature"].source == "flag --feature"
    with pytest.raises(loading.ConfigError, match=r"brand_new .*>= 2"):
        loading.load("server", table, [], {"DOWNPOUR_BRAND_NEW": "1"}, SECTIONS)
    derived = settings.config_class("Config", __name__, "a test config", table)
    cfg = derived.from_values(s.values())
    assert (cfg.brand_new, cfg.feature, cfg.learning_rate) == (5, True, 1e-3)


def test_example_files_in_deploy_are_valid() -> None:
    for service in SECTIONS:
        f = ROOT / "deploy" / "systemd" / f"{service}.toml"
        s = load(service, ["--config", str(f)], {})
        assert any(v.source == f"file {f}" for v in s.items.values())


def test_config_show_prints_values_and_sources(tmp_path: Path) -> None:
    f = tmp_path / "w.toml"
    f.write_text('server = "10.1.2.3:5570"\n')
    r = downpour(
        "config", "show", "--json", "worker", "--config", str(f), "--n-push", "3",
        extra_env={"DOWNPOUR_EPOCHS": "2.5", "DOWNPOUR_NOT_A_SETTING": "1"},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    got = {k: (v["value"], v["source"]) for k, v in doc["settings"].items()}
    assert got["server"] == ("10.1.2.3:5570", f"file {f}")
    assert got["epochs"] == (2.5, "env DOWNPOUR_EPOCHS")
    assert got["n_push"] == (3, "flag --n-push")
    assert got["n_fetch"] == (1, "default")
    assert doc["ignored_env"] == ["DOWNPOUR_NOT_A_SETTING"]

    table = downpour("config", "show", "server", extra_env={"DOWNPOUR_LR": "0.5"})
    assert table.returncode == 0, table.stderr
    line = next(ln for ln in table.stdout.splitlines() if ln.startswith("lr "))
    assert "0.5" in line and "env DOWNPOUR_LR" in line and "> 0" in line


def test_services_refuse_bad_settings_at_start(tmp_path: Path) -> None:
    r = downpour("server", extra_env={"DOWNPOUR_STATUS_PORT": "70000"})
    assert r.returncode == 2
    assert "status_port" in r.stderr and "0..65535" in r.stderr
    r = downpour("worker", "--n-fetch", "0")
    assert r.returncode == 2 and "--n-fetch" in r.stderr and ">= 1" in r.stderr
    f = tmp_path / "w.toml"
    f.write_text("[worker]\nheartbeat = -2\n")
    r = downpour("worker", "--config", str(f))
    assert r.returncode == 2 and "heartbeat" in r.stderr and "> 0" in r.stderr
