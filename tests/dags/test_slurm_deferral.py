"""A live Airflow (scheduler, LocalExecutor, triggerer) waits for Slurm jobs in its triggerer (SlurmJobTrigger) and
stops them as Airflow stops the task: the trigger's log lines reach the task's log, a triggerer restart leaves the job
running (the next triggerer waits on), a mark-failed of the deferred task scancels it (the trigger's on_kill), and a
task whose execution_timeout passes while deferred resumes in __fail__ and scancels its job there.

The deferring tasks are SlurmStageOperator with its Slurm end (trigger, resume, kill, timeout) and a plain
``sleep`` job in place of the stage (what it trains: tests/dags/test_slurm_pipeline.py)."""

from __future__ import annotations

import json
import time

import pytest
import yaml

from tests.conftest import base_config
from tests.live_airflow import live_airflow  # noqa: F401 - the fixture

pytestmark = [pytest.mark.airflow, pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(900)]

DAG_FILE = """
import datetime as dt, json, os, pathlib
import pendulum
from airflow.sdk import DAG
from stagewise.airflow.backends import slurm
from stagewise.airflow.operators import SlurmStageOperator
from stagewise.airflow.slurm_trigger import SlurmJobTrigger

inputs = json.loads(pathlib.Path(os.environ["STAGEWISE_TEST_INPUTS"]).read_text())


class SleepingStage(SlurmStageOperator):
    # The stage's job is a sleep that prints: its deferral, kill and timeout are the operator's own.
    def execute(self, context):
        settings, name = self._settings(), self._name(context)
        output = str(pathlib.Path(inputs["logs"]) / f"{name}.out")
        script = (f"#!/bin/bash\\n#SBATCH --job-name={name}\\n#SBATCH --nodes=1\\n#SBATCH --output={output}\\n"
                  "for i in $(seq 1 300); do echo tick $i; sleep 1; done\\n")
        self._job_id = slurm.submit(settings, script, slurm.slurm_env(settings))
        self.log.info("Slurm job %s (%s) submitted", self._job_id, name)
        self.defer(trigger=SlurmJobTrigger(job_id=self._job_id, name=name, settings=settings.model_dump(mode="json"),
                                           output=output, poll_s=1), method_name="execute_complete",
                   timeout=self._timeout(context))


with DAG("slurm_deferral", schedule=None, start_date=pendulum.datetime(2026, 1, 1, tz="UTC")) as dag:
    for stage, seconds in (("s1", 3600), ("s2", 25)):
        SleepingStage(task_id=f"train_{stage}", run=inputs["run"], stage=stage, swept={"best_params": {}},
                      execution_timeout=dt.timedelta(seconds=seconds), retries=0)
"""


def _config(tmp_path, conf: str):
    raw = base_config(tmp_path / "storage")
    profile = {"backend": "slurm", "nodes": 1, "processes_per_node": 1, "retries": 0,
               "slurm": {"slurm_conf": conf, "poll_s": 1}}
    raw["profiles"].update({"ddp1": {**raw["profiles"]["ddp1"], **profile},
                            "ddp2": {**raw["profiles"]["ddp2"], **profile}})
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _job_of(cluster, name: str) -> dict:
    """The newest job named ``name`` (an earlier run of this test may have left one of the same name)."""
    done = cluster.run("squeue", "-h", "--name", name, "-o", "%i", "--states=all")
    ids = sorted(int(field) for field in done.stdout.split() if field.isdigit())
    return cluster.job(str(ids[-1])) if ids else {}


def test_the_triggerer_logs_the_job_a_restart_keeps_it_and_a_kill_or_timeout_cancels_it(tmp_path, slurm,
                                                                                       live_airflow):  # noqa: F811
    from stagewise.airflow.stage_job import job_name

    dags = tmp_path / "dags"
    dags.mkdir()
    (dags / "slurm_deferral.py").write_text(DAG_FILE)
    (tmp_path / "logs").mkdir()
    config = _config(tmp_path, str(slurm.conf))
    inputs = tmp_path / "inputs.json"
    # The run id is ours: the operator names its job by it, and the DAG file reads it before the run exists.
    run_id = "manual__slurm_deferral"
    run = {"dag_id": "slurm_deferral", "run_id": run_id, "config": str(config), "out": str(tmp_path / "out"),
           "overrides": {}}
    inputs.write_text(json.dumps({"run": run, "logs": str(tmp_path / "logs")}))
    live = live_airflow(dags, env={"STAGEWISE_TEST_INPUTS": str(inputs), "STAGEWISE_CONFIG": str(config),
                                   "AIRFLOW__SCHEDULER__TRIGGER_TIMEOUT_CHECK_INTERVAL": "2"})
    live._spawn("triggerer", "triggerer", "--skip-serve-logs")
    live.wait_for_dag("slurm_deferral")
    live.unpause("slurm_deferral")
    live.api("POST", "/api/v2/dags/slurm_deferral/dagRuns", json={"dag_run_id": run_id, "logical_date": None})
    killed, timed_out = (job_name("slurm_deferral", run_id, stage, 1) for stage in ("s1", "s2"))

    def states() -> dict:
        return {ti["task_id"]: ti["state"] for ti in live.task_instances("slurm_deferral", run_id)}

    live.wait_until(lambda: states().get("train_s1") == "deferred" and _job_of(slurm, killed).get(
        "JobState") == "RUNNING", 240, lambda: f"tasks {states()}, job {_job_of(slurm, killed)}")

    # The execution_timeout (25 s) passes while train_s2 is deferred: it resumes in __fail__, which scancels.
    live.wait_until(lambda: states().get("train_s2") == "failed", 240, lambda: f"tasks {states()}")
    live.wait_until(lambda: _job_of(slurm, timed_out).get("JobState") == "CANCELLED", 60,
                    lambda: f"job {_job_of(slurm, timed_out)}")
    assert "cancelling Slurm job" in live.task_log("slurm_deferral", run_id, "train_s2")

    # A triggerer restart (SIGTERM, a new one) leaves the job running; the new triggerer waits on.
    triggerer = live.processes["triggerer"]
    triggerer.terminate()
    triggerer.wait(timeout=60)
    time.sleep(3)
    assert _job_of(slurm, killed)["JobState"] == "RUNNING"
    live._spawn("triggerer", "triggerer", "--skip-serve-logs", mode="a")

    # The trigger's log is the task's: the job's state and output, as they came, from both triggerers.
    def task_log() -> str:
        return live.task_log("slurm_deferral", run_id, "train_s1")

    log = live.wait_until(lambda: (text := task_log()).count("waiting for Slurm job") >= 2 and text, 120,
                          lambda: task_log()[-3000:] + live.component_log("triggerer")[-3000:])
    assert "tick 3" in log and "RUNNING" in log and states()["train_s1"] == "deferred"

    # Mark failed while deferred: the trigger's on_kill scancels the job.
    live.api("PATCH", f"/api/v2/dags/slurm_deferral/dagRuns/{run_id}/taskInstances/train_s1",
             json={"new_state": "failed"})
    live.wait_until(lambda: _job_of(slurm, killed).get("JobState") == "CANCELLED", 90,
                    lambda: f"job {_job_of(slurm, killed)}\n{live.component_log('triggerer')[-3000:]}")
    assert "cancelling Slurm job" in live.component_log("triggerer") + live.task_log("slurm_deferral", run_id,
                                                                                     "train_s1")
