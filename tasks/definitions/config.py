"""The pipeline config's schema: typed, strict pydantic models with one line of doc per field.

Loading a file (overrides, relative paths) is ``stagewise.definitions.loading``; the generated reference
``stagewise.definitions.reference``; ``python -m stagewise.config`` validates a file.
"""

from __future__ import annotations

import datetime as dt
import math
import os
import re
import urllib.parse
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from stagewise.core.contract import STAGE_VALUES
from stagewise.core.errors import UserError
from stagewise.definitions.bookkeeping import BOOKKEEPING, with_bookkeeping
from stagewise.definitions.caching import Cache
from stagewise.definitions.hyperparams import (
    BUILTIN_SPEC,
    KNOWN,
    TUNABLE,
    hyperparameter_problem,
)
from stagewise.definitions.intervals import fields_in, static_prefix
from stagewise.definitions.passwords import password_problem, study_storage_problem
from stagewise.definitions.retention import Retention
from stagewise.definitions.roots import local_root_problem
from stagewise.definitions.sharding import stage_strategy_problem, sweep_strategy_problem
from stagewise.definitions.spec_source import declared_default_params

# Optuna keeps a study's name in at most 512 characters (its RDB schema).
MAX_STUDY_NAME = 512
# Upper bounds of counts no real deployment reaches: a value past one is a typo (1e18 slots, a batch of 10^12), refused
# naming its key before it reaches Airflow, a loader or an allocation. Each field's description states its bound.
MAX_BATCH = 1 << 24  # rows in one batch or optimizer step: 16,777,216
MAX_ROWS = 10**12  # rows of a data set (a sweep's row budget, an inference shard)
MAX_STEPS = 10**9  # optimizer steps (warmup, checkpoint and measurement intervals)
MAX_EPOCHS = 10_000
MAX_TRIALS = 10_000
MAX_SECONDS = 30 * 86_400  # 30 days: a task, a job or a wait
MAX_SEED = 2**32 - 1  # numpy's seeds are 32-bit
# In a journal path, the study's name (made safe for a file name): a file per study (stagewise.study.studies).
STUDY_PLACEHOLDER = "{study}"
# Where the sweep's journal lives under storage_root when sweep.storage is unset: a file per study, since Optuna
# replays a journal whole on open (one file of 500 studies took 0.51 s a worker; docs/sweeps.md).
DEFAULT_JOURNAL = "optuna/studies/{study}.journal"
# The one journal of every study that earlier releases kept there: still read for studies made before the move.
LEGACY_JOURNAL = "optuna/optuna.journal"
# What well-known metrics can be: a limit outside can never be met nor missed, so it is a typo.
METRIC_RANGES = {**dict.fromkeys(("accuracy", "precision", "recall", "f1", "auc"), (0.0, 1.0)),
                 **dict.fromkeys(("rmse", "mae", "mse", "loss"), (0.0, math.inf))}


class ConfigError(UserError):
    """The pipeline config is invalid; the message names the file, key and reason."""


class _Strict(BaseModel):
    # Unknown keys are refused so a typo never silently falls back to a default.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)  # a NaN or inf limit would mean none


class SageMakerSettings(_Strict):
    """One SageMaker training job per stage try, all its nodes gang-scheduled by SageMaker (backend 'sagemaker')."""

    instance_type: str = Field(description="Instance type of every node, e.g. ml.g5.12xlarge.")
    image_uri: str = Field(description="The runtime image (docker/runtime.Dockerfile) pushed to ECR.")
    role_arn: str = Field(pattern=r"^arn:aws[\w-]*:iam::\d{12}:role/.+$",
                          description="IAM role the job runs as: reads the run's data, writes checkpoints and models.")
    volume_size_gb: int = Field(100, ge=1, le=16384, description="EBS volume of each node, in GB (at most 16384).")
    max_run_s: int = Field(86400, ge=60, le=28 * 86_400, description="The job's MaxRuntimeInSeconds (SageMaker's limit: at most 28 days, 2419200).")
    use_spot: bool = Field(False, description="Managed spot training; an interrupted job resumes from its S3 checkpoints.")
    max_wait_s: int | None = Field(None, ge=60, le=MAX_SECONDS, description=(
        "MaxWaitTimeInSeconds with spot, above max_run_s (at most 30 days, 2592000); empty: 2 x "
        "max_run_s."))
    spot_fallback_on_last_retry: bool = Field(True, description="The stage's last Airflow try runs on demand instead of spot.")
    region: str = Field("", description="AWS region of the job; empty: the connection's or the environment's.")
    aws_conn_id: str = Field("aws_default", description="Airflow connection for the SageMaker API.")
    deferrable: bool = Field(False, description=(
        "Wait in Airflow's triggerer, freeing the worker slot while the job runs; but a task killed or marked failed "
        "while deferred cannot stop its job (it runs until it ends or hits max_run_s), and no node log lines stream "
        "while deferred (status only on resume)."))

    @model_validator(mode="after")
    def _wait_above_run(self) -> SageMakerSettings:
        if self.max_wait_s is not None and not self.use_spot:
            raise ValueError("max_wait_s applies to spot training only (use_spot: true)")
        if self.max_wait_s is not None and self.max_wait_s <= self.max_run_s:
            raise ValueError(f"max_wait_s {self.max_wait_s} must exceed max_run_s {self.max_run_s}: it includes the spot wait")
        return self


class KubernetesSettings(_Strict):
    """One Indexed Job (a pod per node) and a headless Service per stage try (backend 'kubernetes')."""

    image: str = Field(description="The runtime image (docker/runtime.Dockerfile) the pods run.")
    namespace: str = Field("default", description="Namespace of the Job and its Service.")
    gpus_per_pod: int = Field(0, ge=0, le=16, description="nvidia.com/gpu limit of each pod (usually processes_per_node); at most 16.")
    cpu: str = Field("", description="CPU request and limit of each pod, e.g. '8'; empty: none.")
    memory: str = Field("", description="Memory request and limit of each pod, e.g. '32Gi'; empty: none.")
    node_selector: dict[str, str] = Field(default_factory=dict, description="Node labels the pods must match.")
    tolerations: list[dict[str, Any]] = Field(default_factory=list, description="Pod tolerations, as in a pod spec.")
    service_account: str = Field("", description="Service account of the pods (e.g. with IRSA for S3); empty: the namespace's default.")
    kubernetes_conn_id: str = Field("kubernetes_default", description="Airflow connection for the cluster's API.")
    rendezvous_port: int = Field(29400, ge=1024, le=65535, description="Port of the rendezvous store on pod 0 (torchrun's static rendezvous).")
    join_timeout_s: int = Field(900, ge=60, le=86_400, description=(
        "How long torchrun waits for every pod to join (above scheduling time); at most a day, 86400."))


class Profile(_Strict):
    """Where and how a sub-job runs: the launcher plus Airflow's own knobs."""

    backend: Literal["local", "sagemaker", "kubernetes"] = Field(
        "local", description="Launcher: 'local' runs processes on the worker; 'sagemaker'/'kubernetes' submit a train stage's whole gang as one job.")
    nodes: int = Field(1, ge=1, le=512, description="Nodes (instances or pods) of a train stage, at most 512; fixed, so the global batch is too.")
    processes_per_node: int = Field(1, ge=1, le=64, description="Processes per node (torchrun --nproc-per-node); at most 64.")
    threads_per_process: int = Field(1, ge=1, le=256, description="Intra-op threads per process (OMP/torch); at most 256.")
    device: Literal["cpu", "cuda", "auto"] = Field("cpu", description="Device: cpu, cuda, or auto (cuda if present).")
    pool: str = Field("default_pool", description="Airflow pool that bounds concurrent use of this resource.")
    pool_slots: int = Field(1, ge=1, le=100_000, description="Pool slots one task of this profile takes (at most 100000).")
    queue: str = Field("default", description="Executor queue (Celery queue / instance type).")
    priority_weight: int = Field(1, ge=1, le=1_000_000, description="Airflow priority_weight of the profile's tasks (at most 1000000); higher runs first.")
    weight_rule: Literal["downstream", "upstream", "absolute"] = Field(
        "absolute", description="'absolute': priority_weight alone (older runs first); 'downstream' adds every downstream task's, the light tasks' too.")
    retries: int = Field(1, ge=0, le=20, description="Airflow retries after an infrastructure failure (at most 20).")
    retry_delay_s: float = Field(5.0, ge=0, le=86_400, description="Seconds before the first retry (at most a day, 86400).")
    retry_backoff: float = Field(2.0, ge=1.0, le=100, description="Multiplier of the retry delay per further retry (at most 100).")
    max_retry_delay_s: float = Field(300.0, ge=0, le=7 * 86_400, description="Cap on the retry delay (at most a week, 604800).")
    execution_timeout_s: float = Field(3600.0, gt=0, le=MAX_SECONDS, description=(
        "Seconds after which the task and its processes are killed (at most 30 days, 2592000)."))
    max_restarts: int = Field(0, ge=0, le=10, description="torchrun --max-restarts inside one Airflow try (at most 10).")
    sagemaker: SageMakerSettings | None = Field(None, description="The SageMaker job settings (backend 'sagemaker').")
    kubernetes: KubernetesSettings | None = Field(None, description="The Kubernetes Job settings (backend 'kubernetes').")

    @property
    def world_size(self) -> int:
        """Processes of one job over all its nodes: what batch arithmetic and the LR rules count."""
        return self.nodes * self.processes_per_node

    @model_validator(mode="after")
    def _backend_settings(self) -> Profile:
        for backend in ("sagemaker", "kubernetes"):
            settings = getattr(self, backend)
            if self.backend == backend and settings is None:
                raise ValueError(f"backend '{backend}' needs a '{backend}:' block (see docs/scale-out.md)")
            if self.backend != backend and settings is not None:
                raise ValueError(f"a '{backend}:' block belongs to backend '{backend}', not '{self.backend}'")
        if self.backend == "local" and self.nodes != 1:
            raise ValueError(f"backend 'local' runs on one worker: nodes must be 1, not {self.nodes} "
                             f"(use backend sagemaker or kubernetes for several nodes)")
        return self


def filesystem_problem(uri: str) -> str | None:
    """Why fsspec cannot open ``uri``'s scheme here (unknown, or its package not installed), or None."""
    if "://" not in uri:
        return None
    import importlib.util

    from fsspec.registry import known_implementations, registry

    scheme = uri.split("://", 1)[0].lower()
    if scheme in registry:
        return None
    known = known_implementations.get(scheme)
    if known is None:
        return f"scheme '{scheme}://' has no fsspec filesystem; use a local path, file:// or s3://"
    package = known["class"].split(".", 1)[0]
    # find_spec looks the package up without importing it, so loading a config stays fast.
    if importlib.util.find_spec(package) is None:
        hint = known.get("err") or f"install {package}"
        return f"scheme '{scheme}://' needs the {package} package, which is not installed ({hint}: pip install {package})"
    return None


def _check_filesystem(uri: str) -> str:
    problem = filesystem_problem(uri)
    if problem:
        raise ValueError(problem)
    return uri


class FeatureColumn(_Strict):
    """A feature column declared with its type: a fixed-shape tensor, integer or categorical ids, or a variable-length list."""

    column: str = Field(description="The raw column.")
    dtype: Literal["float32", "int64", "categorical"] = Field(
        "float32", description="float32 (standardised unless normalize: false), int64 (exact integer ids, never "
                               "normalised) or categorical (strings or integers -> ids of the training split's vocabulary).")
    shape: list[Annotated[int, Field(ge=1, le=1 << 20)]] | None = Field(
        None, min_length=1, max_length=8, description="A list column with this fixed per-row tensor shape, e.g. [1, 8, 8] (up to 8 "
                                                      "dimensions of at most 1048576); empty: a scalar.")
    max_length: int | None = Field(
        None, ge=1, le=65536, description="A variable-length list column of up to this many values a row (at most 65536), padded per batch with a mask.")
    truncate: bool = Field(False, description="Keep the first max_length values of a longer row instead of failing on it.")
    normalize: bool | None = Field(
        None, description="float32 fixed-shape columns: standardise with the training data's mean/std (empty: true for a "
                          "tensor column, dataset.normalize for a scalar).")
    max_categories: int = Field(
        100_000, ge=1, le=100_000_000, description="categorical: keep the most frequent values of the training split (at "
                                                   "most 100000000); others get id 0.")

    @model_validator(mode="after")
    def _consistent(self) -> FeatureColumn:
        where = f"feature column '{self.column}'"
        if self.shape is not None and self.max_length is not None:
            raise ValueError(f"{where}: give shape (fixed) or max_length (variable-length), not both")
        if self.truncate and self.max_length is None:
            raise ValueError(f"{where}: truncate applies to a variable-length column (max_length)")
        if self.normalize and (self.dtype != "float32" or self.max_length is not None):
            kind = f"a {self.dtype} column" if self.dtype != "float32" else "a variable-length column"
            raise ValueError(f"{where}: {kind} is never normalised (normalize: true); its values reach the spec as they are")
        if self.dtype == "categorical" and (self.shape is not None or self.max_length is not None):
            raise ValueError(f"{where}: a categorical column is one value a row (no shape or max_length)")
        if self.max_categories != 100_000 and self.dtype != "categorical":
            raise ValueError(f"{where}: max_categories applies to dtype categorical")
        return self

    @property
    def typed(self) -> bool:
        """Not a plain float32 element of the feature vector: ids or a variable-length list."""
        return self.dtype != "float32" or self.max_length is not None


class Dataset(_Strict):
    """The input table: where it is and which columns play which part."""

    uri: str = Field(description="Parquet file or folder of raw shards; relative paths are under storage_root.")
    key: str = Field(description="Unique row key column (integer or string); drives the split.")
    label: str = Field(description="Label column: integer classes with num_classes, else a float target (regression).")
    features: list[str | FeatureColumn] | str = Field(
        description="Feature columns: names, or {column, dtype, shape or max_length} typed ones; or a prefix ending in '*' (e.g. 'px_*').")
    num_classes: int | None = Field(None, ge=2, le=10_000_000, description=(
        "Classes of an integer label in [0, num_classes) (at most 10000000); null: the label is a float "
        "target."))
    normalize: bool = Field(True, description="Standardise the plain (scalar) feature columns; false keeps them as they are.")
    demo_data: Literal["digits", "digits-images", "diabetes", "synthetic", "tokens"] = Field(
        "digits", description="What `python -m stagewise.data demo` (make demo) writes into uri when it holds no shards.")

    @field_validator("uri")
    @classmethod
    def _interval_placeholders(cls, value: str) -> str:
        fields_in(value, "dataset.uri")  # a run's first task fills them (stagewise.definitions.intervals)
        return value

    @field_validator("features", mode="before")
    @classmethod
    def _tensor_columns(cls, value: Any) -> Any:
        # One clear message per bad {column, shape} entry instead of pydantic's error for every member of the union.
        if not isinstance(value, list):
            return value
        items = []
        for index, item in enumerate(value):
            if isinstance(item, dict):
                try:
                    item = FeatureColumn.model_validate(item)
                except ValidationError as exc:
                    problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
                    raise ValueError(f"item {index} {item}: {problems}") from None
            items.append(item)
        return items

    @field_validator("features")
    @classmethod
    def _features_not_empty(cls, value: list[str | FeatureColumn] | str) -> list[str | FeatureColumn] | str:
        if isinstance(value, str) and not value.endswith("*"):
            raise ValueError("a string must be a prefix ending in '*', e.g. 'px_*'; otherwise give a list")
        if isinstance(value, list) and not value:
            raise ValueError("at least one feature column is needed")
        if isinstance(value, list):
            names = [item if isinstance(item, str) else item.column for item in value]
            if len(set(names)) != len(names):
                raise ValueError("feature columns repeat")
        return value

    @property
    def shapes(self) -> dict[str, list[int]]:
        """Declared float32 tensor columns -> their shapes (flattened into the feature vector)."""
        return {item.column: list(item.shape) for item in self.declared.values() if item.shape is not None and not item.typed}

    @property
    def declared(self) -> dict[str, FeatureColumn]:
        """Columns declared with their type ({column: ...} entries), by name."""
        return {} if isinstance(self.features, str) else {
            item.column: item for item in self.features if isinstance(item, FeatureColumn)}

    @field_validator("uri")
    @classmethod
    def _uri_filesystem(cls, value: str) -> str:
        return _check_filesystem(value)


class Split(_Strict):
    """Fractions of rows, chosen by a hash of the row key, held out from training."""

    validation: float = Field(0.15, gt=0, lt=1, description="Fraction of rows for validation.")
    test: float = Field(0.15, gt=0, lt=1, description="Fraction of rows for test.")
    salt: str = Field("stagewise", description="Hash salt; change it to draw a different split.")

    @model_validator(mode="after")
    def _leaves_training_rows(self) -> Split:
        if self.validation + self.test >= 0.9:
            raise ValueError(f"validation + test = {self.validation + self.test:g} leaves too little for training (< 0.1)")
        return self


class Preprocess(_Strict):
    """Sharded cleaning, statistics, normalisation and split."""

    profile: str = Field(description="Instance profile of each shard task.")
    split: Split = Field(default_factory=Split, description="Held-out fractions.")
    max_null_fraction: float = Field(0.5, ge=0, le=1, description="Fail when more rows than this are dropped as dirty.")


class _Dimension(_Strict):
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


class Sampler(_Strict):
    """How trials pick hyperparameters."""

    type: Literal["tpe", "random", "cmaes", "grid"] = Field("tpe", description="tpe (Bayesian), random, cmaes or grid.")
    multivariate: bool = Field(True, description="TPE: model parameters jointly.")
    constant_liar: bool = Field(True, description="TPE: treat running trials as bad so parallel workers spread out.")
    n_startup_trials: int = Field(4, ge=0, le=MAX_TRIALS, description="TPE/CMA-ES: random trials before the model takes over (at most 10000).")


class Pruner(_Strict):
    """How weak trials stop early."""

    type: Literal["hyperband", "median", "none"] = Field("hyperband", description="hyperband, median or none.")
    min_resource: int = Field(1, ge=1, le=MAX_EPOCHS, description="Hyperband: epochs before the first decision (budget rows: min_rows); at most 10000.")
    reduction_factor: int = Field(3, ge=2, le=100, description="Hyperband: keep 1/reduction_factor at each rung (at most 100).")
    n_startup_trials: int = Field(2, ge=0, le=MAX_TRIALS, description="Median: trials before pruning starts (at most 10000).")
    n_warmup_steps: int = Field(1, ge=0, le=MAX_EPOCHS, description="Median: epochs of a trial before it can be pruned (at most 10000).")


class EntryPoint(_Strict):
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


class Sweep(_Strict):
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


class LRSchedule(_Strict):
    """The learning rate after warmup, on the stage's optimizer steps (a resumed stage continues the curve)."""

    type: Literal["constant", "cosine", "linear", "step"] = Field(
        "constant", description="constant, cosine or linear decay to the floor, or step decay every step_epochs.")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="The floor, as a fraction of the stage's (rescaled) lr.")
    step_epochs: int = Field(1, ge=1, le=MAX_EPOCHS, description="step: epochs between two decays (at most 10000).")
    gamma: float = Field(0.1, gt=0, lt=1, description="step: the factor of each decay.")


class EarlyStopping(_Strict):
    """Stop a stage whose objective has not improved for a while."""

    patience: int = Field(ge=1, le=MAX_EPOCHS, description="Epochs without improvement before the stage stops (at most 10000).")
    min_delta: float = Field(0.0, ge=0, description="The least change of the objective that counts as improvement.")


# The built-in loop's knobs: a stage that runs the user's own script never gets them, so it may not change their defaults.
BUILT_IN_LOOP_KNOBS = ("lr_schedule", "grad_clip_norm", "hand_on", "hand_on_optimizer", "early_stopping", "precision",
                       "data_placement", "resident_memory_fraction", "shuffle_block_rows", "compile", "tf32", "cuda_graph", "strategy",
                       "activation_checkpointing")


class TrainStage(_Strict):
    """One training stage: its own process count, batch and epochs."""

    name: str = Field(pattern=r"^[A-Za-z0-9_]+$", description="Stage name; used in task ids and paths.")
    profile: str = Field(description="Instance profile (processes_per_node sets the world size).")
    per_process_batch: int | None = Field(None, ge=1, le=MAX_BATCH, description="Micro-batch on each process (or give global_batch); at most 16777216.")
    global_batch: int | None = Field(None, ge=1, le=MAX_BATCH, description=(
        "Samples per optimizer step over all processes (or give per_process_batch); at most 16777216."))
    grad_accum_steps: int = Field(1, ge=1, le=65_536, description="Micro-batches accumulated per optimizer step (at most 65536).")
    epochs: int = Field(ge=1, le=10000, description="Epochs of this stage (at most 10000).")
    warmup_steps: int = Field(0, ge=0, le=MAX_STEPS, description="Linear LR warmup steps when the global batch grew (at most 10^9).")
    entrypoint: EntryPoint | None = Field(None, description="Run this user script/module instead of stagewise.train.")
    data_placement: Literal["auto", "host", "resident", "streamed"] = Field("auto", description=(
        "Where batches are shuffled and sliced: auto (CUDA: resident if it fits, else streamed; CPU: host), host "
        "(stagewise.datasets.loader, copied per batch), resident (read and moved once) or streamed (chunks copied ahead) on the device."))
    resident_memory_fraction: float = Field(0.5, gt=0, le=1, description=(
        "auto: data is resident when the whole train split (per rank) fits in this fraction of the device's memory."))
    shuffle_block_rows: int = Field(1, ge=1, le=MAX_BATCH, description=(
        "Host loader: rows move within a shuffle window in runs of this many stored rows (1: single rows; more is "
        "coarser and faster, see bench parquet_loading's details; at most 16777216); device placements always "
        "shuffle single rows."))
    precision: Literal["fp32", "bf16", "fp16"] = Field("fp32", description=(
        "bf16 or fp16: forward and loss under autocast (weights stay fp32); fp16 adds a gradient scaler, checkpointed."))
    compile: Literal["off", "default", "reduce-overhead", "max-autotune"] = Field("off", description=(
        "torch.compile the model with this mode (reduce-overhead: CUDA graphs); checkpoints stay the plain model's."))
    tf32: bool = Field(True, description=(
        "On a GPU with TensorFloat-32 (Ampere and later), float32 matmuls and convolutions use it (several times "
        "faster, a 10-bit mantissa); false: exact float32. No effect on CPU."))
    cuda_graph: Literal["auto", "on", "off"] = Field("auto", description=(
        "Capture the training step (forward, loss, backward, clipping) as a CUDA graph and replay it: auto and on do "
        "where it is safe (one process on CUDA, a spec with static_shapes, fp32/bf16, no accumulation, compile off; "
        "otherwise eager, logged why: a WARNING for on); off: always eager."))
    strategy: Literal["ddp", "fsdp"] = Field("ddp", description=(
        "ddp: a full copy of parameters, gradients and optimizer state per rank; fsdp: all three sharded over the "
        "stage's ranks (FSDP2, sharded checkpoints), for models that do not fit one device (docs/stages.md)."))
    activation_checkpointing: bool = Field(False, description=(
        "fsdp: recompute each unit's activations in its backward instead of keeping them (less memory, ~1/3 more compute)."))
    lr_schedule: LRSchedule = Field(default_factory=LRSchedule, description=(
        "The lr after warmup (a spec's lr_schedule() replaces it); the batch rescale and warmup apply on top."))
    grad_clip_norm: float | None = Field(None, gt=0, description=(
        "Clip gradients to this global L2 norm before each optimizer step (the pre-clip norm is logged per epoch)."))
    hand_on: Literal["best", "last"] = Field("best", description=(
        "Which epoch's model the stage hands to the next stage, evaluation and the registry: best on the objective, or last."))
    hand_on_optimizer: bool = Field(True, description=(
        "Hand the optimizer state on with the model (a sharded checkpoint beside final.pt, ~2x the model with Adam)."))
    early_stopping: EarlyStopping | None = Field(None, description="Stop the stage early when the objective stalls.")

    @model_validator(mode="after")
    def _one_batch_size(self) -> TrainStage:
        if (self.per_process_batch is None) == (self.global_batch is None):
            raise ValueError("give exactly one of per_process_batch and global_batch")
        return self

    @model_validator(mode="after")
    def _one_way_to_cuda_graphs(self) -> TrainStage:
        if self.cuda_graph == "on" and self.compile != "off":
            raise ValueError(f"cuda_graph: 'on' captures the eager step; compile '{self.compile}' runs the forward through "
                             "torch.compile instead (reduce-overhead makes its own CUDA graphs): set one of them")
        return self

    @model_validator(mode="after")
    def _fsdp_knobs(self) -> TrainStage:
        if problem := stage_strategy_problem(self):
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _built_in_knobs_only_on_the_built_in_loop(self) -> TrainStage:
        # Compared with the defaults, not with the keys given: a run's config snapshot writes every key out.
        given = [knob for knob in BUILT_IN_LOOP_KNOBS if getattr(self, knob) != type(self).model_fields[knob].get_default(
            call_default_factory=True)]
        if self.entrypoint is not None and given:
            raise ValueError(f"{', '.join(given)}: the built-in loop's, but this stage runs its own entrypoint, which "
                             "never sees them; drop them (the script decides its schedule, clipping, epoch, precision and data itself)")
        return self

    def micro_batch(self, world_size: int) -> int:
        """Per-process batch: global batch = micro batch x world size x accumulation steps."""
        if self.per_process_batch is not None:
            return self.per_process_batch
        assert self.global_batch is not None
        return self.global_batch // (world_size * self.grad_accum_steps)

    def global_batch_for(self, world_size: int) -> int:
        """Samples per optimizer step over ``world_size`` processes."""
        return self.micro_batch(world_size) * world_size * self.grad_accum_steps


class Train(_Strict):
    """Sequential DDP stages whose global batch grows."""

    base_batch: int = Field(32, ge=1, le=MAX_BATCH, description="Global batch at which the swept lr holds (at most 16777216).")
    lr_rule: Literal["linear", "sqrt", "none"] = Field("linear", description="How lr scales with global batch.")
    default_params: dict[str, float | int | str] = Field(
        default_factory=dict, description="Hyperparameters used where the sweep does not set them."
    )
    seed: int = Field(0, ge=0, le=MAX_SEED, description="Seed of init, shuffling and dropout, 0 to 4294967295.")
    checkpoint_every_steps: int = Field(50, ge=1, le=MAX_STEPS, description=(
        "Rank 0 checkpoints every this many optimizer steps (a retry redoes at most these; at most "
        "10^9)."))
    keep_checkpoints: int = Field(2, ge=1, le=1000, description="Checkpoints kept per stage (older ones are deleted); at most 1000.")
    async_checkpoints: bool = Field(False, description=(
        "fsdp stages: write each sharded checkpoint in a background thread while training goes on (DCP async_save); "
        "it commits (meta.pt, then latest.json) once every shard is written."))
    noise_scale: bool = Field(True, description=(
        "Measure the gradient noise scale B_simple in every stage (epoch log, report, training chart)."))
    noise_scale_every_steps: int = Field(8, ge=1, le=MAX_STEPS, description=(
        "Measure it on one optimizer step in this many (at most 10^9): a measurement costs a few passes over the "
        "gradients; one process without accumulation (a second forward and backward) spaces them 4x as far apart after "
        "its first 10."))
    batch_growth: Literal["fixed", "adaptive"] = Field("fixed", description=(
        "fixed: the batches the stages give; adaptive: each stage after the first takes the noise scale measured at the "
        "end of the stage before as its global batch, clamped between its own configured global batch and max_global_batch (its "
        "per_process_batch is then a memory bound, gradient accumulation reaching beyond it)."))
    max_global_batch: int | None = Field(None, ge=1, le=MAX_BATCH, description="adaptive: the largest global batch a stage may take (at most 16777216).")
    stages: list[TrainStage] = Field(min_length=1, max_length=100, description="The stages, run in order (1 to 100).")

    @field_validator("default_params")
    @classmethod
    def _params_in_domain(cls, value: dict[str, float | int | str]) -> dict[str, float | int | str]:
        problems = [problem for name, v in value.items() if (problem := hyperparameter_problem(name, v, known=None))]
        if problems:
            raise ValueError("; ".join(problems))
        return value

    @model_validator(mode="after")
    def _adaptive_growth_has_what_it_needs(self) -> Train:
        if self.batch_growth != "adaptive":
            return self
        if self.max_global_batch is None:
            raise ValueError("batch_growth: 'adaptive' needs max_global_batch, the largest global batch a stage may take")
        if not self.noise_scale:
            raise ValueError("batch_growth: 'adaptive' chooses batches from the noise scale; turn noise_scale on")
        scripted = [stage.name for stage in self.stages[1:] if stage.entrypoint is not None]
        if scripted:
            raise ValueError(f"batch_growth: 'adaptive' sizes the built-in loop's stages; {scripted} run their own "
                             f"entrypoint, whose batch the script decides")
        return self

    @field_validator("stages")
    @classmethod
    def _unique_names(cls, value: list[TrainStage]) -> list[TrainStage]:
        names = [stage.name for stage in value]
        if len(set(names)) != len(names):
            raise ValueError(f"stage names repeat: {names}")
        return value


class Evaluate(_Strict):
    """Test-split evaluation."""

    profile: str = Field(description="Instance profile of the evaluation task.")
    min_test_accuracy: float = Field(0.0, ge=0, le=1, description="Fail the run below this test accuracy.")
    objective_limit: float | None = Field(
        None, allow_inf_nan=False,
        description="Fail the run when test_<objective.metric> is worse than this in objective.direction; null: no limit.")


class Inference(_Strict):
    """Sharded batch inference."""

    profile: str = Field(description="Instance profile of each shard task.")
    input_uri: str = Field("", description="Raw-schema Parquet to score; empty means the pipeline's dataset.")
    rows_per_shard: int = Field(500, ge=1, le=MAX_ROWS, description="Target rows per inference shard (at most 10^12).")
    batch_size: int = Field(1024, ge=1, le=MAX_BATCH, description="Rows scored per forward pass (at most 16777216).")
    bad_rows: Literal["quarantine", "fail"] = Field(
        "quarantine", description="Rows that cannot be scored: set aside with a reason, or fail the shard.")

    @field_validator("input_uri")
    @classmethod
    def _input_filesystem(cls, value: str) -> str:
        return _check_filesystem(value)


class Pool(_Strict):
    """An Airflow pool: the slots that profiles' pool_slots draw from."""

    slots: int = Field(ge=1, le=100_000, description="Concurrent slots, e.g. the cores or GPUs of a worker (at most 100000).")
    description: str = Field("", description="Shown in the Airflow UI.")


MODEL_NAME_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$"


def default_model_name(dataset_uri: str) -> str:
    """The registry name a config gets when it names none: the data set's last path component (raw/digits -> digits),
    before any interval placeholder (every interval's data trains one model)."""
    last = static_prefix(dataset_uri).rstrip("/").rsplit("/", 1)[-1].removesuffix(".parquet")
    return re.sub(r"[^A-Za-z0-9_.-]", "_", last).lstrip(".-") or "default"


class Registry(_Strict):
    """Versioned models under storage_root/models/<model_name> and the gate that moves `current`."""

    model_name: str = Field("", pattern=r"^$|" + MODEL_NAME_PATTERN,
                            description=("Registry scope (models/<model_name>/): the gate and inference see only this "
                                         "name's models; empty: the last path component of dataset.uri as the config "
                                         "file gives it."))
    gate_metric: str | None = Field(None, description="Test metric the gate compares; default: test_<objective.metric>, in the objective's direction.")
    margin: float = Field(0.0, ge=0, description="A new model must beat the current one by more than this, in the objective's direction.")
    backend: Literal["storage", "mlflow"] = Field("storage", description=(
        "Where versions live: storage (models/<model_name>/ under storage_root, current.json) or mlflow (the tracking "
        "server's Model Registry, model <model_name>, aliases champion and challenger; needs tracking.mlflow_uri)."))
    report_only: bool = Field(False, description=(
        "The gate decides and reports (would promote / would refuse) but moves no pointer; inference scores with the "
        "model that would be current. $STAGEWISE_SCRATCH_ROOT turns it on (docs/ci.md)."))

    @field_validator("gate_metric")
    @classmethod
    def _test_metric(cls, value: str | None) -> str | None:
        if value is not None and not re.match(r"^test_\w+$", value):
            raise ValueError(f"'{value}' is not a test metric name such as test_accuracy")
        return value

    @model_validator(mode="after")
    def _report_only_on_storage(self) -> Registry:
        if self.report_only and self.backend != "storage":
            raise ValueError("report_only judges in the storage registry (backend: storage); the mlflow backend "
                             "has no report-only gate")
        return self


class Tracking(_Strict):
    """Opt-in MLflow tracking: a parent run per DAG run, nested runs per sweep trial and training stage."""

    mlflow_uri: str = Field("", description=(
        "The team's MLflow tracking server (http:// or https://); empty: tracking off. Never put credentials here: "
        "conn_id or the worker's MLFLOW_TRACKING_* variables carry them."))
    experiment: str = Field("", description="MLflow experiment of the pipeline's runs; empty: stagewise/<pipeline name>.")
    conn_id: str = Field("", description=(
        "Airflow connection with the server's credentials (login and password: basic auth; password alone: a token); "
        "empty: the worker's MLFLOW_TRACKING_USERNAME/PASSWORD or MLFLOW_TRACKING_TOKEN."))
    timeout_s: float = Field(10.0, gt=0, le=300, description=(
        "Longest wait for one request; a server slower than this is skipped for the task with one warning."))

    @field_validator("mlflow_uri")
    @classmethod
    def _http_without_credentials(cls, value: str) -> str:
        if not value:
            return value
        parsed = urllib.parse.urlparse(value)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError(f"'{value}' is not an http:// or https:// server address")
        if parsed.username or parsed.password:
            raise ValueError("holds credentials; put them in the Airflow connection (tracking.conn_id) or the worker's "
                             "MLFLOW_TRACKING_USERNAME/PASSWORD instead, never in the config")
        return value.rstrip("/")


class Model(_Strict):
    """The model: a ModelSpec subclass named by import path, with its arguments (see tasks/spec.py)."""

    spec: str = Field(BUILTIN_SPEC, pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$",
                      description="The ModelSpec as module:Class, beside the config (model.import_paths) or installed.")
    args: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of the spec class.")
    import_paths: list[str] | None = Field(
        None, description="Folders the spec imports from, relative to the config file; null: the config's own folder.")


class Objective(_Strict):
    """What 'better' means: drives the sweep, pruning, stage reporting, the gate and the registry."""

    metric: str = Field("accuracy", pattern=r"^\w+$",
                        description="A validation/test metric the spec reports (its metrics() names, or loss).")
    direction: Literal["maximize", "minimize"] = Field("maximize", description="maximize or minimize the metric.")


class Retrain(_Strict):
    """The retrain DAG: on a schedule and when new data lands."""

    schedule: str = Field("0 3 * * 0", description="Cron schedule (UTC), besides the data-landed trigger.")
    num_trials: int = Field(4, ge=1, le=MAX_TRIALS, description="Sweep budget of a retrain (warm-started from the current model); at most 10000.")

    @field_validator("schedule")
    @classmethod
    def _cron(cls, value: str) -> str:
        try:  # Airflow's own cron parser, a plain package: everywhere Airflow is, so wherever the DAGs are built
            from croniter import croniter
        except ImportError:  # a sub-job's host (a GPU box) need not have it: the schedule's shape is checked here
            problem = cron_shape_problem(value)
        else:
            try:
                croniter(value)
                problem = None
            except (ValueError, KeyError) as exc:
                problem = str(exc)
        if problem is not None:
            raise ValueError(f"'{value}' is not a cron expression ({problem}): give 5 fields, minute hour day-of-month "
                             f"month day-of-week (e.g. '0 3 * * 0' is Sundays 03:00), or a preset such as @daily")
        return value


CRON_PRESETS = ("@yearly", "@annually", "@monthly", "@weekly", "@daily", "@midnight", "@hourly")
# minute, hour, day of month, month, day of week (0 and 7 are Sunday), and croniter's optional sixth: seconds.
_CRON_RANGES = ((0, 59), (0, 23), (1, 31), (1, 12), (0, 7), (0, 59))
_CRON_NAMES = {3: "jan feb mar apr may jun jul aug sep oct nov dec".split(), 4: "sun mon tue wed thu fri sat".split()}


def cron_shape_problem(value: str) -> str | None:
    """What makes ``value`` no cron expression, checked without croniter (None: none found): a preset, or 5 (or 6)
    fields of ``*``, numbers and names in range, ranges ``a-b`` and steps ``/n``, lists; croniter's ``L``, ``W``, ``#``
    and ``?`` extensions pass unchecked. Used only where croniter is not installed."""
    if value.strip().lower() in CRON_PRESETS:
        return None
    fields = value.split()
    if len(fields) not in (5, 6):
        return f"{len(fields)} fields"
    for position, field in enumerate(fields):
        low, high = _CRON_RANGES[position]
        names = _CRON_NAMES.get(position, [])
        for item in field.lower().split(","):
            if re.search(r"[lw#?]", item) and position in (2, 4):
                continue
            base, _, step = item.partition("/")
            if step and not (step.isdigit() and int(step) > 0):
                return f"step '{step}' in '{field}'"
            if base == "*":
                continue
            for bound in base.split("-", 1):
                number = (names.index(bound) + (1 if position == 3 else 0)) if bound in names else (
                    int(bound) if bound.isdigit() else None)
                if number is None or not low <= number <= high:
                    return f"'{bound}' in '{field}' is not in {low}-{high}"
    return None


CALLBACK_PATH = r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$"


class AirflowSettings(_Strict):
    """How the pipeline's DAGs fit the team's Airflow: owner, tags, run limits, start date, default_args, callbacks."""

    owner: str = Field("stagewise", min_length=1, description="Owner of every task (default_args.owner).")
    tags: list[str] = Field(default_factory=list, description="Tags added to each DAG's own (stagewise and its kind).")
    max_active_runs: int | None = Field(None, ge=1, le=1000, description="Concurrent runs of each DAG (at most 1000); null: 4, and 1 for retrain.")
    start_date: dt.date = Field(dt.date(2026, 1, 1), description="The DAGs' start_date (UTC midnight).")
    catchup: bool = Field(False, description="Whether the scheduled retrain runs the intervals it missed.")
    default_args: dict[str, Any] = Field(
        default_factory=dict, description="More default_args of every task (email, email_on_failure, ...); the profile's own knobs win.")
    on_failure_callback: list[Annotated[str, Field(pattern=CALLBACK_PATH)]] = Field(
        default_factory=list, description="Your callbacks (module:function) called when a task fails, beside Stagewise's own.")
    on_retry_callback: list[Annotated[str, Field(pattern=CALLBACK_PATH)]] = Field(
        default_factory=list, description="Your callbacks (module:function) called when a task goes up for retry.")
    on_success_callback: list[Annotated[str, Field(pattern=CALLBACK_PATH)]] = Field(
        default_factory=list, description="Your callbacks (module:function) called when a task succeeds.")

    @field_validator("default_args")
    @classmethod
    def _no_callbacks_in_default_args(cls, value: dict[str, Any]) -> dict[str, Any]:
        if callbacks := sorted(key for key in value if key.endswith("_callback")):
            raise ValueError(f"{callbacks}: name callbacks in airflow.on_failure_callback (and the like) as "
                             f"module:function, so they run beside Stagewise's own")
        return value


class PipelineConfig(_Strict):
    """The whole pipeline."""

    name: str = Field("", pattern=r"^([A-Za-z][A-Za-z0-9_]{0,63})?$", description=(
        "The pipeline's name, which its DAG ids start with (<name>_pipeline, <name>_retrain, ...); empty: the file's name."))
    storage_root: str = Field(description="URI under which raw/, runs/ and models/ live (file path, file:// or s3://).")
    storage_conn_id: str = Field("", description="Airflow connection (type aws) with S3 keys and extra endpoint_url; empty: the worker's AWS environment.")
    dataset: Dataset = Field(description="The input table.")
    model: Model = Field(default_factory=Model, description="The model spec every stage trains, evaluates and serves.")
    objective: Objective = Field(default_factory=Objective, description="The metric and direction that decide what is better.")
    profiles: dict[str, Profile] = Field(min_length=1, description="Named instance profiles; 'bookkeeping' (defaults filled in) runs the light tasks.")
    pools: dict[str, Pool] = Field(default_factory=dict, description="Pools to create if missing (`make airflow-init`); existing pools keep their slots.")
    preprocess: Preprocess = Field(description="Sharded cleaning, statistics, normalisation and split.")
    sweep: Sweep = Field(description="The Optuna sweep.")
    train: Train = Field(description="The training stages.")
    evaluate: Evaluate = Field(description="Test-split evaluation.")
    inference: Inference = Field(description="Sharded batch inference.")
    registry: Registry = Field(default_factory=Registry, description="Model registry and gate.")
    tracking: Tracking = Field(default_factory=Tracking, description="MLflow tracking of runs, trials and stages (off by default).")
    retrain: Retrain = Field(default_factory=Retrain, description="Scheduled and data-triggered retraining.")
    airflow: AirflowSettings = Field(default_factory=AirflowSettings, description="How the DAGs fit the team's Airflow.")
    cache: Cache = Field(default_factory=Cache, description="Step caching across runs (off by default): `true`, or per kind.")
    retention: Retention = Field(default_factory=Retention, description="What the maintenance DAG and stagewise.retention remove, and when.")

    @field_validator("storage_root")
    @classmethod
    def _root_filesystem(cls, value: str) -> str:
        if problem := local_root_problem(value):
            raise ValueError(problem)
        return _check_filesystem(value)

    @model_validator(mode="before")
    @classmethod
    def _name_the_model(cls, raw: Any) -> Any:
        # load_config fills the name from the file before overrides; this covers configs built in code.
        if not isinstance(raw, dict) or not isinstance(raw.get("dataset"), dict) or not isinstance(raw["dataset"].get("uri"), str):
            return raw
        registry = raw.get("registry", {})
        if isinstance(registry, dict) and not registry.get("model_name"):
            return {**raw, "registry": {**registry, "model_name": default_model_name(raw["dataset"]["uri"])}}
        return raw

    @model_validator(mode="before")
    @classmethod
    def _journal_under_the_root(cls, raw: Any) -> Any:
        # The journal is a file every run writes: unset or relative, it lives under storage_root like the rest.
        if not isinstance(raw, dict) or not isinstance(raw.get("sweep"), dict) or not isinstance(raw.get("storage_root"), str):
            return raw
        chosen = raw["sweep"].get("storage", "")
        if raw["sweep"].get("storage_conn_id") and not chosen:
            return raw  # the connection's database
        file = chosen.removeprefix("journal://") if isinstance(chosen, str) else ""
        if chosen == "":
            file = DEFAULT_JOURNAL
        elif not chosen.startswith("journal://") or not file or os.path.isabs(file):
            return raw  # a database, an absolute file, or a bad value the field's own check names
        root = raw["storage_root"]
        if "://" in root and not root.startswith("file://"):
            raise ValueError(f"sweep.storage: storage_root '{root}' is not a local folder, so the sweep's journal file "
                             f"cannot live under it; set sweep.storage_conn_id to a connection of a postgresql database "
                             f"(workers on several hosts) or journal:///an/absolute/path that every sweep worker shares")
        journal = os.path.normpath(os.path.join(root.removeprefix("file://"), file))
        return {**raw, "sweep": {**raw["sweep"], "storage": f"journal://{journal}"}}

    @model_validator(mode="before")
    @classmethod
    def _no_password(cls, raw: Any) -> Any:
        # Defined last, so it runs first: no other check gets to echo a URL that holds a password.
        if problem := password_problem(raw):
            raise ValueError(problem)
        return raw

    @model_validator(mode="after")
    def _params_known_to_the_builtin_spec(self) -> PipelineConfig:
        if self.model.spec != BUILTIN_SPEC:
            return self  # a user spec declares its own hyperparameters; checked when it is loaded
        known = TUNABLE
        for where, names in (("sweep.search_space", self.sweep.search_space), ("train.default_params", self.train.default_params)):
            unknown = sorted(set(names) - set(known))
            if unknown:
                raise ValueError(f"{where}: unknown hyperparameter(s) {unknown} for {BUILTIN_SPEC}; tunable: {list(known)}")
        return self

    @model_validator(mode="after")
    def _mlflow_registry_needs_a_server(self) -> PipelineConfig:
        if self.registry.backend == "mlflow" and not self.tracking.mlflow_uri:
            raise ValueError("registry.backend: 'mlflow' keeps versions on the tracking server; set tracking.mlflow_uri")
        return self

    @model_validator(mode="after")
    def _limit_in_metric_range(self) -> PipelineConfig:
        limit, metric = self.evaluate.objective_limit, self.objective.metric
        low, high = METRIC_RANGES.get(metric, (-math.inf, math.inf))
        if limit is not None and not low <= limit <= high:
            raise ValueError(f"evaluate.objective_limit: {limit} is outside the range of {metric} ({low} to {high}): "
                             f"no model could ever pass or fail it")
        return self

    def gate_metric(self) -> str:
        """The test metric the gate compares."""
        return self.registry.gate_metric or f"test_{self.objective.metric}"

    @model_validator(mode="before")
    @classmethod
    def _bookkeeping_profile(cls, raw: Any) -> Any:
        return with_bookkeeping(raw)  # light tasks get their own pool and weight (stagewise.definitions.bookkeeping)

    @model_validator(mode="after")
    def _profiles_exist(self) -> PipelineConfig:
        used = {
            "bookkeeping tasks": BOOKKEEPING,
            "preprocess.profile": self.preprocess.profile,
            "sweep.profile": self.sweep.profile,
            "evaluate.profile": self.evaluate.profile,
            "inference.profile": self.inference.profile,
        }
        used.update({f"train.stages[{i}].profile": s.profile for i, s in enumerate(self.train.stages)})
        for where, name in used.items():
            if name not in self.profiles:
                raise ValueError(f"{where}: profile '{name}' is not defined in profiles ({sorted(self.profiles)})")
        for name, profile in self.profiles.items():
            if profile.pool != "default_pool" and profile.pool not in self.pools:
                raise ValueError(f"profiles.{name}.pool: pool '{profile.pool}' is not defined in pools ({sorted(self.pools)})")
            if profile.pool in self.pools and profile.pool_slots > self.pools[profile.pool].slots:
                raise ValueError(f"profiles.{name}.pool_slots: {profile.pool_slots} exceeds the {self.pools[profile.pool].slots} "
                                 f"slot(s) of pool '{profile.pool}'; the task could never start")
        for name, profile in self.profiles.items():
            if profile.backend == "sagemaker" and not self.storage_root.startswith("s3://"):
                raise ValueError(f"profiles.{name}: backend 'sagemaker' reads and writes the run through S3, but storage_root "
                                 f"is '{self.storage_root}'; give an s3:// storage_root")
        for index, stage in enumerate(self.train.stages):
            if stage.entrypoint is not None and self.profiles[stage.profile].backend != "local":
                raise ValueError(f"train.stages[{index}] ({stage.name}): an entrypoint (your own script) runs on backend "
                                 f"local only for now; profile '{stage.profile}' has backend "
                                 f"'{self.profiles[stage.profile].backend}'")
            world = self.profiles[stage.profile].world_size
            if stage.global_batch is not None and stage.global_batch % (world * stage.grad_accum_steps):
                raise ValueError(
                    f"train.stages[{index}] ({stage.name}): global_batch {stage.global_batch} does not divide into "
                    f"{world} process(es) x {stage.grad_accum_steps} accumulation step(s) "
                    f"({stage.global_batch} / {world * stage.grad_accum_steps} = {stage.global_batch / (world * stage.grad_accum_steps):g})")
        self._entrypoint_args_known()
        for where, name in used.items():
            if where.startswith(("train.", "sweep.")):
                continue
            if self.profiles[name].processes_per_node != 1:
                raise ValueError(f"{where}: profile '{name}' has processes_per_node > 1; only train stages and sweep trials run DDP")
        for where, name in used.items():
            if not where.startswith("train.") and self.profiles[name].backend != "local":
                raise ValueError(f"{where}: profile '{name}' has backend '{self.profiles[name].backend}'; only train stages "
                                 f"run as SageMaker or Kubernetes jobs (give this step a local profile)")
        return self

    def arg_placeholders(self) -> list[str]:
        """Names an entrypoint's args may use: the stage contract, then every hyperparameter a stage can get (the
        spec's own ``default_params`` as its source declares them)."""
        spec_params = sorted(declared_default_params(self.model.spec, self.model.import_paths or ()))
        hyper = [name for name in [*TUNABLE, *self.sweep.search_space, *self.train.default_params, *spec_params]
                 if name not in ARG_PLACEHOLDERS]
        return [*ARG_PLACEHOLDERS, *dict.fromkeys(hyper)]

    def _entrypoint_args_known(self) -> None:
        entries = [(f"train.stages[{index}] ({stage.name})", stage.entrypoint) for index, stage in enumerate(self.train.stages)]
        if not any(entry and entry.args for _, entry in [*entries, ("sweep", self.sweep.entrypoint)]):
            return  # nothing to check: no spec source is read
        known = self.arg_placeholders()
        for owner, entry in [*entries, ("sweep", self.sweep.entrypoint)]:
            for position, arg in enumerate(entry.args if entry else []):
                where = f"{owner}: entrypoint.args[{position}] {arg!r}"
                try:
                    unknown = [name for name in placeholders(arg) if name not in known]
                except ValueError as exc:
                    raise ValueError(f"{where}: {exc}; write literal braces as {{{{ and }}}}") from None
                if unknown:
                    raise ValueError(f"{where}: unknown placeholder {{{unknown[0]}}}; known: {known} "
                                     f"(write literal braces as {{{{ and }}}})")

    def profile(self, name: str) -> Profile:
        return self.profiles[name]

    def stage(self, name: str) -> TrainStage:
        for stage in self.train.stages:
            if stage.name == name:
                return stage
        raise ConfigError(f"train stage '{name}' is not in train.stages ({[s.name for s in self.train.stages]})")
