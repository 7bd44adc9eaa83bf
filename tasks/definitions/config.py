"""The pipeline config's schema: typed, strict pydantic models with one line of doc per field.

Loading a file (overrides, relative paths) is ``stagewise.definitions.loading``; the generated reference
``stagewise.definitions.reference``; ``python -m stagewise.config`` validates a file.
"""

from __future__ import annotations

import math
import os
from typing import Any

from pydantic import Field, field_validator, model_validator

from stagewise.definitions.bookkeeping import BOOKKEEPING, with_bookkeeping
from stagewise.definitions.caching import Cache
from stagewise.definitions.hyperparams import (
    BUILTIN_SPEC,
    TUNABLE,
)
from stagewise.definitions.metric_names import CLASSIFICATION, CURVE_METRICS, MAX_CURVE_CLASSES, REGRESSION, kind_of
from stagewise.definitions.passwords import password_problem
from stagewise.definitions.retention import Retention
from stagewise.definitions.roots import local_root_problem
from stagewise.definitions.sections.base import (  # noqa: F401  (re-exported: the schema's one import path)
    DEFAULT_JOURNAL,
    LEGACY_JOURNAL,
    MAX_BATCH,
    MAX_EPOCHS,
    MAX_ROWS,
    MAX_SECONDS,
    MAX_SEED,
    MAX_STEPS,
    MAX_STUDY_NAME,
    MAX_TRIALS,
    METRIC_RANGES,
    STUDY_PLACEHOLDER,
    ConfigError,
    StrictModel,
    check_filesystem,
    filesystem_problem,
)
from stagewise.definitions.sections.data import (  # noqa: F401  (re-exported: the schema's one import path)
    Dataset,
    FeatureColumn,
    Preprocess,
    Split,
)
from stagewise.definitions.sections.deployment import (  # noqa: F401  (re-exported: the schema's one import path)
    CALLBACK_PATH,
    CRON_PRESETS,
    AirflowSettings,
    KubernetesSettings,
    Pool,
    Profile,
    SageMakerSettings,
    SlurmSettings,
    cron_shape_problem,
)
from stagewise.definitions.sections.serving import (  # noqa: F401  (re-exported: the schema's one import path)
    MODEL_NAME_PATTERN,
    Inference,
    Model,
    Objective,
    Registry,
    Retrain,
    Tracking,
    default_model_name,
)
from stagewise.definitions.sections.sweep import (  # noqa: F401  (re-exported: the schema's one import path)
    ARG_PLACEHOLDERS,
    CategoricalParam,
    EntryPoint,
    FloatParam,
    IntParam,
    Pruner,
    Sampler,
    SearchParam,
    Sweep,
    placeholders,
)
from stagewise.definitions.sections.train import (  # noqa: F401  (re-exported: the schema's one import path)
    BUILT_IN_LOOP_KNOBS,
    EarlyStopping,
    Evaluate,
    LRSchedule,
    Train,
    TrainStage,
)
from stagewise.definitions.spec_source import declared_default_params

# The steps besides train stages whose sub-job may run as a one-node Slurm job (stagewise.airflow.shard_steps).
SLURM_SUBJOBS = ("inference.profile", "sweep.profile")


class PipelineConfig(StrictModel):
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
        return check_filesystem(value)

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

    @model_validator(mode="after")
    def _objective_metric_exists(self) -> PipelineConfig:
        metric, classes = self.objective.metric, self.dataset.num_classes
        kind = kind_of(metric)
        available = [*(CLASSIFICATION if classes is not None else REGRESSION), "loss"]
        if classes is not None and classes > MAX_CURVE_CLASSES:
            available = [name for name in available if name not in CURVE_METRICS]
        if self.model.spec == BUILTIN_SPEC:  # a classifier, whatever the data (it refuses a float target itself)
            computed = [name for name in (*CLASSIFICATION, "loss") if classes is None or classes <= MAX_CURVE_CLASSES
                        or name not in CURVE_METRICS]
            if metric not in computed:
                raise ValueError(f"objective.metric: '{metric}' is not a metric {BUILTIN_SPEC} computes; it computes "
                                 f"{', '.join(computed)}")
        elif kind is not None and metric not in available:  # a user's spec may add metrics, not change a built-in's kind
            other = "an integer class label (dataset.num_classes)" if kind == "classification" else "a float target"
            raise ValueError(f"objective.metric: '{metric}' is a {kind} metric, for {other}; this data's built-in "
                             f"metrics are {', '.join(available)}")
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
            if profile.backend == "slurm" and self.storage_root.startswith("s3://") and not profile.slurm.log_dir:
                raise ValueError(f"profiles.{name}.slurm.log_dir: a Slurm job writes its output to a folder the nodes "
                                 f"share, and storage_root '{self.storage_root}' is S3; give slurm.log_dir")
        for index, stage in enumerate(self.train.stages):
            if stage.entrypoint is not None and self.profiles[stage.profile].backend not in ("local", "slurm"):
                raise ValueError(f"train.stages[{index}] ({stage.name}): an entrypoint (your own script) runs on backend "
                                 f"local or slurm only for now; profile '{stage.profile}' has backend "
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
            backend = self.profiles[name].backend
            if where.startswith("train.") or backend == "local" or (where in SLURM_SUBJOBS and backend == "slurm"):
                continue
            raise ValueError(f"{where}: profile '{name}' has backend '{backend}'; only train stages run as SageMaker, "
                             f"Kubernetes or Slurm jobs, and inference shards and sweep workers as Slurm jobs (give "
                             f"this step a local profile)")
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
