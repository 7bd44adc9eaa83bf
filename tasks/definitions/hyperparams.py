"""The hyperparameters the framework knows, declared once: name, default, domain and how a sweep may search it.

The framework's own (optimizer and learning-rate rules) hold in every run; the built-in MLP's
(``stagewise.model:MLPClassifier``) are known by name too, so a typo in its params is refused early. A
user's spec declares its own in ``ModelSpec.default_params``; their domains are the spec's to check.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

BUILTIN_SPEC = "stagewise.model:MLPClassifier"
"""The model.spec of a config that names none: the built-in MLP."""


@dataclass(frozen=True, kw_only=True)
class Hyperparameter:
    """One hyperparameter the framework validates by name."""

    name: str
    """Its key in params, train.default_params and sweep.search_space."""
    default: Any
    """The value a run uses when nothing sets it."""
    domain: str
    """What a value must be, as an error message words it."""
    low: float | None = None
    """Smallest allowed value (None: no lower bound)."""
    low_inclusive: bool = True
    """Whether ``low`` itself is allowed."""
    below: float | None = None
    """Every value must be below this (None: no upper bound)."""
    integer: bool = False
    """Only whole numbers (a float search dimension is refused; resolved values become int)."""
    choices: tuple[str, ...] = ()
    """The allowed values of a categorical hyperparameter (a sweep must search it as categorical)."""
    fraction_of: str = "values"
    """What a fractional value would be, for the message refusing a float search dimension of an integer one."""
    doc: str = ""
    """What it does, in one line (the generated config reference lists it)."""

    def admits(self, value: Any) -> bool:
        """Whether ``value`` lies in the domain."""
        if self.choices:
            return value in self.choices
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return False
        if self.low is not None and (value < self.low or (value == self.low and not self.low_inclusive)):
            return False
        if self.below is not None and value >= self.below:
            return False
        return not self.integer or float(value).is_integer()


def defaults(hypers: tuple[Hyperparameter, ...]) -> dict[str, Any]:
    """``{name: default}`` of ``hypers``."""
    return {hyper.name: hyper.default for hyper in hypers}


FRAMEWORK = (
    Hyperparameter(name="lr", default=0.05, domain="> 0", low=0.0, low_inclusive=False,
                   doc="The learning rate at train.base_batch; each stage rescales it (train.lr_rule)."),
    Hyperparameter(name="weight_decay", default=0.0, domain=">= 0", low=0.0,
                   doc="Weight decay of weight matrices and kernels (never of biases or norm scales)."),
    Hyperparameter(name="momentum", default=0.9, domain="in [0, 1)", low=0.0, below=1.0,
                   doc="SGD's momentum (Nesterov when above 0); adamw ignores it."),
    Hyperparameter(name="optimizer", default="sgd", domain="one of sgd, adamw", choices=("sgd", "adamw"),
                   doc="The framework's optimizer, unless the spec builds its own (ModelSpec.optimizer)."),
)
"""The framework's own: the optimizer and the learning-rate rules read them in every run."""

BUILTIN_SPEC_PARAMS = (
    Hyperparameter(name="hidden", default=128, domain="a whole number >= 1", low=1.0, integer=True, fraction_of="widths",
                   doc="The built-in MLP's hidden width."),
    Hyperparameter(name="dropout", default=0.0, domain="in [0, 1)", low=0.0, below=1.0,
                   doc="The built-in MLP's dropout rate."),
)
"""The built-in MLP's own (its ``default_params`` are these defaults)."""

KNOWN = {hyper.name: hyper for hyper in (*FRAMEWORK, *BUILTIN_SPEC_PARAMS)}
"""Every hyperparameter with a domain the framework checks, by name."""
FRAMEWORK_DEFAULTS = defaults(FRAMEWORK)
"""The framework's hyperparameters and their defaults."""
TUNABLE = tuple(KNOWN)
"""The names a sweep of the built-in model may search."""


def hyperparameter_problem(name: str, value: Any, known: tuple[str, ...] | None = TUNABLE) -> str | None:
    """Why ``value`` is no valid ``name`` (unknown name or outside its obvious domain), or None when it is.

    ``known=None`` accepts any name (a user's spec declares its own; it is checked when the spec is loaded).
    """
    if known is not None and name not in known:
        return f"unknown hyperparameter '{name}'; known: {list(known)}"
    hyper = KNOWN.get(name)
    if hyper is None:
        return None  # a user spec's own parameter: its domain is the spec's to check
    if not hyper.admits(value):
        return f"{name}={value!r} is out of range: {name} must be {hyper.domain}"
    return None


def typed(params: dict[str, Any]) -> dict[str, Any]:
    """``params`` with each integer hyperparameter as an int (a sweep or JSON may give 64.0)."""
    return {name: int(value) if name in KNOWN and KNOWN[name].integer else value for name, value in params.items()}


# The framework's optimizer hyperparameters: they build its SGD/AdamW, so beside a spec's own optimizer they say nothing.
FRAMEWORK_OPTIMIZER_PARAMS = ("optimizer", "momentum")


def ran_params(params: dict[str, Any], recipe: dict[str, Any] | None) -> dict[str, Any]:
    """The hyperparameters as a record shows them beside ``recipe`` (stagewise.training.recipe): without the
    framework's optimizer choice and momentum when the spec built its own optimizer (what it built is in the recipe).
    Plain dicts only: the registry step, which runs in Airflow's task process, imports it without torch."""
    if not recipe or recipe.get("optimizer", {}).get("source") != "spec":
        return dict(params)
    return {key: value for key, value in params.items() if key not in FRAMEWORK_OPTIMIZER_PARAMS}
