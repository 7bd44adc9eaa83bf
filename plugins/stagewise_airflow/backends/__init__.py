"""Launchers that submit a train stage's whole gang as one job: a SageMaker training job or a Kubernetes Indexed Job.

Each backend has two halves. The builders (``training_job_request``, ``job_objects``) are pure: config in,
request out, no Airflow and no network, so tests check them against the services' own schemas
(botocore's SageMaker model, the kubernetes client's models). ``run_stage`` is the Airflow glue: it
submits through the provider's hook, streams the job's status into the task log, maps failures onto
Airflow's retry rules and returns what ``stagewise.train`` returns.

What runs on every node is one command, :func:`node_command`: ``stagewise.training.node_launch`` reads the
node's place in the gang from the platform (SageMaker's resourceconfig.json, the Indexed Job's
JOB_COMPLETION_INDEX) and starts torchrun with that node's processes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from stagewise.core.errors import USER_ERROR_EXIT, UserError
from stagewise.definitions.config import PipelineConfig, Profile

NODE_LAUNCH_MODULE = "stagewise.training.node_launch"
# Where the project lives in the runtime image (docker/runtime.Dockerfile's WORKDIR).
IMAGE_WORKDIR = "/opt/stagewise"
# A node that fails on the user's input (stagewise.core.errors.USER_ERROR_EXIT) reports this prefix in its failure
# message (SageMaker's /opt/ml/output/failure, the pod's termination message): no retry.
USER_ERROR_MARKER = "stagewise user error"
# Environment variables of the storage connection that are safe in a job description (no keys: the job's
# role or service account grants storage access).
_PUBLIC_AWS_ENV = ("AWS_ENDPOINT_URL_S3", "AWS_DEFAULT_REGION")


def node_command(mode: str, *, processes_per_node: int, stage: str, out: str, params: dict[str, Any],
                 init_from: str | None, config_file: str) -> list[str]:
    """The command every node of a job runs (container entrypoint + arguments): node_launch, then stagewise.train."""
    if mode not in ("sagemaker", "kubernetes"):
        raise ValueError(f"node_launch mode must be sagemaker or kubernetes, not {mode!r}")
    command = ["python", "-m", NODE_LAUNCH_MODULE, mode, "--nproc-per-node", str(processes_per_node),
               "-m", "stagewise.train", "--stage", stage, "--out", out, "--params", json.dumps(params, sort_keys=True)]
    if init_from:
        command += ["--init-from", init_from]
    return [*command, "--config", config_file]


@dataclass(frozen=True)
class StageJob:
    """What both builders start from: the stage's profile and backend settings, and the command every node runs."""

    profile: Profile
    settings: Any
    """The profile's ``sagemaker`` or ``kubernetes`` block."""
    config_file: str
    """The run's config snapshot on its storage, which every node reads (not a file of the image)."""
    command: list[str]


def stage_job(config: PipelineConfig, backend: str, *, stage: str, out: str, params: dict[str, Any], init_from: str | None,
              config_file: str) -> StageJob:
    """The stage's ``backend`` settings (a user error if its profile has another backend) and its node command."""
    name = config.stage(stage).profile
    profile = config.profile(name)
    settings = getattr(profile, backend)
    if settings is None:
        raise UserError(f"stage {stage}: profile '{name}' has backend '{profile.backend}', not {backend}")
    command = node_command(backend, processes_per_node=profile.processes_per_node, stage=stage, out=out, params=params,
                           init_from=init_from, config_file=config_file)
    return StageJob(profile=profile, settings=settings, config_file=config_file, command=command)


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


def submit_stage(config: PipelineConfig, run: dict[str, Any], stage: str, params: dict[str, Any], init_from: str | None,
                 attempt: int) -> dict[str, Any]:
    """Run one try of ``stage`` as a job of its profile's backend and return what stagewise.train returns."""
    import time

    from airflow.sdk.exceptions import AirflowFailException

    from stagewise.airflow import credentials

    spec = config.stage(stage)
    backend = config.profile(spec.profile).backend
    storage_env = credentials.aws_environment(config.storage_conn_id)
    started = time.monotonic()
    common = dict(dag_id=run["dag_id"], run_id=run["run_id"], stage=stage, out=run["out"], attempt=attempt, params=params,
                  init_from=init_from, config_file=run["config"], storage_env=storage_env)
    try:
        with credentials.exported(storage_env):  # the stage's metrics.json is read back from the run's storage
            if backend == "sagemaker":
                from stagewise.airflow.backends import sagemaker

                result = sagemaker.run_stage(config, request=sagemaker.training_job_request(config, **common),
                                             out=run["out"], stage=stage)
            elif backend == "kubernetes":
                from stagewise.airflow.backends import kubernetes

                service, job = kubernetes.job_objects(config, **common)
                result = kubernetes.run_stage(config, service=service, job=job, out=run["out"], stage=stage)
            else:
                raise ValueError(f"backend {backend!r} submits no job")
    except UserError as exc:
        raise AirflowFailException(str(exc)) from None
    return {**result, "duration_s": round(time.monotonic() - started, 3), "attempt": attempt}
