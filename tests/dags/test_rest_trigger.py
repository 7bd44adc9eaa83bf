"""Triggering through the REST API with a conf, as the UI does: bad conf is refused naming the param."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.airflow, pytest.mark.service]  # service: the shared stack's MLflow server


@pytest.fixture(scope="module")
def stack(shared_airflow):
    """The shared live stack's pipeline `ml`, ml_pipeline and ml_ingest unpaused; each test only triggers its own runs
    and reads them back. Returns (live, storage root, config path)."""
    live = shared_airflow.live
    for dag_id in ("ml_pipeline", "ml_ingest"):
        live.wait_for_dag(dag_id)
        live.unpause(dag_id)
    return live, shared_airflow.roots["ml"], shared_airflow.configs["ml"]


def test_rest_trigger_refuses_out_of_bounds_conf_and_runs_a_valid_one(stack, tmp_path, subprocess_env):
    """POST dagRuns with num_trials=0 is a 400 naming num_trials; a valid ingest conf runs to success, and its task's
    log holds no Python warning (each task process loads plugins and parses the DAG file: a warning there repeats in
    every task log, as pathspec's GitWildMatchPattern deprecation did)."""
    import subprocess
    import sys

    live, storage_root, config_path = stack
    env = {**subprocess_env, "STAGEWISE_CONFIG": str(config_path)}
    new_data = tmp_path / "incoming"
    subprocess.run([sys.executable, "-m", "stagewise.data", "digits", str(new_data), "--num-shards", "1"], cwd=REPO_ROOT,
                   env=env, check=True, capture_output=True)

    refused = live.api("POST", "/api/v2/dags/ml_pipeline/dagRuns", expect=(400,),
                       json={"logical_date": None, "conf": {"num_trials": 0}})
    assert "num_trials" in refused.text

    run_id = live.trigger("ml_ingest", {"source_uri": str(new_data)})
    assert live.wait_for_run("ml_ingest", run_id, timeout=180) == "success", live.logs_tail()
    added = live.xcom("ml_ingest", run_id, "ingest")["added"]
    assert len(added) == 1 and Path(added[0]).parent == storage_root / "raw" / "digits"
    log = live.task_log("ml_ingest", run_id, "ingest")
    assert "py.warnings" not in log and "Warning" not in log, log[-3000:]


def test_unknown_trigger_key_is_refused_at_the_trigger_and_again_at_start_run(stack):
    """A conf key that is no Param (num_trails): the REST trigger (the UI's) answers 400 naming it and the known keys,
    and stores no run; a run made without the api-server (`airflow dags trigger`) fails start_run once, naming it;
    nothing else runs."""
    import json
    import subprocess
    import sys

    live, _, _ = stack

    def stored() -> int:
        return live.api("GET", "/api/v2/dags/ml_pipeline/dagRuns", params={"limit": 1}).json()["total_entries"]

    before = stored()
    refused = live.api("POST", "/api/v2/dags/ml_pipeline/dagRuns", expect=(400,),
                       json={"logical_date": None, "conf": {"num_trails": 3}})
    assert "unknown key(s) ['num_trails']" in refused.text and "'num_trials'" in refused.text, refused.text
    assert stored() == before, "the refused trigger stored no run"

    run_id = "cli_unknown_key"
    subprocess.run([sys.executable, "-m", "airflow", "dags", "trigger", "ml_pipeline", "--run-id", run_id, "--conf",
                    json.dumps({"num_trails": 3})], env=live.env, cwd=live.tmp_dir, check=True, capture_output=True,
                   timeout=180)
    assert live.wait_for_run("ml_pipeline", run_id, timeout=180) == "failed", live.logs_tail()
    instances = {ti["task_id"]: ti for ti in live.task_instances("ml_pipeline", run_id) if ti["map_index"] == -1}
    assert (instances["start_run"]["state"], instances["start_run"]["try_number"]) == ("failed", 1)
    assert instances["plan_shards"]["state"] == "upstream_failed"
    log = live.task_log("ml_pipeline", run_id, "start_run")
    assert "unknown key(s) ['num_trails']" in log and "'num_trials'" in log, log[-3000:]
