"""The staleness policies built from their texts: each ``--policy`` form's constructor.

``downpour.config.policy`` reads a text into a description (the form, its parameters, its
capabilities; a hybrid's two halves) from ``POLICIES``, the one table of forms. Here
``CONSTRUCTORS`` gives each form's policy class (``dc-a:L`` is ``dc:L`` made adaptive), and
``build_policy`` calls it with the description's parameters: the constructor checks their
ranges, ``HybridPolicy`` which half each policy may be. ``parse_policy``
(``downpour.server.policies.base``) is ``build_policy``; the rules themselves are the
policies' docstrings.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from downpour.config.policy import HYBRID, PolicyDescription, describe_policy
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

CONSTRUCTORS: dict[str, Callable[..., Policy]] = {  # a form of POLICIES -> its policy
    "async": AsyncPolicy,
    "staleness-aware": StalenessAwarePolicy,
    "bounded:K": BoundedPolicy,
    "ssp:K": SSPPolicy,
    "sync:K/N": SyncPolicy,
    "dc:L": DelayCompensatedPolicy,
    "dc-a:L": partial(DelayCompensatedPolicy, adaptive=True),
    "gap-aware": GapAwarePolicy,
    "momentum-aware[:B]": MomentumAwarePolicy,
    "lookahead[:A]": LookaheadPolicy,
    "momentum-aware[:B]+lookahead[:A]": partial(LookaheadPolicy, beta_1=DEFAULT_BETA_1),
    HYBRID: HybridPolicy,
}


def build_policy(text: str) -> Policy:
    """A fresh policy from ``text``: ``describe_policy``'s errors for a text that is no form,
    else the policy its description says, any ValueError of its constructors prefixed with
    the text."""
    description = describe_policy(text)
    try:
        return from_description(description)
    except ValueError as exc:
        raise ValueError(f"policy {text!r}: {exc}") from None


def from_description(description: PolicyDescription) -> Policy:
    """The policy ``description`` says: its form's constructor called with its parameters
    (ValueError for one out of range); a hybrid's halves built first, each error prefixed
    with that half's text, then ``HybridPolicy`` (ValueError for a half it refuses)."""
    build = CONSTRUCTORS[description.form]
    dense, rows = description.dense, description.rows
    if dense is not None and rows is not None:  # a hybrid: built from its two halves
        return build(_half(dense), _half(rows))
    return build(**description.params)


def _half(description: PolicyDescription) -> Policy:
    try:
        return from_description(description)
    except ValueError as exc:
        raise ValueError(f"policy {description.text!r}: {exc}") from None
