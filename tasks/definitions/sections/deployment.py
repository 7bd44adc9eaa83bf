"""Where and how tasks run: instance profiles (local, SageMaker, Kubernetes, Slurm), pools and the DAGs' Airflow settings."""

from __future__ import annotations

import datetime as dt
import re
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from stagewise.definitions.sections.base import MAX_SECONDS, StrictModel


class SageMakerSettings(StrictModel):
    """One SageMaker training job per stage try, all its nodes gang-scheduled by SageMaker (backend 'sagemaker')."""

    instance_type: str = Field(description="Instance type of every node, e.g. ml.g5.12xlarge.")
    image_uri: str = Field(description="The runtime image (docker/runtime.Dockerfile) pushed to ECR.")
    role_arn: str = Field(pattern=r"^arn:aws[\w-]*:iam::\d{12}:role/.+$",
                          description="IAM role the job runs as: reads the run's data, writes checkpoints and models.")
    volume_size_gb: int = Field(100, ge=1, le=16384, description="EBS volume of each node, in GB (at most 16384).")
    max_run_s: int = Field(86400, ge=60, le=28 * 86_400, description="The job's MaxRuntimeInSeconds (SageMaker's limit: at most 28 days, 2419200).")
    use_spot: bool = Field(False, description="Managed spot training; an interrupted job resumes from its S3 checkpoints.")
    max_wait_s: int | None = Field(None, ge=60, le=MAX_SECONDS, description=(
        "MaxWaitTimeInSeconds with spot, above max_run_s (at most 30 days, 2592000); empty: 2 x "
        "max_run_s."))
    spot_fallback_on_last_retry: bool = Field(True, description="The stage's last Airflow try runs on demand instead of spot.")
    region: str = Field("", description="AWS region of the job; empty: the connection's or the environment's.")
    aws_conn_id: str = Field("aws_default", description="Airflow connection for the SageMaker API.")
    deferrable: bool = Field(False, description=(
        "Wait in Airflow's triggerer, freeing the worker slot while the job runs; but a task killed or marked failed "
        "while deferred cannot stop its job (it runs until it ends or hits max_run_s), and no node log lines stream "
        "while deferred (status only on resume)."))

    @model_validator(mode="after")
    def _wait_above_run(self) -> SageMakerSettings:
        if self.max_wait_s is not None and not self.use_spot:
            raise ValueError("max_wait_s applies to spot training only (use_spot: true)")
        if self.max_wait_s is not None and self.max_wait_s <= self.max_run_s:
            raise ValueError(f"max_wait_s {self.max_wait_s} must exceed max_run_s {self.max_run_s}: it includes the spot wait")
        return self


class KubernetesSettings(StrictModel):
    """One Indexed Job (a pod per node) and a headless Service per stage try (backend 'kubernetes')."""

    image: str = Field(description="The runtime image (docker/runtime.Dockerfile) the pods run.")
    namespace: str = Field("default", description="Namespace of the Job and its Service.")
    gpus_per_pod: int = Field(0, ge=0, le=16, description="nvidia.com/gpu limit of each pod (usually processes_per_node); at most 16.")
    cpu: str = Field("", description="CPU request and limit of each pod, e.g. '8'; empty: none.")
    memory: str = Field("", description="Memory request and limit of each pod, e.g. '32Gi'; empty: none.")
    node_selector: dict[str, str] = Field(default_factory=dict, description="Node labels the pods must match.")
    tolerations: list[dict[str, Any]] = Field(default_factory=list, description="Pod tolerations, as in a pod spec.")
    service_account: str = Field("", description="Service account of the pods (e.g. with IRSA for S3); empty: the namespace's default.")
    kubernetes_conn_id: str = Field("kubernetes_default", description="Airflow connection for the cluster's API.")
    rendezvous_port: int = Field(29400, ge=1024, le=65535, description="Port of the rendezvous store on pod 0 (torchrun's static rendezvous).")
    join_timeout_s: int = Field(900, ge=60, le=86_400, description=(
        "How long torchrun waits for every pod to join (above scheduling time); at most a day, 86400."))


# Slurm's --time: minutes, minutes:seconds, hours:minutes:seconds, days-hours, days-hours:minutes, days-hours:minutes:seconds.
SLURM_TIME = r"^(\d+|\d+:\d{1,2}|\d+:\d{1,2}:\d{1,2}|\d+-\d+|\d+-\d+:\d{1,2}|\d+-\d+:\d{1,2}:\d{1,2})$"


class SlurmSettings(StrictModel):
    """One sbatch allocation per stage try, srun starting one torchrun agent per node (backend 'slurm')."""

    partition: str = Field("", description="sbatch --partition; empty: the cluster's default partition.")
    account: str = Field("", description="sbatch --account the job is charged to; empty: the user's default.")
    qos: str = Field("", description="sbatch --qos; empty: the account's default.")
    constraint: str = Field("", description="sbatch --constraint (node features, e.g. 'a100&ib'); empty: none.")
    cpus_per_task: int = Field(1, ge=1, le=1024, description="sbatch --cpus-per-task: CPUs of each node's agent and its ranks (at most 1024).")
    mem_per_cpu: str = Field("", pattern=r"^(\d+[KMGTkmgt]?)?$", description="sbatch --mem-per-cpu, e.g. '2G'; empty: the cluster's default.")
    gpus_per_node: int = Field(0, ge=0, le=64, description="GPUs of each node as --gres=gpu:N (usually processes_per_node); at most 64.")
    time_limit: str = Field("", description="sbatch --time, 'HH:MM:SS', 'D-HH:MM' or minutes; empty: the partition's limit.")
    extra_sbatch_options: list[str] = Field(default_factory=list, description="More sbatch options, each one '--name=value' as on the command line.")
    slurm_conf: str = Field("", description="The cluster's slurm.conf, exported as SLURM_CONF to every Slurm command; empty: the client's default.")
    min_nodes: int | None = Field(None, ge=1, le=512, description=(
        "Fewest nodes a try may start on (at most 512), resharded at the same global batch; empty: exactly nodes."))
    queue_wait_warn_s: float = Field(600.0, ge=0, le=MAX_SECONDS, description=(
        "A job pending longer is logged as waiting in the queue with Slurm's reason, never failed for it."))
    log_dir: str = Field("", description=(
        "Folder of the job's output file, on a filesystem the nodes share; empty: <run>/train/<stage>/slurm/ (an s3 root needs it)."))
    python: str = Field("", description="The interpreter on the nodes; empty: this worker's own (a shared install).")
    rendezvous_port: int = Field(29400, ge=1024, le=64536, description=(
        "Port of the rendezvous store on the first node, at most 64536: a job adds its id modulo 1000 (nodes are shared)."))
    poll_s: float = Field(10.0, gt=0, le=3600, description=(
        "Longest wait between polls of the job's state: the first come after 1 s, doubling up to it (at most 3600)."))
    join_timeout_s: int = Field(900, ge=60, le=86_400, description=(
        "How long torchrun waits for every node to join (above srun's start-up); at most a day, 86400."))
    deferrable: bool = Field(True, description="Wait in Airflow's triggerer, freeing the worker slot while the job runs or queues.")

    @field_validator("time_limit")
    @classmethod
    def _a_time_sbatch_takes(cls, value: str) -> str:
        if value and not re.match(SLURM_TIME, value):
            raise ValueError(f"'{value}' is no time sbatch takes: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS")
        return value

    @field_validator("extra_sbatch_options")
    @classmethod
    def _options_are_options(cls, value: list[str]) -> list[str]:
        if bad := [option for option in value if not option.startswith("-")]:
            raise ValueError(f"{bad}: each extra sbatch option is one '--name=value' (or '-x') as sbatch takes it")
        return value


class Profile(StrictModel):
    """Where and how a sub-job runs: the launcher plus Airflow's own knobs."""

    backend: Literal["local", "sagemaker", "kubernetes", "slurm"] = Field(
        "local", description="Launcher: 'local' runs processes on the worker; 'sagemaker'/'kubernetes'/'slurm' submit a train stage's whole gang as one job.")
    nodes: int = Field(1, ge=1, le=512, description="Nodes (instances, pods or Slurm nodes) of a train stage, at most 512; fixed unless slurm.min_nodes.")
    processes_per_node: int = Field(1, ge=1, le=64, description="Processes per node (torchrun --nproc-per-node); at most 64.")
    threads_per_process: int = Field(1, ge=1, le=256, description="Intra-op threads per process (OMP/torch); at most 256.")
    device: Literal["cpu", "cuda", "auto"] = Field("cpu", description="Device: cpu, cuda, or auto (cuda if present).")
    pool: str = Field("default_pool", description="Airflow pool that bounds concurrent use of this resource.")
    pool_slots: int = Field(1, ge=1, le=100_000, description="Pool slots one task of this profile takes (at most 100000).")
    queue: str = Field("default", description="Executor queue (Celery queue / instance type).")
    priority_weight: int = Field(1, ge=1, le=1_000_000, description="Airflow priority_weight of the profile's tasks (at most 1000000); higher runs first.")
    weight_rule: Literal["downstream", "upstream", "absolute"] = Field(
        "absolute", description="'absolute': priority_weight alone (older runs first); 'downstream' adds every downstream task's, the light tasks' too.")
    retries: int = Field(1, ge=0, le=20, description="Airflow retries after an infrastructure failure (at most 20).")
    retry_delay_s: float = Field(5.0, ge=0, le=86_400, description="Seconds before the first retry (at most a day, 86400).")
    retry_backoff: float = Field(2.0, ge=1.0, le=100, description="Multiplier of the retry delay per further retry (at most 100).")
    max_retry_delay_s: float = Field(300.0, ge=0, le=7 * 86_400, description="Cap on the retry delay (at most a week, 604800).")
    execution_timeout_s: float = Field(3600.0, gt=0, le=MAX_SECONDS, description=(
        "Seconds after which the task and its processes are killed (at most 30 days, 2592000)."))
    max_restarts: int = Field(0, ge=0, le=10, description="torchrun --max-restarts inside one Airflow try (at most 10).")
    sagemaker: SageMakerSettings | None = Field(None, description="The SageMaker job settings (backend 'sagemaker').")
    kubernetes: KubernetesSettings | None = Field(None, description="The Kubernetes Job settings (backend 'kubernetes').")
    slurm: SlurmSettings | None = Field(None, description="The Slurm job settings (backend 'slurm').")

    @property
    def world_size(self) -> int:
        """Processes of one job over all its nodes: what batch arithmetic and the LR rules count."""
        return self.nodes * self.processes_per_node

    @model_validator(mode="after")
    def _backend_settings(self) -> Profile:
        for backend in ("sagemaker", "kubernetes", "slurm"):
            settings = getattr(self, backend)
            if self.backend == backend and settings is None:
                raise ValueError(f"backend '{backend}' needs a '{backend}:' block (see docs/scale-out.md)")
            if self.backend != backend and settings is not None:
                raise ValueError(f"a '{backend}:' block belongs to backend '{backend}', not '{self.backend}'")
        if self.backend == "local" and self.nodes != 1:
            raise ValueError(f"backend 'local' runs on one worker: nodes must be 1, not {self.nodes} "
                             f"(use backend sagemaker, kubernetes or slurm for several nodes)")
        if self.slurm is not None and self.slurm.min_nodes is not None and self.slurm.min_nodes > self.nodes:
            raise ValueError(f"slurm.min_nodes {self.slurm.min_nodes} exceeds nodes {self.nodes}: the job runs on "
                             f"min_nodes to nodes nodes")
        return self


class Pool(StrictModel):
    """An Airflow pool: the slots that profiles' pool_slots draw from."""

    slots: int = Field(ge=1, le=100_000, description="Concurrent slots, e.g. the cores or GPUs of a worker (at most 100000).")
    description: str = Field("", description="Shown in the Airflow UI.")


CRON_PRESETS = ("@yearly", "@annually", "@monthly", "@weekly", "@daily", "@midnight", "@hourly")
# minute, hour, day of month, month, day of week (0 and 7 are Sunday), and croniter's optional sixth: seconds.
_CRON_RANGES = ((0, 59), (0, 23), (1, 31), (1, 12), (0, 7), (0, 59))
_CRON_NAMES = {3: "jan feb mar apr may jun jul aug sep oct nov dec".split(), 4: "sun mon tue wed thu fri sat".split()}


def cron_problem(value: str) -> str | None:
    """Why ``value`` is no cron expression (None: it is one), by croniter (Airflow's own parser, wherever the DAGs are
    built) where installed, else by :func:`cron_shape_problem`: a sub-job's host (a GPU box) need not have croniter."""
    try:
        from croniter import croniter
    except ImportError:
        return cron_shape_problem(value)
    try:
        croniter(value)
    except (ValueError, KeyError) as exc:
        return str(exc)
    return None


def cron_shape_problem(value: str) -> str | None:
    """What makes ``value`` no cron expression, checked without croniter (None: none found): a preset, or 5 (or 6)
    fields of ``*``, numbers and names in range, ranges ``a-b`` and steps ``/n``, lists; croniter's ``L``, ``W``, ``#``
    and ``?`` extensions pass unchecked. Used only where croniter is not installed."""
    if value.strip().lower() in CRON_PRESETS:
        return None
    fields = value.split()
    if len(fields) not in (5, 6):
        return f"{len(fields)} fields"
    for position, field in enumerate(fields):
        low, high = _CRON_RANGES[position]
        names = _CRON_NAMES.get(position, [])
        for item in field.lower().split(","):
            if re.search(r"[lw#?]", item) and position in (2, 4):
                continue
            base, _, step = item.partition("/")
            if step and not (step.isdigit() and int(step) > 0):
                return f"step '{step}' in '{field}'"
            if base == "*":
                continue
            for bound in base.split("-", 1):
                number = (names.index(bound) + (1 if position == 3 else 0)) if bound in names else (
                    int(bound) if bound.isdigit() else None)
                if number is None or not low <= number <= high:
                    return f"'{bound}' in '{field}' is not in {low}-{high}"
    return None


CALLBACK_PATH = r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$"


class AirflowSettings(StrictModel):
    """How the pipeline's DAGs fit the team's Airflow: owner, tags, run limits, start date, default_args, callbacks."""

    owner: str = Field("stagewise", min_length=1, description="Owner of every task (default_args.owner).")
    tags: list[str] = Field(default_factory=list, description="Tags added to each DAG's own (stagewise and its kind).")
    max_active_runs: int | None = Field(None, ge=1, le=1000, description="Concurrent runs of each DAG (at most 1000); null: 4, and 1 for retrain.")
    start_date: dt.date = Field(dt.date(2026, 1, 1), description="The DAGs' start_date (UTC midnight).")
    catchup: bool = Field(False, description="Whether the scheduled retrain runs the intervals it missed.")
    default_args: dict[str, Any] = Field(
        default_factory=dict, description="More default_args of every task (email, email_on_failure, ...); the profile's own knobs win.")
    on_failure_callback: list[Annotated[str, Field(pattern=CALLBACK_PATH)]] = Field(
        default_factory=list, description="Your callbacks (module:function) called when a task fails, beside Stagewise's own.")
    on_retry_callback: list[Annotated[str, Field(pattern=CALLBACK_PATH)]] = Field(
        default_factory=list, description="Your callbacks (module:function) called when a task goes up for retry.")
    on_success_callback: list[Annotated[str, Field(pattern=CALLBACK_PATH)]] = Field(
        default_factory=list, description="Your callbacks (module:function) called when a task succeeds.")

    @field_validator("default_args")
    @classmethod
    def _no_callbacks_in_default_args(cls, value: dict[str, Any]) -> dict[str, Any]:
        if callbacks := sorted(key for key in value if key.endswith("_callback")):
            raise ValueError(f"{callbacks}: name callbacks in airflow.on_failure_callback (and the like) as "
                             f"module:function, so they run beside Stagewise's own")
        return value
