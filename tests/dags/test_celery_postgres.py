"""The production layout on one machine: PostgreSQL as Airflow's metadata DB, Celery's result backend and the Optuna
storage; the CeleryExecutor with the Redis broker and two workers, each serving one instance profile's queue; mapped
sub-jobs that really run side by side."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import pytest
import yaml

from tests import run_cache
from tests.conftest import base_config

REPO_ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.airflow, pytest.mark.torchrun, pytest.mark.service]
QUEUES = {"small": "cpu_small", "ddp": "cpu_ddp"}  # worker name -> the queue it serves


def _overlapping(instances: list[dict]) -> bool:
    spans = sorted((datetime.fromisoformat(ti["start_date"]), datetime.fromisoformat(ti["end_date"])) for ti in instances)
    return any(later_start < earlier_end for (_, earlier_end), (later_start, _) in zip(spans, spans[1:]))


@pytest.mark.slow
def test_pipeline_on_postgresql_and_celery_runs_each_sub_job_on_its_queues_worker_side_by_side(
        live_airflow, postgres_databases, redis_url, tmp_path):
    """ml_pipeline succeeds with Airflow, Celery results and Optuna on PostgreSQL; each task instance ran on the worker
    whose queue its profile names; the mapped sweep workers overlapped; the study is the only one stored."""
    storage_root = tmp_path / "storage"
    raw = base_config(storage_root)
    raw["profiles"]["small"]["queue"] = QUEUES["small"]
    for profile in ("ddp1", "ddp2"):
        raw["profiles"][profile]["queue"] = QUEUES["ddp"]
    # Separate databases: Airflow and Optuna each keep their own alembic_version table.
    raw["sweep"]["storage"] = postgres_databases().replace("postgresql://", "postgresql+psycopg2://")
    config_path = tmp_path / "pipeline.yaml"
    config_path.write_text(yaml.safe_dump(raw))
    # Four raw shards: four mapped preprocess instances per pass on the small worker's two slots.
    run_cache.demo_data(config_path, num_shards=4)

    airflow_db = postgres_databases().replace("postgresql://", "postgresql+psycopg2://")
    results = postgres_databases().replace("postgresql://", "db+postgresql+psycopg2://")
    live = live_airflow(REPO_ROOT / "dags", {
        "STAGEWISE_CONFIG": str(config_path), "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": airflow_db,
        "AIRFLOW__CORE__EXECUTOR": "CeleryExecutor", "AIRFLOW__CELERY__BROKER_URL": redis_url,
        "AIRFLOW__CELERY__RESULT_BACKEND": results, "AIRFLOW__CORE__HOSTNAME_CALLABLE": "tests.live_airflow.worker_hostname"})
    for name, queue in QUEUES.items():
        live.start_celery_worker(name, [queue])
    live.api("POST", "/api/v2/pools", expect=(200, 201), json={"name": "cpu_cores", "slots": 2})
    live.wait_for_dag("ml_pipeline")
    live.unpause("ml_pipeline")
    run_id = live.trigger("ml_pipeline", {"num_trials": 4, "num_sweep_workers": 2})
    assert live.wait_for_run("ml_pipeline", run_id, timeout=600) == "success", live.logs_tail()

    instances = live.task_instances("ml_pipeline", run_id)
    serving = {queue: name for name, queue in QUEUES.items()}
    assert {ti["queue"] for ti in instances} == set(QUEUES.values())
    wrong = [(ti["task_id"], ti["map_index"], ti["queue"], ti["hostname"]) for ti in instances
             if ti["hostname"] != serving[ti["queue"]]]
    assert wrong == [], f"task instances ran off their queue's worker: {wrong}"
    assert {ti["hostname"] for ti in instances if ti["task_id"].startswith("train_")} == {"ddp"}
    # The sweep's long mapped workers ran side by side on their worker. Per-shard preprocessing is mapped too, but each
    # shard's task lasts well under a second of work: whether two of them meet depends on dispatch timing alone (a run
    # where none did failed here), so only their mapping is asserted.
    for task_id in ("preprocess_stats", "preprocess_transform"):
        assert len([ti for ti in instances if ti["task_id"] == task_id]) >= 2, f"{task_id} is not mapped per shard"
    sweep_workers = [ti for ti in instances if ti["task_id"] == "sweep_worker"]
    assert len(sweep_workers) == 2 and _overlapping(sweep_workers), "the sweep's workers never ran at the same time"
    report = json.loads(next(storage_root.glob("runs/ml_pipeline/*/report.json")).read_text())
    assert report["sweep"]["n_trials"] == 4

    import optuna

    studies = optuna.get_all_study_summaries(storage=raw["sweep"]["storage"])
    assert [s.study_name for s in studies] == [report["sweep"]["study_name"]]
