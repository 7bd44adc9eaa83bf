"""The scheduler dies mid-run and comes back: the run still finishes, and no output is duplicated."""

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


def test_scheduler_killed_and_config_edited_mid_run(live_airflow, tmp_path):
    """SIGKILL the scheduler while sweep workers run and edit pipeline.yaml's s2 (batch, warmup) meanwhile, start a new
    scheduler: success, each row predicted once, and s2 trained with the values the run started with (its snapshot)."""
    storage_root = tmp_path / "storage"
    raw = base_config(storage_root)
    raw["sweep"]["epochs"] = 6
    config_path = tmp_path / "pipeline.yaml"
    config_path.write_text(yaml.safe_dump(raw))
    run_cache.demo_data(config_path)

    # A short heartbeat timeout lets the new scheduler notice any task instance the crash orphaned.
    live = live_airflow(REPO_ROOT / "dags", {"STAGEWISE_CONFIG": str(config_path),
                                             "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT": "30"})
    live.api("POST", "/api/v2/pools", expect=(200, 201), json={"name": "cpu_cores", "slots": 2})
    live.wait_for_dag("ml_pipeline")
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
    assert live.wait_for_run("ml_pipeline", run_id, timeout=600) == "success", live.logs_tail()

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
