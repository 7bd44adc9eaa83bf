"""Airflow 3's GitDagBundle over a local bare repository: a run stays on the commit it started with (DAG versioning)
while the next run takes the new commit's shape, with Stagewise's DAG file naming its pipelines relative to itself."""

from __future__ import annotations

import json
import subprocess
from datetime import datetime
from pathlib import Path

import pytest
import yaml

from tests import run_cache
from tests.conftest import base_config

pytestmark = [pytest.mark.airflow, pytest.mark.torchrun]

# The DAG file as docs/pipelines.md gives it: the pipelines folder is found beside the bundle's dags folder, so a
# task parses the pipelines of its own commit's checkout.
DAG_FILE = """\
from pathlib import Path

from stagewise.airflow.dags import build_pipelines

build_pipelines(globals(), str(Path(__file__).parent.parent / "pipelines"))
"""


def _git(cwd: Path, *args: str) -> str:
    done = subprocess.run(["git", "-c", "user.name=stagewise-test", "-c", "user.email=test@stagewise.invalid",
                           *args], cwd=cwd, capture_output=True, text=True, check=True)
    return done.stdout.strip()


def _commit(work: Path, message: str) -> str:
    """Commit everything in the work tree, push it to the bare repository's main; the commit's sha."""
    _git(work, "add", "-A")
    _git(work, "commit", "-q", "-m", message)
    _git(work, "push", "-q", "origin", "main")
    return _git(work, "rev-parse", "HEAD")


def _task_ids(live, run_id: str) -> set[str]:
    return {ti["task_id"] for ti in live.task_instances("ml_pipeline", run_id)}


@pytest.mark.slow
def test_a_run_keeps_the_commit_it_started_with(live_airflow, tmp_path):
    """Revision 1 (stages s1, s2) starts a run; revision 2 removes s2 while it runs. The running run stays on
    revision 1 (its bundle version, its one DAG version) and runs train_s2 to success from revision 1's checkout,
    after the dag-processor has serialized revision 2, then waits at its gate for a person (approval required) and,
    answered once revision 3 is in, resumes on revision 1; a run started then is on revision 2, without train_s2.
    Revision 3 breaks the config: the DAG keeps revision 2's tasks, but a run started on revision 3 fails at its
    first task, whose log names the file and the key."""
    bare, work = tmp_path / "team.git", tmp_path / "work"
    subprocess.run(["git", "init", "-q", "--bare", "-b", "main", str(bare)], check=True)
    subprocess.run(["git", "init", "-q", "-b", "main", str(work)], check=True)
    _git(work, "remote", "add", "origin", str(bare))
    (work / "dags").mkdir()
    (work / "dags" / "stagewise_pipelines.py").write_text(DAG_FILE)
    (work / "pipelines").mkdir()
    raw = {**base_config(tmp_path / "storage"), "name": "ml"}
    raw["sweep"].update({"num_trials": 1, "num_workers": 1, "epochs": 1})
    raw["airflow"] = {**raw.get("airflow", {}), "max_active_runs": 1}  # a second run waits, its shape already set
    raw["registry"] = {**raw.get("registry", {}), "approval": "required"}  # the first run waits for a person
    config_path = work / "pipelines" / "ml.yaml"
    config_path.write_text(yaml.safe_dump(raw))
    run_cache.demo_data(config_path)
    first = _commit(work, "two stages")

    bundle = {"name": "team", "classpath": "airflow.providers.git.bundles.git.GitDagBundle",
              "kwargs": {"git_conn_id": "team_git", "tracking_ref": "main", "subdir": "dags", "refresh_interval": 5}}
    storage = tmp_path / "bundles"
    (tmp_path / "no_dags_folder").mkdir()
    live = live_airflow(tmp_path / "no_dags_folder", {
        "AIRFLOW__DAG_PROCESSOR__DAG_BUNDLE_CONFIG_LIST": json.dumps([bundle]),
        "AIRFLOW__DAG_PROCESSOR__DAG_BUNDLE_STORAGE_PATH": str(storage),
        "AIRFLOW_CONN_TEAM_GIT": json.dumps({"conn_type": "git", "host": str(bare)}),
        # The DAG file itself never changes between commits: it is parsed again at this interval.
        "AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL": "10",
        "AIRFLOW__WORKERS__MISSING_DAG_RETRIES": "0"})
    live.api("POST", "/api/v2/pools", expect=(200, 201), json={"name": "cpu_cores", "slots": 2})
    live.wait_for_dag("ml_pipeline", timeout=120)
    live.unpause("ml_pipeline")
    old_run = live.trigger("ml_pipeline")
    assert live.api("GET", f"/api/v2/dags/ml_pipeline/dagRuns/{old_run}").json()["bundle_version"] == first
    assert {"train_s1", "train_s2"} <= _task_ids(live, old_run)

    raw["train"]["stages"] = raw["train"]["stages"][:1]
    config_path.write_text(yaml.safe_dump(raw))
    second = _commit(work, "s2 removed")

    def second_version() -> dict | None:
        versions = live.api("GET", "/api/v2/dags/ml_pipeline/dagVersions").json()["dag_versions"]
        return next((v for v in versions if v["bundle_version"] == second), None)

    version = live.wait_until(second_version, 120, "revision 2 was never serialized", interval=1.0)
    tasks = {task["task_id"] for task in live.api("GET", "/api/v2/dags/ml_pipeline/tasks").json()["tasks"]}
    assert "train_s1" in tasks and "train_s2" not in tasks

    new_run = live.trigger("ml_pipeline")
    body = live.api("GET", f"/api/v2/dags/ml_pipeline/dagRuns/{new_run}").json()
    assert body["bundle_version"] == second
    assert [v["version_number"] for v in body["dag_versions"]] == [version["version_number"]]
    assert "train_s1" in _task_ids(live, new_run) and "train_s2" not in _task_ids(live, new_run)
    # Its shape is all this run has to show: ended now, it leaves the cores to the first run.
    live.api("PATCH", f"/api/v2/dags/ml_pipeline/dagRuns/{new_run}", json={"state": "failed"})

    raw["train"]["stages"][0]["epochs"] = "two"
    config_path.write_text(yaml.safe_dump(raw))
    broken = _commit(work, "a typo")

    def dag_at_broken() -> dict | None:
        dag = live.api("GET", "/api/v2/dags/ml_pipeline").json()
        return dag if dag["bundle_version"] == broken else None

    assert not live.wait_until(dag_at_broken, 120, "revision 3 was never parsed", interval=1.0)["is_stale"]
    tasks = {task["task_id"] for task in live.api("GET", "/api/v2/dags/ml_pipeline/tasks").json()["tasks"]}
    assert "train_s1" in tasks and "train_s2" not in tasks and "config_error" not in tasks
    broken_run = live.trigger("ml_pipeline")
    assert live.api("GET", f"/api/v2/dags/ml_pipeline/dagRuns/{broken_run}").json()["bundle_version"] == broken

    # Revision 1's gate asks a person; answered after revisions 2 and 3 landed, approve_model resumes on revision 1.
    live.wait_for_hitl("ml_pipeline", old_run, "approve_model", timeout=900)
    live.api("PATCH", live.hitl_path("ml_pipeline", old_run, "approve_model"),
             json={"chosen_options": ["Approve"], "params_input": {"note": "on revision 1"}})
    assert live.wait_for_run("ml_pipeline", old_run, timeout=900) == "success"
    body = live.api("GET", f"/api/v2/dags/ml_pipeline/dagRuns/{old_run}").json()
    assert body["bundle_version"] == first
    assert {v["bundle_version"] for v in body["dag_versions"]} == {first}
    states = {ti["task_id"]: ti for ti in live.task_instances("ml_pipeline", old_run) if ti["map_index"] == -1}
    assert states["train_s2"]["state"] == "success"
    # It ran after revision 2 was the DAG's latest version, parsed from revision 1's own checkout.
    assert datetime.fromisoformat(states["train_s2"]["start_date"]) > datetime.fromisoformat(version["created_at"])
    assert (storage / "team" / "versions" / first / "pipelines" / "ml.yaml").is_file()
    # Stagewise trained both stages of revision 1 (the runs of revisions 2 and 3 write no report).
    reports = list((tmp_path / "storage").glob("runs/ml_pipeline/*/report.json"))
    assert len(reports) == 1, reports
    report = json.loads(reports[0].read_text())
    assert [stage["stage"] for stage in report["training"]] == ["s1", "s2"]
    assert report["registry"]["promoted"] and report["registry"]["approval"]["note"] == "on revision 1"

    # The run of the broken commit parses that commit's checkout, where the pipeline has no valid config: its first
    # task is not in the DAG it builds and fails (at once here; Airflow reschedules it 3 times, 60 s apart, by default).
    assert live.wait_for_run("ml_pipeline", broken_run, timeout=300) == "failed"
    states = {ti["task_id"]: ti["state"] for ti in live.task_instances("ml_pipeline", broken_run)}
    assert states.pop("start_run") == "failed" and set(states.values()) == {"upstream_failed"}
    log = live.task_log("ml_pipeline", broken_run, "start_run")
    assert f"versions/{broken}/pipelines/ml.yaml: invalid pipeline config" in log
    assert "train.stages.0.epochs" in log and "Task not found in Dag" in log
