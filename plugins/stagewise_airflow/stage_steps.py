"""A built-in train stage's try, as the TaskFlow step (steps.train_stage) and the deferrable Slurm operator
(operators.SlurmStageOperator) both prepare and finish it: keyed by its inputs' fingerprint, looked up in and
remembered by ``cache.stage``, and, on Slurm, with what it cost (stagewise.reporting.cost).

Below the steps: nothing here imports steps, operators or the DAG factory.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from stagewise.airflow import credentials
from stagewise.core.errors import UserError
from stagewise.definitions.config import PipelineConfig


@contextlib.contextmanager
def guarded(config: PipelineConfig) -> Iterator[None]:
    """The block with the run's storage credentials; a user error in it fails the task without retry."""
    from airflow.sdk.exceptions import AirflowFailException

    try:
        with credentials.exported(credentials.task_environment(config)):
            yield
    except UserError as exc:
        raise AirflowFailException(str(exc)) from None


def data_fingerprint(prepared: dict[str, Any]) -> str:
    """The fingerprint of the data preprocess committed (a manifest from before fingerprints: its bytes' hash)."""
    from stagewise.registry import data_fingerprint as manifest_fingerprint

    return prepared.get("fingerprint") or manifest_fingerprint(prepared["manifest_uri"])


def stage_inputs(config: PipelineConfig, run: dict[str, Any], stage: str, swept: dict[str, Any],
                 previous: dict[str, Any] | None) -> dict[str, Any]:
    """The fingerprint of a stage's inputs: the run's committed data, the params, the stage before's output, the
    config and the code (stagewise.reuse.fingerprints.stage_inputs), with the data's own fingerprint and the one its
    checkpoints are keyed by (the same but the process count: a retry on another count resumes them)."""
    from stagewise.core import storage
    from stagewise.reuse.fingerprints import code_identity, stage_resume_inputs
    from stagewise.reuse.fingerprints import stage_inputs as inputs_of

    manifest_uri = storage.join(run["out"], "preprocess", "manifest.json")
    data = data_fingerprint({**storage.read_json(manifest_uri), "manifest_uri": manifest_uri})
    upstream = previous.get("fingerprint") if previous else None
    code = code_identity(config)
    return {"fingerprint": inputs_of(config, stage, data, swept["best_params"], upstream, code),
            "data_fingerprint": data,
            "resume_fingerprint": stage_resume_inputs(config, stage, data, swept["best_params"], upstream, code)}


def fingerprinted_job(config: PipelineConfig, run: dict[str, Any], stage: str, swept: dict[str, Any],
                      previous: dict[str, Any] | None, attempt: int) -> tuple[Any, dict[str, Any] | None]:
    """A built-in loop stage's try: ``(job, None)``, its job with the inputs' fingerprints in its arguments, or
    ``(None, hit)`` when ``cache.stage`` holds a stage trained from the same inputs."""
    from stagewise.airflow.stage_job import build
    from stagewise.reuse import cache

    init_from = previous["checkpoint_uri"] if previous else None
    with guarded(config):
        inputs = stage_inputs(config, run, stage, swept, previous)
        fingerprint = inputs["fingerprint"]
        hit = cache.lookup(config, "stage", fingerprint, f"{run['dag_id']}/{run['run_id']}",
                           lambda result: cache.stage_problem(result, fingerprint))
        if hit is not None:
            return None, hit
        keys = {"inputs_fingerprint": fingerprint, "data_fingerprint": inputs["data_fingerprint"],
                "resume_fingerprint": inputs["resume_fingerprint"]}
        return build(config, run, stage, swept["best_params"], init_from, attempt, fingerprints=keys), None


def job_fingerprint(job: Any) -> str:
    """The inputs' fingerprint a fingerprinted job's arguments carry (its cache key)."""
    args = list(job.args)
    return args[args.index("--inputs-fingerprint") + 1]


def remember_stage(config: PipelineConfig, run_ref: str, fingerprint: str, result: dict[str, Any]) -> dict[str, Any]:
    """Remember a fingerprinted stage's result under its inputs' ``fingerprint`` (``cache.stage``); returns it."""
    from stagewise.reuse import cache

    with guarded(config):
        cache.remember(config, "stage", fingerprint, run_ref, result)
    return result


def with_cost(config: PipelineConfig, job: Any, result: dict[str, Any]) -> dict[str, Any]:
    """A Slurm stage's result with its ``cost`` over this try and the ones before (stagewise.reporting.cost); the
    backend's own figures of this try (its result's ``slurm``: the cost, or ``{"cost", "job_id", "state"}``) are
    recorded first where the backend did not record them."""
    from stagewise.core import storage
    from stagewise.reporting import cost

    ran = result.pop("slurm", None) if isinstance(result, dict) else None
    ran = ran if isinstance(ran, dict) else {}
    spent = ran.get("cost") if isinstance(ran.get("cost"), dict) else ran if "elapsed_s" in ran else None
    with guarded(config):
        if spent is not None and not storage.exists(cost.attempt_uri(job.out, job.stage, job.attempt)):
            cost.record(job.out, job.stage, job.attempt, spent, job_id=ran.get("job_id"), state=ran.get("state"))
        return {**result, "cost": cost.gathered(job.out, job.stage, job.attempt)}
