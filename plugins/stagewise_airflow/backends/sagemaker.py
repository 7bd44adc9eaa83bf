"""Backend 'sagemaker': one SageMaker training job per stage try, every node running node_launch.

:func:`run_job` is the backend's interface (stagewise.airflow.backends). :func:`training_job_request` builds the
CreateTrainingJob request from the job (pure; tests validate it with botocore's own SageMaker model). :func:`run_stage`
submits it through the Amazon provider's SageMakerHook, polls until the job ends, logs each status change, and maps the
outcome onto Airflow: a job that failed on the user's input fails the task (no retry); capacity, spot interruption and
internal errors retry. The stage's result is read back from the run's storage by the caller.

The node command goes in as ``ContainerEntrypoint``/``ContainerArguments`` (SageMaker runs a custom image
with them as given), not as hyperparameters: hyperparameters reach the container only as a JSON file the
entry script must parse, whereas arguments give every backend the same command line (node_command).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Iterable
from typing import Any

from stagewise.airflow.backends.remote import Stopped, is_user_error, stop_on_sigterm
from stagewise.airflow.stage_job import RemoteParts, StageJob
from stagewise.core.errors import UserError
from stagewise.definitions.config import Profile

log = logging.getLogger(__name__)

CHECKPOINT_LOCAL_PATH = "/opt/ml/checkpoints"
DATA_CHANNEL = "preprocess"
# CreateTrainingJob limits the service model states and botocore's validator does not check (it checks types/min).
MAX_ARGUMENTS, MAX_ARGUMENT_CHARS, MAX_ENV_VALUE_CHARS = 100, 256, 512
TERMINAL = ("Completed", "Failed", "Stopped")
POLL_S = 30  # seconds between DescribeTrainingJob calls while a job runs (the task's or the triggerer's)
# FailureReason prefixes of a job that failed on its request or the user's code/config: retrying changes nothing.
_USER_FAILURES = ("ClientError",)


def _tag_value(text: str) -> str:
    """A tag value SageMaker accepts: letters, digits, spaces and _.:/=+-@ only, at most 256 chars."""
    return "".join(c if c.isalnum() or c in " _.:/=+-@" else "_" for c in text)[:256]


def spot_for(profile: Profile, attempt: int) -> bool:
    """Spot on every try but the last one when spot_fallback_on_last_retry is set (that one runs on demand)."""
    settings = profile.sagemaker
    last_try = attempt > profile.retries
    return bool(settings.use_spot and not (settings.spot_fallback_on_last_retry and last_try))


def training_job_request(job: StageJob, parts: RemoteParts | None = None) -> dict[str, Any]:
    """The CreateTrainingJob request of one try of the job's stage (its ``out``: the run prefix, an s3:// URI), from
    the job's remote ``parts`` (made here when not given)."""
    from stagewise.core import storage

    stage, out, attempt = job.stage, job.out, job.attempt
    if not out.startswith("s3://"):
        raise UserError(f"stage {stage}: a SageMaker job reads and writes the run through S3, but the run prefix is {out}")
    parts = parts or job.remote("sagemaker")
    profile, settings, command, environment = parts.profile, parts.settings, parts.command, parts.environment
    arguments = command[1:]
    too_long = [arg for arg in arguments if len(arg) > MAX_ARGUMENT_CHARS]
    if too_long or len(arguments) > MAX_ARGUMENTS:
        raise UserError(f"stage {stage}: SageMaker takes at most {MAX_ARGUMENTS} container arguments of "
                        f"{MAX_ARGUMENT_CHARS} characters; too long: {[arg[:60] + '...' for arg in too_long]}")
    prefix = storage.stage_prefix(out, stage)
    spot = spot_for(profile, attempt)
    stopping: dict[str, int] = {"MaxRuntimeInSeconds": settings.max_run_s}
    if spot:
        stopping["MaxWaitTimeInSeconds"] = settings.max_wait_s or 2 * settings.max_run_s
    if too_long := [key for key, value in environment.items() if len(value) > MAX_ENV_VALUE_CHARS]:
        raise UserError(f"stage {stage}: SageMaker takes environment values of at most {MAX_ENV_VALUE_CHARS} "
                        f"characters; too long: {too_long}")
    return {
        "TrainingJobName": parts.name,
        "AlgorithmSpecification": {
            "TrainingImage": settings.image_uri,
            # FastFile: the channel is mounted and streamed on access, nothing is copied before the job starts
            # (stagewise.train reads the manifest's files through s3fs itself, each rank its own rows).
            "TrainingInputMode": "FastFile",
            "ContainerEntrypoint": command[:1],
            "ContainerArguments": arguments,
        },
        "RoleArn": settings.role_arn,
        # FullyReplicated: every node sees the whole committed preprocess output, because the rank split is the
        # manifest's (stagewise.training.loop.rank_batches), not S3 keys'; ShardedByS3Key would hide rows from ranks.
        "InputDataConfig": [{
            "ChannelName": DATA_CHANNEL,
            "DataSource": {"S3DataSource": {"S3DataType": "S3Prefix", "S3Uri": storage.join(out, "preprocess") + "/",
                                            "S3DataDistributionType": "FullyReplicated"}},
        }],
        "OutputDataConfig": {"S3OutputPath": storage.join(prefix, "sagemaker") + "/"},
        "ResourceConfig": {"InstanceType": settings.instance_type, "InstanceCount": profile.nodes,
                           "VolumeSizeInGB": settings.volume_size_gb},
        "StoppingCondition": stopping,
        "EnableManagedSpotTraining": spot,
        # stagewise.train checkpoints straight to S3 under this prefix; SageMaker syncs it into the local path on a
        # spot restart, and a resumed stage finds its latest checkpoint there either way.
        "CheckpointConfig": {"S3Uri": storage.join(prefix, "checkpoints") + "/", "LocalPath": CHECKPOINT_LOCAL_PATH},
        "Environment": environment,
        "Tags": [{"Key": f"stagewise:{key}", "Value": _tag_value(value)} for key, value in
                 (("dag_id", job.dag_id), ("run_id", job.run_id), ("stage", stage), ("try", str(attempt)))],
    }


def failure(description: dict[str, Any]) -> Exception:
    """The exception an ended, unsuccessful job raises: AirflowFailException for the user's faults, else retryable."""
    from airflow.sdk.exceptions import AirflowFailException

    name, status = description["TrainingJobName"], description["TrainingJobStatus"]
    reason = description.get("FailureReason") or description.get("SecondaryStatus") or "no reason given"
    message = f"SageMaker training job {name} {status.lower()}: {reason}"
    exit_code = re.search(r"exit code:? (\d+)", reason, re.IGNORECASE)  # an AlgorithmError ends with the node's code
    if status == "Failed" and (reason.startswith(_USER_FAILURES)
                               or is_user_error(reason, int(exit_code.group(1)) if exit_code else None)):
        return AirflowFailException(message + " (not retried: fix the config, image or role)")
    # Capacity errors, spot interruptions past MaxWaitTime, internal errors and stops by hand: another try may pass.
    return RuntimeError(message + "; retrying if retries are left")


LOG_GROUP = "/aws/sagemaker/TrainingJobs"


class CloudWatchTail:
    """The new lines of a job's CloudWatch log streams (``<job>/algo-<n>-<id>``, one per node) since the last call.

    The task log is for watching, not for the job's fate: a failed read is logged once and the job goes on.
    """

    def __init__(self, connect: Callable[[], Any], name: str) -> None:
        self.connect, self.client, self.name, self.tokens, self.failed = connect, None, name, {}, False

    def __call__(self) -> list[str]:
        try:
            return self._read()
        except Stopped:
            raise  # SIGTERM arrived mid-read: the task must unwind and delete the job, not read on
        except Exception as exc:  # noqa: BLE001 - see the class docstring
            if not self.failed:
                log.warning("cannot read the CloudWatch logs of SageMaker job %s (%s); status only", self.name, exc)
            self.failed = True
            return []

    def _read(self) -> list[str]:
        self.client = self.client or self.connect()
        streams = self.client.describe_log_streams(logGroupName=LOG_GROUP, logStreamNamePrefix=f"{self.name}/")
        lines = []
        for stream in sorted(item["logStreamName"] for item in streams.get("logStreams", [])):
            request = {"logGroupName": LOG_GROUP, "logStreamName": stream, "startFromHead": True}
            if stream in self.tokens:
                request["nextToken"] = self.tokens[stream]
            response = self.client.get_log_events(**request)
            self.tokens[stream] = response["nextForwardToken"]
            node = stream.removeprefix(f"{self.name}/")
            lines.extend(f"[{node}] {event['message'].rstrip()}" for event in response.get("events", []))
        return lines


def wait(describe: Callable[[str], dict[str, Any]], name: str, *, poll_s: float, log_line: Callable[[str], None],
         sleep: Callable[[float], None] = time.sleep, node_lines: Callable[[], Iterable[str]] = list) -> dict[str, Any]:
    """Poll until the job ends; log every status change and SageMaker's status messages once each, and the nodes'
    new log lines (``node_lines``) as they come."""
    seen_status, seen_transitions = None, 0
    while True:
        description = describe(name)
        for line in node_lines():
            log_line(line)
        status = (description["TrainingJobStatus"], description.get("SecondaryStatus"))
        if status != seen_status:
            log_line(f"SageMaker job {name}: {status[0]} / {status[1]}")
            seen_status = status
        transitions = description.get("SecondaryStatusTransitions") or []
        for transition in transitions[seen_transitions:]:
            if transition.get("StatusMessage"):
                log_line(f"SageMaker job {name}: {transition['Status']}: {transition['StatusMessage']}")
        seen_transitions = len(transitions)
        if status[0] in TERMINAL:
            return description
        sleep(poll_s)


def hook_for(settings: Any) -> Any:
    """The Amazon provider's SageMakerHook for a profile's ``sagemaker`` settings (connection and region)."""
    from airflow.providers.amazon.aws.hooks.sagemaker import SageMakerHook

    return SageMakerHook(aws_conn_id=settings.aws_conn_id or None, region_name=settings.region or None)


def submit(hook: Any, request: dict[str, Any]) -> str:
    """Create the job of ``request``, or attach to it if this try submitted it before; its name.

    A request SageMaker refuses as invalid fails the task without retry (AirflowFailException).
    """
    from botocore.exceptions import ClientError

    name = request["TrainingJobName"]
    try:
        hook.describe_training_job(name)
        log.info("SageMaker job %s exists (this try submitted it before): attaching to it", name)
        return name
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") not in ("ValidationException", "ResourceNotFound"):
            raise
    log.info("submitting SageMaker job %s: %d x %s, image %s", name, request["ResourceConfig"]["InstanceCount"],
             request["ResourceConfig"]["InstanceType"], request["AlgorithmSpecification"]["TrainingImage"])
    try:
        hook.create_training_job(request, wait_for_completion=False, print_log=False)
    except ClientError as create_error:
        from airflow.sdk.exceptions import AirflowFailException

        if create_error.response.get("Error", {}).get("Code") == "ValidationException":
            raise AirflowFailException(f"SageMaker refused job {name}: {create_error}") from None
        raise
    return name


def run_job(job: StageJob) -> None:
    """The backend's interface: build the try's request, submit it (or attach to it) and wait for it to succeed."""
    parts = job.remote("sagemaker")
    run_stage(parts.settings, request=training_job_request(job, parts))


def run_stage(settings: Any, *, request: dict[str, Any], poll_s: float | None = None, hook: Any = None) -> None:
    """Submit ``request`` (or attach to the job this try already submitted) with the profile's ``settings`` and wait;
    returns once the job completed (its result is in the run's storage), raises as Airflow should take its end."""
    hook = hook if hook is not None else hook_for(settings)
    poll_s = POLL_S if poll_s is None else poll_s
    name = submit(hook, request)
    ended = False
    try:
        with stop_on_sigterm(f"SageMaker job {name}"):
            description = wait(hook.describe_training_job, name, poll_s=poll_s, log_line=log.info,
                               node_lines=CloudWatchTail(lambda: hook.logs_hook.get_conn(), name))
        ended = True
    finally:
        if not ended:  # killed, timed out or lost the API: never leave a job billing with no task watching it
            log.warning("stopping SageMaker job %s: its task ends before the job", name)
            try:
                hook.get_conn().stop_training_job(TrainingJobName=name)
            except Exception as exc:  # noqa: BLE001 - the original error matters more than the cleanup's
                log.error("could not stop SageMaker job %s: %s", name, exc)
    if description["TrainingJobStatus"] != "Completed":
        raise failure(description)
    billable = description.get("BillableTimeInSeconds")
    log.info("SageMaker job %s completed%s", name, f" ({billable} billable s)" if billable is not None else "")
