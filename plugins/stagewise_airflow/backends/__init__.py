"""The backends a train stage runs on, behind one interface: ``run_job(job)`` of :mod:`.local` (torchrun on this
worker), :mod:`.sagemaker` (a SageMaker training job) or :mod:`.kubernetes` (an Indexed Job), each taking the
:class:`~stagewise.airflow.stage_job.StageJob` the step built and returning what ``stagewise.train`` returns.

A remote backend's module holds all of its own request (pure: config in, request out, so tests check it against the
service's own schema) and the Airflow glue that submits it, streams its status into the task log and maps failures
onto Airflow's retry rules. What they share is here: job names, the public part of the storage environment, the
user-error rule, SIGTERM while waiting, and reading the stage's result back from its storage.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
import signal
from collections.abc import Iterator
from typing import Any

from stagewise.airflow.stage_job import StageJob
from stagewise.core.errors import USER_ERROR_EXIT, UserError
from stagewise.definitions.config import PipelineConfig

# Where the project lives in the runtime image (docker/runtime.Dockerfile's WORKDIR).
IMAGE_WORKDIR = "/opt/stagewise"
# A node that fails on the user's input (stagewise.core.errors.USER_ERROR_EXIT) reports this prefix in its failure
# message (SageMaker's /opt/ml/output/failure, the pod's termination message): no retry.
USER_ERROR_MARKER = "stagewise user error"
# Environment variables of the storage connection that are safe in a job description (no keys: the job's
# role or service account grants storage access).
_PUBLIC_AWS_ENV = ("AWS_ENDPOINT_URL_S3", "AWS_DEFAULT_REGION")


def job_name(dag_id: str, run_id: str, stage: str, attempt: int, limit: int = 63) -> str:
    """A name unique per (DAG run, stage, try), lowercase letters, digits and '-' only, at most ``limit`` chars.

    Valid both as a SageMaker training job name and as a DNS-1123 label (Kubernetes Job and Service names).
    """
    digest = hashlib.sha256(f"{dag_id}\0{run_id}\0{stage}".encode()).hexdigest()[:10]
    tail = f"-{digest}-t{attempt}"
    readable = re.sub(r"[^a-z0-9]+", "-", f"sw-{stage}".lower()).strip("-")
    return readable[:limit - len(tail)].rstrip("-") + tail


def public_storage_env(storage_env: dict[str, str]) -> dict[str, str]:
    """The storage connection's endpoint and region, never its keys (a job's description is readable by many)."""
    return {key: value for key, value in storage_env.items() if key in _PUBLIC_AWS_ENV}


def is_user_error(message: str | None, exit_code: int | None = None) -> bool:
    """Whether a node's failure is the user's to fix (bad config or data): no Airflow retry."""
    return exit_code == USER_ERROR_EXIT or USER_ERROR_MARKER in (message or "").lower()


class Stopped(RuntimeError):
    """The task got SIGTERM (killed, marked failed) while its job ran; Airflow retries it if retries are left."""


@contextlib.contextmanager
def stop_on_sigterm(what: str) -> Iterator[None]:
    """Turn SIGTERM into :class:`Stopped` in the waiting task, so its ``finally`` stops or deletes the job.

    Airflow's own handler only calls the operator's on_kill (a Python task has none) and the process is
    SIGKILLed after a grace period; raising here unwinds the wait first. Outside the main thread nothing
    is installed (signals reach only the main thread).
    """
    previous = signal.getsignal(signal.SIGTERM)

    def on_term(signum: int, frame: Any) -> None:
        if callable(previous):
            previous(signum, frame)
        raise Stopped(f"{what} was stopped: the task got SIGTERM (killed or marked failed)")

    try:
        signal.signal(signal.SIGTERM, on_term)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def stage_result(config: PipelineConfig, out: str, stage: str) -> dict[str, Any]:
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
    except UserError as exc:
        raise AirflowFailException(str(exc)) from None
    # A local sub-job times its own work (stagewise.core.cli); a remote job's wall time stands in for it.
    return {"duration_s": round(time.monotonic() - started, 3), **result, "attempt": job.attempt}
