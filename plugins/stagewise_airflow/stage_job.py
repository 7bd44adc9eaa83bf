"""One try of a train stage, as the Airflow step hands it to a backend: what to run, where, with which environment and
credentials, each computed once here.

``train_stage`` (stagewise.airflow.steps) builds a :class:`StageJob` with :func:`build` and passes it to
``stagewise.airflow.backends.run_job``, which picks the profile's backend (local torchrun, SageMaker, Kubernetes,
Slurm); each backend's module turns the job into its own request and nothing else. A remote backend (an image of its
own: REMOTE_BACKENDS) runs the same command on every node (:func:`node_command`): ``stagewise.training.node_launch``
starts torchrun there with ``stagewise.train``. A Slurm job runs this worker's own install on a shared filesystem, so
its job is built as a local one (fingerprints, environment, own entrypoint) and its backend wraps those arguments in
``node_launch slurm`` (stagewise.airflow.backends.slurm).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

from stagewise.core.errors import UserError
from stagewise.definitions.config import PipelineConfig, Profile

TRAIN_MODULE = "stagewise.train"
NODE_LAUNCH_MODULE = "stagewise.training.node_launch"
REMOTE_BACKENDS = ("sagemaker", "kubernetes")  # not slurm: its nodes share this worker's install and storage
# Environment variables of the storage connection that are safe in a job description (no keys: the job's
# role or service account grants storage access).
PUBLIC_STORAGE_ENV = ("AWS_ENDPOINT_URL_S3", "AWS_DEFAULT_REGION")


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
    return {key: value for key, value in storage_env.items() if key in PUBLIC_STORAGE_ENV}


def node_command(mode: str, *, processes_per_node: int, stage: str, out: str, params: dict[str, Any],
                 init_from: str | None, config_file: str) -> list[str]:
    """The command every node of a remote job runs (container entrypoint + arguments): node_launch, then the stage."""
    if mode not in REMOTE_BACKENDS:
        raise ValueError(f"node_launch mode must be sagemaker or kubernetes, not {mode!r}")
    command = ["python", "-m", NODE_LAUNCH_MODULE, mode, "--nproc-per-node", str(processes_per_node),
               "-m", TRAIN_MODULE, "--stage", stage, "--out", out, "--params", json.dumps(params, sort_keys=True)]
    if init_from:
        command += ["--init-from", init_from]
    return [*command, "--config", config_file]


@dataclass(frozen=True)
class RemoteParts:
    """What every remote backend's request is made of, computed from the job in one call (:meth:`StageJob.remote`)."""

    name: str
    """The job's name, unique per (DAG run, stage, try), within the backend's length limit."""
    command: list[str]
    """The command every node runs (node_launch, then the stage)."""
    environment: dict[str, str]
    """The nodes' environment: the config snapshot's path and the storage connection's public part, no keys."""
    profile: Profile
    """The stage's instance profile (nodes, processes per node, retries, timeout)."""
    settings: Any
    """The profile's ``sagemaker`` or ``kubernetes`` block."""


@dataclass(frozen=True)
class StageJob:
    """One try of one train stage, everything a backend needs to run it, resolved once from the run's config: a backend
    reads these fields and never the config itself."""

    stage: str
    """The stage's name in train.stages."""
    profile_name: str
    """The name of the stage's profile in the config (what an error about its settings names)."""
    profile: Profile
    """The stage's instance profile: its backend, nodes, processes, retries and the backend's settings block."""
    dag_id: str
    """The DAG of the run: with run_id and attempt it names a remote job."""
    run_id: str
    """The run's id."""
    out: str
    """The run prefix under the storage root (holds preprocess/manifest.json and train/<stage>/)."""
    config_file: str
    """The run's config snapshot, which the stage's processes read (on every node of a remote job)."""
    attempt: int
    """Airflow's try number of this task."""
    params: dict[str, Any]
    """The hyperparameters the stage trains with (the sweep's best)."""
    init_from: str | None
    """The stage before's hand-off, or None for the first stage."""
    import_paths: tuple[str, ...] = ()
    """The config's model.import_paths: folders the stage's processes import the user's code from."""
    storage_env: dict[str, str] = field(default_factory=dict)
    """The storage connection's variables: the task reads results back with them; a remote job gets only the public ones."""
    env: dict[str, str] = field(default_factory=dict)
    """What a local stage's processes get on top of their own: the credentials, and an own script's STAGEWISE_*."""
    args: tuple[str, ...] = ()
    """A local stage's arguments (stagewise.train's, or an own entrypoint's with its placeholders filled)."""
    entry: Any = None
    """The stage's own entrypoint (script or module), or None for the built-in loop."""
    contract: dict[str, Any] | None = None
    """An own script's contract values (stagewise.scripting.stage_contract), which check its outputs afterwards."""

    @property
    def backend(self) -> str:
        return self.profile.backend

    def settings(self, backend: str) -> Any:
        """The profile's block of ``backend``; a user error when the profile has another backend."""
        settings = getattr(self.profile, backend)
        if settings is None:
            raise UserError(f"stage {self.stage}: profile '{self.profile_name}' has backend '{self.backend}', not {backend}")
        return settings

    def remote(self, backend: str, name_limit: int = 63) -> RemoteParts:
        """The parts of this job's request on the remote ``backend``; a user error when its profile has another."""
        from stagewise.definitions.loading import CONFIG_ENV_VAR

        profile, settings = self.profile, self.settings(backend)
        command = node_command(backend, processes_per_node=profile.processes_per_node, stage=self.stage, out=self.out,
                               params=self.params, init_from=self.init_from, config_file=self.config_file)
        return RemoteParts(name=job_name(self.dag_id, self.run_id, self.stage, self.attempt, limit=name_limit),
                           command=command, profile=profile, settings=settings,
                           environment={CONFIG_ENV_VAR: self.config_file, **public_storage_env(self.storage_env)})


def stage_job(config: PipelineConfig, *, dag_id: str, run_id: str, stage: str, out: str, attempt: int,
              params: dict[str, Any], init_from: str | None, config_file: str,
              storage_env: dict[str, str] | None = None, **local: Any) -> StageJob:
    """A job from its parts, the stage's profile and import paths read from ``config`` here, once; ``local`` takes
    env, args, entry and contract."""
    profile_name = config.stage(stage).profile
    return StageJob(stage=stage, profile_name=profile_name, profile=config.profile(profile_name), dag_id=dag_id,
                    run_id=run_id, out=out, config_file=config_file, attempt=attempt, params=params,
                    init_from=init_from, import_paths=tuple(config.model.import_paths or ()),
                    storage_env=dict(storage_env or {}), **local)


def build(config: PipelineConfig, run: dict[str, Any], stage: str, params: dict[str, Any], init_from: str | None,
          attempt: int, *, fingerprints: dict[str, str] | None = None) -> StageJob:
    """The try's job as the Airflow step runs it: credentials read from Airflow's connections once; for an own
    entrypoint its contract, environment and arguments (the user's to fix if they are wrong: UserError); for the
    built-in loop stagewise.train's arguments, with the inputs' ``fingerprints`` that key its checkpoints."""
    from stagewise.airflow import credentials

    storage_env = credentials.aws_environment(config.storage_conn_id)
    common = dict(dag_id=run["dag_id"], run_id=run["run_id"], stage=stage, out=run["out"], attempt=attempt,
                  params=params, init_from=init_from, config_file=run["config"], storage_env=storage_env)
    env = {**storage_env, **credentials.mlflow_environment(config.tracking.conn_id),
           **credentials.study_environment(config.sweep.storage_conn_id)}
    spec = config.stage(stage)
    if config.profile(spec.profile).backend in REMOTE_BACKENDS:
        return stage_job(config, **common)
    if spec.entrypoint is not None:
        from stagewise.scripting.entrypoint import contract_environment
        from stagewise.scripting.stage_contract import byo_args, byo_contract

        values = byo_contract(config, run["config"], stage, run["out"], params, init_from)  # once: env and args read it
        own = contract_environment(config, values, run["overrides"])  # byo_environment's, from the same values
        return stage_job(config, **common, env={**env, **own}, args=tuple(byo_args(config, stage, values)),
                         entry=spec.entrypoint, contract=values)
    args = ["--stage", stage, "--out", run["out"], "--params", json.dumps(params)]
    for name, value in (fingerprints or {}).items():
        args += [f"--{name.replace('_', '-')}", value]
    if init_from:
        args += ["--init-from", init_from]
    return stage_job(config, **common, env=env, args=(*args, "--config", run["config"]))
