"""sagemaker.deferrable: a train stage is a SageMakerStageOperator that submits its try's job (moto's SageMaker
server), defers to the Amazon provider's SageMakerTrigger, and maps the trigger's event onto the stage's result or
the backend's failure rules; the DAG wires it in place of the TaskFlow step."""

from __future__ import annotations

import asyncio
import json
import time
import types
from pathlib import Path

import pytest

# Imported here, not in a test: Airflow configures its logging on first import (see test_sagemaker_backend).
from airflow.providers.amazon.aws.hooks.sagemaker import SageMakerHook  # noqa: F401
from airflow.providers.amazon.aws.triggers.sagemaker import SageMakerTrigger
from airflow.sdk.exceptions import AirflowFailException, TaskDeferred

from stagewise.airflow.backends import sagemaker
from stagewise.airflow.operators import STARTUP_SLACK_S, SageMakerStageOperator
from stagewise.airflow.stage_job import job_name, stage_job
from tests.plugins.backend_configs import RUN, backend_config, job_args
from tests.plugins.test_sagemaker_backend import moto_aws  # noqa: F401 - the fixture

REPO_ROOT = Path(__file__).resolve().parents[2]
PARAMS = {"lr": 0.05, "hidden": 64}


def _stage(tmp_path, root: str, attempt: int = 1):
    """A deferrable s2 config under ``root`` in moto's S3 with its preprocess output; the operator and its context."""
    import s3fs

    from stagewise.core.storage import run_prefix

    path, config = backend_config(tmp_path, "sagemaker", storage_root=root, deferrable=True)
    # A run of its own: moto's server lives for the session, and a job's name is per (DAG, run, stage, try).
    run_id = f"manual__{root.rsplit('/', 1)[-1]}"
    out = run_prefix(config.storage_root, RUN["dag_id"], run_id)
    args = job_args(path, config, attempt=attempt, run_id=run_id, out=out, init_from=f"{out}/train/s1/final.pt")
    fs = s3fs.S3FileSystem()
    if not fs.exists("stagewise-test"):
        fs.mkdir("stagewise-test")
    fs.pipe(f"{args['out']}/preprocess/manifest.json".removeprefix("s3://"), b"{}")
    fs.pipe(args["config_file"].removeprefix("s3://"), path.read_bytes())  # the run's snapshot, as start_run writes it
    run = {**RUN, "run_id": run_id, "config": args["config_file"], "overrides": {}, "out": out}
    operator = SageMakerStageOperator(task_id="train_s2", run=run, stage="s2", swept={"best_params": PARAMS},
                                      previous={"checkpoint_uri": args["init_from"]})
    return config, args, operator, {"ti": types.SimpleNamespace(try_number=attempt, start_date=None)}


@pytest.mark.service
def test_execute_submits_the_tries_job_and_defers_to_the_providers_sagemaker_trigger(tmp_path, moto_aws, monkeypatch):  # noqa: F811
    import boto3

    from stagewise.airflow import credentials

    config, args, operator, context = _stage(tmp_path, "s3://stagewise-test/deferred", attempt=2)
    before = time.time()
    with pytest.raises(TaskDeferred) as deferred:
        operator.execute(context)
    trigger = deferred.value.trigger
    name = job_name(RUN["dag_id"], args["run_id"], "s2", 2)
    assert type(trigger) is SageMakerTrigger
    assert trigger.job_name == name and trigger.job_type == "training" and trigger.waiter_delay == sagemaker.POLL_S
    # The trigger outlasts the job's own limit (spot: MaxWaitTimeInSeconds 7200) plus start-up.
    assert trigger.attempts * trigger.waiter_delay >= 7200 + STARTUP_SLACK_S
    assert (trigger.aws_conn_id, trigger.region_name) == ("aws_stagewise_test", "us-east-1")
    assert deferred.value.method_name == "execute_complete"
    assert before <= deferred.value.kwargs["started"] <= time.time()
    json.dumps(trigger.serialize()[1])  # the triggerer gets it as JSON

    # The job moto holds is the backend's own request for this try (spot: try 2 of retries 2 is not the last).
    request = sagemaker.training_job_request(stage_job(config, **args, storage_env=credentials.aws_environment(config.storage_conn_id)))
    received = boto3.client("sagemaker", region_name="us-east-1").describe_training_job(TrainingJobName=name)
    for key in ("ResourceConfig", "StoppingCondition", "CheckpointConfig", "OutputDataConfig", "RoleArn",
                "InputDataConfig", "EnableManagedSpotTraining"):
        assert received[key] == request[key], key
    sent = {k: v for k, v in received["AlgorithmSpecification"].items() if k != "MetricDefinitions"}  # moto adds one
    assert sent == request["AlgorithmSpecification"]
    arguments = sent["ContainerArguments"]
    assert arguments[arguments.index("--init-from") + 1] == args["init_from"]

    # The same try again (the worker died before deferring): attaches to the job, creates none.
    monkeypatch.setattr(SageMakerHook, "create_training_job", lambda *a, **k: pytest.fail("submitted twice"))
    with pytest.raises(TaskDeferred):
        operator.execute(context)


@pytest.mark.service
def test_a_success_event_returns_the_stages_result_and_failures_map_as_the_backend_does(tmp_path, moto_aws, monkeypatch):  # noqa: F811
    import s3fs

    from stagewise.airflow.backends import stage_result

    config, args, operator, context = _stage(tmp_path, "s3://stagewise-test/resumed")
    with pytest.raises(TaskDeferred) as deferred:
        operator.execute(context)
    name = deferred.value.trigger.job_name
    out = args["out"]
    # What stagewise.train's rank 0 writes last on success (moto runs no container).
    metrics = {"stage": "s2", "world_size": 4, "global_batch": 256, "checkpoint_uri": f"{out}/train/s2/final.pt",
               "history": [{"epoch": 0}], "complete": True}
    s3fs.S3FileSystem().pipe(f"{out}/train/s2/metrics.json".removeprefix("s3://"), json.dumps(metrics).encode())
    result = operator.execute_complete(context, {"status": "success", "job_name": name}, started=time.time() - 5)
    assert {k: v for k, v in result.items() if k not in ("duration_s", "attempt", "task_s")} == stage_result(out, "s2")
    assert result["model_uri"] == f"{out}/train/s2/model.pt" and result["attempt"] == 1 and result["duration_s"] >= 5

    # The trigger gave up (timeout) or lost the API: retryable, and nothing is left running unwatched.
    stopped = []
    monkeypatch.setattr(SageMakerHook, "get_conn", lambda self: types.SimpleNamespace(
        stop_training_job=lambda TrainingJobName: stopped.append(TrainingJobName)))  # noqa: N803 - boto3's name
    with pytest.raises(RuntimeError, match="ended with timeout.*retrying") as error:
        operator.execute_complete(context, {"status": "timeout", "job_name": name, "message": "max attempts"})
    assert not isinstance(error.value, AirflowFailException) and stopped == [name]


@pytest.mark.parametrize(("event", "retried"), [
    ({"status": "failed", "message": "AlgorithmError: stage s2: global_batch 100 does not divide, exit code: 3"}, False),
    ({"status": "failed", "message": "ClientError: Please ensure the IAM role has access to the image"}, False),
    ({"status": "failed", "message": "AlgorithmError: ExecuteUserScriptError: NCCL timeout, exit code: 1"}, True),
    ({"status": "failed", "message": "CapacityError: Unable to provision requested ML compute capacity"}, True),
    ({"status": "stopped", "message": "Waiter encountered a terminal failure state"}, True),
])
def test_a_failure_event_fails_without_retry_for_the_users_faults_and_retries_otherwise(tmp_path, event, retried):
    path, config = backend_config(tmp_path, "sagemaker", deferrable=True)
    run = {**RUN, "config": str(path), "overrides": {}, "out": job_args(path, config)["out"]}
    operator = SageMakerStageOperator(task_id="train_s2", run=run, stage="s2", swept={"best_params": {}})
    with pytest.raises(Exception) as error:
        operator.execute_complete({"ti": types.SimpleNamespace(try_number=1)}, {**event, "job_name": "sw-s2-abc-t1"})
    assert isinstance(error.value, AirflowFailException) != retried
    assert "sw-s2-abc-t1" in str(error.value) and event["message"] in str(error.value)


@pytest.mark.service
def test_the_providers_trigger_yields_success_for_a_completed_job_on_moto(tmp_path, moto_aws):  # noqa: F811
    """The real trigger, as the triggerer runs it (asyncio, aiobotocore), against moto's SageMaker."""
    _, _, operator, context = _stage(tmp_path, "s3://stagewise-test/trigger")
    with pytest.raises(TaskDeferred) as deferred:
        operator.execute(context)
    classpath, kwargs = deferred.value.trigger.serialize()
    assert classpath == "airflow.providers.amazon.aws.triggers.sagemaker.SageMakerTrigger"
    trigger = SageMakerTrigger(**{**kwargs, "waiter_delay": 1, "waiter_max_attempts": 5})

    async def first_event():
        return await asyncio.wait_for(anext(aiter(trigger.run())), timeout=30)

    event = asyncio.run(first_event())
    assert event.payload == {"status": "success", "job_name": kwargs["job_name"]}


def test_a_deferrable_sagemaker_stage_is_wired_as_the_operator_with_its_profiles_knobs(tmp_path, monkeypatch):
    from airflow.dag_processing.dagbag import DagBag

    path, config = backend_config(tmp_path, "sagemaker", deferrable=True, retries=3)
    monkeypatch.setenv("STAGEWISE_CONFIG", str(path))
    bag = DagBag(dag_folder=str(REPO_ROOT / "dags" / "stagewise_pipelines.py"))
    assert bag.import_errors == {}
    dag = bag.dags["ml_pipeline"]
    task = dag.get_task("train_s2")
    profile = config.profile("ddp2")
    assert type(task).__name__ == SageMakerStageOperator.__name__ and task.stage == "s2"
    assert (task.pool, task.pool_slots, task.retries) == (profile.pool, profile.pool_slots, 3)
    assert task.execution_timeout.total_seconds() == profile.execution_timeout_s
    # Its inputs come by XCom: the run, the sweep's result and the previous stage (a TaskFlow task on profile local).
    assert {"start_run", "sweep_summary", "train_s1"} <= task.upstream_task_ids
    assert type(dag.get_task("train_s1")).__name__ != SageMakerStageOperator.__name__
    assert "train_s2" in dag.get_task("evaluate").upstream_task_ids
    assert set(SageMakerStageOperator.template_fields) == {"run", "swept", "previous"}
    # As the dag-processor hands it to the scheduler: serialized and back, the operator and its knobs intact.
    from airflow.serialization.serialized_objects import DagSerialization

    served = DagSerialization.from_dict(DagSerialization.to_dict(dag)).get_task("train_s2")
    assert served.task_type == "SageMakerStageOperator" and (served.pool, served.retries) == (profile.pool, 3)
    assert served.upstream_task_ids == task.upstream_task_ids

    # Without the option the stage stays the TaskFlow step (it waits on the worker, streaming node logs).
    path, _ = backend_config(tmp_path, "sagemaker")
    monkeypatch.setenv("STAGEWISE_CONFIG", str(path))
    bag = DagBag(dag_folder=str(REPO_ROOT / "dags" / "stagewise_pipelines.py"))
    assert type(bag.dags["ml_pipeline"].get_task("train_s2")).__name__ != SageMakerStageOperator.__name__



DAG_RUN_FILE = """
import json, os, pathlib
import pendulum
from airflow.sdk import DAG, task
from stagewise.airflow.operators import SageMakerStageOperator

inputs = json.loads(pathlib.Path(os.environ["STAGEWISE_TEST_INPUTS"]).read_text())


@task
def evaluate(result):
    pathlib.Path(os.environ["STAGEWISE_TEST_INPUTS"]).with_name("result.json").write_text(json.dumps(result))


with DAG("sagemaker_deferrable_dagrun", schedule=None, start_date=pendulum.datetime(2026, 1, 1, tz="UTC")) as dag:
    run = task(lambda: inputs["run"], task_id="start_run")()
    swept = task(lambda: inputs["swept"], task_id="sweep_summary")()
    previous = task(lambda: inputs["previous"], task_id="train_s1")()
    evaluate(SageMakerStageOperator(task_id="train_s2", run=run, stage="s2", swept=swept, previous=previous,
                                    poll_s=1).output)
"""


@pytest.mark.timeout(300)
@pytest.mark.service
@pytest.mark.airflow
def test_a_dag_run_resolves_the_xcom_inputs_defers_and_pushes_the_stages_result(tmp_path, moto_aws, monkeypatch):  # noqa: F811
    """dag.test(): the inputs arrive by XCom through template_fields, the real trigger runs (inline, against moto),
    execute_complete resumes the task and its result is the next task's input."""
    import runpy

    import s3fs

    _, args, operator, _ = _stage(tmp_path, "s3://stagewise-test/dagrun")
    out = args["out"]
    s3fs.S3FileSystem().pipe(f"{out}/train/s2/metrics.json".removeprefix("s3://"),
                             json.dumps({"stage": "s2", "world_size": 4, "complete": True}).encode())
    dags = tmp_path / "dags"
    dags.mkdir()
    (dags / "sagemaker_deferrable_dagrun.py").write_text(DAG_RUN_FILE)
    inputs = tmp_path / "inputs" / "inputs.json"
    inputs.parent.mkdir()
    inputs.write_text(json.dumps({"run": operator.run, "swept": operator.swept, "previous": operator.previous}))
    monkeypatch.setenv("STAGEWISE_TEST_INPUTS", str(inputs))
    monkeypatch.setenv("AIRFLOW__DAG_PROCESSOR__DAG_BUNDLE_CONFIG_LIST", json.dumps([{
        "name": "sagemaker-deferrable-test", "classpath": "airflow.dag_processing.bundles.local.LocalDagBundle",
        "kwargs": {"path": str(dags)}}]))
    dag = runpy.run_path(str(dags / "sagemaker_deferrable_dagrun.py"))["dag"]
    try:
        dag_run = dag.test()  # in the Airflow home's DB (make test migrates it), removed again below
        states = {ti.task_id: ti.state for ti in dag_run.get_task_instances()}
    finally:
        from airflow.api.common.delete_dag import delete_dag

        delete_dag(dag.dag_id, keep_records_in_log=False)
    assert dag_run.state == "success", states
    result = json.loads(inputs.with_name("result.json").read_text())
    assert result["world_size"] == 4 and result["model_uri"] == f"{out}/train/s2/model.pt" and result["attempt"] == 1
