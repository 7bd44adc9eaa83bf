"""A person's yes before the gate moves the current model, and who hears of each gate decision."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from stagewise.definitions.sections.base import StrictModel

DECISIONS = ("promoted", "refused", "waiting", "approved", "rejected", "timed_out", "superseded", "rolled_back")
"""Every gate decision a notifier can hear of (docs/pipelines.md, "Approval and notifications")."""
MAX_TIMEOUT_MINUTES = 525_600  # a year: a longer wait is a forgotten one
IMPORT_PATH = r"^[A-Za-z_][\w.]*\.[A-Za-z_]\w*$"


class Approval(StrictModel):
    """When a promotion waits for a person: an Airflow Required Action (a HITL task) between the gate and the move."""

    mode: Literal["none", "required", "when_worse_on"] = Field("none", description=(
        "none: the gate promotes alone; required: every promotion waits for a person; when_worse_on: a promotion "
        "that loses more than approval.margin on approval.metric waits."))
    metric: str | None = Field(None, description="The secondary test metric when_worse_on watches, e.g. test_f1_macro.")
    direction: Literal["maximize", "minimize"] = Field("maximize", description="Which way approval.metric is better.")
    margin: float = Field(0.0, ge=0, description="The loss on approval.metric a promotion may have without asking.")
    timeout_minutes: float = Field(1440.0, gt=0, le=MAX_TIMEOUT_MINUTES, description=(
        "How long a waiting gate waits (at most 525600, a year); then it rejects, saying it timed out."))
    respondents: list[str] = Field(default_factory=list, description=(
        "Airflow user ids who may answer (HITL's assigned users); empty: anyone Airflow lets act on the DAG's tasks."))

    @model_validator(mode="before")
    @classmethod
    def _mode_alone(cls, raw: Any) -> Any:
        return {"mode": raw} if isinstance(raw, str) else raw  # `approval: required` is the short form

    @field_validator("metric")
    @classmethod
    def _test_metric(cls, value: str | None) -> str | None:
        if value is not None and not re.match(r"^test_\w+$", value):
            raise ValueError(f"'{value}' is not a test metric name such as test_f1_macro")
        return value

    @model_validator(mode="after")
    def _metric_for_when_worse_on(self) -> Approval:
        if self.mode == "when_worse_on" and self.metric is None:
            raise ValueError("mode when_worse_on needs approval.metric, the test metric a promotion may not lose on")
        return self


class Notifier(StrictModel):
    """One Airflow notifier (a BaseNotifier subclass) told of gate decisions."""

    notifier: str = Field(pattern=IMPORT_PATH, description=(
        "Import path of the class, e.g. airflow.providers.smtp.notifications.smtp.SmtpNotifier."))
    args: dict[str, Any] = Field(default_factory=dict, description=(
        "Its keyword arguments; strings may use {{ stagewise.subject }}, {{ stagewise.message }} and the other "
        "fields of the decision."))
    on: list[Literal[DECISIONS]] = Field(list(DECISIONS), description="The decisions it hears of; default: all.")  # type: ignore[valid-type]
