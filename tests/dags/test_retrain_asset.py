"""New data lands (an asset event through the REST API): `retrain` runs on a real scheduler and promotes through the gate."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests import run_cache
from tests.conftest import base_config

REPO_ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.airflow, pytest.mark.torchrun]


def test_asset_event_triggers_retrain_which_registers_and_promotes(live_airflow, tmp_path):
    """POST /api/v2/assets/events on the raw-data asset starts retrain; it succeeds and moves models/current."""
    storage_root = tmp_path / "storage"
    raw = base_config(storage_root)  # small sweep, 2 epochs a stage
    # Feb 29: the last trigger (2024) predates the DAG's start, so no scheduled run competes with the asset run.
    raw["retrain"] = {"schedule": "0 0 29 2 *", "num_trials": 2}
    config_path = tmp_path / "pipeline.yaml"
    config_path.write_text(yaml.safe_dump(raw))
    run_cache.demo_data(config_path)

    live = live_airflow(REPO_ROOT / "dags", {"STAGEWISE_CONFIG": str(config_path)})
    live.api("POST", "/api/v2/pools", expect=(200, 201), json={"name": "cpu_cores", "slots": 2, "description": "test"})
    live.wait_for_dag("ml_retrain")
    live.unpause("ml_retrain")
    assets = live.api("GET", "/api/v2/assets", params={"name_pattern": "stagewise_raw_data"}).json()["assets"]
    assert len(assets) == 1 and assets[0]["uri"] == f"file://{storage_root}/raw/digits"
    live.api("POST", "/api/v2/assets/events", expect=(200,), json={"asset_id": assets[0]["id"], "extra": {"by": "test"}})

    def asset_run() -> str | None:
        runs = live.api("GET", "/api/v2/dags/ml_retrain/dagRuns").json()["dag_runs"]
        triggered = [r for r in runs if r["run_type"] == "asset_triggered"]
        return triggered[0]["dag_run_id"] if triggered else None

    run_id = live.wait_until(asset_run, 120, "no asset-triggered retrain run appeared", interval=1.0)
    assert live.wait_for_run("ml_retrain", run_id, timeout=600) == "success", live.logs_tail()
    report = json.loads(next(storage_root.glob("runs/ml_retrain/*/report.json")).read_text())
    assert report["sweep"]["n_trials"] == 2, "retrain uses its own smaller budget"
    assert report["registry"]["promoted"] and report["registry"]["reason"] == "no current model"
    current = json.loads((storage_root / "models" / "digits" / "current.json").read_text())
    assert current["version"] == report["registry"]["version"]
