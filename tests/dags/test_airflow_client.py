"""Scripting Stagewise the way users script Airflow: the official apache-airflow-client against a live stack.

A JWT from ``POST /auth/token``, a trigger with a conf, a wait, the mapped task instances by their
names, the report task's XCom, and the report.json it points to (also found by ``python -m stagewise.report latest``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.conftest import service_unavailable
from tests.live_airflow import FINAL_RUN_STATES

REPO_ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.airflow, pytest.mark.torchrun, pytest.mark.service]  # service: the stack's MLflow server


def _client_api():
    """The client package's modules, or a skip (a failure under CI=true) when it is not installed."""
    try:
        import airflow_client.client as client
    except ImportError:
        service_unavailable("apache-airflow-client is not installed (pip install -r requirements.txt)")
    return client


def _access_token(base_url: str, username: str, password: str) -> str:
    """A JWT for the REST API, as the client's README gets one: POST /auth/token with the user's password."""
    response = httpx.post(f"{base_url}/auth/token", json={"username": username, "password": password},
                          timeout=30.0, trust_env=False)
    response.raise_for_status()
    return response.json()["access_token"]


@pytest.mark.slow
def test_official_client_triggers_waits_lists_named_mapped_tasks_and_reads_the_report(shared_airflow):
    """With the client: a bad conf is a 400 naming the param; a valid one runs; mapped tasks carry names; report_uri opens.
    On the shared stack's pipeline `ml`."""
    import pyarrow.parquet as pq

    client = _client_api()
    from airflow_client.client.api.dag_run_api import DagRunApi
    from airflow_client.client.api.task_instance_api import TaskInstanceApi
    from airflow_client.client.api.x_com_api import XComApi
    from airflow_client.client.models.trigger_dag_run_post_body import TriggerDAGRunPostBody

    live, storage_root = shared_airflow.live, shared_airflow.roots["ml"]
    live.wait_for_dag("ml_pipeline")
    live.unpause("ml_pipeline")
    raw_files = sorted((storage_root / "raw" / "digits").glob("*.parquet"))
    raw_rows = sum(pq.ParquetFile(path).metadata.num_rows for path in raw_files)  # an ingest may have added a file
    configuration = client.Configuration(host=live.base_url,
                                         access_token=_access_token(live.base_url, "admin", live.password))
    with client.ApiClient(configuration) as api_client:
        runs = DagRunApi(api_client)
        with pytest.raises(client.ApiException) as refused:
            runs.trigger_dag_run("ml_pipeline", TriggerDAGRunPostBody(logical_date=None, conf={"num_trials": 0}))
        assert refused.value.status == 400 and "num_trials" in refused.value.body

        run = runs.trigger_dag_run("ml_pipeline", TriggerDAGRunPostBody(
            logical_date=None, conf={"num_trials": 3, "num_sweep_workers": 2}))
        run_id = run.dag_run_id

        def finished() -> str | None:
            state = runs.get_dag_run("ml_pipeline", run_id).state.value
            return state if state in FINAL_RUN_STATES else None

        assert live.wait_until(finished, 600, f"run {run_id} did not finish", interval=2.0) == "success", \
            live.logs_tail()

        instances = TaskInstanceApi(api_client)
        raw_names = [path.name for path in raw_files]
        stats = instances.get_mapped_task_instances("ml_pipeline", run_id, "preprocess_stats").task_instances
        assert [(ti.map_index, ti.rendered_map_index) for ti in sorted(stats, key=lambda ti: ti.map_index)] == \
            list(enumerate(raw_names))
        workers = instances.get_mapped_task_instances("ml_pipeline", run_id, "sweep_worker").task_instances
        assert sorted(ti.rendered_map_index for ti in workers) == ["worker 0", "worker 1"]
        shards = instances.get_mapped_task_instances("ml_pipeline", run_id, "infer_shard").task_instances
        assert shards and all(ti.rendered_map_index.split(",")[0] in raw_names and
                              ti.rendered_map_index.endswith(" rows") for ti in shards), \
            [ti.rendered_map_index for ti in shards]

        entry = XComApi(api_client).get_xcom_entry("ml_pipeline", "report", run_id, "return_value", deserialize=True)
        report_uri = entry.actual_instance.value["report_uri"]  # anyOf(native, string): deserialize=True gives native

    report = json.loads(Path(report_uri).read_text())
    assert (report["dag_id"], report["run_id"]) == ("ml_pipeline", run_id)
    assert Path(report_uri).parent.parent == storage_root / "runs" / "ml_pipeline"
    assert report["sweep"]["n_trials"] == 3, "the conf's budget reached the sweep"
    assert report["predictions"]["rows"] == raw_rows and report["test_accuracy"] >= 0.5
    # The README's other way to find it: the newest report under the storage root.
    latest = subprocess.run([sys.executable, "-m", "stagewise.report", "latest"], cwd=REPO_ROOT, capture_output=True,
                            text=True, env={**os.environ, "PYTHONPATH": str(REPO_ROOT),
                                                    "STAGEWISE_CONFIG": str(shared_airflow.configs["ml"])})
    assert latest.returncode == 0, latest.stderr
    assert latest.stdout.strip().splitlines()[-1] == f"REPORT {report_uri}"

