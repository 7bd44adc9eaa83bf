"""Operators the wiring uses where a TaskFlow step cannot do the job: waiting for a SageMaker or Slurm stage in the
triggerer.

:class:`SageMakerStageOperator` is a train stage of a profile with ``sagemaker.deferrable: true``. It takes what
``steps.train_stage`` takes (the run, the stage, the sweep's result, the previous stage's result, as XComArgs
Airflow resolves through ``template_fields``), submits the try's job with the backend's own request builder,
and defers to the Amazon provider's SageMakerTrigger: the worker slot is free while the job runs. On resume it
maps the trigger's event as ``sagemaker.run_stage`` maps the ended job (``sagemaker.failure``), and returns
what ``stagewise.airflow.backends.run_job`` returns. Trade-off (README, SageMaker section): while deferred, no task
process exists to stop the job on a kill, and no node log lines stream.

:class:`SlurmStageOperator` is a train stage of a profile with ``backend: slurm`` and ``slurm.deferrable: true``
(the default): see its docstring for what it does on an end, a kill and a timeout.
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
            result = stage_result(self.run["out"], self.stage)
        duration = round(time.time() - started, 3) if started is not None else None
        from stagewise.airflow.steps import task_seconds

        return {**result, "duration_s": duration, "attempt": context["ti"].try_number, "task_s": task_seconds(context)}


class SlurmStageOperator(BaseOperator):
    """One try of a train stage as a Slurm job, waited for in the triggerer (deferrable).

    It takes what ``steps.train_stage`` takes and prepares the try as that step does for a Slurm profile (the inputs'
    fingerprint, ``cache.stage``, the local stage's arguments), submits the backend's batch script (or attaches to
    the job this try submitted before), and defers to :class:`stagewise.airflow.slurm_trigger.SlurmJobTrigger`, which
    logs the job's state changes and output while it queues and runs. On resume it logs the rest of the output,
    records the attempt's cost (stagewise.reporting.cost), maps the job's end as the backend does (a user error fails
    without retry; a lost node, a preemption or a timeout retries, a new allocation that resumes from the newest
    checkpoint) and returns the stage's result read back from storage, with what every attempt cost.

    Stopping the job: a mark-failed, mark-success or clear while deferred reaches the trigger's ``on_kill`` (scancel);
    the execution_timeout, which Airflow does not apply to a deferred task, is the deferral's timeout, after which the
    task resumes in ``__fail__`` and :meth:`resume_execution` scancels; a kill while the task runs on a worker reaches
    :meth:`on_kill`. A triggerer restart cancels nothing: the job runs on and the next triggerer waits for it.
    """

    template_fields = ("run", "swept", "previous")
    ui_color = "#d3e4cd"

    def __init__(self, *, run: Any, stage: str, swept: Any, previous: Any = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.run, self.stage, self.swept, self.previous = run, stage, swept, previous
        self._job_id: str | None = None

    def _config(self) -> Any:
        from stagewise.airflow.steps import run_config

        return run_config(self.run)

    def _settings(self) -> Any:
        config = self._config()
        return config.profile(config.stage(self.stage).profile).slurm

    def _name(self, context: Any) -> str:
        from stagewise.airflow.stage_job import job_name

        return job_name(self.run["dag_id"], self.run["run_id"], self.stage, context["ti"].try_number)

    def _timeout(self, context: Any) -> Any:
        """What is left of the task's execution_timeout (Airflow applies none to a deferred task): the deferral's."""
        import datetime as dt

        if self.execution_timeout is None:
            return None
        start = getattr(context["ti"], "start_date", None)
        spent = dt.datetime.now(dt.UTC) - start if start is not None else dt.timedelta(0)
        return max(self.execution_timeout - spent, dt.timedelta(seconds=1))

    def execute(self, context: Any) -> Any:
        from pathlib import Path

        from airflow.sdk.exceptions import AirflowFailException

        from stagewise.airflow.backends import slurm
        from stagewise.airflow.slurm_trigger import SlurmJobTrigger
        from stagewise.airflow.stage_steps import fingerprinted_job, job_fingerprint
        from stagewise.airflow.steps import task_seconds
        from stagewise.core.errors import UserError

        config, attempt = self._config(), context["ti"].try_number
        job, hit = fingerprinted_job(config, self.run, self.stage, self.swept, self.previous, attempt)
        if hit is not None:
            return {**hit, "task_s": task_seconds(context)}
        settings, name, started = job.settings("slurm"), self._name(context), time.time()
        try:
            prepared = slurm.submission(job)  # the waiting task's own: min_nodes' node count, script, environment
            files, script, env = prepared.files, prepared.script, prepared.env
            Path(files.output).parent.mkdir(parents=True, exist_ok=True)
            self._job_id = slurm.attached(settings, name)
            if self._job_id is not None:
                self.log.info("Slurm job %s (%s) is this try's, submitted before: attaching to it", self._job_id, name)
                offset = 0
            else:
                for stale in (files.error, files.result):
                    Path(stale).unlink(missing_ok=True)
                # The output file is the try's; a requeue appends to it: log only what this job adds.
                offset = Path(files.output).stat().st_size if Path(files.output).exists() else 0
                self._job_id = slurm.submit(settings, script, env)
        except UserError as exc:
            raise AirflowFailException(str(exc)) from None
        self.log.info("Slurm job %s (%s) submitted: %d node(s), output %s; deferring (the triggerer polls every %.0f s "
                      "and logs its state and output)", self._job_id, name, prepared.nodes, files.output,
                      settings.poll_s)
        carry = {"started": started, "fingerprint": job_fingerprint(job), "result_file": files.result,
                 "error_file": files.error}
        self.defer(trigger=SlurmJobTrigger(job_id=self._job_id, name=name, settings=settings.model_dump(mode="json"),
                                           output=files.output, offset=offset, poll_s=settings.poll_s, carry=carry),
                   method_name="execute_complete", timeout=self._timeout(context))

    def execute_complete(self, context: Any, event: dict[str, Any], **_: Any) -> dict[str, Any]:
        """The job ended: its last output, its cost recorded, its end mapped, the stage's result read back."""
        import json
        import os

        from airflow.sdk.exceptions import AirflowFailException

        from stagewise.airflow.backends import slurm, stage_result
        from stagewise.airflow.slurm_trigger import tail_from
        from stagewise.airflow.stage_steps import guarded, remember_stage
        from stagewise.airflow.steps import run_ref, task_seconds
        from stagewise.reporting import cost

        config, settings, attempt = self._config(), self._settings(), context["ti"].try_number
        self._job_id, state = str(event["job_id"]), event.get("state")
        tail = tail_from(event["output"], int(event.get("offset") or 0)) if event.get("output") else None
        time.sleep(min(settings.poll_s, 1.0))  # the output's last lines (slurmstepd flushes after the state)
        for line in tail() if tail is not None else []:
            self.log.info("%s", line)
        if state in ("UNKNOWN", "NODE_FAIL", "NEVER_RUNS"):  # the trigger saw the end before Slurm said it
            self._cancel(settings, event.get("message") or state)
            if state == "NEVER_RUNS":
                raise AirflowFailException(event.get("message"))
            record = self._final_record(settings)
            if record is not None:
                self._record_cost(config, attempt, record)
            raise RuntimeError(f"Slurm job {self._job_id} {state}: {event.get('message')}; retrying as a new "
                               "allocation that resumes from the newest checkpoint")
        record = slurm.job_record(settings, self._job_id)
        self._record_cost(config, attempt, record)
        said = self._user_error(event, tail)
        if (failure := slurm.outcome(record, said)) is not None:
            raise failure
        self.log.info("Slurm job %s completed", self._job_id)
        result_file = event.get("result_file") or ""
        with guarded(config):
            if result_file and os.path.exists(result_file):
                with open(result_file) as handle:
                    result = json.load(handle)
            else:
                result = stage_result(self.run["out"], self.stage)
            spent = cost.gathered(self.run["out"], self.stage, attempt)
        started = event.get("started")
        result = {"duration_s": round(time.time() - started, 3) if started else None, **result, "attempt": attempt,
                  "cost": spent, "task_s": task_seconds(context)}
        return remember_stage(config, run_ref(self.run), event.get("fingerprint") or result.get("fingerprint"), result)

    @staticmethod
    def _user_error(event: dict[str, Any], tail: Any) -> str:
        """What the job's ranks said of a user error: its error file, else the output's marker (logged by the trigger
        or read here), else ''."""
        path = event.get("error_file") or ""
        try:
            with open(path, errors="replace") as handle:
                said = " | ".join(dict.fromkeys(line.strip() for line in handle if line.strip()))
        except OSError:
            said = ""
        if not said and (event.get("user_error") or getattr(tail, "user_error", False)):
            said = "a rank reported a user error (see the job's output above)"
        return said

    def _final_record(self, settings: Any) -> Any:
        from stagewise.airflow.backends import slurm

        try:
            return slurm.job_record(settings, self._job_id)
        except Exception as exc:  # noqa: BLE001 - the record only prices the attempt here
            self.log.warning("Slurm job %s: no record to price it by (%s)", self._job_id, exc)
            return None

    def _record_cost(self, config: Any, attempt: int, record: Any) -> None:
        """This attempt's cost beside the stage (every attempt, failed ones too); a failure to is logged, not raised."""
        from stagewise.airflow.backends import slurm
        from stagewise.airflow.stage_steps import guarded
        from stagewise.reporting import cost

        try:
            spent = slurm.cost(record, slurm.accounting_record(self._settings(), self._job_id))
            with guarded(config):
                cost.record(self.run["out"], self.stage, attempt, spent, job_id=self._job_id, state=record.state)
            self.log.info("Slurm job %s %s, cost: %s", self._job_id, record.state, cost.text(cost.summary([spent])))
        except Exception as exc:  # noqa: BLE001 - the cost is a view of the stage, never a reason to fail it
            self.log.warning("Slurm job %s: its cost could not be recorded (%s)", self._job_id, exc)

    def _cancel(self, settings: Any, why: str) -> None:
        from stagewise.airflow.backends import slurm

        self.log.warning("cancelling Slurm job %s: %s", self._job_id, why)
        try:
            slurm.cancel(settings, self._job_id)
        except Exception as exc:  # noqa: BLE001 - the task's own end matters more than the cleanup's
            self.log.error("could not cancel Slurm job %s: %s", self._job_id, exc)

    def resume_execution(self, next_method: str, next_kwargs: dict[str, Any] | None, context: Any) -> Any:
        """Resumed to fail (``__fail__``: the deferral timed out, i.e. the execution_timeout, or the trigger crashed):
        scancel this try's job first, found by its name (Airflow keeps no kwargs of ours on that path)."""
        if next_method == "__fail__":
            from stagewise.airflow.backends import slurm

            settings = self._settings()
            if (job_id := slurm.attached(settings, self._name(context))) is not None:
                self._job_id = job_id
                self._cancel(settings, f"the deferred task ended before its job ({(next_kwargs or {}).get('error')})")
        return super().resume_execution(next_method, next_kwargs, context)

    def on_kill(self) -> None:
        """Killed while running on a worker (submitting, or reading the result back): scancel the job it knows."""
        if self._job_id:
            self._cancel(self._settings(), "the task was killed")
