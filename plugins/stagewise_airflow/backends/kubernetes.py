"""Backend 'kubernetes': one Indexed Job (a pod per node) and a headless Service per stage try.

:func:`run_job` is the backend's interface (stagewise.airflow.backends). :func:`job_objects` builds both from the
job with the kubernetes client's models (pure; tests serialize them). Pod ``i`` is ``<job>-i`` (an Indexed Job's pod
hostname) in the Service's subdomain, so every pod reaches pod 0, the c10d rendezvous host, as ``<job>-0.<service>``.
:func:`run_stage` creates both through the cncf.kubernetes provider's KubernetesHook, polls the Job (streaming the
pods' log lines into the task log), maps a failure onto Airflow's retry rules (a pod that exited with the user-error
code or said so in its termination message: no retry) and always deletes both objects. Retries are Airflow's
(backoffLimit 0): each try is a new Job with its own rendezvous id.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from stagewise.airflow.backends.remote import IMAGE_WORKDIR, Stopped, is_user_error, stop_on_sigterm
from stagewise.airflow.stage_job import RemoteParts, StageJob
from stagewise.core.errors import USER_ERROR_EXIT, UserError

log = logging.getLogger(__name__)

JOB_LABEL = "stagewise.dev/job"
CONTAINER = "node"
# Room for "-<index>" after the Job name: a pod's hostname <job>-<index> must stay a 63-char label.
NAME_LIMIT = 63 - len("-511")
FINISHED_TTL_S = 3600
# Toleration keys as written in a pod spec -> the client model's attribute names.
_TOLERATION_FIELDS = {"key": "key", "operator": "operator", "value": "value", "effect": "effect",
                      "tolerationSeconds": "toleration_seconds", "toleration_seconds": "toleration_seconds"}


def _tolerations(items: list[dict[str, Any]]) -> list[Any]:
    from kubernetes.client import V1Toleration

    result = []
    for index, item in enumerate(items):
        unknown = set(item) - set(_TOLERATION_FIELDS)
        if unknown:
            raise UserError(f"kubernetes.tolerations[{index}]: unknown key(s) {sorted(unknown)}; "
                            f"a toleration has {sorted(set(_TOLERATION_FIELDS) - {'toleration_seconds'})}")
        result.append(V1Toleration(**{_TOLERATION_FIELDS[key]: value for key, value in item.items()}))
    return result


def job_objects(stage_job: StageJob, parts: RemoteParts | None = None) -> tuple[Any, Any]:
    """The headless Service and the Indexed Job of one try of the job's stage: (V1Service, V1Job), from the job's
    remote ``parts`` (made here when not given)."""
    from kubernetes import client as k8s

    parts = parts or stage_job.remote("kubernetes", name_limit=NAME_LIMIT)
    profile, settings, command, name = parts.profile, parts.settings, parts.command, parts.name
    labels = {JOB_LABEL: name, "app.kubernetes.io/part-of": "stagewise"}
    port = settings.rendezvous_port
    service = k8s.V1Service(
        api_version="v1", kind="Service",
        metadata=k8s.V1ObjectMeta(name=name, namespace=settings.namespace, labels=labels),
        spec=k8s.V1ServiceSpec(cluster_ip="None", selector={JOB_LABEL: name}, publish_not_ready_addresses=True,
                               ports=[k8s.V1ServicePort(name="rendezvous", port=port, target_port=port)]))
    from stagewise.training import node_launch  # the names the node side reads, declared there once

    env = {**parts.environment,
           node_launch.K8S_ENDPOINT_ENV: f"{name}-0.{name}:{port}",  # pod 0 under the headless Service
           node_launch.K8S_NNODES_ENV: str(profile.nodes),
           node_launch.K8S_RDZV_ID_ENV: name,  # the name is unique per try, so is the rendezvous
           node_launch.JOIN_TIMEOUT_ENV: str(settings.join_timeout_s)}
    resources: dict[str, str] = {}
    if settings.cpu:
        resources["cpu"] = settings.cpu
    if settings.memory:
        resources["memory"] = settings.memory
    limits = {**resources, **({"nvidia.com/gpu": str(settings.gpus_per_pod)} if settings.gpus_per_pod else {})}
    container = k8s.V1Container(
        name=CONTAINER, image=settings.image, command=command, working_dir=IMAGE_WORKDIR,
        env=[k8s.V1EnvVar(name=key, value=value) for key, value in env.items()],
        ports=[k8s.V1ContainerPort(name="rendezvous", container_port=port)],
        resources=k8s.V1ResourceRequirements(requests=resources or None, limits=limits or None),
        # The end of the log becomes the termination message when the node wrote none: failures explain themselves.
        termination_message_policy="FallbackToLogsOnError")
    pod = k8s.V1PodTemplateSpec(
        metadata=k8s.V1ObjectMeta(labels=labels),
        spec=k8s.V1PodSpec(containers=[container], restart_policy="Never", subdomain=name,
                           service_account_name=settings.service_account or None,
                           node_selector=dict(settings.node_selector) or None,
                           tolerations=_tolerations(settings.tolerations) or None))
    job = k8s.V1Job(
        api_version="batch/v1", kind="Job",
        metadata=k8s.V1ObjectMeta(name=name, namespace=settings.namespace, labels=labels),
        spec=k8s.V1JobSpec(
            completion_mode="Indexed", completions=profile.nodes, parallelism=profile.nodes,
            backoff_limit=0,  # Airflow retries the stage as a new Job; Kubernetes never restarts one pod of a gang
            active_deadline_seconds=int(profile.execution_timeout_s),  # the backstop if the task dies unseen
            ttl_seconds_after_finished=FINISHED_TTL_S,
            pod_failure_policy=k8s.V1PodFailurePolicy(rules=[
                k8s.V1PodFailurePolicyRule(action="FailJob", on_exit_codes=k8s.V1PodFailurePolicyOnExitCodesRequirement(
                    container_name=CONTAINER, operator="In", values=[USER_ERROR_EXIT]))]),
            template=pod))
    return service, job


def pod_failure(core_v1: Any, namespace: str, name: str) -> tuple[bool, str]:
    """(user error?, what the failed pods said): exit codes and termination messages of the Job's pods."""
    pods = core_v1.list_namespaced_pod(namespace=namespace, label_selector=f"{JOB_LABEL}={name}").items
    said, user = [], False
    for pod in pods:
        for status in (pod.status.container_statuses or []) if pod.status else []:
            terminated = status.state.terminated if status.state else None
            if terminated is None or terminated.exit_code == 0:
                continue
            message = (terminated.message or terminated.reason or "").strip()
            user = user or is_user_error(message, terminated.exit_code)
            said.append(f"{pod.metadata.name} exited {terminated.exit_code}: {message[-500:]}")
    return user, "; ".join(said) or "no pod reported an exit"


def _log_time(stamp: str) -> datetime:
    """A pod log line's RFC 3339 timestamp (nanoseconds cut to microseconds)."""
    head, _, fraction = stamp.rstrip("Z").partition(".")
    return datetime.fromisoformat(f"{head}.{(fraction or '0')[:6]:0<6}+00:00")


class PodLogTail:
    """The new lines of every pod of a Job since the last call, each prefixed with its pod.

    Reads with timestamps and ``since_seconds`` from the last line seen, so a long job is not re-read on every
    poll. The task log is for watching, not for the job's fate: a failed read is logged once, then skipped.
    """

    def __init__(self, core_v1: Any, namespace: str, name: str, now: Callable[[], datetime] | None = None) -> None:
        self.core_v1, self.namespace, self.name, self.failed = core_v1, namespace, name, False
        self.now = now or (lambda: datetime.now(UTC))
        self.last: dict[str, tuple[datetime, set[str]]] = {}  # pod -> (last timestamp, lines seen at it)

    def __call__(self) -> list[str]:
        try:
            return self._read()
        except Stopped:
            raise  # SIGTERM arrived mid-read: the task must unwind and delete the job, not read on
        except Exception as exc:  # noqa: BLE001 - see the class docstring
            if not self.failed:
                log.warning("cannot read the pod logs of Kubernetes job %s/%s (%s); status only", self.namespace,
                            self.name, exc)
            self.failed = True
            return []

    def _read(self) -> list[str]:
        pods = self.core_v1.list_namespaced_pod(namespace=self.namespace, label_selector=f"{JOB_LABEL}={self.name}").items
        lines = []
        for pod in sorted(pods, key=lambda item: item.metadata.name):
            if not pod.status or pod.status.phase not in ("Running", "Succeeded", "Failed"):
                continue  # no container log yet
            pod_name = pod.metadata.name
            request: dict[str, Any] = {"name": pod_name, "namespace": self.namespace, "container": CONTAINER, "timestamps": True}
            last, seen = self.last.get(pod_name, (None, set()))
            if last is not None:
                request["since_seconds"] = max(1, int((self.now() - last).total_seconds()) + 1)
            # The raw response, decoded here: the client's own str() of a text body varies between versions.
            response = self.core_v1.read_namespaced_pod_log(**request, _preload_content=False)
            for raw in response.data.decode("utf-8", errors="replace").splitlines():
                stamp, _, message = raw.partition(" ")
                try:
                    when = _log_time(stamp)
                except ValueError:
                    continue
                if last is not None and (when < last or (when == last and raw in seen)):
                    continue  # read again because since_seconds overlaps the previous read
                if last is None or when > last:
                    last, seen = when, set()
                seen.add(raw)
                lines.append(f"[{pod_name}] {message}")
            if last is not None:
                self.last[pod_name] = (last, seen)
        return lines


def wait(read_job: Callable[[], Any], name: str, *, poll_s: float, log_line: Callable[[str], None],
         sleep: Callable[[float], None] = time.sleep, node_lines: Callable[[], list[str]] = list) -> tuple[bool, str]:
    """Poll the Job until it completes or fails; log each change of its pod counts and the pods' new log lines
    (``node_lines``). Returns (succeeded, reason)."""
    seen = None
    while True:
        job = read_job()
        for line in node_lines():
            log_line(line)
        status = job.status
        counts = (status.active or 0, status.succeeded or 0, status.failed or 0) if status else (0, 0, 0)
        if counts != seen:
            log_line(f"Kubernetes job {name}: {counts[0]} active, {counts[1]} succeeded, {counts[2]} failed")
            seen = counts
        for condition in (status.conditions or []) if status else []:
            if condition.type in ("Complete", "Failed") and str(condition.status) == "True":
                return condition.type == "Complete", f"{condition.reason or ''} {condition.message or ''}".strip()
        sleep(poll_s)


def delete(hook: Any, namespace: str, name: str) -> None:
    """Delete the Job (its pods with it) and the Service; a missing one is fine, other errors are logged."""
    from kubernetes.client import V1DeleteOptions
    from kubernetes.client.exceptions import ApiException

    for kind, call in (("job", lambda: hook.batch_v1_client.delete_namespaced_job(
                            name=name, namespace=namespace, body=V1DeleteOptions(propagation_policy="Background"))),
                       ("service", lambda: hook.core_v1_client.delete_namespaced_service(name=name, namespace=namespace))):
        try:
            call()
            log.info("deleted %s %s/%s", kind, namespace, name)
        except ApiException as exc:
            if exc.status != 404:
                log.error("could not delete %s %s/%s: %s %s", kind, namespace, name, exc.status, exc.reason)


def run_job(job: StageJob) -> None:
    """The backend's interface: build the try's Service and Job and run them to the job's success."""
    parts = job.remote("kubernetes", name_limit=NAME_LIMIT)
    service, indexed = job_objects(job, parts)
    run_stage(parts.settings, service=service, job=indexed)


def run_stage(settings: Any, *, service: Any, job: Any, poll_s: float = 10.0, hook: Any = None) -> None:
    """Create the Service and the Job with the profile's ``settings``, wait for the Job and delete both whatever
    happens; returns once the Job succeeded (its result is in the run's storage)."""
    if hook is None:
        from airflow.providers.cncf.kubernetes.hooks.kubernetes import KubernetesHook

        hook = KubernetesHook(conn_id=settings.kubernetes_conn_id)
    namespace, name = job.metadata.namespace, job.metadata.name
    log.info("creating Service and Indexed Job %s/%s: %d pod(s) of %s", namespace, name, job.spec.completions,
             job.spec.template.spec.containers[0].image)
    try:
        with stop_on_sigterm(f"Kubernetes job {namespace}/{name}"):
            _create_and_wait(hook, service, job, poll_s)
    finally:  # success, failure, kill (SIGTERM) or timeout: nothing of this try stays in the cluster
        delete(hook, namespace, name)


def _create_and_wait(hook: Any, service: Any, job: Any, poll_s: float) -> None:
    """Create both objects, wait for the Job; a failure raises (AirflowFailException: the user's; else retryable)."""
    from airflow.sdk.exceptions import AirflowFailException
    from kubernetes.client.exceptions import ApiException

    namespace, name = job.metadata.namespace, job.metadata.name
    try:
        hook.core_v1_client.create_namespaced_service(namespace=namespace, body=service)
        hook.create_job(job)
    except ApiException as exc:
        if exc.status in (400, 403, 422):  # the cluster refuses the objects or our rights: retrying changes nothing
            raise AirflowFailException(f"Kubernetes refused {namespace}/{name}: {exc.status} {exc.reason}: "
                                       f"{(exc.body or '')[:500]}") from None
        raise
    succeeded, reason = wait(lambda: hook.get_job_status(job_name=name, namespace=namespace), name,
                             poll_s=poll_s, log_line=log.info, node_lines=PodLogTail(hook.core_v1_client, namespace, name))
    if not succeeded:
        user, said = pod_failure(hook.core_v1_client, namespace, name)
        message = f"Kubernetes job {namespace}/{name} failed ({reason}): {said}"
        if user:
            raise AirflowFailException(message + " (not retried: fix the config or data)")
        raise RuntimeError(message + "; retrying if retries are left")
