"""The staleness policies' forms: the one table of ``--policy`` texts.

``POLICIES`` maps each form (``bounded:K``, ``lookahead[:A]`` ...) to its parser, its
policy's constructor (which checks the parameters' ranges), what it does and what its
parameters must be. ``parse_policy`` (``downpour.server.policies.base``), ``POLICY_FORMS`` (the
forms in error messages), ``POLICY_HELP`` (``downpour server --policy``'s help) and the
table in docs/policies.md (compared with it by ``tests/test_policies.py``) all derive from it.
The rules themselves are the policies' docstrings.
"""

from __future__ import annotations

from functools import partial

from downpour.config.forms import Form, Forms, literal, pattern
from downpour.server.policies.base import (
    AsyncPolicy,
    BoundedPolicy,
    Policy,
    SSPPolicy,
    StalenessAwarePolicy,
    SyncPolicy,
)
from downpour.server.policies.compensation import (
    DEFAULT_BETA_1,
    DelayCompensatedPolicy,
    GapAwarePolicy,
    LookaheadPolicy,
    MomentumAwarePolicy,
)
from downpour.server.policies.hybrid import HybridPolicy

POLICIES: Forms[Policy] = Forms(
    "policy",
    {
        "async": Form(literal("async"), AsyncPolicy, "apply each gradient as it arrives"),
        "staleness-aware": Form(
            literal("staleness-aware"),
            StalenessAwarePolicy,
            "learning rate / max(1, staleness)",
        ),
        "bounded:K": Form(
            pattern(r"bounded:(?P<max_staleness>.+)", max_staleness=int),
            BoundedPolicy,
            "drop a gradient of staleness > K",
            "an integer K >= 0",
        ),
        "ssp:K": Form(
            pattern(r"ssp:(?P<max_lead>.+)", max_lead=int),
            SSPPolicy,
            "a worker more than K pushes ahead of the slowest live one waits in its pull",
            "an integer K >= 0",
        ),
        "sync:K/N": Form(
            pattern(r"sync:(?P<aggregate>[^/]+)/(?P<workers>.+)", aggregate=int, workers=int),
            SyncPolicy,
            "average the first K fresh gradients of N workers, apply once",
            "integers 1 <= K <= N",
        ),
        "dc:L": Form(
            pattern(r"(?:dc|dc-asgd):(?P<lam>.+)", lam=float),
            DelayCompensatedPolicy,
            "delay compensation: g + L * g * g * (w_now - w_base)",
            "a number L >= 0",
        ),
        "dc-a:L": Form(
            pattern(r"dc-a:(?P<lam>.+)", lam=float),
            partial(DelayCompensatedPolicy, adaptive=True),
            "adaptive delay compensation: L divided by the gradient's running RMS",
            "a number L >= 0",
        ),
        "gap-aware": Form(literal("gap-aware"), GapAwarePolicy, "learning rate / parameter gap"),
        "momentum-aware[:B]": Form(
            pattern(r"momentum-aware(?::(?P<beta_1>[^+]+))?", beta_1=float),
            MomentumAwarePolicy,
            "Adam's beta_1 lowered from B, default 0.9, as staleness grows",
            "a number 0 <= B < 1",
        ),
        "lookahead[:A]": Form(
            pattern(r"lookahead(?::(?P<scale>.+))?", scale=float),
            LookaheadPolicy,
            "pulls get the weights extrapolated over the mean staleness, A times (default 1)",
            "a number A >= 0",
        ),
        "momentum-aware[:B]+lookahead[:A]": Form(
            pattern(
                r"momentum-aware(?::(?P<beta_1>[^+]+))?\+lookahead(?::(?P<scale>.+))?",
                beta_1=float,
                scale=float,
            ),
            partial(LookaheadPolicy, beta_1=DEFAULT_BETA_1),
            "momentum-aware[:B] and lookahead[:A] together",
            "numbers 0 <= B < 1 and A >= 0",
        ),
        "dense=SPEC,rows=SPEC": Form(
            pattern(r"(?P<text>[^=]*=.*)", text=str),
            HybridPolicy.from_text,
            "the dense variables by one policy, the tables' rows by another, applied apart",
            "dense: async, staleness-aware, bounded:K, ssp:K or sync:K/N; "
            "rows: async, staleness-aware or bounded:K",
        ),
    },
)

POLICY_FORMS = POLICIES.summary
POLICY_HELP = POLICIES.help("what to do with stale gradients") + "; see docs: policies.md"
