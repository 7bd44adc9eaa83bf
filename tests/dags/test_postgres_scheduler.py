"""Production layout on one machine: PostgreSQL as Airflow's metadata DB and as the Optuna storage, a real scheduler
with LocalExecutor parallelism > 1, mapped sub-jobs that really run side by side, and a scheduler that dies mid-run
and comes back while the config file is edited: the run still finishes with the config it started with, and no
output is duplicated.

One run guards all of it (it used to be two tests, a run each: tests/dags/test_scheduler_restart.py ran the crash on
SQLite).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from tests import run_cache
from tests.conftest import base_config

REPO_ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.airflow, pytest.mark.torchrun, pytest.mark.service]


def _overlapping(instances: list[dict]) -> bool:
    spans = sorted((datetime.fromisoformat(ti["start_date"]), datetime.fromisoformat(ti["end_date"])) for ti in instances)
    return any(later_start < earlier_end for (_, earlier_end), (later_start, _) in zip(spans, spans[1:]))


def test_pipeline_on_postgresql_rides_out_a_scheduler_crash_and_a_mid_run_config_edit(live_airflow, postgres_databases,
                                                                                      tmp_path):
    """ml_pipeline on PostgreSQL (Airflow and Optuna): SIGKILL the scheduler while both sweep workers run and edit
    pipeline.yaml's s2 (batch, warmup) meanwhile, start a new scheduler: success, mapped preprocess and sweep tasks
    overlapped, one study, each row predicted once, and s2 trained with the values the run started with (its snapshot)."""
    storage_root = tmp_path / "storage"
    raw = base_config(storage_root)
    raw["sweep"]["epochs"] = 6
    # Separate databases: Airflow and Optuna each keep their own alembic_version table.
    raw["sweep"]["storage"] = postgres_databases().replace("postgresql://", "postgresql+psycopg2://")
    config_path = tmp_path / "pipeline.yaml"
    config_path.write_text(yaml.safe_dump(raw))
    run_cache.demo_data(config_path)

    airflow_db = postgres_databases().replace("postgresql://", "postgresql+psycopg2://")
    # A short heartbeat timeout lets the new scheduler notice any task instance the crash orphaned.
    live = live_airflow(REPO_ROOT / "dags", {"STAGEWISE_CONFIG": str(config_path),
                                             "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": airflow_db,
                                             "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT": "30"})
    live.api("POST", "/api/v2/pools", expect=(200, 201), json={"name": "cpu_cores", "slots": 2})
    live.wait_for_dag("ml_pipeline")
    live.unpause("ml_pipeline")
    run_id = live.trigger("ml_pipeline", {"num_trials": 6, "num_sweep_workers": 2})

    def sweep_workers_running() -> bool:
        states = [ti["state"] for ti in live.task_instances("ml_pipeline", run_id) if ti["task_id"] == "sweep_worker"]
        return len(states) == 2 and all(state == "running" for state in states)

    live.wait_until(sweep_workers_running, 300, "the two sweep workers never ran together", interval=0.5)
    edited = yaml.safe_load(config_path.read_text())
    edited["train"]["stages"][1].update({"per_process_batch": 16, "warmup_steps": 0})  # no Param: only the file says
    config_path.write_text(yaml.safe_dump(edited))
    live.kill("scheduler")
    live.restart_scheduler()
    assert live.wait_for_run("ml_pipeline", run_id, timeout=600) == "success", live.logs_tail()

    instances = live.task_instances("ml_pipeline", run_id)
    for task_id in ("preprocess_stats", "sweep_worker"):
        mapped = [ti for ti in instances if ti["task_id"] == task_id]
        assert len(mapped) >= 2 and _overlapping(mapped), f"{task_id} instances never ran at the same time"
    report = json.loads(next(storage_root.glob("runs/ml_pipeline/*/report.json")).read_text())
    assert report["sweep"]["n_trials"] == 6, "the budget holds across the crash"

    import optuna

    studies = optuna.get_all_study_summaries(storage=raw["sweep"]["storage"])
    assert [s.study_name for s in studies] == [report["sweep"]["study_name"]]

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
