"""Backend 'sagemaker': the CreateTrainingJob request is valid for SageMaker's own API model, and a stage's job is
submitted, watched and read back through the Amazon provider's hook against moto's SageMaker server."""

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
from airflow.providers.amazon.aws.hooks.sagemaker import SageMakerHook  # noqa: F401
from airflow.sdk.exceptions import AirflowFailException

from stagewise.airflow.backends import sagemaker
from stagewise.airflow.backends.remote import USER_ERROR_MARKER
from stagewise.airflow.stage_job import job_name, node_command, stage_job
from stagewise.core.errors import UserError
from tests.plugins.backend_configs import RUN, backend_config, job_args

SECRET = "do-not-put-me-in-a-job"


def _validate(request: dict) -> None:
    """botocore's own check of the request against the sagemaker CreateTrainingJob input shape."""
    import botocore.session
    from botocore.validate import validate_parameters

    model = botocore.session.get_session().get_service_model("sagemaker").operation_model("CreateTrainingJob")
    validate_parameters(request, model.input_shape)  # raises ParamValidationError listing every problem
    # botocore leaves lengths above max and patterns to the service: check the ones we fill from user input.
    name_shape = model.input_shape.members["TrainingJobName"]
    assert len(request["TrainingJobName"]) <= name_shape.metadata["max"]
    assert re.fullmatch(name_shape.metadata["pattern"], request["TrainingJobName"])
    for tag in request["Tags"]:
        assert re.fullmatch(r"[\w\s.:/=+\-@]*", tag["Value"]) and len(tag["Value"]) <= 256


def test_the_request_is_valid_for_sagemakers_api_and_runs_node_launch_on_every_node(tmp_path):
    path, config = backend_config(tmp_path, "sagemaker")
    storage_env = {"AWS_ACCESS_KEY_ID": "AKIADONOTLEAK", "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_DEFAULT_REGION": "us-east-1",
                   "AWS_ENDPOINT_URL_S3": "https://s3.example"}
    request = sagemaker.training_job_request(stage_job(config, **job_args(path, config, init_from="s3://b/final.pt"),
                                             storage_env=storage_env))
    _validate(request)
    out = job_args(path, config)["out"]
    spec = request["AlgorithmSpecification"]
    assert spec["TrainingImage"] == config.profile("ddp2").sagemaker.image_uri
    # The same command line the kubernetes backend runs, with the config as the image sees it.
    assert spec["ContainerEntrypoint"] + spec["ContainerArguments"] == node_command(
        "sagemaker", processes_per_node=2, stage="s2", out=out, params={"lr": 0.05, "hidden": 64},
        init_from="s3://b/final.pt", config_file=f"{out}/config.yaml")  # the run's snapshot, read from S3 by every node
    assert spec["ContainerArguments"][:4] == ["-m", "stagewise.training.node_launch", "sagemaker", "--nproc-per-node"]
    # What the container's entrypoint makes of them on the second of two hosts: torchrun joins host 1's store.
    from stagewise.training.node_launch import sagemaker_node, torchrun_argv

    hosts = {"SM_HOSTS": '["algo-1", "algo-2"]', "SM_CURRENT_HOST": "algo-2", "STAGEWISE_SM_RESOURCE_CONFIG": "/nonexistent"}
    node, torchrun = torchrun_argv("sagemaker", spec["ContainerArguments"][3:], hosts)
    assert node == sagemaker_node(hosts) and (node.node_rank, node.num_nodes, node.master_addr) == (1, 2, "algo-1")
    assert torchrun[torchrun.index("--nproc-per-node") + 1] == "2" and "stagewise.train" in torchrun
    assert request["ResourceConfig"] == {"InstanceType": "ml.g5.12xlarge", "InstanceCount": 2, "VolumeSizeInGB": 100}
    assert request["RoleArn"] == "arn:aws:iam::123456789012:role/stagewise-training"
    assert request["CheckpointConfig"]["S3Uri"] == f"{out}/train/s2/checkpoints/"
    assert request["OutputDataConfig"]["S3OutputPath"].startswith(f"{out}/train/s2/")
    channel = request["InputDataConfig"][0]["DataSource"]["S3DataSource"]
    assert channel["S3Uri"] == f"{out}/preprocess/" and channel["S3DataDistributionType"] == "FullyReplicated"
    assert request["Environment"] == {"STAGEWISE_CONFIG": f"{out}/config.yaml", "AWS_DEFAULT_REGION": "us-east-1",
                                      "AWS_ENDPOINT_URL_S3": "https://s3.example"}
    assert SECRET not in json.dumps(request) and "AKIADONOTLEAK" not in json.dumps(request)  # keys stay out of the job
    assert {tag["Key"]: tag["Value"] for tag in request["Tags"]}["stagewise:stage"] == "s2"


def test_spot_on_early_tries_on_demand_on_the_last_and_each_try_has_its_own_job(tmp_path):
    path, config = backend_config(tmp_path, "sagemaker", retries=2)
    tries = [sagemaker.training_job_request(stage_job(config, **job_args(path, config, attempt=n))) for n in (1, 2, 3)]
    for request in tries:
        _validate(request)
    assert [r["EnableManagedSpotTraining"] for r in tries] == [True, True, False]
    assert tries[0]["StoppingCondition"] == {"MaxRuntimeInSeconds": 3600, "MaxWaitTimeInSeconds": 7200}
    assert tries[2]["StoppingCondition"] == {"MaxRuntimeInSeconds": 3600}
    assert len({r["TrainingJobName"] for r in tries}) == 3
    other_run = sagemaker.training_job_request(stage_job(config, **job_args(path, config, run_id="manual__other")))
    assert other_run["TrainingJobName"] != tries[0]["TrainingJobName"]
    _, keep_spot = backend_config(tmp_path, "sagemaker", retries=0, spot_fallback_on_last_retry=False)
    assert sagemaker.training_job_request(stage_job(keep_spot, **job_args(path, keep_spot)))["EnableManagedSpotTraining"] is True


def test_a_long_stage_name_still_gives_a_valid_job_name(tmp_path):
    path, config = backend_config(tmp_path, "sagemaker")
    name = job_name("d" * 200, "r" * 200, "A_very.long stage name " * 5, attempt=12)
    assert len(name) <= 63 and re.fullmatch(r"[a-z0-9](-*[a-z0-9]){0,62}", name) and name.endswith("-t12")


def test_oversized_params_are_refused_naming_the_problem(tmp_path):
    path, config = backend_config(tmp_path, "sagemaker")
    with pytest.raises(UserError, match="at most 100 container arguments of 256 characters"):
        sagemaker.training_job_request(stage_job(config, **job_args(path, config, params={"note": "x" * 300})))


@pytest.mark.parametrize(("description", "retried"), [
    ({"FailureReason": "ClientError: Please ensure the IAM role has access to the image"}, False),
    ({"FailureReason": f"AlgorithmError: {USER_ERROR_MARKER}: stage s2: unknown column 'px_99', exit code: 3"}, False),
    ({"FailureReason": "AlgorithmError: stage s2: global_batch 100 does not divide, exit code: 3"}, False),
    ({"FailureReason": "AlgorithmError: ExecuteUserScriptError: NCCL timeout, exit code: 1"}, True),
    ({"FailureReason": "AlgorithmError: killed, exit code: 137"}, True),
    ({"FailureReason": "CapacityError: Unable to provision requested ML compute capacity"}, True),
    ({"FailureReason": "InternalServerError: We encountered an internal error"}, True),
    ({"TrainingJobStatus": "Stopped", "SecondaryStatus": "MaxWaitTimeExceeded"}, True),  # spot never came back
])
def test_user_faults_fail_without_retry_and_infrastructure_faults_retry(description, retried):
    error = sagemaker.failure({"TrainingJobName": "job", "TrainingJobStatus": "Failed", **description})
    assert isinstance(error, AirflowFailException) != retried
    assert "job" in str(error) and (description.get("FailureReason") or "MaxWaitTimeExceeded") in str(error)


def test_waiting_logs_each_status_change_and_message_once_until_the_job_ends():
    states = [("InProgress", "Starting", []), ("InProgress", "Starting", []),
              ("InProgress", "Downloading", [{"Status": "Starting", "StatusMessage": "Preparing the instances"}]),
              ("InProgress", "Training", [{"Status": "Starting", "StatusMessage": "Preparing the instances"},
                                          {"Status": "Training", "StatusMessage": "Training image download completed"}]),
              ("Completed", "Completed", [])]
    calls, lines, sleeps = iter(states), [], []

    def describe(name):
        status, secondary, transitions = next(calls)
        return {"TrainingJobName": name, "TrainingJobStatus": status, "SecondaryStatus": secondary,
                "SecondaryStatusTransitions": transitions}

    final = sagemaker.wait(describe, "job", poll_s=7, log_line=lines.append, sleep=sleeps.append)
    assert final["TrainingJobStatus"] == "Completed" and sleeps == [7, 7, 7, 7]
    assert lines == ["SageMaker job job: InProgress / Starting", "SageMaker job job: InProgress / Downloading",
                     "SageMaker job job: Starting: Preparing the instances", "SageMaker job job: InProgress / Training",
                     "SageMaker job job: Training: Training image download completed",
                     "SageMaker job job: Completed / Completed"]


class _RunningJobHook:
    """A SageMakerHook stand-in holding this try's job, still running."""

    def __init__(self):
        self.stopped, self.described = [], 0

    def describe_training_job(self, name):
        self.described += 1
        return {"TrainingJobName": name, "TrainingJobStatus": "InProgress"}

    def create_training_job(self, *args, **kwargs):
        raise AssertionError("the job exists already: attach, never submit twice")

    def get_conn(self):
        return self

    def stop_training_job(self, TrainingJobName):  # noqa: N803 - boto3's argument name
        self.stopped.append(TrainingJobName)


def test_node_log_lines_are_logged_once_each_and_a_logs_outage_never_fails_the_job():
    class Logs:
        def __init__(self):
            self.events = {"job/algo-1-1": ["a", "b"]}
            self.down = False

        def describe_log_streams(self, logGroupName, logStreamNamePrefix):  # noqa: N803 - boto3's names
            if self.down:
                raise ConnectionError("logs endpoint unreachable")
            return {"logStreams": [{"logStreamName": name} for name in self.events if name.startswith(logStreamNamePrefix)]}

        def get_log_events(self, logGroupName, logStreamName, startFromHead, nextToken="0"):  # noqa: N803
            start = int(nextToken)
            events = self.events[logStreamName][start:]
            return {"events": [{"message": m + "\n"} for m in events], "nextForwardToken": str(start + len(events))}

    logs = Logs()
    tail = sagemaker.CloudWatchTail(lambda: logs, "job")
    assert tail() == ["[algo-1-1] a", "[algo-1-1] b"]
    logs.events["job/algo-1-1"].append("c")
    logs.events["job/algo-2-1"] = ["other node"]
    assert tail() == ["[algo-1-1] c", "[algo-2-1] other node"]
    logs.down = True
    assert tail() == [] and tail() == []  # the job's status polling goes on


@pytest.mark.timeout(60)
def test_a_task_killed_while_waiting_stops_its_job(tmp_path, airflow_on_term):
    """SIGTERM (Airflow's kill or mark-failed) mid-wait: the task stops its job rather than leave it billing."""
    from stagewise.airflow.backends.remote import Stopped

    path, config = backend_config(tmp_path, "sagemaker")
    request = sagemaker.training_job_request(stage_job(config, **job_args(path, config)))
    hook, before = _RunningJobHook(), signal.getsignal(signal.SIGTERM)

    def kill_once_waiting() -> None:  # SIGTERM after the attach and two status polls: mid-wait
        while hook.described < 3:
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=kill_once_waiting, daemon=True).start()
    with pytest.raises(Stopped, match="SageMaker job .* was stopped: the task got SIGTERM"):
        sagemaker.run_stage(config.profile("ddp2").sagemaker, request=request, hook=hook, poll_s=0.05)
    assert hook.stopped == [request["TrainingJobName"]]
    assert signal.getsignal(signal.SIGTERM) == before  # the task's own handler is back
    assert airflow_on_term == [signal.SIGTERM]  # and it still ran (Airflow calls on_kill there)


@pytest.fixture
def moto_aws(s3_endpoint, monkeypatch):
    """The Airflow connection the profile names, pointing at moto's server (S3 and SageMaker), and its env exported."""
    for key, value in s3_endpoint.items():
        monkeypatch.setenv(key, value)
    connection = {"conn_type": "aws", "login": s3_endpoint["AWS_ACCESS_KEY_ID"],
                  "password": s3_endpoint["AWS_SECRET_ACCESS_KEY"],
                  "extra": {"endpoint_url": s3_endpoint["AWS_ENDPOINT_URL"], "region_name": "us-east-1"}}
    monkeypatch.setenv("AIRFLOW_CONN_AWS_STAGEWISE_TEST", json.dumps(connection))
    return s3_endpoint


@pytest.mark.service
def test_a_stage_runs_as_a_training_job_on_motos_sagemaker_and_returns_the_stages_result(tmp_path, moto_aws, caplog, capsys):
    """Submitted through SageMakerHook; moto holds the request as sent; the result is the metrics.json the job wrote."""
    import boto3
    import s3fs

    from stagewise.airflow.backends import stage_result

    path, config = backend_config(tmp_path, "sagemaker")
    args = job_args(path, config)
    out = args["out"]
    fs = s3fs.S3FileSystem()
    if not fs.exists("stagewise-test"):
        fs.mkdir("stagewise-test")
    fs.pipe(f"{out}/preprocess/manifest.json".removeprefix("s3://"), b"{}")
    # What stagewise.train's rank 0 writes last on success (the job itself is emulated: moto runs no container).
    metrics = {"stage": "s2", "world_size": 4, "global_batch": 256, "lr": 0.4, "checkpoint_uri": f"{out}/train/s2/final.pt",
               "history": [{"epoch": 0}], "complete": True, "params": {"lr": 0.05}}
    fs.pipe(f"{out}/train/s2/metrics.json".removeprefix("s3://"), json.dumps(metrics).encode())

    request = sagemaker.training_job_request(stage_job(config, **args))
    # What SageMaker's nodes write to CloudWatch (emulated: moto runs no container), one stream per node.
    logs = boto3.client("logs", region_name="us-east-1")
    logs.create_log_group(logGroupName=sagemaker.LOG_GROUP)
    for node, message in (("algo-1-1700000000", "stage s2 epoch 1/8: loss 0.4120"), ("algo-2-1700000000", "rank 4 joined")):
        stream = f"{request['TrainingJobName']}/{node}"
        logs.create_log_stream(logGroupName=sagemaker.LOG_GROUP, logStreamName=stream)
        logs.put_log_events(logGroupName=sagemaker.LOG_GROUP, logStreamName=stream,
                            logEvents=[{"timestamp": int(time.time() * 1000), "message": message}])
    caplog.set_level("INFO", logger=sagemaker.__name__)
    settings = config.profile("ddp2").sagemaker
    assert sagemaker.run_stage(settings, request=request, poll_s=0) is None  # completed: the result is in storage
    result = stage_result(out, "s2")
    assert result == {**{k: v for k, v in metrics.items() if k not in ("history", "complete")},
                      "model_uri": f"{out}/train/s2/model.pt"}

    received = boto3.client("sagemaker", region_name="us-east-1").describe_training_job(
        TrainingJobName=request["TrainingJobName"])
    assert received["TrainingJobStatus"] == "Completed"
    for key in ("ResourceConfig", "StoppingCondition", "CheckpointConfig", "OutputDataConfig", "RoleArn"):
        assert received[key] == request[key], key
    assert received["InputDataConfig"] == request["InputDataConfig"]
    assert received["EnableManagedSpotTraining"] is True
    sent = {k: v for k, v in received["AlgorithmSpecification"].items() if k != "MetricDefinitions"}  # moto adds one
    assert sent == request["AlgorithmSpecification"]
    logged = caplog.text + capsys.readouterr().out  # once Airflow's logging is configured, structlog prints it
    assert f"submitting SageMaker job {request['TrainingJobName']}: 2 x ml.g5.12xlarge" in logged
    assert "Starting: Preparing the instances for training" in logged and "Completed / Completed" in logged
    assert "[algo-1-1700000000] stage s2 epoch 1/8: loss 0.4120" in logged and "[algo-2-1700000000] rank 4 joined" in logged

    # The same try again (a worker restart mid-wait): attaches to the job moto holds, submits nothing new.
    caplog.clear()
    sagemaker.run_stage(settings, request=request, poll_s=0)
    assert "exists (this try submitted it before): attaching" in caplog.text + capsys.readouterr().out


@pytest.mark.service
def test_a_job_that_succeeded_without_committing_its_metrics_is_retried(tmp_path, moto_aws, monkeypatch):
    import s3fs

    from stagewise.airflow.backends import run_job

    path, config = backend_config(tmp_path, "sagemaker", storage_root="s3://stagewise-test/nometrics")
    args = job_args(path, config)
    fs = s3fs.S3FileSystem()
    if not fs.exists("stagewise-test"):
        fs.mkdir("stagewise-test")
    fs.pipe(f"{args['out']}/preprocess/manifest.json".removeprefix("s3://"), b"{}")
    job = stage_job(config, **args)
    monkeypatch.setattr(sagemaker, "POLL_S", 0)
    with pytest.raises(RuntimeError, match="wrote no .*metrics.json; retrying"):
        run_job(job)  # the backend's run succeeded; reading its result back fails


@pytest.mark.service
def test_train_stage_submits_a_sagemaker_profiles_stage_as_a_job_and_the_config_refuses_an_entrypoint_there(tmp_path, moto_aws,
                                                                                                monkeypatch):
    """steps.train_stage dispatches on the profile's backend: the stage's result comes back from the job, never a local run."""
    import types

    import s3fs

    from stagewise.airflow import launch, steps

    path, config = backend_config(tmp_path, "sagemaker", storage_root="s3://stagewise-test/dispatch")
    args = job_args(path, config, attempt=3)
    fs = s3fs.S3FileSystem()
    if not fs.exists("stagewise-test"):
        fs.mkdir("stagewise-test")
    fs.pipe(f"{args['out']}/preprocess/manifest.json".removeprefix("s3://"), b"{}")
    fs.pipe(f"{args['out']}/train/s2/metrics.json".removeprefix("s3://"),
            json.dumps({"stage": "s2", "world_size": 4, "complete": True}).encode())
    monkeypatch.setattr(steps, "_context", lambda: {"ti": types.SimpleNamespace(try_number=3)})
    monkeypatch.setattr(launch, "run", lambda *a, **k: pytest.fail("a sagemaker stage must not run on the worker"))
    run = {**RUN, "config": str(path), "overrides": {}, "out": args["out"]}
    result = steps.train_stage(run, "s2", {"best_params": {"lr": 0.05}}, {"checkpoint_uri": f"{args['out']}/train/s1/final.pt"})
    assert result["world_size"] == 4 and result["attempt"] == 3 and "duration_s" in result
    import boto3

    name = job_name(RUN["dag_id"], RUN["run_id"], "s2", 3)
    received = boto3.client("sagemaker", region_name="us-east-1").describe_training_job(TrainingJobName=name)
    arguments = received["AlgorithmSpecification"]["ContainerArguments"]
    assert arguments[arguments.index("--init-from") + 1] == f"{args['out']}/train/s1/final.pt"
    assert received["EnableManagedSpotTraining"] is False  # try 3 of retries 2: the last one runs on demand

    from stagewise.definitions.config import ConfigError
    from stagewise.definitions.loading import load_config

    with_entrypoint = yaml_with(path, {"train.stages.1.entrypoint": {"module": "my_train"}})
    with pytest.raises(ConfigError, match=r"train.stages\[1\] \(s2\): an entrypoint .* runs on backend local or slurm only"):
        load_config(with_entrypoint)  # refused where the run starts (start_run), before any job exists


def yaml_with(path, changes: dict):
    """A copy of the config at ``path`` with dotted keys set (written next to it)."""
    import yaml

    from stagewise.definitions.loading import _apply_overrides

    raw = yaml.safe_load(path.read_text())
    _apply_overrides(raw, changes)
    copy = path.with_name("changed.yaml")
    copy.write_text(yaml.safe_dump(raw))
    return copy
