"""What a run makes of its model: the objective, inference, the registry and gate, tracking and retraining."""

from __future__ import annotations

import re
import urllib.parse
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from stagewise.definitions.hyperparams import BUILTIN_SPEC
from stagewise.definitions.intervals import static_prefix
from stagewise.definitions.metric_names import DIRECTIONS
from stagewise.definitions.sections.approval import Approval, Notifier
from stagewise.definitions.sections.base import MAX_BATCH, MAX_ROWS, MAX_TRIALS, StrictModel, check_filesystem
from stagewise.definitions.sections.deployment import cron_problem


class Inference(StrictModel):
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
        return check_filesystem(value)


MODEL_NAME_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$"


def default_model_name(dataset_uri: str) -> str:
    """The registry name a config gets when it names none: the data set's last path component (raw/digits -> digits),
    before any interval placeholder (every interval's data trains one model)."""
    last = static_prefix(dataset_uri).rstrip("/").rsplit("/", 1)[-1].removesuffix(".parquet")
    return re.sub(r"[^A-Za-z0-9_.-]", "_", last).lstrip(".-") or "default"


class Registry(StrictModel):
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
    approval: Approval = Field(default_factory=Approval, description=(
        "A person's yes before a promotion (none, required, when_worse_on); a report-only gate never waits."))
    notify: list[Notifier] = Field(default_factory=list, description=(
        "Airflow notifiers told of every gate decision; one that fails is a warning and a line in the report."))

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


class Tracking(StrictModel):
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


class Model(StrictModel):
    """The model: a ModelSpec subclass named by import path, with its arguments (see tasks/spec.py)."""

    spec: str = Field(BUILTIN_SPEC, pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$",
                      description="The ModelSpec as module:Class, beside the config (model.import_paths) or installed.")
    args: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of the spec class.")
    import_paths: list[str] | None = Field(
        None, description="Folders the spec imports from, relative to the config file; null: the config's own folder.")


class Objective(StrictModel):
    """What 'better' means: drives the sweep, pruning, stage reporting, the gate and the registry."""

    metric: str = Field("accuracy", pattern=r"^\w+$",
                        description="The metric that decides: a built-in one (accuracy, f1_macro, auroc, auprc, log_loss, "
                                    "rmse, r2, ...), one the spec's metrics() reports, or loss.")
    direction: Literal["maximize", "minimize"] = Field(
        "maximize", description="maximize or minimize the metric; left out: a built-in metric's own direction "
                                "(log_loss, rmse, mae and loss are minimised), else maximize.")

    @model_validator(mode="before")
    @classmethod
    def _direction_of_the_metric(cls, raw: Any) -> Any:
        if not isinstance(raw, dict) or not isinstance(raw.get("metric", "accuracy"), str):
            return raw
        metric = raw.get("metric", "accuracy")
        known = DIRECTIONS.get(metric)
        if raw.get("direction") is None:
            return {**raw, "direction": known or "maximize"}
        if known is not None and raw["direction"] != known:
            raise ValueError(f"objective.direction: {raw['direction']} contradicts objective.metric '{metric}', which "
                             f"is better when it is {'lower' if known == 'minimize' else 'higher'} ({known}); leave "
                             f"direction out or set {known}")
        return raw


class Retrain(StrictModel):
    """The retrain DAG: on a schedule and when new data lands."""

    schedule: str = Field("0 3 * * 0", description="Cron schedule (UTC), besides the data-landed trigger.")
    num_trials: int = Field(4, ge=1, le=MAX_TRIALS, description="Sweep budget of a retrain (warm-started from the current model); at most 10000.")

    @field_validator("schedule")
    @classmethod
    def _cron(cls, value: str) -> str:
        problem = cron_problem(value)
        if problem is not None:
            raise ValueError(f"'{value}' is not a cron expression ({problem}): give 5 fields, minute hour day-of-month "
                             f"month day-of-week (e.g. '0 3 * * 0' is Sundays 03:00), or a preset such as @daily")
        return value
