"""The ``retention:`` section of a pipeline config: what ``python -m stagewise.retention`` (and the pipeline's
``<name>_maintenance`` DAG) removes from the storage root, and when.

Every age is in days and counts from the run's recorded start (a failed run: its last recorded activity; a version:
its registration; a study: its last trial), never later than now; ``null`` keeps that kind forever. What is
never removed, whatever the policy says, is listed in docs/operations.md: the current (champion) model, its rollback
target, a pinned version, what an MLflow version or a running run still needs, and anything under raw/.
"""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field, field_validator

from stagewise.definitions.sections.deployment import cron_problem

MAX_DAYS = 100 * 365  # past a century an age is a typo, not a policy
MAX_COUNT = 1_000_000
VERSION_PATTERN = r"m-[0-9a-f]{12}"  # stagewise.models.versions' ids; that library sits above definitions


class Retention(BaseModel):
    """How long a pipeline's runs, models, studies and leftovers are kept (defaults: a year of hourly demo runs < 1 GB)."""

    # Unknown keys are refused so a typo never silently keeps (or removes) everything.
    model_config = ConfigDict(extra="forbid", frozen=True)

    schedule: str = Field("@daily", description="Cron schedule (UTC) of the <name>_maintenance DAG that applies this policy.")
    keep_runs: int | None = Field(48, ge=1, le=MAX_COUNT, description=(
        "Finished runs of each DAG kept whole, newest first (at most 1000000); older ones keep only their record (report, lineage, config)."))
    keep_runs_days: int | None = Field(14, ge=0, le=MAX_DAYS, description=(
        "Finished runs older than this many days (at most 36500) keep only their record, even among the newest keep_runs."))
    keep_records_days: int | None = Field(90, ge=0, le=MAX_DAYS, description=(
        "A run's record (report.json, report.html, lineage, config) goes, with its folder, after this many days (at most 36500)."))
    failed_days: int | None = Field(3, ge=0, le=MAX_DAYS, description=(
        "A failed run's leftovers (preprocess/ copy, checkpoints, sweep, predictions) go after this many idle days (at most 36500)."))
    checkpoints_days: int | None = Field(2, ge=0, le=MAX_DAYS, description=(
        "Checkpoints of a finished run's stages (all but model.pt and their JSON records) go after this many days (at most 36500)."))
    drop_after_success: bool = Field(True, description=(
        "A succeeded run's report step drops what only a resume reads: checkpoints, hand-offs, the split copy (model.pt stays)."))
    predictions_days: int | None = Field(30, ge=0, le=MAX_DAYS, description=(
        "Prediction shards of finished runs (training and batch inference) go after this many days (at most 36500)."))
    keep_model_versions: int | None = Field(10, ge=1, le=MAX_COUNT, description=(
        "Registered versions kept, newest first (at most 1000000); older ones go unless current, its rollback target or pinned."))
    pinned_versions: list[str] = Field(default_factory=list, description=(
        "Model versions (m-<hash>) never removed, whatever their age."))
    studies_days: int | None = Field(90, ge=0, le=MAX_DAYS, description=(
        "Optuna studies with no trial for this many days (at most 36500) are deleted (never one a model card names)."))
    pending_tracking_days: int | None = Field(7, ge=0, le=MAX_DAYS, description=(
        "Unsent MLflow records (<run>/tracking/pending/) older than this many days (at most 36500) are dropped."))
    idle_hours: float = Field(48.0, gt=0, le=MAX_DAYS * 24, description=(
        "An unfinished run with no task attempt recorded nor file changed for this many hours (at most 876000), not running in Airflow, counts as failed."))

    @field_validator("schedule")
    @classmethod
    def _cron(cls, value: str) -> str:
        if (problem := cron_problem(value)) is not None:
            raise ValueError(f"'{value}' is not a cron expression ({problem}): give 5 fields, minute hour day-of-month "
                             f"month day-of-week (e.g. '0 4 * * *'), or a preset such as @daily")
        return value

    @field_validator("pinned_versions")
    @classmethod
    def _versions(cls, value: list[str]) -> list[str]:
        bad = [v for v in value if not re.fullmatch(VERSION_PATTERN, v)]
        if bad:
            raise ValueError(f"{bad} are not model versions (m- and 12 hex digits, as `python -m stagewise.registry list` shows)")
        return value
