"""The policies' grammar and capabilities, ``shared/config/policy.py``: the shared parser
agrees with the server's policies form by form, the worker's side asks it (not the text),
and the checks that read capabilities (``validate_server``, the hybrid's halves) refuse what
they name, with their messages."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import zmq
from conftest import ROOT, env

from downpour.config.policy import (
    DENSE_HALF_FORMS,
    HYBRID,
    POLICIES,
    ROWS_HALF_FORMS,
    Capabilities,
    PolicyDescription,
    capabilities_table,
    describe_policy,
)
from downpour.config.settings import ConfigError
from downpour.model.partition import make_partition
from downpour.net.cluster import ShardSet
from downpour.server.policies.base import parse_policy
from downpour.server.policies.forms import CONSTRUCTORS, from_description
from downpour.server.policies.hybrid import HybridPolicy
from downpour.server.settings import ModelFacts, ServerConfig, validate_server

EXAMPLES = {  # a text of every form, canonical (the server's spec of it)
    "async": "async",
    "staleness-aware": "staleness-aware",
    "bounded:K": "bounded:3",
    "ssp:K": "ssp:2",
    "sync:K/N": "sync:3/4",
    "dc:L": "dc:0.04",
    "dc-a:L": "dc-a:0.1",
    "gap-aware": "gap-aware",
    "momentum-aware[:B]": "momentum-aware:0.8",
    "lookahead[:A]": "lookahead:0.5",
    "momentum-aware[:B]+lookahead[:A]": "momentum-aware:0.8+lookahead:0.5",
    HYBRID: "dense=sync:7/8,rows=async",
}
PLAIN_FORMS = [f for f in EXAMPLES if f != HYBRID]

# ---------------------------------------------------------------- one parser, two sides


def test_the_examples_cover_the_table_and_every_form_has_a_constructor() -> None:
    assert list(EXAMPLES) == list(POLICIES.forms) == list(CONSTRUCTORS)


@pytest.mark.parametrize(("form", "text"), EXAMPLES.items())
def test_every_form_parses_to_what_the_server_builds(form: str, text: str) -> None:
    """The shared description's form, kind and capabilities are the server policy's, and
    the server builds the same policy from the description as from the text."""
    description = describe_policy(text)
    policy = parse_policy(text)
    assert (description.form, description.text) == (form, text)
    assert (description.kind, description.caps) == (policy.kind, policy.caps)
    assert from_description(description).spec == policy.spec == text
    assert describe_policy(policy.spec) == description  # the canonical text reads back alike


@pytest.mark.parametrize(
    ("text", "params"),
    [
        ("async", {}),
        ("bounded:3", {"max_staleness": 3}),
        ("ssp:2", {"max_lead": 2}),
        ("sync:3/4", {"aggregate": 3, "workers": 4}),
        ("dc:0.04", {"lam": 0.04}),
        ("dc-asgd:0.04", {"lam": 0.04}),
        ("dc-a:0.1", {"lam": 0.1}),
        ("momentum-aware", {}),
        ("momentum-aware:0.8", {"beta_1": 0.8}),
        ("lookahead", {}),
        ("lookahead:0.5", {"scale": 0.5}),
        ("momentum-aware+lookahead:2", {"scale": 2.0}),
        ("momentum-aware:0.8+lookahead:0.5", {"beta_1": 0.8, "scale": 0.5}),
    ],
)
def test_the_parameters_are_the_constructors_keywords(text: str, params: dict[str, Any]) -> None:
    """A description's parameters, as written, are what the server passes its form's
    constructor: called with them directly it builds the policy the text does."""
    description = describe_policy(text)
    assert description.params == params
    assert CONSTRUCTORS[description.form](**params).spec == parse_policy(text).spec


def test_a_hybrid_is_described_by_its_halves() -> None:
    d = describe_policy(" Rows=bounded:8, DENSE=ssp:2 ")
    assert (d.text, d.form, d.kind, d.hybrid) == (
        "rows=bounded:8, dense=ssp:2",
        HYBRID,
        "hybrid",
        True,
    )
    assert d.dense == describe_policy("ssp:2") and d.rows == describe_policy("bounded:8")
    assert d.dense_policy is d.dense and d.rows_policy is d.rows
    assert d.caps == Capabilities(holds_pulls=True, splits=True)  # pulls gated by its dense half
    policy = parse_policy(d.text)
    assert isinstance(policy, HybridPolicy) and policy.caps == d.caps
    assert (policy.dense.kind, policy.rows.kind) == (d.dense.kind, d.rows.kind)
    plain = describe_policy("async")
    assert not plain.hybrid and plain.dense_policy is plain is plain.rows_policy


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("downpour", r"unknown policy 'downpour'"),
        ("bounded:x", r"expected bounded:K with an integer K >= 0"),
        ("dense=async", "the rows half is missing"),
        ("dense=rows=async,rows=async", "is one policy"),
    ],
)
def test_the_shared_parser_refuses_what_is_no_form(text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        describe_policy(text)


def test_ranges_are_the_constructors_to_check() -> None:
    """The grammar reads ``bounded:-1``; the server's constructor refuses it, naming it."""
    assert describe_policy("bounded:-1").params == {"max_staleness": -1}
    with pytest.raises(ValueError, match=r"policy 'bounded:-1': bounded:K needs K >= 0"):
        parse_policy("bounded:-1")


def test_the_docs_table_of_capabilities_is_the_registry() -> None:
    docs = (Path(__file__).resolve().parents[1] / "docs" / "policies.md").read_text()
    assert capabilities_table() in docs, (
        "docs/policies.md's table of capabilities differs from:\n" + capabilities_table()
    )


def test_the_shared_parser_imports_no_tensorflow() -> None:
    code = (
        "import sys, downpour.config.policy, downpour.net.cluster; "
        "sys.exit('tensorflow' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


# ---------------------------------------------------------------- the worker's side


@pytest.mark.parametrize(
    ("policy", "hybrid", "sync", "ssp", "extrapolates"),
    [
        ("async", False, False, False, False),
        ("sync:2/4", False, True, False, False),
        ("ssp:3", False, False, True, False),
        ("bounded:2", False, False, False, False),
        ("lookahead", False, False, False, True),
        ("momentum-aware:0.5+lookahead", False, False, False, True),
        ("dense=sync:2/4,rows=async", True, True, False, False),
        ("rows=bounded:8,dense=ssp:2", True, False, True, False),
        ("dense=async,rows=async", True, False, False, False),
        (" Rows=async, DENSE=sync:2/4 ", True, True, False, False),  # as the grammar reads
        ("", False, False, False, False),  # before any hello
        ("newfangled:3", False, False, False, False),  # a form this client does not know
    ],
)
def test_the_shard_set_asks_the_description(
    policy: str, hybrid: bool, sync: bool, ssp: bool, extrapolates: bool
) -> None:
    """What a worker does around the server's policy (wait for sync rounds, count pushes for
    ssp holds, no pull bound under lookahead) comes from the shared parser's description of
    the hello's text; a text it cannot read has no capabilities."""
    partition = make_partition(["v"], [(4,)], ["float32"], 1, "f")
    shards = ShardSet(zmq.Context.instance(), [("127.0.0.1", 1)], partition, sender="w")
    try:
        shards.policy = policy
        assert shards.policy == policy
        try:
            expected = describe_policy(policy)
        except ValueError:
            expected = PolicyDescription(policy)
        assert shards.policy_description == expected
        got = (shards.hybrid, shards.sync, shards.ssp, shards.extrapolates)
        assert got == (hybrid, sync, ssp, extrapolates)
    finally:
        shards.close()


# ---------------------------------------------------------------- the checks

DYNAMIC = ModelFacts(("tokens_b", "tokens_a"))
NAMES = "tokens_a, tokens_b"
# what dynamic tables refuse first (a hybrid passes whatever its dense half: its rows half,
# which the tables' rows follow, decides each push alone), then what they refuse second
DENSE_ONLY = {
    "sync:K/N",
    "dc:L",
    "dc-a:L",
    "gap-aware",
    "lookahead[:A]",
    "momentum-aware[:B]+lookahead[:A]",
}
SETS_BETA_1 = {"momentum-aware[:B]", "momentum-aware[:B]+lookahead[:A]"}


def _problems(**settings: Any) -> list[str]:
    model = settings.pop("model", None)
    try:
        validate_server(ServerConfig(**settings), model)
    except ConfigError as exc:
        return exc.problems
    return []


@pytest.mark.parametrize(("form", "text"), EXAMPLES.items())
def test_dynamic_tables_refuse_a_dense_only_policy_and_one_that_sets_beta_1(
    form: str, text: str
) -> None:
    """What a server with dynamic tables refuses: a policy that sums gradients densely or
    reads whole weights (sync, dc, dc-a, gap-aware, lookahead), then one that sets beta_1
    (momentum-aware); ssp, bounded, staleness-aware, async and any hybrid pass. Without
    the model's facts, or with a model without dynamic tables, nothing is refused."""
    assert _problems(policy=text) == [] == _problems(policy=text, model=ModelFacts())
    got = _problems(policy=text, model=DYNAMIC)
    if form in DENSE_ONLY:
        assert got == [
            f"--policy {text} cannot apply the dynamic tables {NAMES}: it sums gradients "
            "densely or reads whole weights; use async, ssp:K, bounded:K, staleness-aware, "
            "or a hybrid whose dense half may be sync (dense=sync:K/N,rows=async)"
        ]
    elif form in SETS_BETA_1:
        assert got == [
            f"--policy {text} changes Adam's beta_1, which the dynamic tables {NAMES} do not "
            "follow; use async, ssp:K, bounded:K or staleness-aware"
        ]
    else:
        assert got == []


def test_dynamic_tables_refuse_eval_every_besides_the_policy() -> None:
    eval_problem = (
        f"--eval-every evaluates the model in the server, whose dynamic tables ({NAMES}) it "
        "does not hold as variables; workers report their held-out score, and `downpour "
        "export` writes the model to evaluate"
    )
    assert _problems(eval_every=10, model=DYNAMIC) == [eval_problem]
    assert _problems(eval_every=10, model=ModelFacts()) == []
    both = _problems(eval_every=10, policy="sync:2/2", model=DYNAMIC)
    assert len(both) == 2 and both[1] == eval_problem


@pytest.mark.parametrize("optimizer", ["adam", "lazy_adam", "sgd", "adagrad"])
@pytest.mark.parametrize(("form", "text"), EXAMPLES.items())
def test_a_policy_that_sets_beta_1_needs_an_optimizer_with_one(
    form: str, text: str, optimizer: str
) -> None:
    got = _problems(policy=text, optimizer=optimizer)
    if form in SETS_BETA_1 and optimizer in ("sgd", "adagrad"):
        canonical = parse_policy(text).spec
        assert got == [
            f"--policy {canonical} sets the optimizer's beta_1: it needs --optimizer adam, "
            f"not {optimizer}"
        ]
    else:
        assert got == []


def test_the_beta_1_check_names_the_canonical_text_and_skips_a_text_that_is_no_policy() -> None:
    assert _problems(policy="MOMENTUM-AWARE:0.90", optimizer="sgd") == [
        "--policy momentum-aware sets the optimizer's beta_1: it needs --optimizer adam, not sgd"
    ]
    assert _problems(policy="bogus", optimizer="sgd") == []  # the server's parse raises


@pytest.mark.parametrize("rows", PLAIN_FORMS)
@pytest.mark.parametrize("dense", PLAIN_FORMS)
def test_a_hybrid_takes_the_halves_its_capabilities_allow(dense: str, rows: str) -> None:
    """Dense halves: the plain forms that read and change nothing the rows share; rows
    halves: those that decide each push alone. The rest are refused, dense first, with the
    forms that may be that half."""
    dense_ok = dense in ("async", "staleness-aware", "bounded:K", "ssp:K", "sync:K/N")
    rows_ok = rows in ("async", "staleness-aware", "bounded:K")
    assert (dense in DENSE_HALF_FORMS, rows in ROWS_HALF_FORMS) == (dense_ok, rows_ok)
    text = f"dense={EXAMPLES[dense]},rows={EXAMPLES[rows]}"
    if dense_ok and rows_ok:
        assert parse_policy(text).spec == text
        return
    with pytest.raises(ValueError) as err:
        parse_policy(text)
    d, r = parse_policy(EXAMPLES[dense]).spec, parse_policy(EXAMPLES[rows]).spec
    if not dense_ok:
        why = (
            "a hybrid's dense half must be one of async, staleness-aware, bounded:K, ssp:K, "
            f"sync:K/N, got {d}: it reads or changes the weights and optimizer the rows share"
        )
    else:
        why = (
            "a hybrid's rows half must be one of async, staleness-aware, bounded:K, got "
            f"{r}: rows are decided push by push (a policy that sums gradients sums tables "
            "densely; one that reads, extrapolates or gates whole weights copies them)"
        )
    assert str(err.value) == f"policy {text!r}: {why}"


# ---------------------------------------------------------------- the command line


def _server(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "downpour", "server", "--port", "0", "--push-port", "0",
         "--status-port", "0", *args],
        env={k: v for k, v in env().items() if not k.startswith("DOWNPOUR_")},
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_the_command_refuses_momentum_aware_without_beta_1_at_once_with_exit_2() -> None:
    done = _server("--policy", "momentum-aware", "--optimizer", "sgd")
    assert done.returncode == 2
    assert "--policy momentum-aware sets the optimizer's beta_1: it needs --optimizer adam, " \
        "not sgd" in done.stderr  # fmt: skip


def test_the_command_refuses_a_policy_dynamic_tables_cannot_go_with_with_exit_2() -> None:
    done = _server("--model", "tiny_models:dynamic_tensor", "--policy", "sync:2/2")
    assert done.returncode == 2
    assert "cannot start: --policy sync:2/2 cannot apply the dynamic tables" in done.stderr
