"""Scale-out: CeleryExecutor with the Redis broker and two workers, each serving one instance profile's queue."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests import run_cache
from tests.conftest import base_config

REPO_ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.airflow, pytest.mark.torchrun, pytest.mark.service]
QUEUES = {"small": "cpu_small", "ddp": "cpu_ddp"}  # worker name -> the queue it serves


def test_every_sub_job_runs_on_the_worker_serving_its_profile_queue(live_airflow, postgres_databases, redis_url,
                                                                     tmp_path):
    """Each task instance ran on the worker whose queue its profile names, and the run succeeded."""
    storage_root = tmp_path / "storage"
    raw = base_config(storage_root)
    raw["profiles"]["small"]["queue"] = QUEUES["small"]
    for profile in ("ddp1", "ddp2"):
        raw["profiles"][profile]["queue"] = QUEUES["ddp"]
    config_path = tmp_path / "pipeline.yaml"
    config_path.write_text(yaml.safe_dump(raw))
    run_cache.demo_data(config_path)

    results = postgres_databases().replace("postgresql://", "db+postgresql+psycopg2://")
    live = live_airflow(REPO_ROOT / "dags", {
        "STAGEWISE_CONFIG": str(config_path), "AIRFLOW__CORE__EXECUTOR": "CeleryExecutor",
        "AIRFLOW__CELERY__BROKER_URL": redis_url, "AIRFLOW__CELERY__RESULT_BACKEND": results,
        "AIRFLOW__CORE__HOSTNAME_CALLABLE": "tests.live_airflow.worker_hostname"})
    for name, queue in QUEUES.items():
        live.start_celery_worker(name, [queue])
    live.api("POST", "/api/v2/pools", expect=(200, 201), json={"name": "cpu_cores", "slots": 2})
    live.wait_for_dag("ml_pipeline")
    live.unpause("ml_pipeline")
    run_id = live.trigger("ml_pipeline", {"num_trials": 2, "num_sweep_workers": 2})
    assert live.wait_for_run("ml_pipeline", run_id, timeout=600) == "success", live.logs_tail()

    serving = {queue: name for name, queue in QUEUES.items()}
    instances = live.task_instances("ml_pipeline", run_id)
    assert {ti["queue"] for ti in instances} == set(QUEUES.values())
    wrong = [(ti["task_id"], ti["map_index"], ti["queue"], ti["hostname"]) for ti in instances
             if ti["hostname"] != serving[ti["queue"]]]
    assert wrong == [], f"task instances ran off their queue's worker: {wrong}"
    assert {ti["hostname"] for ti in instances if ti["task_id"].startswith("train_")} == {"ddp"}
    report = json.loads(next(storage_root.glob("runs/ml_pipeline/*/report.json")).read_text())
    assert report["sweep"]["n_trials"] == 2
