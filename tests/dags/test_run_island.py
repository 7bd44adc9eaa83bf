"""A run is an island: the scheduler dies mid-run, and meanwhile its pipeline's file is edited, a second file clashes
with it, a typo breaks it and it is deleted; the run finishes with the tasks and config it started with, another
pipeline's DAGs never change, and each error shows as an import error naming the file and key (one live stack)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from tests import run_cache
from tests.conftest import base_config

REPO_ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.airflow, pytest.mark.torchrun]


def _errors_text(live) -> str:
    return "\n".join(f"{error['filename']}: {error['stack_trace']}" for error in live.import_errors())


def _wait_for_error(live, *fragments: str) -> str:
    """Until the import errors hold every fragment (the check file re-parses every few seconds); their text."""
    def shown() -> str | None:
        text = _errors_text(live)
        return text if all(fragment in text for fragment in fragments) else None

    return live.wait_until(shown, 120, lambda: f"no import error with {fragments}: {_errors_text(live)[:3000]}",
                           interval=1.0)


def _dag_state(live, dag_id: str) -> tuple[bool, list[str]]:
    """Whether the DAG is stale, and its task ids as the scheduler has them."""
    stale = live.api("GET", f"/api/v2/dags/{dag_id}").json()["is_stale"]
    tasks = [task["task_id"] for task in live.api("GET", f"/api/v2/dags/{dag_id}/tasks").json()["tasks"]]
    return stale, sorted(tasks)


@pytest.mark.slow
def test_a_run_is_an_island(live_airflow, tmp_path):
    """ml's run: SIGKILL the scheduler while sweep workers run and edit ml.yaml's s2 (batch, warmup) meanwhile; then,
    the run held in flight (its DAG paused), a new file claims ml's registry, a typo breaks ml.yaml and the file is
    deleted. The run succeeds with the values it started with; `bystander` keeps its DAGs; copycat alone is refused."""
    storage_root, folder = tmp_path / "storage", tmp_path / "pipelines"
    folder.mkdir()
    raw = {**base_config(storage_root), "name": "ml"}
    raw["sweep"]["epochs"] = 6
    config_path = folder / "ml.yaml"
    config_path.write_text(yaml.safe_dump(raw))
    run_cache.demo_data(config_path)
    bystander = {**base_config(tmp_path / "bystander_storage"), "name": "bystander"}
    (folder / "bystander.yaml").write_text(yaml.safe_dump(bystander))

    # A short heartbeat timeout lets the new scheduler notice any task instance the crash orphaned; a short parse
    # interval shows each change of the folder within seconds.
    live = live_airflow(REPO_ROOT / "dags", {"STAGEWISE_PIPELINES": str(folder),
                                             "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT": "30",
                                             "AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL": "5"})
    live.api("POST", "/api/v2/pools", expect=(200, 201), json={"name": "cpu_cores", "slots": 2})
    live.wait_for_dag("ml_pipeline")
    live.wait_for_dag("bystander_pipeline")
    bystander_before = _dag_state(live, "bystander_pipeline")
    ml_tasks = _dag_state(live, "ml_pipeline")[1]
    live.unpause("ml_pipeline")
    run_id = live.trigger("ml_pipeline", {"num_trials": 6})

    def sweep_running() -> bool:
        return any(ti["task_id"] == "sweep_worker" and ti["state"] == "running"
                   for ti in live.task_instances("ml_pipeline", run_id))

    live.wait_until(sweep_running, 300, "no sweep_worker started", interval=0.5)
    edited = yaml.safe_load(config_path.read_text())
    edited["train"]["stages"][1].update({"per_process_batch": 16, "warmup_steps": 0})  # no Param: only the file says
    config_path.write_text(yaml.safe_dump(edited))
    live.kill("scheduler")
    live.restart_scheduler()

    # Hold the run in flight (a paused DAG's running tasks finish, no new one starts) while the folder breaks.
    live.api("PATCH", "/api/v2/dags/ml_pipeline", json={"is_paused": True})
    (folder / "copycat.yaml").write_text(yaml.safe_dump({**edited, "name": "copycat"}))
    _wait_for_error(live, "copycat.yaml: registry.model_name 'digits'", f"is already {config_path}'s")
    typo = yaml.safe_load(config_path.read_text())
    typo["evaluate"]["min_test_acuracy"] = typo["evaluate"].pop("min_test_accuracy")
    config_path.write_text(yaml.safe_dump(typo))
    _wait_for_error(live, f"{config_path}: invalid pipeline config", "evaluate.min_test_acuracy: unknown key")
    config_path.unlink()
    errors = _wait_for_error(live, f"{config_path}: the config file of pipeline 'ml' is gone", "copycat.yaml")
    assert "bystander" not in errors
    for dag_id in ("ml_pipeline", "ml_retrain", "ml_batch_inference", "ml_ingest"):
        assert _dag_state(live, dag_id)[0] is False, f"{dag_id} went stale: its running runs would never finish"
    assert _dag_state(live, "ml_pipeline")[1] == ml_tasks, "the in-flight run keeps its tasks"
    assert _dag_state(live, "bystander_pipeline") == bystander_before, "another pipeline is untouched"
    assert _dag_state(live, "copycat_pipeline")[1] == ["config_error"], "the file that clashed is the one refused"
    assert live.run_state("ml_pipeline", run_id) == "running"
    live.unpause("ml_pipeline")
    assert live.wait_for_run("ml_pipeline", run_id, timeout=600) == "success", live.logs_tail()
    removed = [ti["task_id"] for ti in live.task_instances("ml_pipeline", run_id) if ti["state"] == "removed"]
    assert not removed, f"tasks of the in-flight run were removed: {removed}"

    report = json.loads(next(storage_root.glob("runs/ml_pipeline/*/report.json")).read_text())
    assert report["sweep"]["n_trials"] == 6, "the budget holds across the crash"
    s2 = report["training"][1]
    assert s2["global_batch"] == 2 * raw["train"]["stages"][1]["per_process_batch"], "the edit never reached this run"
    snapshot = yaml.safe_load(Path(report["config"]["config_uri"]).read_text())
    assert snapshot["train"]["stages"][1]["warmup_steps"] == raw["train"]["stages"][1]["warmup_steps"]
    assert snapshot["sweep"]["num_trials"] == 6 and report["config"]["config_source"] == str(config_path)
    card = json.loads(next(storage_root.glob(f"models/digits/{report['registry']['version']}/card.json")).read_text())
    assert card["config_hash"] == report["config"]["config_hash"], "the model card names the config it trained with"
    manifest = json.loads(Path(report["predictions"]["uri"]).read_text())
    keys = [k for entry in manifest["files"] for k in pq.read_table(entry["uri"]).column("row_id").to_pylist()]
    assert len(keys) == len(set(keys)) == 1797
    on_disk = {str(p) for p in Path(report["predictions"]["uri"]).parent.glob("*.parquet")}
    assert on_disk == {entry["uri"] for entry in manifest["files"]}, "no duplicate or stray prediction files"

    # The typo back: a new run fails at once naming the file and key, without retry; the fix clears every error.
    config_path.write_text(yaml.safe_dump(typo))
    _wait_for_error(live, "evaluate.min_test_acuracy: unknown key")
    refused = live.trigger("ml_pipeline")
    assert live.wait_for_run("ml_pipeline", refused, timeout=120) == "failed"
    start = next(ti for ti in live.task_instances("ml_pipeline", refused) if ti["task_id"] == "start_run")
    assert start["state"] == "failed" and start["try_number"] == 1
    assert "evaluate.min_test_acuracy: unknown key" in live.task_log("ml_pipeline", refused, "start_run")
    config_path.write_text(yaml.safe_dump(edited))
    (folder / "copycat.yaml").unlink()
    live.wait_until(lambda: not live.import_errors(), 120, lambda: f"errors stay: {_errors_text(live)[:2000]}",
                    interval=1.0)
