"""The Optuna sweep: its search space, sampler, pruner, storage and a user's own trial entrypoint."""

from __future__ import annotations

import math
import re
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from stagewise.core.contract import STAGE_VALUES
from stagewise.definitions.hyperparams import KNOWN
from stagewise.definitions.passwords import study_storage_problem
from stagewise.definitions.sections.base import (
    MAX_BATCH,
    MAX_EPOCHS,
    MAX_ROWS,
    MAX_SEED,
    MAX_STUDY_NAME,
    MAX_TRIALS,
    STUDY_PLACEHOLDER,
    StrictModel,
)
from stagewise.definitions.sharding import sweep_strategy_problem


class _Dimension(StrictModel):
    when: dict[str, list[int | float | str]] | None = Field(
        None, description="Conditional: searched only when these categorical params take one of these values.")
    grid: list[int | float | str] | None = Field(None, description="Values the grid sampler tries.")


class FloatParam(_Dimension):
    """A float search dimension."""

    type: Literal["float"] = Field(description="'float': a real number in [low, high].")
    low: float = Field(description="Lower bound.")
    high: float = Field(description="Upper bound.")
    log: bool = Field(False, description="Sample on a log scale.")

    @model_validator(mode="after")
    def _bounds(self) -> FloatParam:
        if not self.low < self.high:
            raise ValueError(f"low ({self.low}) must be below high ({self.high})")
        if self.log and self.low <= 0:
            raise ValueError(f"log scale needs low > 0, got {self.low}")
        return self


class IntParam(_Dimension):
    """An integer search dimension."""

    type: Literal["int"] = Field(description="'int': an integer in [low, high].")
    low: int = Field(description="Lower bound (inclusive).")
    high: int = Field(description="Upper bound (inclusive).")
    log: bool = Field(False, description="Sample on a log scale.")

    @model_validator(mode="after")
    def _bounds(self) -> IntParam:
        if not self.low < self.high:
            raise ValueError(f"low ({self.low}) must be below high ({self.high})")
        if self.log and self.low < 1:
            raise ValueError(f"log scale needs low >= 1, got {self.low}")
        return self


class CategoricalParam(_Dimension):
    """A categorical search dimension."""

    type: Literal["categorical"] = Field(description="'categorical': one of choices.")
    choices: list[int | float | str] = Field(min_length=1, description="The values to choose from.")


SearchParam = FloatParam | IntParam | CategoricalParam
def _space_problem(name: str, space: SearchParam) -> str | None:
    """Why a search dimension can sample values outside ``name``'s domain, or None."""
    hyper = KNOWN.get(name)
    if hyper is None:
        return None  # a user spec's own parameter: no domain the framework knows
    if hyper.choices and not isinstance(space, CategoricalParam):
        return f"{name}: must be a categorical param (choices among {list(hyper.choices)})"
    if hyper.integer and isinstance(space, FloatParam):
        return f"{name}: a float param gives fractional {hyper.fraction_of}; use type int or categorical"
    points = {"choices": space.choices} if isinstance(space, CategoricalParam) else {"low": [space.low], "high": [space.high]}
    points["grid"] = space.grid or []
    for which, values in points.items():
        for value in values:
            if not hyper.admits(value):
                return f"{name}.{which} {value!r} is out of range: {name} must be {hyper.domain}"
    return None


class Sampler(StrictModel):
    """How trials pick hyperparameters."""

    type: Literal["tpe", "random", "cmaes", "grid"] = Field("tpe", description="tpe (Bayesian), random, cmaes or grid.")
    multivariate: bool = Field(True, description="TPE: model parameters jointly.")
    constant_liar: bool = Field(True, description="TPE: treat running trials as bad so parallel workers spread out.")
    n_startup_trials: int = Field(4, ge=0, le=MAX_TRIALS, description="TPE/CMA-ES: random trials before the model takes over (at most 10000).")


class Pruner(StrictModel):
    """How weak trials stop early."""

    type: Literal["hyperband", "median", "none"] = Field("hyperband", description="hyperband, median or none.")
    min_resource: int = Field(1, ge=1, le=MAX_EPOCHS, description="Hyperband: epochs before the first decision (budget rows: min_rows); at most 10000.")
    reduction_factor: int = Field(3, ge=2, le=100, description="Hyperband: keep 1/reduction_factor at each rung (at most 100).")
    n_startup_trials: int = Field(2, ge=0, le=MAX_TRIALS, description="Median: trials before pruning starts (at most 10000).")
    n_warmup_steps: int = Field(1, ge=0, le=MAX_EPOCHS, description="Median: epochs of a trial before it can be pruned (at most 10000).")


class EntryPoint(StrictModel):
    """A user's own torchrun script or module for a stage or for each sweep trial (bring your own training code)."""

    script: str | None = Field(None, description="Python file, relative to the config file or absolute.")
    module: str | None = Field(None, description="Importable module, run as `-m module`.")
    args: list[str] = Field(default_factory=list, description=(
        "Arguments; {epochs}, {lr}, {per_process_batch}, ... and hyperparameter names are filled in ({{ }}: literal braces)."))

    @model_validator(mode="after")
    def _one_target(self) -> EntryPoint:
        if (self.script is None) == (self.module is None):
            raise ValueError("give exactly one of script and module")
        return self


class Sweep(StrictModel):
    """An Optuna study shared by parallel worker tasks."""

    profile: str = Field(description="Instance profile of each worker task (more than one process: DDP trials).")
    num_trials: int = Field(12, ge=1, le=MAX_TRIALS, description="Trial budget of the whole study (at most 10000).")
    num_workers: int = Field(2, ge=1, le=64, description="Parallel worker tasks sharing the study (at most 64).")
    epochs: int = Field(8, ge=1, le=1000, description="Max epochs of one trial (Hyperband's max resource); at most 1000.")
    batch_size: int = Field(32, ge=1, le=MAX_BATCH, description="Per-process batch size inside a trial (at most 16777216).")
    strategy: Literal["ddp", "fsdp"] = Field("ddp", description=(
        "How a trial spreads its model over the profile's processes: ddp (a copy each) or fsdp (sharded, as a stage's)."))
    storage: str = Field(
        "",
        description=("Optuna storage: journal://<file> (embedded; relative: under storage_root; {study} in it: a file "
                     "per study) or a password-free postgresql://... (multi-node); empty: sweep.storage_conn_id's "
                     "database, else journal://<storage_root>/optuna/studies/{study}.journal (s3:// roots need one)."),
    )
    storage_conn_id: str = Field("", description=(
        "Airflow connection (type postgres: host, port, login, password, schema) of the study's database, resolved "
        "on the worker at run time; set it and leave storage empty (docs/services.md)."))
    seed: int = Field(0, ge=0, le=MAX_SEED, description="Sampler seed, 0 to 4294967295.")
    sampler: Sampler = Field(default_factory=Sampler, description="The sampler.")
    pruner: Pruner = Field(default_factory=Pruner, description="The pruner.")
    warm_start_from: str = Field("", max_length=MAX_STUDY_NAME,
                                 description="Study name whose best params are enqueued first (empty: cold start).")
    entrypoint: EntryPoint | None = Field(None, description=(
        "Run each trial as this user script/module under torchrun (it reports through stagewise.spec.report) "
        "instead of the built-in loop; {epochs} is sweep.epochs, {per_process_batch} sweep.batch_size."))
    budget: Literal["epochs", "rows"] = Field("epochs", description=(
        "Hyperband's resource: the epochs a trial has trained, or the training rows it has seen (its rounds pass over "
        "growing, nested, key-hashed subsets of the train split, the same for every trial; docs/sweeps.md)."))
    max_rows: int | None = Field(None, ge=1, le=MAX_ROWS, description=(
        "budget rows: the rows a trial that is never pruned sees in all (at most 10^12; default: sweep.epochs passes "
        "of the split)."))
    min_rows: int | None = Field(None, ge=1, le=MAX_ROWS, description=(
        "budget rows: the fewest rows of a trial's first round, before the first pruning decision; rounds end at "
        "max_rows / reduction_factor^k (at most 10^12; default: max_rows / reduction_factor^3, at least 16 batches)."))
    validation_rows: int | None = Field(None, ge=1, le=MAX_ROWS, description=(
        "Score trials on this many key-hashed validation rows, the same for every trial (at most 10^12; default: the "
        "whole split)."))
    search_space: dict[str, Annotated[SearchParam, Field(discriminator="type")]] = Field(
        description="Tunable hyperparameters by name.")

    @field_validator("search_space")
    @classmethod
    def _known_params(cls, value: dict[str, Any]) -> dict[str, Any]:
        if "lr" not in value:
            raise ValueError("'lr' must be searched: training rescales it by batch size")
        for name, space in value.items():
            problem = _space_problem(name, space)
            if problem:
                raise ValueError(problem)
        for name, space in value.items():
            for parent, values in (space.when or {}).items():
                parent_space = value.get(parent)
                if not isinstance(parent_space, CategoricalParam) or parent_space.when:
                    raise ValueError(f"{name}.when: '{parent}' must be an unconditional categorical param of the space")
                unknown_values = [v for v in values if v not in parent_space.choices]
                if unknown_values:
                    raise ValueError(f"{name}.when: {unknown_values} are not among {parent}'s choices {parent_space.choices}")
        return value

    @field_validator("storage")
    @classmethod
    def _storage_scheme(cls, value: str) -> str:
        if value and not re.match(r"^(journal://.+|postgresql(\+\w+)?://.+|sqlite:///.+)$", value):
            raise ValueError(f"'{value}' is neither journal://<file> nor postgresql://...")
        if STUDY_PLACEHOLDER in value and not value.startswith("journal://"):
            raise ValueError(f"'{value}': only a journal file's path may hold {STUDY_PLACEHOLDER} (a file per study)")
        return value

    @model_validator(mode="after")
    def _one_storage(self) -> Sweep:
        if problem := study_storage_problem(self.storage, self.storage_conn_id):
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _strategy_fits(self) -> Sweep:
        if problem := sweep_strategy_problem(self):
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _row_budget_is_coherent(self) -> Sweep:
        if self.entrypoint is not None and self.validation_rows is not None:
            raise ValueError("validation_rows caps the built-in trial loop's validation; a sweep.entrypoint script "
                             "reads its own validation data")
        if self.budget == "epochs":
            given = [name for name in ("max_rows", "min_rows") if getattr(self, name) is not None]
            if given:
                raise ValueError(f"{' and '.join(given)} size a row budget; set budget: rows to use them")
            return self
        if self.entrypoint is not None:
            raise ValueError("budget: rows drives the built-in trial loop over data subsets; a sweep.entrypoint script "
                             "chooses its own data and reports its own steps: use budget: epochs with it")
        if self.min_rows is not None and self.max_rows is not None and self.min_rows > self.max_rows:
            raise ValueError(f"min_rows {self.min_rows} exceeds max_rows {self.max_rows}")
        return self

    @model_validator(mode="after")
    def _grid_is_complete(self) -> Sweep:
        if self.sampler.type != "grid":
            return self
        for name, space in self.search_space.items():
            if space.when:
                raise ValueError(f"search_space.{name}: the grid sampler cannot search conditional params")
            if space.grid is None and not isinstance(space, CategoricalParam):
                raise ValueError(f"search_space.{name}: the grid sampler needs 'grid: [values]' for {space.type} params")
        points = math.prod(len(values) for values in self.grid().values())
        if self.num_trials > points:
            raise ValueError(f"num_trials {self.num_trials} exceeds the grid's {points} points; lower the budget")
        return self

    @property
    def needs_subsets(self) -> bool:
        """Whether trials read data subsets written before them (stagewise.datasets.subsets): a row budget, a validation cap."""
        return self.budget == "rows" or self.validation_rows is not None

    def grid(self) -> dict[str, list[Any]]:
        """The grid sampler's search space."""
        return {name: list(space.grid or getattr(space, "choices", [])) for name, space in self.search_space.items()}


# The stage values (stagewise.contract.STAGE_VALUES) an entrypoint's args may name as {name}; params is a JSON object
# (braces and all): a script reads it from $STAGEWISE_PARAMS, not from an argument.
ARG_PLACEHOLDERS = tuple(name for name in STAGE_VALUES if name != "params")


def placeholders(arg: str) -> list[str]:
    """The ``{name}`` fields of one entrypoint argument (``{{``/``}}`` are literal braces); ValueError if malformed."""
    import string

    names = []
    for _, field, spec, _ in string.Formatter().parse(arg):
        if field is None:
            continue
        if not field.isidentifier():
            raise ValueError(f"'{{{field}}}' is not a placeholder name")
        if spec and "{" in spec:
            raise ValueError(f"'{{{field}:{spec}}}' nests a placeholder in a format spec")
        names.append(field)
    return names
