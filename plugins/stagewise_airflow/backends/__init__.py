"""The backends a train stage runs on, behind one interface: ``run_job(job)`` of :mod:`.local` (torchrun on this
worker), :mod:`.sagemaker` (a SageMaker training job) or :mod:`.kubernetes` (an Indexed Job), each taking the
:class:`~stagewise.airflow.stage_job.StageJob` the step built.

A remote backend's module holds all of its own request (pure: job in, request out, so tests check it against the
service's own schema) and the Airflow glue that submits it, streams its status into the task log and maps failures
onto Airflow's retry rules; :mod:`.remote` has what they share while a job runs. The local backend returns what
``stagewise.train`` returns; a remote one returns once its job succeeded, and :func:`run_job` reads the stage's
result back from the run's storage.
"""

from __future__ import annotations

from typing import Any

from stagewise.airflow.stage_job import StageJob
from stagewise.core.errors import UserError


def stage_result(out: str, stage: str) -> dict[str, Any]:
    """What stagewise.train returns, read back from the ``metrics.json`` its rank 0 wrote last (the stage's commit)."""
    from stagewise.core import storage

    prefix = storage.stage_prefix(out, stage)
    uri = storage.join(prefix, "metrics.json")
    if not storage.exists(uri):
        raise RuntimeError(f"stage {stage}: the job succeeded but wrote no {uri}; retrying")
    metrics = storage.read_json(uri)
    if not metrics.get("complete"):
        raise RuntimeError(f"stage {stage}: the job succeeded but {uri} is not marked complete; retrying")
    result = {key: value for key, value in metrics.items() if key not in ("history", "complete")}
    result.setdefault("checkpoint_uri", storage.join(prefix, "final.pt"))
    result["model_uri"] = storage.join(prefix, "model.pt")
    return result


def run_job(job: StageJob) -> dict[str, Any]:
    """Run one try of the job's stage on its profile's backend; a user error fails the task without retry."""
    import importlib
    import time

    from airflow.sdk.exceptions import AirflowFailException

    from stagewise.airflow import credentials

    backend = importlib.import_module(f"{__name__}.{job.backend}")
    started = time.monotonic()
    try:
        with credentials.exported(job.storage_env):  # a remote stage's metrics.json is read back from the run's storage
            result = backend.run_job(job)
            if result is None:  # a remote job succeeded: what its rank 0 committed is the stage's result
                result = stage_result(job.out, job.stage)
    except UserError as exc:
        raise AirflowFailException(str(exc)) from None
    # A local sub-job times its own work (stagewise.core.cli); a remote job's wall time stands in for it.
    return {"duration_s": round(time.monotonic() - started, 3), **result, "attempt": job.attempt}
