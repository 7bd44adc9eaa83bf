"""New data lands (an asset event through the REST API): `<name>_retrain` runs on a real scheduler and promotes through
the gate. On the shared stack's pipeline `fresh` (tests/shared_stack.py): an empty registry, a retrain budget of 2."""

from __future__ import annotations

import json

import pytest

pytestmark = [pytest.mark.airflow, pytest.mark.torchrun, pytest.mark.service]  # service: the stack's MLflow server


@pytest.mark.slow
def test_asset_event_triggers_retrain_which_registers_and_promotes(shared_airflow):
    """POST /api/v2/assets/events on the pipeline's raw-data asset starts its retrain; it succeeds and moves models/current."""
    live, storage_root = shared_airflow.live, shared_airflow.roots["fresh"]
    live.wait_for_dag("fresh_retrain")
    live.unpause("fresh_retrain")
    assets = live.api("GET", "/api/v2/assets", params={"name_pattern": "stagewise_raw_data"}).json()["assets"]
    ours = [asset for asset in assets if asset["uri"] == f"file://{storage_root}/raw/digits"]
    assert len(ours) == 1 and len(assets) == len(shared_airflow.roots), "one raw-data asset per pipeline"
    live.api("POST", "/api/v2/assets/events", expect=(200,), json={"asset_id": ours[0]["id"], "extra": {"by": "test"}})

    def asset_run() -> str | None:
        runs = live.api("GET", "/api/v2/dags/fresh_retrain/dagRuns").json()["dag_runs"]
        triggered = [r for r in runs if r["run_type"] == "asset_triggered"]
        return triggered[0]["dag_run_id"] if triggered else None

    run_id = live.wait_until(asset_run, 120, "no asset-triggered retrain run appeared", interval=1.0)
    assert live.wait_for_run("fresh_retrain", run_id, timeout=600) == "success", live.logs_tail()
    report = json.loads(next(storage_root.glob("runs/fresh_retrain/*/report.json")).read_text())
    assert report["sweep"]["n_trials"] == 2, "retrain uses its own smaller budget"
    assert report["registry"]["promoted"] and report["registry"]["reason"] == "no current model"
    current = json.loads((storage_root / "models" / "digits" / "current.json").read_text())
    assert current["version"] == report["registry"]["version"]
