"""Backend 'kubernetes': the headless Service and Indexed Job are valid kubernetes objects that wire torchrun's
rendezvous to pod 0, and a stage runs through the real KubernetesHook against a fake API server on 127.0.0.1,
which always ends with both objects deleted."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time

import pytest

# Imported here, not in a test: Airflow configures its logging on first import, onto whatever stdout is then;
# inside a test that is pytest's per-test capture, closed when the test ends.
from airflow.sdk.exceptions import AirflowFailException

from stagewise.airflow.backends import kubernetes, sagemaker, stage_result
from stagewise.airflow.backends.remote import Stopped
from stagewise.airflow.stage_job import node_command, stage_job
from stagewise.core.errors import USER_ERROR_EXIT
from tests.plugins.backend_configs import backend_config, job_args
from tests.plugins.fake_kube_api import FakeKubeAPI

DNS_1123_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")  # a Service name must start with a letter too


def _serialized(obj):
    from kubernetes.client import ApiClient

    return ApiClient().sanitize_for_serialization(obj)


def test_the_job_and_service_wire_every_pod_to_pod_0_as_the_rendezvous_host(tmp_path):
    path, config = backend_config(tmp_path, "kubernetes")
    args = job_args(path, config, init_from="s3://b/final.pt")
    storage_env = {"AWS_SECRET_ACCESS_KEY": "secret!", "AWS_DEFAULT_REGION": "eu-west-1"}
    service, job = (_serialized(obj) for obj in kubernetes.job_objects(stage_job(config, **args, storage_env=storage_env)))
    name = job["metadata"]["name"]
    assert DNS_1123_LABEL.match(name) and len(f"{name}-511") <= 63  # the last pod's hostname is a label too
    assert service["metadata"]["name"] == name and service["metadata"]["namespace"] == job["metadata"]["namespace"] == "ml"
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["ports"] == [{"name": "rendezvous", "port": 29400, "targetPort": 29400}]
    spec, pod = job["spec"], job["spec"]["template"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()  # the Service finds the pods
    assert (spec["completionMode"], spec["completions"], spec["parallelism"], spec["backoffLimit"]) == ("Indexed", 2, 2, 0)
    assert spec["podFailurePolicy"]["rules"][0] == {"action": "FailJob", "onExitCodes": {
        "containerName": "node", "operator": "In", "values": [USER_ERROR_EXIT]}}
    assert pod["spec"]["subdomain"] == name and pod["spec"]["restartPolicy"] == "Never"
    assert pod["spec"]["serviceAccountName"] == "stagewise-trainer"
    assert pod["spec"]["nodeSelector"] == {"node.kubernetes.io/instance-type": "p4d.24xlarge"}
    assert pod["spec"]["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    container = pod["spec"]["containers"][0]
    assert container["resources"] == {"requests": {"cpu": "8", "memory": "32Gi"},
                                      "limits": {"cpu": "8", "memory": "32Gi", "nvidia.com/gpu": "8"}}
    assert container["command"] == node_command(
        "kubernetes", processes_per_node=2, stage="s2", out=args["out"], params=args["params"], init_from="s3://b/final.pt",
        config_file=args["config_file"])
    env = {item["name"]: item["value"] for item in container["env"]}
    assert env["AWS_DEFAULT_REGION"] == "eu-west-1"
    assert "JOB_COMPLETION_INDEX" not in env  # Kubernetes sets it per pod
    # What the pod's entrypoint makes of it, with the index Kubernetes adds: pod 1 of 2, rendezvous on pod 0.
    from stagewise.training.node_launch import kubernetes_node

    node = kubernetes_node({**env, "JOB_COMPLETION_INDEX": "1"})
    assert (node.node_rank, node.num_nodes, node.master_addr, node.master_port) == (1, 2, f"{name}-0.{name}", 29400)
    assert node.run_id == name and node.join_timeout_s == 900
    assert "secret!" not in json.dumps([service, job])


def test_the_objects_round_trip_through_the_kubernetes_models(tmp_path):
    """What we send deserializes back into the client's V1Job/V1Service (the API server's schema, as the client has it)."""
    from kubernetes.client import ApiClient

    path, config = backend_config(tmp_path, "kubernetes")
    service, job = kubernetes.job_objects(stage_job(config, **job_args(path, config)))

    class Response:
        def __init__(self, obj):
            self.data = json.dumps(_serialized(obj))

    client = ApiClient()
    assert client.deserialize(Response(job), "V1Job") == job
    assert client.deserialize(Response(service), "V1Service") == service


def test_each_try_and_each_run_has_its_own_job_and_rendezvous(tmp_path):
    path, config = backend_config(tmp_path, "kubernetes")
    names = {kubernetes.job_objects(stage_job(config, **job_args(path, config, attempt=n)))[1].metadata.name for n in (1, 2)}
    names.add(kubernetes.job_objects(stage_job(config, **job_args(path, config, run_id="scheduled__x")))[1].metadata.name)
    assert len(names) == 3 and all(DNS_1123_LABEL.match(name) for name in names)


def test_a_bad_toleration_is_refused_naming_it(tmp_path):
    from stagewise.core.errors import UserError

    path, config = backend_config(tmp_path, "kubernetes", tolerations=[{"key": "a", "efect": "NoSchedule"}])
    with pytest.raises(UserError, match=r"tolerations\[0\]: unknown key\(s\) \['efect'\]"):
        kubernetes.job_objects(stage_job(config, **job_args(path, config)))


def _running(active=2):
    return {"active": active}


def _ended(kind, reason=""):
    return {"failed" if kind == "Failed" else "succeeded": 2,
            "conditions": [{"type": kind, "status": "True", "reason": reason, "message": ""}]}


def _pod(name, exit_code, message):
    return {"metadata": {"name": name}, "status": {"containerStatuses": [{
        "name": "node", "image": "i", "imageID": "", "ready": False, "restartCount": 0,
        "state": {"terminated": {"exitCode": exit_code, "message": message, "reason": "Error"}}}]}}


@pytest.fixture
def stage_on(tmp_path, monkeypatch):
    """Run stage s2 through the real KubernetesHook (its connection points at the fake API) with a local storage root."""
    from stagewise.core import storage

    def run(api: FakeKubeAPI, write_metrics: bool = True):
        connection = {"conn_type": "kubernetes", "extra": {"kube_config": json.dumps(api.kubeconfig())}}
        monkeypatch.setenv("AIRFLOW_CONN_KUBERNETES_STAGEWISE_TEST", json.dumps(connection))
        path, config = backend_config(tmp_path, "kubernetes", storage_root=str(tmp_path / "storage"))
        args = job_args(path, config)
        if write_metrics:
            storage.write_json(storage.join(args["out"], "train", "s2", "metrics.json"),
                               {"stage": "s2", "world_size": 4, "global_batch": 256, "lr": 0.4, "complete": True,
                                "checkpoint_uri": storage.join(args["out"], "train", "s2", "final.pt"), "history": []})
        service, job = kubernetes.job_objects(stage_job(config, **args))

        def run_to_result():  # what backends.run_job does after the backend's run: read the result back
            kubernetes.run_stage(config.profile("ddp2").kubernetes, service=service, job=job, poll_s=0.05)
            return stage_result(args["out"], "s2")

        return job.metadata.name, args["out"], run_to_result

    return run


def test_a_completed_job_returns_the_stages_result_and_leaves_nothing_behind(stage_on, caplog, capsys):
    caplog.set_level("INFO", logger=kubernetes.__name__)
    with FakeKubeAPI([_running(0), _running(2), _running(2), _ended("Complete")]) as api:
        name, out, run = stage_on(api)
        result = run()
    assert result["world_size"] == 4 and result["model_uri"] == f"{out}/train/s2/model.pt"
    assert api.calls("POST") == ["/api/v1/namespaces/ml/services", "/apis/batch/v1/namespaces/ml/jobs"]
    assert sorted(api.calls("DELETE")) == [f"/api/v1/namespaces/ml/services/{name}", f"/apis/batch/v1/namespaces/ml/jobs/{name}"]
    job_delete = next(body for verb, path, body in api.requests if verb == "DELETE" and "/jobs/" in path)
    assert job_delete["propagationPolicy"] == "Background"  # the pods go with the Job
    assert api.objects == {}
    logged = caplog.text + capsys.readouterr().out  # once Airflow's logging is configured, structlog prints it
    assert f"Kubernetes job {name}: 2 active, 0 succeeded, 0 failed" in logged
    assert logged.count("2 active, 0 succeeded") == 1  # logged on change, not on every poll


def test_a_pod_that_exited_with_the_user_error_code_fails_without_retry(stage_on):
    pods = [_pod("j-0", USER_ERROR_EXIT, "stage s2: per-process batch 64 exceeds the ~40 train rows"), _pod("j-1", 143, "")]
    with FakeKubeAPI([_running(), _ended("Failed", "PodFailurePolicy")], pods=pods) as api:
        name, _, run = stage_on(api)
        with pytest.raises(AirflowFailException, match="per-process batch 64 exceeds.*not retried"):
            run()
    assert api.objects == {}
    labels = next(query for verb, path, query in api.requests if path.endswith("/pods"))["labelSelector"]
    assert labels == [f"{kubernetes.JOB_LABEL}={name}"]


def test_a_job_failed_by_infrastructure_is_retried(stage_on):
    pods = [_pod("j-0", 137, "OOMKilled"), _pod("j-1", 1, "torch.distributed: connection to rendezvous lost")]
    with FakeKubeAPI([_ended("Failed", "BackoffLimitExceeded")], pods=pods) as api:
        _, _, run = stage_on(api)
        with pytest.raises(RuntimeError, match="BackoffLimitExceeded.*j-0 exited 137: OOMKilled.*retrying") as caught:
            run()
    assert not isinstance(caught.value, AirflowFailException)
    assert api.objects == {}


def test_a_refused_job_fails_without_retry_and_its_service_is_deleted(stage_on):
    with FakeKubeAPI([_running()], refuse_job=(422, "spec.template.spec.containers[0].image: Required value")) as api:
        name, _, run = stage_on(api)
        with pytest.raises(AirflowFailException, match="Kubernetes refused ml/.*422"):
            run()
    assert api.calls("DELETE") == [f"/apis/batch/v1/namespaces/ml/jobs/{name}", f"/api/v1/namespaces/ml/services/{name}"]
    assert api.objects == {}


@pytest.mark.timeout(60)
def test_a_task_killed_while_the_job_runs_deletes_the_job_and_service(stage_on, airflow_on_term):
    """SIGTERM (Airflow's kill or mark-failed) while the Job runs: the task stops waiting, and deletes both objects."""

    before = signal.getsignal(signal.SIGTERM)
    with FakeKubeAPI([_running()]) as api:
        _, _, run = stage_on(api)

        def kill_once_waiting() -> None:  # SIGTERM after the task has polled the Job's status twice: mid-wait
            while len([path for path in api.calls("GET") if path.endswith("/status")]) < 2:
                time.sleep(0.02)
            os.kill(os.getpid(), signal.SIGTERM)

        threading.Thread(target=kill_once_waiting, daemon=True).start()
        with pytest.raises(Stopped, match="was stopped: the task got SIGTERM"):
            run()
    assert api.objects == {} and len(api.calls("DELETE")) == 2
    assert len([path for path in api.calls("GET") if path.endswith("/status")]) > 1  # it was waiting
    assert signal.getsignal(signal.SIGTERM) == before  # the task's own handler is back
    assert airflow_on_term == [signal.SIGTERM]  # and it still ran (Airflow calls on_kill there)


def _live_pod(name, phase="Running"):
    return {"metadata": {"name": name}, "status": {"phase": phase}}


def test_the_pods_log_lines_reach_the_task_log_once_each(stage_on, caplog, capsys):
    """Each pod's new lines, prefixed with the pod, appear in the task log as the Job runs, none twice although
    successive reads overlap (since_seconds from the last line seen)."""
    caplog.set_level("INFO", logger=kubernetes.__name__)
    first = ["2026-11-23T10:00:00.100000000Z train: stage s2 epoch 1/2: loss 0.5"]
    second = [*first, "2026-11-23T10:00:05.2Z train: stage s2 epoch 2/2: loss 0.3"]
    with FakeKubeAPI([_running(), _running(), _running(), _ended("Complete")],
                     pods=[_live_pod("job-0"), _live_pod("job-1", "Pending")], logs={"job-0": [first, second]}) as api:
        name, out, run = stage_on(api)
        run()
    logged = caplog.text + capsys.readouterr().out
    assert logged.count("[job-0] train: stage s2 epoch 1/2: loss 0.5") == 1
    assert logged.count("[job-0] train: stage s2 epoch 2/2: loss 0.3") == 1
    reads = [query for verb, path, query in api.requests if verb == "GET" and path.endswith("/job-0/log")]
    assert reads and "sinceSeconds" not in reads[0] and all("sinceSeconds" in query for query in reads[1:])
    assert not [path for verb, path, _ in api.requests if path.endswith("/job-1/log")], "a pending pod has no log yet"


def test_a_pod_log_that_cannot_be_read_is_one_warning_and_the_job_goes_on(caplog):
    """Logs are for watching: a failing read warns once and yields nothing, it never fails the stage."""

    class Broken:
        def list_namespaced_pod(self, **_):
            raise OSError("connection reset")

    tail = kubernetes.PodLogTail(Broken(), "ml", "job")
    assert tail() == [] and tail() == []
    assert caplog.text.count("cannot read the pod logs") == 1


@pytest.mark.parametrize("tail_of", [
    lambda broken: kubernetes.PodLogTail(broken, "ml", "job"),
    lambda broken: sagemaker.CloudWatchTail(lambda: broken, "job"),
], ids=["kubernetes", "sagemaker"])
def test_sigterm_during_a_log_read_stops_the_wait_instead_of_being_swallowed(tail_of):
    """A stop that lands while the logs are read unwinds the task (which then deletes its job); only read errors
    are the logs' own to swallow (it once hung the task until its timeout)."""

    class Interrupted:
        def list_namespaced_pod(self, **_):
            raise Stopped("job was stopped: the task got SIGTERM")

        def describe_log_streams(self, **_):
            raise Stopped("job was stopped: the task got SIGTERM")

    with pytest.raises(Stopped):
        tail_of(Interrupted())()
