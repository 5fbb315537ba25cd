"""``downpour run-local``'s options reach its children: every server and worker option it offers
is on the command line it starts each child with, as the child's own config loader reads it.

No process is started: the children's command lines come from ``plan_children``, the function
``run-local`` spawns them from, and are parsed by ``downpour.config.loading.load`` as ``downpour
server|worker`` parses them.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from downpour import cli
from downpour.cli import local
from downpour.cli.local.options import (
    LOCAL_OPTIONS,
    OVERRIDES,
    RUN_OPTIONS,
    SERVER_DECIDES,
    SERVER_RENAMED,
    WORKER_DECIDES,
    Child,
    plan_children,
)
from downpour.config import loading
from downpour.config.settings import Option, Range, to_argv
from downpour.server.settings import SERVER_OPTIONS, ServerConfig
from downpour.worker.settings import WORKER_OPTIONS, WorkerConfig

SERVICES = {"server": (SERVER_OPTIONS, ServerConfig), "worker": (WORKER_OPTIONS, WorkerConfig)}
SERVER_NAMES = {o.name for o in SERVER_OPTIONS}
WORKER_NAMES = {o.name for o in WORKER_OPTIONS}
FROM_LOCAL = {local_name: name for name, local_name in SERVER_RENAMED.items()}
PASSED_ON = [o for o in LOCAL_OPTIONS if o not in RUN_OPTIONS]

# A value other than the default for options whose type is a grammar or a contradiction
# with another default; the rest are derived from the declaration (``other_value``).
CHOSEN: dict[str, Any] = {
    "policy": "sync:2/2",
    "compress": "topk:0.01",
    "device": "gpu:1",
    "model": "tiny_models:tiny",
    "max_workers": 100,
}
# Options that are valid only together with another setting.
TOGETHER: dict[str, dict[str, Any]] = {
    "split_size": {"data_dispatch": "server"},
    "export_dir": {"export_every": 5},
    "export_every": {"export_dir": "/chosen/export_dir"},
}


def other_value(option: Option) -> Any:
    """A valid value of ``option`` other than its default."""
    if option.name in CHOSEN:
        return CHOSEN[option.name]
    default = option.default_value()
    if option.is_switch:
        return not default
    if option.choices is not None:
        return next(c for c in option.choices if c != default)
    if isinstance(option.type, Range) and option.type.kind is float:
        return 2.0 * default if default else 0.5
    if isinstance(option.type, Range) or option.type is int:
        return 7 if default is None else default + 1
    return f"/chosen/{option.name}"


def run_local_args(values: dict[str, Any]) -> argparse.Namespace:
    """``downpour run-local`` given ``values`` (run-local names), parsed by the real parser."""
    return cli.build_parser().parse_args(["run-local", *to_argv(LOCAL_OPTIONS, values)])


def child_config(child: Child) -> Any:
    """The config the child builds from its command line (no environment, no file)."""
    options, config_type = SERVICES[child.service]
    settings = loading.load(child.service, options, child.argv[1:], {}, SERVICES)
    return config_type.from_values(settings.values())


def field(options: tuple[Option, ...], name: str) -> str:
    return next(o.field for o in options if o.name == name)


@pytest.mark.parametrize("option", PASSED_ON, ids=lambda o: o.flag)
def test_every_option_run_local_offers_reaches_each_child_it_belongs_to(
    option: Option, tmp_path: Path
) -> None:
    value = other_value(option)
    args = run_local_args({option.name: value, **TOGETHER.get(option.name, {})})
    assert getattr(args, option.name) == value
    children = plan_children(args, tmp_path, "127.0.0.1:5000")
    name = FROM_LOCAL.get(option.name, option.name)
    targets = [
        (child, SERVICES[child.service][0])
        for child in [*children.servers, *children.workers]
        if name in (SERVER_NAMES if child.service == "server" else WORKER_NAMES)
    ]
    assert targets, f"{option.flag} reaches no child"
    for child, options in targets:
        got = getattr(child_config(child), field(options, name))
        assert got == next(o for o in options if o.name == name).config_value(value), child.name


def test_row_options_and_state_dir_reach_the_children(tmp_path: Path) -> None:
    """The options the hand-written worker command line used to drop, by example."""
    args = run_local_args(
        {"row_staleness": 3, "row_cache_rows": 64, "state_dir": str(tmp_path / "state")}
    )
    children = plan_children(args, tmp_path, "127.0.0.1:5000")
    for child in children.workers:
        cfg = child_config(child)
        assert (cfg.row_staleness, cfg.row_cache_rows, cfg.row_pulls) == (3, 64, "auto")
    assert child_config(children.servers[0]).state_dir == str(tmp_path / "state")
    off = plan_children(run_local_args({"row_pulls": "off"}), tmp_path, "127.0.0.1:5000")
    assert [child_config(c).row_pulls for c in off.workers] == ["off", "off"]


def test_run_local_decides_per_child_what_it_does_not_offer(tmp_path: Path) -> None:
    args = run_local_args(
        {"shards": 2, "workers": 3, "state_dir": "/s", "metrics_port": 9100, "secure": True}
    )
    children = plan_children(args, tmp_path, "127.0.0.1:5000,127.0.0.1:5001")
    servers = [child_config(c) for c in children.servers]
    assert [(s.shard, s.num_shards) for s in servers] == [(0, 2), (1, 2)]
    assert [s.state_dir for s in servers] == ["/s/shard-0", "/s/shard-1"]  # a dir per shard
    assert [s.metrics_port for s in servers] == [9100, 0]
    assert [s.eval_every for s in servers] == [0, 0]  # a shard holds part of the model
    assert [(s.port, s.push_port, s.status_port) for s in servers] == [(0, 0, 0)] * 2
    assert [s.ready_file for s in servers] == [str(tmp_path / f"server-{i}.json") for i in (0, 1)]
    assert all(s.keys_dir == str(tmp_path / "keys") for s in servers)
    workers = [child_config(c) for c in children.workers]
    assert [(w.worker_id, w.worker_index, w.num_workers) for w in workers] == [
        (f"worker-{i}", i, 3) for i in range(3)
    ]
    assert all(w.servers == (("127.0.0.1", 5000), ("127.0.0.1", 5001)) for w in workers)
    assert workers[2].key_file == str(tmp_path / "keys/clients/worker-2.key_secret")
    dispatched = plan_children(
        run_local_args({"shards": 2, "data_dispatch": "server"}), tmp_path, "h:1,h:2"
    )
    assert [child_config(c).data_dispatch for c in dispatched.servers] == ["server", "none"]
    assert {(child_config(w).num_workers, child_config(w).worker_index)
            for w in dispatched.workers} == {(1, 0)}  # fmt: skip


def test_offered_options_are_the_services_tables_less_what_run_local_decides() -> None:
    """A new server or worker option is a run-local option without a line of its own."""
    assert set(SERVER_DECIDES) <= SERVER_NAMES and set(WORKER_DECIDES) <= WORKER_NAMES
    server = {SERVER_RENAMED.get(n, n) for n in SERVER_NAMES - set(SERVER_DECIDES)}
    worker = WORKER_NAMES - set(WORKER_DECIDES)
    assert {o.name for o in PASSED_ON} == server | worker
    assert set(OVERRIDES) <= server | worker  # an override names an option run-local offers
    own = {o.name for o in RUN_OPTIONS}
    assert not own & (server | worker)  # run-local's own names shadow no service option
    by_name = {o.name: o for o in (*SERVER_OPTIONS, *WORKER_OPTIONS)}
    for o in PASSED_ON:  # the same setting: the same type, choices and range
        service = by_name[FROM_LOCAL.get(o.name, o.name)]
        assert (o.type, o.choices) == (service.type, service.choices), o.name
    both = {o.name for o in SERVER_OPTIONS} & {o.name for o in WORKER_OPTIONS} - {"key"}
    for name in both:  # one run-local option goes to both: both must mean the same value
        s, w = (next(o for o in t if o.name == name) for t in (SERVER_OPTIONS, WORKER_OPTIONS))
        assert (s.type, s.choices, s.default_value()) == (w.type, w.choices, w.default_value())


@pytest.mark.parametrize(
    ("values", "error"),
    [
        ({"row_pulls": "off", "row_cache_rows": 8}, "--row-cache-rows needs row pulls"),
        ({"split_size": 64}, "--split-size goes with --data-dispatch server"),
        ({"shards": 2, "max_workers": 10**6}, "--max-workers must be at most"),
    ],
)
def test_run_local_refuses_what_a_child_would_refuse_before_starting_one(
    values: dict[str, Any], error: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = run_local_args({"run_dir": str(tmp_path / "run"), **values})
    assert local.run(args) == 2
    assert error in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_children_start_without_the_services_settings_variables() -> None:
    environ = {"DOWNPOUR_LR": "0.1", "DOWNPOUR_CONFIG": "f.toml", "DOWNPOUR_TEST_GATE": "g"}
    assert local.settings_variables(environ) == ["DOWNPOUR_CONFIG", "DOWNPOUR_LR"]
