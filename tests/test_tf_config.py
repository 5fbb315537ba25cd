"""Roles from TF_CONFIG: every task type's settings, the layers that override them, each
malformed or inconsistent TF_CONFIG refused with exit 2 naming the field, and ``downpour job``'s
dispatch. Unit tests: no service starts (``start`` is replaced by a recorder), and the parse and
mapping are checked not to import TensorFlow in a separate interpreter.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
from conftest import isolated_json

import downpour.cli
import downpour.cli.job
from downpour.cli import job, local
from downpour.cli.job import chief, evaluator, watch
from downpour.config import loading
from downpour.config.settings import MODEL, ConfigError
from downpour.config.tf_config import (
    TFConfig,
    from_environ,
    parse_tf_config,
    role_settings,
    status_endpoints,
)
from downpour.server import main as server_main
from downpour.server.settings import SERVER_OPTIONS
from downpour.worker import main as worker_main
from downpour.worker.settings import WORKER_OPTIONS, WorkerConfig, validate_worker

PS = ["ps-0.job.svc:2222", "ps-1.job.svc:2222"]
WORKERS = ["w0:2222", "w1:2222", "w2:2222"]


def tf_config(task_type: str, index: object, **cluster: list[str]) -> str:
    """A TF_CONFIG text: ``cluster`` (default 2 ps and 3 workers) and this task."""
    cluster = cluster or {"chief": ["chief-0:2222"], "ps": PS, "worker": WORKERS}
    return json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index}})


@pytest.fixture
def environ(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """os.environ without DOWNPOUR_* and TF_CONFIG, restored after the test."""
    import os

    for name in [k for k in os.environ if k.startswith("DOWNPOUR_") or k == "TF_CONFIG"]:
        monkeypatch.delenv(name)
    return monkeypatch


@pytest.fixture
def started(environ: pytest.MonkeyPatch) -> dict[str, dict[str, Any]]:
    """The settings' values a service would have started with (no service starts)."""
    seen: dict[str, dict[str, Any]] = {}
    for name, module in (("server", server_main), ("worker", worker_main)):

        def record(values: dict[str, Any], name: str = name) -> int:
            seen[name] = dict(values)
            return 0

        environ.setattr(module, "start", record)
    return seen


def load(service: str, argv: list[str], environ: dict[str, str]) -> loading.Settings:
    options = SERVER_OPTIONS if service == "server" else WORKER_OPTIONS
    return loading.load(service, options, argv, environ, ("server", "worker"))


# ------------------------------------------------------------------------------ every role


def test_ps_task_i_is_shard_i_of_len_ps_on_its_entrys_ports() -> None:
    s = load("server", [], {"TF_CONFIG": tf_config("ps", 1)})
    want = {
        "shard": 1,
        "num_shards": 2,
        "host": "0.0.0.0",  # a DNS name is not bindable: every interface
        "port": 2222,
        "push_port": 2223,
        "status_port": 2224,
    }
    assert {n: s.items[n].value for n in want} == want
    assert {s.items[n].source for n in want} == {"TF_CONFIG (ps 1)"}
    assert s.items["lr"].source == "default"
    assert s.tf_task == "ps 1"


@pytest.mark.parametrize(
    ("address", "host"),
    [("10.1.2.3:5000", "10.1.2.3"), ("localhost:5000", "127.0.0.1"), ("[::1]:5000", "[::1]")],
)
def test_a_ps_binds_an_ip_literal_as_given(address: str, host: str) -> None:
    tf = parse_tf_config(tf_config("ps", 0, ps=[address]))
    assert role_settings(tf, "server")["host"] == host


def test_worker_task_i_is_worker_i_of_len_worker_and_its_servers_are_the_ps_list() -> None:
    s = load("worker", [], {"TF_CONFIG": tf_config("worker", 2)})
    assert s.items["worker_index"].value == 2
    assert s.items["num_workers"].value == 3
    assert s.items["server"].value == ",".join(PS)
    assert s.items["server"].source == "TF_CONFIG (worker 2)"
    assert WorkerConfig.from_values(s.values()).endpoints() == (
        ("ps-0.job.svc", 2222),
        ("ps-1.job.svc", 2222),
    )


def test_a_worker_taking_splits_from_the_server_gets_no_static_shard() -> None:
    environ = {"TF_CONFIG": tf_config("worker", 2), "DOWNPOUR_DATA_DISPATCH": "server"}
    s = load("worker", [], environ)
    assert (s.items["worker_index"].value, s.items["worker_index"].source) == (0, "default")
    assert (s.items["num_workers"].value, s.items["num_workers"].source) == (1, "default")
    assert s.items["server"].source == "TF_CONFIG (worker 2)"
    validate_worker(WorkerConfig.from_values(s.values()))


@pytest.mark.parametrize(
    ("text", "service"),
    [
        (tf_config("chief", 0), "chief"),
        (tf_config("master", 0, master=["m:1"], ps=PS, worker=WORKERS), "chief"),
        (tf_config("evaluator", 0), "evaluator"),  # not in the cluster, as TensorFlow has it
        (tf_config("evaluator", 1, evaluator=["e0:1", "e1:1"], ps=PS), "evaluator"),
    ],
)
def test_chief_master_and_evaluator_are_job_roles_with_the_ps_list(text: str, service: str) -> None:
    tf = parse_tf_config(text)
    assert tf.service == service
    implied = role_settings(tf, service)
    assert implied["server"] == ",".join(PS)
    assert implied["num_workers"] == len(tf.cluster.get("worker", ()))


def test_the_status_endpoints_are_each_ps_entrys_port_plus_2() -> None:
    tf = parse_tf_config(tf_config("chief", 0, chief=["c:1"], ps=["a:2222", "[::1]:3000"]))
    assert status_endpoints(tf) == ["a:2224", "[::1]:3002"]


def test_keys_tensorflow_reads_for_itself_are_accepted() -> None:
    data = json.loads(tf_config("ps", 0))
    data.update(environment="cloud", rpc_layer="grpc")
    data["task"]["trial"] = "1"
    assert parse_tf_config(json.dumps(data)) == TFConfig(data["cluster"], "ps", 0)


@pytest.mark.parametrize("value", [None, "", "  "])
def test_no_tf_config_no_layer(value: str | None) -> None:
    environ = {} if value is None else {"TF_CONFIG": value}
    assert from_environ(environ) is None
    s = load("server", [], environ)
    assert s.tf_task is None
    assert all(not item.source.startswith("TF_CONFIG") for item in s.items.values())


# ------------------------------------------------------------------------------ overrides


def test_file_below_tf_config_below_env_below_flag(tmp_path: Path) -> None:
    f = tmp_path / "downpour.toml"
    f.write_text("[server]\nshard = 0\nport = 6000\nlr = 0.01\n")
    environ = {"TF_CONFIG": tf_config("ps", 1), "DOWNPOUR_PUSH_PORT": "7001"}
    s = load("server", ["--config", str(f), "--status-port", "8002"], environ)

    def got(name: str) -> tuple[object, str]:
        return s.items[name].value, s.items[name].source

    assert got("lr") == (0.01, f"file {f}")  # TF_CONFIG says nothing of it
    assert got("shard") == (1, "TF_CONFIG (ps 1)")  # beats the file
    assert got("port") == (2222, "TF_CONFIG (ps 1)")
    assert got("push_port") == (7001, "env DOWNPOUR_PUSH_PORT")
    assert got("status_port") == (8002, "flag --status-port")


def test_config_show_names_tf_config_as_the_source(
    environ: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    environ.setenv("TF_CONFIG", tf_config("worker", 1))
    environ.setenv("DOWNPOUR_NUM_WORKERS", "5")
    assert downpour.cli.main(["config", "show", "worker", "--server", "a:1"]) == 0
    table = capsys.readouterr().out
    assert "flag > env DOWNPOUR_* > TF_CONFIG > file > default" in table
    rows = {line.split()[0]: line for line in table.splitlines() if line.strip()}
    assert "TF_CONFIG (worker 1)" in rows["worker_index"]
    assert "env DOWNPOUR_NUM_WORKERS" in rows["num_workers"]
    assert "flag --server" in rows["server"]

    assert downpour.cli.main(["config", "show", "--json", "worker"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["tf_config_task"] == "worker 1"
    assert shown["settings"]["worker_index"] == {
        "value": 1,
        "source": "TF_CONFIG (worker 1)",
        "flag": "--worker-index",
        "allowed": "an integer >= 0",
    }


def test_run_local_children_start_without_tf_config() -> None:
    environ = {"TF_CONFIG": tf_config("ps", 0), "DOWNPOUR_LR": "0.1"}
    assert local.settings_variables(environ) == ["DOWNPOUR_LR", "TF_CONFIG"]


# ------------------------------------------------------------------------------ refusals

BAD = [
    ("{not json", "TF_CONFIG: not valid JSON"),
    ('["ps"]', "TF_CONFIG: must be a JSON object"),
    ('{"task": {"type": "ps", "index": 0}}', 'TF_CONFIG: "cluster" is missing'),
    ('{"cluster": ["a:1"], "task": {}}', 'TF_CONFIG: "cluster" must be a map'),
    (tf_config("ps", 0, ps=PS, driver=["d:1"]), "TF_CONFIG: cluster.driver is not a task type"),
    ('{"cluster": {"ps": "a:1"}, "task": {"type": "ps", "index": 0}}', "cluster.ps must be a list"),
    (tf_config("ps", 0, ps=["a:1", 7]), "TF_CONFIG: cluster.ps[1] must be a"),
    (tf_config("ps", 0, ps=["a:1", "ps-1"]), "TF_CONFIG: cluster.ps[1] 'ps-1' is not HOST:PORT"),
    (tf_config("ps", 0, ps=["a:"]), "TF_CONFIG: cluster.ps[0] 'a:' is not HOST:PORT"),
    (tf_config("ps", 0, ps=[":1"]), "TF_CONFIG: cluster.ps[0] ':1' is not HOST:PORT"),
    (tf_config("ps", 0, ps=["a:0"]), "TF_CONFIG: cluster.ps[0] 'a:0': the port must be"),
    (tf_config("ps", 0, ps=["a:70000"]), "TF_CONFIG: cluster.ps[0] 'a:70000': the port must"),
    (tf_config("ps", 0, ps=["a:x"]), "TF_CONFIG: cluster.ps[0] 'a:x': the port must be"),
    (tf_config("ps", 0, ps=["::1:5"]), "TF_CONFIG: cluster.ps[0] '::1:5': an IPv6 address goes"),
    (tf_config("ps", 0, ps=["[::1:5"]), "TF_CONFIG: cluster.ps[0] '[::1:5': an IPv6 address"),
    (tf_config("ps", 0, ps=["[zz]:5"]), "TF_CONFIG: cluster.ps[0] '[zz]:5': [zz] is not an IPv6"),
    (tf_config("worker", 0, worker=WORKERS), "TF_CONFIG: cluster.ps is missing or empty"),
    (tf_config("worker", 0, ps=[], worker=WORKERS), "TF_CONFIG: cluster.ps is missing or empty"),
    (
        tf_config("ps", 0, ps=PS, chief=["c:1"], master=["m:1"]),
        'TF_CONFIG: cluster has both "chief" and "master"',
    ),
    (tf_config("ps", 0, ps=PS, chief=["c:1", "c:2"]), "TF_CONFIG: cluster.chief lists 2 tasks"),
    ('{"cluster": {"ps": ["a:1"]}}', 'TF_CONFIG: "task" is missing'),
    ('{"cluster": {"ps": ["a:1"]}, "task": "ps"}', 'TF_CONFIG: "task" must be a map'),
    ('{"cluster": {"ps": ["a:1"]}, "task": {"index": 0}}', "TF_CONFIG: task.type is missing"),
    (tf_config("trainer", 0), "TF_CONFIG: task.type 'trainer' is not a task type"),
    ('{"cluster": {"ps": ["a:1"]}, "task": {"type": "ps"}}', "TF_CONFIG: task.index is missing"),
    (tf_config("ps", -1), "TF_CONFIG: task.index -1 is not an integer >= 0"),
    (tf_config("ps", "1"), "TF_CONFIG: task.index '1' is not an integer >= 0"),
    (tf_config("ps", True), "TF_CONFIG: task.index True is not an integer >= 0"),
    (tf_config("worker", 3), 'TF_CONFIG: task.index 3 is out of range for 3 "worker" tasks'),
    (tf_config("ps", 2), 'TF_CONFIG: task.index 2 is out of range for 2 "ps" tasks'),
    (tf_config("master", 0), 'TF_CONFIG: task.index 0 is out of range for 0 "master" tasks'),
    (
        tf_config("evaluator", 1, evaluator=["e:1"], ps=PS),
        'TF_CONFIG: task.index 1 is out of range for 1 "evaluator" tasks',
    ),
]


# the settings a task implies, asked of a service whose role it is not
MISMATCHED = [
    (tf_config("worker", 0), "server", 'task.type "worker" is the worker\'s task: run it'),
    (tf_config("ps", 0), "worker", 'task.type "ps" is the server\'s task: run it with'),
    (tf_config("chief", 0), "server", "run it with `downpour job`, not `downpour server`"),
    (tf_config("evaluator", 0), "worker", 'task.type "evaluator" is the evaluator\'s task'),
    (tf_config("ps", 0, ps=["a:65534"]), "server", "cluster.ps[0] port 65534: a ps task"),
]


@pytest.mark.parametrize(
    ("text", "service", "message"),
    [(text, service, message) for text, message in BAD for service in ("server", "worker")]
    + MISMATCHED,
)
def test_a_malformed_or_mismatched_tf_config_exits_2_naming_the_field(
    text: str,
    service: str,
    message: str,
    started: dict[str, dict[str, Any]],
    environ: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    environ.setenv("TF_CONFIG", text)
    assert downpour.cli.main([service]) == 2
    assert message in capsys.readouterr().err
    assert not started


NO_TENSORFLOW = """
import json, sys
from downpour.config import loading
from downpour.server.settings import SERVER_OPTIONS
from downpour.config.settings import ConfigError
from downpour.config.tf_config import from_environ, role_settings
from downpour.worker.settings import WORKER_OPTIONS

good, bad = json.loads(sys.argv[1])
tf = from_environ({"TF_CONFIG": good})
implied = role_settings(tf, "server")
shard = loading.load("server", SERVER_OPTIONS, [], {"TF_CONFIG": good}).values()["shard"]
try:
    loading.load("worker", WORKER_OPTIONS, [], {"TF_CONFIG": bad})
    refused = None
except ConfigError as exc:
    refused = str(exc)
print(json.dumps([implied["shard"], shard, refused, "tensorflow" in sys.modules,
                  "keras" in sys.modules]))
"""


def test_parse_and_mapping_do_not_import_tensorflow() -> None:
    texts = [tf_config("ps", 1), tf_config("worker", 9)]
    implied_shard, shard, refused, tf_loaded, keras_loaded = isolated_json(NO_TENSORFLOW, texts)
    assert (implied_shard, shard) == (1, 1)
    assert refused == 'TF_CONFIG: task.index 9 is out of range for 3 "worker" tasks'
    assert not tf_loaded
    assert not keras_loaded


# ------------------------------------------------------------------------------ downpour job


def parsed_role(tf_text: str, argv: list[str]) -> dict[str, Any]:
    """The settings the role of ``tf_text`` starts with from ``argv``, read by that role's
    own parser: the services through their layered loading (with the same TF_CONFIG), the
    chief and the evaluator through theirs (argparse exits 2 on a flag it does not know)."""
    tf = parse_tf_config(tf_text)
    options = job.role_options(tf.service)
    if tf.service in ("server", "worker"):
        return loading.load(tf.service, options, argv, {"TF_CONFIG": tf_text}).values()
    return vars(watch.parse(options, argv, f"downpour job ({tf.service})"))


@pytest.mark.parametrize("task", ["ps", "worker", "chief", "evaluator", "master"])
def test_every_roles_argv_parses_with_that_roles_own_options(task: str) -> None:
    """The documented command, the same in every replica, starts every role: each gets the
    flags its own option table declares, and nothing else."""
    text = tf_config(task, 0)
    if task == "master":  # TensorFlow's older name for the chief
        text = tf_config(task, 0, master=["m-0:2222"], ps=PS, worker=WORKERS)
    service, argv = job.role_argv(parse_tf_config(text), "m:f", "/vol/run", [])
    values = parsed_role(text, argv)
    assert values["model"] == "m:f"
    want_state = {"server": "/vol/run/shard-0", "worker": None}.get(service, "/vol/run")
    assert values.get("state_dir") == want_state, (service, argv)
    if service == "server":  # from TF_CONFIG's worker list: it ends with the job
        assert values["job_workers"] == len(WORKERS)


def test_a_flag_given_to_the_job_wins_over_what_the_job_decides() -> None:
    text = tf_config("ps", 1)
    _, argv = job.role_argv(parse_tf_config(text), "m:f", "/vol/run", ["--state-dir=/mine"])
    assert parsed_role(text, argv)["state_dir"] == "/mine"
    _, argv = job.role_argv(parse_tf_config(text), "m:f", "/vol/run", ["--job-workers", "1"])
    assert parsed_role(text, argv)["job_workers"] == 1


def test_the_model_is_passed_even_when_it_is_the_default(environ: pytest.MonkeyPatch) -> None:
    """A DOWNPOUR_MODEL in the task's environment cannot override the job's --model."""
    text = tf_config("worker", 0)
    _, argv = job.role_argv(parse_tf_config(text), MODEL.default, None, [])
    values = loading.load(
        "worker", WORKER_OPTIONS, argv, {"TF_CONFIG": text, "DOWNPOUR_MODEL": "x:y"}
    ).values()
    assert values["model"] == MODEL.default


def test_a_ps_under_tf_config_ends_with_its_workers_as_downpour_server_too() -> None:
    """``downpour server`` under a ps task's TF_CONFIG ends its job like ``downpour job``."""
    values = load("server", [], {"TF_CONFIG": tf_config("ps", 1)}).values()
    assert values["job_workers"] == len(WORKERS)
    alone = tf_config("ps", 0, ps=PS, chief=["c:1"])  # no worker listed: nothing to end on
    assert load("server", [], {"TF_CONFIG": alone}).values()["job_workers"] == 0


def test_job_ps_argv_without_a_job_workers_setting_says_the_job_will_not_end(
    caplog: pytest.LogCaptureFixture,
) -> None:
    tf = parse_tf_config(tf_config("ps", 0))
    without = tuple(o for o in SERVER_OPTIONS if o.name != "job_workers")
    with caplog.at_level(logging.WARNING, logger="downpour.job"):
        service, argv = job.role_argv(tf, "m:f", None, [], without)
    assert (service, argv) == ("server", ["--model=m:f"])
    assert "the job does not complete by itself" in caplog.text


def test_job_runs_a_ps_task_as_its_shard(
    started: dict[str, dict[str, Any]], environ: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    environ.setenv("TF_CONFIG", tf_config("ps", 1))
    argv = ["job", "--model", "tiny_models:tiny", "--state-dir", str(tmp_path), "--insecure"]
    assert downpour.cli.main(argv) == 0
    values = started["server"]
    assert values["model"] == "tiny_models:tiny"
    assert (values["shard"], values["num_shards"], values["port"]) == (1, 2, 2222)
    assert values["state_dir"] == str(tmp_path / "shard-1")
    assert values["insecure"] is True


def test_job_runs_a_worker_task_as_its_worker(
    started: dict[str, dict[str, Any]], environ: pytest.MonkeyPatch
) -> None:
    environ.setenv("TF_CONFIG", tf_config("worker", 2))
    assert downpour.cli.main(["job", "--model", "m:f", "--state-dir", "/vol", "--steps", "5"]) == 0
    values = started["worker"]
    assert (values["worker_index"], values["num_workers"], values["steps"]) == (2, 3, 5)
    assert values["server"] == ",".join(PS)
    assert list(started) == ["worker"]


@pytest.mark.parametrize(
    ("task_type", "function"), [("chief", "run_chief"), ("evaluator", "run_evaluator")]
)
def test_job_hands_chief_and_evaluator_to_their_functions(
    task_type: str, function: str, environ: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[str, TFConfig, list[str]]] = []

    def runner(name: str) -> Any:
        def run(tf: TFConfig, argv: list[str]) -> int:
            calls.append((name, tf, argv))
            return 7

        return run

    module = chief if task_type == "chief" else evaluator
    environ.setattr(module, function, runner(function))
    environ.setenv("TF_CONFIG", tf_config(task_type, 0))
    assert downpour.cli.main(["job", "--model", "m:f", "--poll", "3"]) == 7
    assert calls == [
        (function, parse_tf_config(tf_config(task_type, 0)), ["--model=m:f", "--poll", "3"])
    ]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (None, "downpour job: error: TF_CONFIG is not set"),
        (tf_config("worker", 5), 'TF_CONFIG: task.index 5 is out of range for 3 "worker" tasks'),
    ],
)
def test_job_without_a_usable_tf_config_exits_2(
    text: str | None,
    message: str,
    started: dict[str, dict[str, Any]],
    environ: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    if text is not None:
        environ.setenv("TF_CONFIG", text)
    assert downpour.cli.main(["job", "--model", "m:f"]) == 2
    assert message in capsys.readouterr().err
    assert not started


def test_configerror_is_what_the_parser_raises() -> None:
    with pytest.raises(ConfigError, match=r"^TF_CONFIG: task.type is missing$"):
        parse_tf_config('{"cluster": {"ps": ["a:1"]}, "task": {"index": 0}}')
