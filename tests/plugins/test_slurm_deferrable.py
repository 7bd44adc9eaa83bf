"""slurm.deferrable: a Slurm stage is a SlurmStageOperator that prepares the try as steps.train_stage does (the
inputs' fingerprint in stagewise.train's arguments), submits the backend's batch script (or attaches to this try's
job), defers to SlurmJobTrigger with the task's execution_timeout as the deferral's, and on resume maps the job's end
(user error: no retry; else retry), records every attempt's cost and returns the stage's result with it. A deferral
that times out resumes in ``__fail__``: the job is cancelled there. No cluster: sbatch, squeue, scontrol and scancel
are stand-ins (the real ones: tests/dags/test_slurm_pipeline.py)."""

from __future__ import annotations

import datetime as dt
import json
import types
from pathlib import Path

import pytest
import yaml
from airflow.sdk.exceptions import AirflowFailException, TaskDeferralTimeout, TaskDeferred

from stagewise.airflow.backends import slurm
from stagewise.airflow.backends.slurm_records import SlurmJob
from stagewise.airflow.operators import SlurmStageOperator
from stagewise.airflow.slurm_trigger import SlurmJobTrigger
from stagewise.airflow.stage_job import job_name
from stagewise.core import storage
from stagewise.core.errors import USER_ERROR_EXIT
from stagewise.definitions.loading import load_config
from stagewise.reporting import cost
from tests.conftest import REPO_ROOT, base_config

RUN = {"dag_id": "ml_pipeline", "run_id": "manual__2026-12-03T08:00:00+00:00"}
SWEPT = {"best_params": {"lr": 0.05, "hidden": 64}}


def slurm_config(tmp_path, **settings):
    """A config whose stage s2 runs on 2 Slurm nodes (profile ddp2), under a local root in ``tmp_path``."""
    raw = base_config(tmp_path / "storage")
    raw["profiles"]["ddp2"].update({"backend": "slurm", "nodes": 2, "processes_per_node": 1, "retries": 2,
                                    "slurm": {"slurm_conf": "/etc/slurm/test.conf", "poll_s": 1, **settings}})
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path, load_config(path)


@pytest.fixture
def stage(tmp_path, monkeypatch):
    """The operator of s2 with its run (the preprocess commit it fingerprints), its context, and the Slurm calls."""
    from stagewise.core.storage import run_prefix

    path, config = slurm_config(tmp_path)
    out = run_prefix(config.storage_root, **RUN)
    storage.write_json(storage.join(out, "preprocess", "manifest.json"), {"fingerprint": "d" * 64})
    run = {**RUN, "config": str(path), "overrides": {}, "out": out}
    operator = SlurmStageOperator(task_id="train_s2", run=run, stage="s2", swept=SWEPT,
                                  previous={"checkpoint_uri": f"{out}/train/s1/final.pt", "fingerprint": "p" * 64},
                                  execution_timeout=dt.timedelta(seconds=1800))
    calls = []
    monkeypatch.setattr(slurm, "attached", lambda settings, name: None)
    monkeypatch.setattr(slurm, "submit", lambda settings, script, env: calls.append(("submit", script, env)) or "77")
    monkeypatch.setattr(slurm, "cancel", lambda settings, job_id: calls.append(("cancel", job_id)))
    monkeypatch.setattr(slurm, "accounting_record", lambda settings, job_id: None)
    started = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=100)
    context = {"ti": types.SimpleNamespace(try_number=2, start_date=started)}
    return types.SimpleNamespace(operator=operator, context=context, calls=calls, out=out, config=config)


def test_execute_submits_the_tries_batch_script_and_defers_with_what_is_left_of_the_timeout(stage, monkeypatch):
    with pytest.raises(TaskDeferred) as deferred:
        stage.operator.execute(stage.context)
    name = job_name(RUN["dag_id"], RUN["run_id"], "s2", 2)
    [(_, script, env)] = [call for call in stage.calls if call[0] == "submit"]
    assert f"#SBATCH --job-name={name}" in script and "#SBATCH --nodes=2" in script
    args = script.split("stagewise.train", 1)[1]
    assert "--inputs-fingerprint" in args and "--resume-fingerprint" in args  # the fingerprinted local path
    assert env["STAGEWISE_RESULT_FILE"].endswith(f"{name}.result.json") and env["SLURM_CONF"] == "/etc/slurm/test.conf"
    trigger = deferred.value.trigger
    assert type(trigger) is SlurmJobTrigger and (trigger.job_id, trigger.name, trigger.poll_s) == ("77", name, 1.0)
    assert trigger.output == f"{stage.out}/train/s2/slurm/{name}.out"
    assert deferred.value.method_name == "execute_complete"
    assert dt.timedelta(seconds=1690) < deferred.value.timeout <= dt.timedelta(seconds=1700)
    json.dumps(trigger.serialize()[1])  # the triggerer gets it as JSON

    # The same try again (its worker died after sbatch): attaches to the live job, submits none.
    monkeypatch.setattr(slurm, "attached", lambda settings, name: "77")
    stage.calls.clear()
    with pytest.raises(TaskDeferred) as again:
        stage.operator.execute(stage.context)
    assert again.value.trigger.job_id == "77" and stage.calls == []


def _event(stage, state="COMPLETED", **changes):
    name = job_name(RUN["dag_id"], RUN["run_id"], "s2", 2)
    files = slurm.JobFiles.of(f"{stage.out}/train/s2/slurm", name)
    return {"job_id": "77", "name": name, "state": state, "offset": 0, "message": "", "user_error": False,
            "output": files.output, "result_file": files.result, "error_file": files.error, "started": None,
            "fingerprint": "f" * 64, **changes}


def test_a_completed_job_returns_the_stages_result_with_every_attempts_cost(stage, monkeypatch, capsys):
    out = stage.out
    metrics = {"stage": "s2", "world_size": 2, "global_batch": 128, "fingerprint": "f" * 64, "complete": True,
               "history": [{"epoch": 0}]}
    storage.write_json(storage.join(out, "train", "s2", "metrics.json"), metrics)
    cost.record(out, "s2", 1, {"elapsed_s": 20.0, "cpu_time_s": 80.0, "nodes": 2, "gpu_hours": 0.0,
                               "source": "scontrol"}, job_id="76", state="NODE_FAIL")  # the try before
    event = _event(stage)
    Path(event["output"]).parent.mkdir(parents=True, exist_ok=True)  # the cost records are there
    Path(event["output"]).write_text("0: epoch 1 done\n1: epoch 1 done\n")
    monkeypatch.setattr(slurm, "job_record", lambda settings, job_id: SlurmJob(
        job_id="77", state="COMPLETED", exit_code=0, nodes=2, cpus=4, elapsed_s=30.0))
    result = stage.operator.execute_complete(stage.context, event)
    assert result["global_batch"] == 128 and result["attempt"] == 2
    spent = result["cost"]
    assert [(a["attempt"], a["job_id"], a["state"]) for a in spent["attempts"]] == [(1, "76", "NODE_FAIL"),
                                                                                   (2, "77", "COMPLETED")]
    assert (spent["elapsed_s"], spent["cpu_time_s"], spent["nodes"]) == (50.0, 200.0, 2)
    assert "[node 1] epoch 1 done" in capsys.readouterr().out  # the output the trigger had not logged yet


@pytest.mark.parametrize(("record", "retried"), [
    (SlurmJob(job_id="77", state="FAILED", exit_code=USER_ERROR_EXIT), False),
    (SlurmJob(job_id="77", state="FAILED", exit_code=1), True),
    (SlurmJob(job_id="77", state="TIMEOUT"), True),
    (SlurmJob(job_id="77", state="CANCELLED", reason="None"), True),
])
def test_a_failed_job_fails_without_retry_for_the_users_faults_and_retries_otherwise(stage, monkeypatch, record, retried):
    monkeypatch.setattr(slurm, "job_record", lambda settings, job_id: record)
    with pytest.raises(Exception) as error:
        stage.operator.execute_complete(stage.context, _event(stage, record.state))
    assert isinstance(error.value, AirflowFailException) != retried and "77" in str(error.value)
    assert cost.gathered(stage.out, "s2", 2)["attempts"][0]["state"] == record.state  # priced though it failed


def test_what_the_trigger_saw_first_cancels_the_job(stage, monkeypatch):
    """NODE_FAIL (a requeue after a lost node) retries, NEVER_RUNS (a reason that never clears) does not; both scancel."""
    monkeypatch.setattr(slurm, "job_record", lambda settings, job_id: SlurmJob(job_id="77", state="PENDING"))
    with pytest.raises(RuntimeError, match="NODE_FAIL") as error:
        stage.operator.execute_complete(stage.context, _event(stage, "NODE_FAIL", message="node(s) n2 failed"))
    assert not isinstance(error.value, AirflowFailException) and stage.calls == [("cancel", "77")]
    with pytest.raises(AirflowFailException, match="PartitionNodeLimit"):
        stage.operator.execute_complete(stage.context, _event(stage, "NEVER_RUNS", message="can never start: "
                                                                                           "PartitionNodeLimit"))
    assert stage.calls == [("cancel", "77")] * 2


def test_a_deferral_that_timed_out_cancels_the_tries_job_then_fails_as_airflow_does(stage, monkeypatch):
    """Airflow applies no execution_timeout to a deferred task: the deferral's timeout is it, and the scheduler
    resumes the task in __fail__ (TriggerFailureReason.TRIGGER_TIMEOUT) with none of the operator's kwargs."""
    from airflow.models.trigger import TriggerFailureReason

    names = []
    monkeypatch.setattr(slurm, "attached", lambda settings, name: names.append(name) or "77")
    with pytest.raises(TaskDeferralTimeout):
        stage.operator.resume_execution("__fail__", {"error": TriggerFailureReason.TRIGGER_TIMEOUT}, stage.context)
    assert stage.calls == [("cancel", "77")] and names == [job_name(RUN["dag_id"], RUN["run_id"], "s2", 2)]


def test_a_slurm_stage_is_wired_as_the_operator_unless_not_deferrable(tmp_path, monkeypatch):
    from airflow.dag_processing.dagbag import DagBag
    from airflow.serialization.serialized_objects import DagSerialization

    path, config = slurm_config(tmp_path)
    monkeypatch.setenv("STAGEWISE_CONFIG", str(path))
    dag = DagBag(dag_folder=str(REPO_ROOT / "dags" / "stagewise_pipelines.py")).dags["ml_pipeline"]
    task = dag.get_task("train_s2")
    assert type(task).__name__ == "SlurmStageOperator" and task.retries == 2
    assert task.execution_timeout.total_seconds() == config.profile("ddp2").execution_timeout_s
    assert {"start_run", "sweep_summary", "train_s1"} <= task.upstream_task_ids
    served = DagSerialization.from_dict(DagSerialization.to_dict(dag)).get_task("train_s2")
    assert served.task_type == "SlurmStageOperator"

    path, _ = slurm_config(tmp_path, deferrable=False)
    monkeypatch.setenv("STAGEWISE_CONFIG", str(path))
    dag = DagBag(dag_folder=str(REPO_ROOT / "dags" / "stagewise_pipelines.py")).dags["ml_pipeline"]
    assert type(dag.get_task("train_s2")).__name__ != "SlurmStageOperator"
