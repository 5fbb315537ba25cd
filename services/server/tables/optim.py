"""The row-wise optimizers: one update rule per kind, on a table's touched rows only.

A row-sparse table's gradient is (unique rows, their values); only those rows of the table
and of its optimizer slots change. Each kind (``KINDS``) declares, once:

- its slots and each slot's initial value (a constant or one of its hyperparameters);
- its hyperparameters, by the Keras optimizer's attribute names, with Keras's defaults (the
  server reads the values from the Keras optimizer it built, ``rows.row_optimizer``; the
  defaults serve a ``DynamicTable`` built from a kind's name alone, and a test holds them to
  Keras's);
- its update rule: array arithmetic written once, on operators and a ``Math`` namespace, so
  the same rule runs on NumPy arrays (a dynamic table's gathered rows, ``update_rows``,
  in place) and on TensorFlow tensors (a fixed table's rows inside the server's compiled
  apply, ``rows.row_update``, gathered and scattered back).

A rule gets the touched rows' slots and returns a ``RowStep``: the slots' new values and the
rows' change, ``sub`` (the rows become ``rows - sub``: no read of the rows, one scatter-sub
of a fixed table) or ``new`` (the rows become ``new``, for a kind whose rule reads the rows,
``reads_rows``). It may update the slot arrays it is given in place (augmented assignment:
in place on NumPy arrays, a new tensor in TensorFlow) and must not modify ``grad``.

The kinds: ``sgd``; ``adagrad``, Keras's Adagrad arithmetic; ``lazy_adam``, Adam whose
moments and rows change only where touched (TF1's ``LazyAdamOptimizer``, TensorFlow Addons'
``LazyAdam``): a row no batch touches keeps its moments and stops moving. The slot names are
those of the checkpoint format (``dynamic/<path>/slot_<name>``). No TensorFlow import here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Math:
    """The functions a rule calls beyond arithmetic operators, from one array library."""

    sqrt: Callable[[Any], Any]
    square: Callable[[Any], Any]
    power: Callable[[Any, Any], Any]
    clip: Callable[[Any, Any, Any], Any]  # (x, low, high)


NUMPY = Math(np.sqrt, np.square, np.power, np.clip)


@dataclass
class RowStep:
    """A rule's result: each slot's new rows, and the rows' change (``sub`` or ``new``)."""

    slots: dict[str, Any]
    sub: Any = None  # the rows become rows - sub
    new: Any = None  # the rows become new (a rule that reads the rows)


Hyper = Mapping[str, Any]  # hyperparameter name -> its value, a scalar of the rows' dtype
Slots = dict[str, Any]  # slot name -> its touched rows
# rule(math, hyperparameters, rows, slots, grad, lr, t): arrays and scalars of the rows' dtype;
# t is the step number (the optimizer's iterations + 1); rows and t None unless the kind
# reads them (``Kind``)
Rule = Callable[[Math, Hyper, Any, Slots, Any, Any, Any], RowStep]


@dataclass(frozen=True)
class Kind:
    """One row-wise optimizer: ``slots`` (slot name -> initial value: a constant, or the name
    of a hyperparameter), ``hyper`` (hyperparameter -> Keras's default), its ``rule``, and
    what else the rule reads: the rows (``reads_rows``: a fixed table then gathers them) and
    the step number (``reads_step``; otherwise it gets None for either)."""

    slots: Mapping[str, float | str]
    hyper: Mapping[str, float]
    rule: Rule
    reads_rows: bool = False
    reads_step: bool = False


def _sgd(xp: Math, h: Hyper, rows: Any, s: Slots, grad: Any, lr: Any, t: Any) -> RowStep:
    return RowStep(s, sub=lr * grad)


def _adagrad(xp: Math, h: Hyper, rows: Any, s: Slots, grad: Any, lr: Any, t: Any) -> RowStep:
    acc = s["accumulator"]
    acc += xp.square(grad)
    return RowStep({"accumulator": acc}, sub=lr * grad / xp.sqrt(acc + h["epsilon"]))


def _lazy_adam(xp: Math, h: Hyper, rows: Any, s: Slots, grad: Any, lr: Any, t: Any) -> RowStep:
    m, v = s["m"], s["v"]
    b1, b2 = h["beta_1"], h["beta_2"]
    alpha = lr * xp.sqrt(1 - xp.power(b2, t)) / (1 - xp.power(b1, t))
    m *= b1
    m += (1 - b1) * grad
    v *= b2
    v += (1 - b2) * xp.square(grad)
    return RowStep({"m": m, "v": v}, sub=alpha * m / (xp.sqrt(v) + h["epsilon"]))


KINDS: dict[str, Kind] = {  # the row-wise optimizers; hyperparameter defaults are Keras's
    "sgd": Kind({}, {}, _sgd),
    "adagrad": Kind(
        {"accumulator": "initial_accumulator_value"},
        {"initial_accumulator_value": 0.1, "epsilon": 1e-7},
        _adagrad,
    ),
    "lazy_adam": Kind(
        {"m": 0.0, "v": 0.0},
        {"beta_1": 0.9, "beta_2": 0.999, "epsilon": 1e-7},
        _lazy_adam,
        reads_step=True,
    ),
}


@dataclass(frozen=True)
class RowOptimizer:
    """A row-wise optimizer of kind ``kind`` (a key of ``KINDS``) with its hyperparameter
    values ``params`` (those not given: the kind's Keras defaults)."""

    kind: str = "sgd"
    params: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"optimizer must be one of {sorted(KINDS)}, got {self.kind!r}")
        hyper = KINDS[self.kind].hyper
        unknown = sorted(set(self.params) - set(hyper))
        if unknown:
            raise ValueError(f"{self.kind} has no hyperparameters {unknown}: {sorted(hyper)}")
        object.__setattr__(
            self, "params", {k: float(self.params.get(k, d)) for k, d in hyper.items()}
        )

    @property
    def entry(self) -> Kind:
        """This kind's slots, hyperparameters and rule."""
        return KINDS[self.kind]

    @property
    def slots(self) -> tuple[str, ...]:
        return tuple(self.entry.slots)

    def initial_slot(self, name: str) -> float:
        """A new row's value of slot ``name`` (Adagrad's accumulator: its initial
        accumulator value; Adam's moments: 0)."""
        value = self.entry.slots[name]
        return self.params[value] if isinstance(value, str) else value


def update_rows(
    opt: RowOptimizer,
    rows: np.ndarray,
    slots: dict[str, np.ndarray],
    grad: np.ndarray,
    lr: float,
    step: int,
) -> dict[str, np.ndarray]:
    """Update ``rows`` in place by ``grad`` at learning rate ``lr`` as ``opt``'s rule says,
    in the rows' dtype; ``step`` is Adam's step number t (the optimizer's ``iterations +
    1``). Returns the slots' new values: ``slots``' own arrays, updated in place, unless the
    rule makes new ones."""
    dt = rows.dtype.type
    h = {k: dt(v) for k, v in opt.params.items()}
    grad = grad.astype(rows.dtype, copy=False)
    kind = opt.entry
    old = rows if kind.reads_rows else None
    t = dt(step) if kind.reads_step else None
    out = kind.rule(NUMPY, h, old, slots, grad, dt(lr), t)
    if out.new is None:
        rows -= out.sub
    else:
        rows[...] = out.new
    return out.slots
