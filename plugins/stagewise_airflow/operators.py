"""Operators the wiring uses where a TaskFlow step cannot do the job: waiting for a SageMaker stage in the triggerer.

:class:`SageMakerStageOperator` is a train stage of a profile with ``sagemaker.deferrable: true``. It takes what
``steps.train_stage`` takes (the run, the stage, the sweep's result, the previous stage's result, as XComArgs
Airflow resolves through ``template_fields``), submits the try's job with the backend's own request builder,
and defers to the Amazon provider's SageMakerTrigger: the worker slot is free while the job runs. On resume it
maps the trigger's event as ``sagemaker.run_stage`` maps the ended job (``sagemaker.failure``), and returns
what ``stagewise.airflow.backends.run_job`` returns. Trade-off (README, SageMaker section): while deferred, no task
process exists to stop the job on a kill, and no node log lines stream.
"""

from __future__ import annotations

import math
import time
from typing import Any

from airflow.sdk import BaseOperator

# Added to the job's own limit (MaxWaitTimeInSeconds, else MaxRuntimeInSeconds) when sizing the trigger's polls:
# provisioning and image download come on top of MaxRuntimeInSeconds for an on-demand job.
STARTUP_SLACK_S = 3600


class SageMakerStageOperator(BaseOperator):
    """One try of a train stage as a SageMaker training job, waited for in the triggerer (deferrable)."""

    template_fields = ("run", "swept", "previous")
    ui_color = "#f4e1c1"

    def __init__(self, *, run: Any, stage: str, swept: Any, previous: Any = None, poll_s: int | None = None,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.run, self.stage, self.swept, self.previous = run, stage, swept, previous
        self.poll_s = poll_s

    def _config(self) -> Any:
        from stagewise.airflow.steps import run_config

        return run_config(self.run)

    def execute(self, context: Any) -> None:
        from airflow.providers.amazon.aws.triggers.sagemaker import SageMakerTrigger
        from airflow.sdk.exceptions import AirflowFailException

        from stagewise.airflow.backends import sagemaker
        from stagewise.airflow.stage_job import build
        from stagewise.core.errors import UserError

        config, run, stage = self._config(), self.run, self.stage
        spec = config.stage(stage)
        settings = config.profile(spec.profile).sagemaker
        started = time.time()
        try:
            job = build(config, run, stage, self.swept["best_params"],
                        self.previous["checkpoint_uri"] if self.previous else None, context["ti"].try_number)
            request = sagemaker.training_job_request(job)
        except UserError as exc:
            raise AirflowFailException(str(exc)) from None
        name = sagemaker.submit(sagemaker.hook_for(settings), request)
        poll_s = self.poll_s or sagemaker.POLL_S
        stopping = request["StoppingCondition"]
        limit_s = stopping.get("MaxWaitTimeInSeconds", stopping["MaxRuntimeInSeconds"]) + STARTUP_SLACK_S
        self.log.info("SageMaker job %s submitted; deferring (the triggerer polls every %d s, no node logs stream "
                      "while deferred)", name, poll_s)
        self.defer(
            trigger=SageMakerTrigger(job_name=name, job_type="training", waiter_delay=poll_s,
                                     waiter_max_attempts=math.ceil(limit_s / poll_s),
                                     aws_conn_id=settings.aws_conn_id or None, region_name=settings.region or None),
            method_name="execute_complete", kwargs={"started": started})

    def execute_complete(self, context: Any, event: dict[str, Any], started: float | None = None) -> dict[str, Any]:
        """The trigger's event: success -> the stage's result; failed/stopped -> ``sagemaker.failure``'s exception."""
        from stagewise.airflow import credentials
        from stagewise.airflow.backends import sagemaker, stage_result

        config = self._config()
        settings = config.profile(config.stage(self.stage).profile).sagemaker
        name, status = event.get("job_name"), event.get("status")
        message = event.get("message") or "no reason given"
        if status in ("failed", "stopped"):
            raise sagemaker.failure({"TrainingJobName": name, "TrainingJobStatus": status.capitalize(),
                                     "FailureReason": message})
        hook = sagemaker.hook_for(settings)
        if status != "success":  # timeout or an API error: nobody watches the job any more, so stop it
            self.log.warning("stopping SageMaker job %s: its trigger ended (%s) before the job", name, status)
            try:
                hook.get_conn().stop_training_job(TrainingJobName=name)
            except Exception as exc:  # noqa: BLE001 - the trigger's error matters more than the cleanup's
                self.log.error("could not stop SageMaker job %s: %s", name, exc)
            raise RuntimeError(f"waiting for SageMaker job {name} ended with {status}: {message}; retrying")
        description = hook.describe_training_job(name)
        if description["TrainingJobStatus"] != "Completed":
            raise sagemaker.failure(description)
        billable = description.get("BillableTimeInSeconds")
        self.log.info("SageMaker job %s completed%s", name, f" ({billable} billable s)" if billable is not None else "")
        with credentials.exported(credentials.aws_environment(config.storage_conn_id)):
            result = stage_result(config, self.run["out"], self.stage)
        duration = round(time.time() - started, 3) if started is not None else None
        from stagewise.airflow.steps import task_seconds

        return {**result, "duration_s": duration, "attempt": context["ti"].try_number, "task_s": task_seconds(context)}
