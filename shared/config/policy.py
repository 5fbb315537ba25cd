"""The staleness policies' grammar and capabilities: what a ``--policy`` text says.

``POLICIES`` is the one table of ``--policy`` forms (``downpour.config.forms``): per form its
syntax, what it does, what its parameters must be, the policy's ``kind`` and its
``Capabilities``. ``describe_policy`` reads a text into a ``PolicyDescription`` (form, kind,
parameters as written, capabilities; for a hybrid ``dense=SPEC,rows=SPEC`` its two halves),
refusing, with what was expected, a text that is no form. The parameters' ranges are not
checked here: they belong to the policies' constructors, which the server's
``downpour.server.policies.forms`` calls on a description.

Why here, in ``downpour.config``: the text is a setting's value, and two sides read it. The
server builds its policy from it (and ``downpour server --policy``'s help and the docs'
table come from this table); a worker learns it from the server's hello and must know from
it whether to wait for sync rounds, whether its pulls may be held, whether they are
extrapolated. The worker's side (``downpour.net.cluster``) may not import the server, so
the grammar sits in the library, beside the registry of forms it builds on. It imports only
the standard library and ``downpour.config.forms`` (no TensorFlow): the shard set and
``downpour status`` stay light.

Capabilities are facts a policy declares (``Capabilities``' fields); the roles it may take
follow from them by the rules of ``Capabilities``' properties, which the server's checks
read (``downpour.server.settings.validate_server``, ``downpour.server.policies.hybrid``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

from downpour.config.forms import Form, Forms, Parser, literal, pattern

HYBRID = "dense=SPEC,rows=SPEC"  # the hybrid's form
DENSE_HALF = "dense"  # the hybrid's keys: the policy of the dense variables ...
ROWS_HALF = "rows"  # ... and of the row-sparse ones (Embedding tables, dynamic tables)


@dataclass(frozen=True)
class Capabilities:
    """What a policy does beyond deciding each push from its staleness, as facts.

    ``aggregates``: sums fresh gradients into rounds and applies their mean (``sync``): the
    server holds gradients, the workers wait for the round. ``holds_pulls``: holds a
    worker's pull while it is too far ahead (``ssp``): the server asks it before serving a
    pull, the worker counts its pushes and does not prefetch. ``needs_weights``: reads the
    weights of past versions (``dc``, ``dc-a``, ``gap-aware``, ``lookahead``): the server
    hands it each version's snapshot, which it keeps in a weight ring. ``extrapolates``:
    serves whole pulls extrapolated weights (``lookahead``). ``sets_beta_1``: changes the
    optimizer's ``beta_1`` (``momentum-aware``): needs an optimizer that has one.
    ``splits``: splits each push into a dense and a rows half, each decided by its own
    policy (the hybrid).
    """

    aggregates: bool = False
    holds_pulls: bool = False
    needs_weights: bool = False
    extrapolates: bool = False
    sets_beta_1: bool = False
    splits: bool = False

    @property
    def dense_only(self) -> bool:
        """Works on whole dense tensors: sums gradients densely, or reads or extrapolates
        whole weights. Such a policy cannot update a dynamic table, whose rows exist only
        where touched."""
        return self.aggregates or self.needs_weights or self.extrapolates

    @property
    def row_safe(self) -> bool:
        """Decides each push alone, from its staleness, and changes nothing but the
        variables it is given: it may be a hybrid's rows half. Not a policy that is
        ``dense_only`` (it would sum or copy the tables densely), that holds pulls (a pull
        is gated whole, by the dense half), that sets ``beta_1`` (the optimizer is shared)
        or that is itself a hybrid."""
        return not (self.dense_only or self.holds_pulls or self.sets_beta_1 or self.splits)

    @property
    def dense_safe(self) -> bool:
        """May be a hybrid's dense half: reads and changes nothing the rows half shares (the
        whole weights, the optimizer's ``beta_1``), and is not itself a hybrid."""
        return not (self.needs_weights or self.extrapolates or self.sets_beta_1 or self.splits)


PLAIN = Capabilities()  # decides each push from its staleness, nothing more


def hybrid_capabilities(dense: Capabilities) -> Capabilities:
    """A hybrid's capabilities, given its dense half's: it splits pushes and holds pulls
    when its dense half does (a pull is gated whole). It aggregates nothing whole (its
    rows half, ``row_safe``, decides each push alone), so the dense-only rules do not refuse
    it; what its dense half aggregates is that half's ``aggregates``."""
    return Capabilities(holds_pulls=dense.holds_pulls, splits=True)


@dataclass(frozen=True)
class PolicyDescription:
    """What a ``--policy`` text says: ``text`` (lower-cased, without surrounding spaces),
    ``form`` (the table's key: ``bounded:K``), ``kind`` (the policy's name in the status
    document: ``bounded``), ``params`` (the parameters written, as the policy's constructor
    takes them: ``{"max_staleness": 8}``; one left out is the constructor's default) and
    ``caps``. A hybrid has its halves' descriptions as ``dense`` and ``rows``.

    ``PolicyDescription(text)`` alone describes a text this reader knows no form of (a
    worker before its first hello): no form, no capabilities."""

    text: str
    form: str = ""
    kind: str = ""
    params: Mapping[str, Any] = field(default_factory=dict)
    caps: Capabilities = PLAIN
    dense: PolicyDescription | None = None
    rows: PolicyDescription | None = None

    @property
    def hybrid(self) -> bool:
        """A hybrid ``dense=SPEC,rows=SPEC``."""
        return self.dense is not None

    @property
    def dense_policy(self) -> PolicyDescription:
        """The policy the dense variables follow: a hybrid's dense half, else this one."""
        return self.dense if self.dense is not None else self

    @property
    def rows_policy(self) -> PolicyDescription:
        """The policy the row-sparse variables follow: a hybrid's rows half, else this one."""
        return self.rows if self.rows is not None else self


@dataclass(frozen=True)
class PolicyForm(Form[PolicyDescription]):
    """One form of the table: ``Form``'s parser, builder (a description), help and
    parameters, and the policy's ``kind`` and ``caps``."""

    kind: str = ""
    caps: Capabilities = PLAIN


def _plain(form: str, kind: str, caps: Capabilities, **params: Any) -> PolicyDescription:
    """A form's description from its parameters (the text is set by ``describe_policy``)."""
    return PolicyDescription("", form, kind, params, caps)


def _form(
    form: str, kind: str, parse: Parser, help: str, params: str = "", caps: Capabilities = PLAIN
) -> tuple[str, PolicyForm]:
    return form, PolicyForm(
        parse, partial(_plain, form, kind, caps), help, params, kind=kind, caps=caps
    )


_FORMS: dict[str, PolicyForm] = dict(
    [
        _form("async", "async", literal("async"), "apply each gradient as it arrives"),
        _form(
            "staleness-aware",
            "staleness-aware",
            literal("staleness-aware"),
            "learning rate / max(1, staleness)",
        ),
        _form(
            "bounded:K",
            "bounded",
            pattern(r"bounded:(?P<max_staleness>.+)", max_staleness=int),
            "drop a gradient of staleness > K",
            "an integer K >= 0",
        ),
        _form(
            "ssp:K",
            "ssp",
            pattern(r"ssp:(?P<max_lead>.+)", max_lead=int),
            "a worker more than K pushes ahead of the slowest live one waits in its pull",
            "an integer K >= 0",
            Capabilities(holds_pulls=True),
        ),
        _form(
            "sync:K/N",
            "sync",
            pattern(r"sync:(?P<aggregate>[^/]+)/(?P<workers>.+)", aggregate=int, workers=int),
            "average the first K fresh gradients of N workers, apply once",
            "integers 1 <= K <= N",
            Capabilities(aggregates=True),
        ),
        _form(
            "dc:L",
            "dc",
            pattern(r"(?:dc|dc-asgd):(?P<lam>.+)", lam=float),
            "delay compensation: g + L * g * g * (w_now - w_base)",
            "a number L >= 0",
            Capabilities(needs_weights=True),
        ),
        _form(
            "dc-a:L",
            "dc",
            pattern(r"dc-a:(?P<lam>.+)", lam=float),
            "adaptive delay compensation: L divided by the gradient's running RMS",
            "a number L >= 0",
            Capabilities(needs_weights=True),
        ),
        _form(
            "gap-aware",
            "gap-aware",
            literal("gap-aware"),
            "learning rate / parameter gap",
            caps=Capabilities(needs_weights=True),
        ),
        _form(
            "momentum-aware[:B]",
            "momentum-aware",
            pattern(r"momentum-aware(?::(?P<beta_1>[^+]+))?", beta_1=float),
            "Adam's beta_1 lowered from B, default 0.9, as staleness grows",
            "a number 0 <= B < 1",
            Capabilities(sets_beta_1=True),
        ),
        _form(
            "lookahead[:A]",
            "lookahead",
            pattern(r"lookahead(?::(?P<scale>.+))?", scale=float),
            "pulls get the weights extrapolated over the mean staleness, A times (default 1)",
            "a number A >= 0",
            Capabilities(needs_weights=True, extrapolates=True),
        ),
        _form(
            "momentum-aware[:B]+lookahead[:A]",
            "lookahead",
            pattern(
                r"momentum-aware(?::(?P<beta_1>[^+]+))?\+lookahead(?::(?P<scale>.+))?",
                beta_1=float,
                scale=float,
            ),
            "momentum-aware[:B] and lookahead[:A] together",
            "numbers 0 <= B < 1 and A >= 0",
            Capabilities(needs_weights=True, extrapolates=True, sets_beta_1=True),
        ),
    ]
)

ROWS_HALF_FORMS = tuple(k for k, f in _FORMS.items() if f.caps.row_safe)
DENSE_HALF_FORMS = tuple(k for k, f in _FORMS.items() if f.caps.dense_safe)


def _either(forms: tuple[str, ...], last: str = " or ") -> str:
    """``a, b or c``."""
    return ", ".join(forms[:-1]) + last + forms[-1] if len(forms) > 1 else "".join(forms)


def _hybrid(text: str) -> PolicyDescription:
    """``dense=SPEC,rows=SPEC`` (either order; each SPEC a policy text) -> its description;
    ValueError naming what is wrong: an unknown or repeated key, a missing half, a half that
    is itself a hybrid or not a policy. Which policy may be which half is the server's check
    (``downpour.server.policies.hybrid``), after each half's parameters are checked."""
    halves: dict[str, str] = {}
    for item in text.split(","):
        key, sep, spec = (s.strip() for s in item.partition("="))
        if not sep or key not in (DENSE_HALF, ROWS_HALF):
            raise ValueError(
                f"a hybrid policy is dense=SPEC,rows=SPEC; {item.strip()!r} is not "
                "dense=SPEC nor rows=SPEC"
            )
        if key in halves:
            raise ValueError(f"a hybrid policy names its {key} half once, got it twice")
        if "=" in spec:
            raise ValueError(f"a hybrid's {key} half is one policy, not {spec!r}")
        halves[key] = spec
    missing = [k for k in (DENSE_HALF, ROWS_HALF) if k not in halves]
    if missing:
        raise ValueError(
            f"a hybrid policy is dense=SPEC,rows=SPEC; the {missing[0]} half is missing"
        )
    dense, rows = describe_policy(halves[DENSE_HALF]), describe_policy(halves[ROWS_HALF])
    return PolicyDescription(
        "", HYBRID, "hybrid", {}, hybrid_capabilities(dense.caps), dense=dense, rows=rows
    )


_FORMS[HYBRID] = PolicyForm(
    pattern(r"(?P<text>[^=]*=.*)", text=str),
    _hybrid,
    "the dense variables by one policy, the tables' rows by another, applied apart",
    f"dense: {_either(DENSE_HALF_FORMS)}; rows: {_either(ROWS_HALF_FORMS)}",
    kind="hybrid",
    caps=Capabilities(splits=True),
)

POLICIES: Forms[PolicyDescription] = Forms("policy", _FORMS)
POLICY_FORMS = POLICIES.summary  # the forms with their parameters' bounds, for errors
POLICY_HELP = POLICIES.help("what to do with stale gradients") + "; see docs: policies.md"


_CAPABILITY_COLUMNS = (  # the capabilities table's columns: heading, what it reads
    ("aggregates", lambda c: c.aggregates),
    ("holds pulls", lambda c: c.holds_pulls),
    ("needs past weights", lambda c: c.needs_weights),
    ("extrapolates pulls", lambda c: c.extrapolates),
    ("sets beta_1", lambda c: c.sets_beta_1),
    ("rows half", lambda c: c.row_safe),
    ("dense half", lambda c: c.dense_safe),
)


def capabilities_table() -> str:
    """Every form but the hybrid's with its capabilities and the halves it may be, as a
    Markdown table (docs/policies.md carries it, and a test compares the two)."""
    heads = " | ".join(h for h, _ in _CAPABILITY_COLUMNS)
    rows = [f"| form | {heads} |", "| --- |" + " --- |" * len(_CAPABILITY_COLUMNS)]
    for key, form in _FORMS.items():
        if not form.caps.splits:
            marks = " | ".join("yes" if has(form.caps) else "-" for _, has in _CAPABILITY_COLUMNS)
            rows.append(f"| `{key}` | {marks} |")
    return "\n".join(rows)


def describe_policy(text: str) -> PolicyDescription:
    """What ``text`` (case and surrounding spaces ignored) says, one of ``POLICIES``'s forms;
    ValueError saying what was expected for anything else (the parameters' ranges are the
    policies' constructors' to check)."""
    description = POLICIES.parse(text)
    return replace(description, text=text.strip().lower())


def capabilities(form: str) -> Capabilities:
    """The capabilities ``POLICIES`` declares for ``form`` (``sync:K/N``); KeyError for a
    form it does not have."""
    return _FORMS[form].caps
