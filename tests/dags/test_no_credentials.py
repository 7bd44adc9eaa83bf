"""Issue 43: a credential given the ways the docs allow (an Airflow connection each: the study's PostgreSQL through
sweep.storage_conn_id, S3 keys through storage_conn_id, MLflow's through tracking.conn_id) reaches no DAG detail a
viewer reads over REST, no serialized DAG, snapshot, report, tracking record, XCom, task log or component log.

One live stack (api-server, scheduler, dag-processor), one pipeline run with the study on a real PostgreSQL database
whose connection is created over REST, then every output is searched for each planted password.
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path

import httpx
import pytest
import yaml

from tests import run_cache
from tests.conftest import base_config
from tests.live_airflow import REPO_ROOT, LiveAirflow

pytestmark = [pytest.mark.airflow, pytest.mark.torchrun, pytest.mark.service]

# Random each run, so a value found can only have come from this test's connections.
PLANTED = {name: f"planted-{name}-{secrets.token_hex(8)}" for name in ("study", "s3", "mlflow")}


def _found(text: str | bytes) -> list[str]:
    """The planted passwords that appear in ``text``."""
    data = text.encode() if isinstance(text, str) else text
    return [name for name, value in PLANTED.items() if value.encode() in data]


def _viewer(live: LiveAirflow) -> httpx.Client:
    """A REST client logged in as the viewer (the simple auth manager wrote its generated password beside ours)."""
    passwords = json.loads((live.home / "simple_auth_manager_passwords.json.generated").read_text())
    with httpx.Client(base_url=live.base_url, timeout=60.0, trust_env=False) as client:
        token = client.post("/auth/token", json={"username": "viewer", "password": passwords["viewer"]})
    assert token.status_code in (200, 201), token.text
    return httpx.Client(base_url=live.base_url, timeout=60.0, trust_env=False,
                        headers={"Authorization": f"Bearer {token.json()['access_token']}"})


@pytest.mark.slow
def test_no_planted_password_reaches_a_viewer_a_file_or_a_log(tmp_path, postgres_databases, mlflow_server):
    """The run succeeds with its study on the connection's database, and none of the three passwords is in what a
    viewer reads of every DAG of the pipeline, in any file the run wrote, in MLflow's store, in Airflow's metadata
    DB, in any XCom, task log or component log."""
    from sqlalchemy.engine import make_url

    database = make_url(postgres_databases())
    root, folder = tmp_path / "storage", tmp_path / "pipelines"
    folder.mkdir()
    raw = {**base_config(root), "name": "vault", "storage_conn_id": "vault_s3",
           "tracking": {"mlflow_uri": mlflow_server.uri, "experiment": "vault", "conn_id": "vault_mlflow"}}
    raw["sweep"].update(storage="", storage_conn_id="vault_optuna", num_trials=2, num_workers=1)
    config = folder / "vault.yaml"
    config.write_text(yaml.safe_dump(raw))
    run_cache.demo_data(config)
    env = {"STAGEWISE_PIPELINES": str(folder), "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "admin:admin,viewer:viewer",
           "AIRFLOW_CONN_VAULT_S3": json.dumps({"conn_type": "aws", "login": "AKIAVAULT", "password": PLANTED["s3"]}),
           "AIRFLOW_CONN_VAULT_MLFLOW": json.dumps({"conn_type": "http", "login": "stagewise",
                                                    "password": PLANTED["mlflow"]})}
    with LiveAirflow(tmp_path / "live", REPO_ROOT / "dags", env) as live:
        # The study's connection the way an operator makes one in the UI: stored (encrypted) in the metadata DB.
        live.api("POST", "/api/v2/connections", expect=(200, 201), json={
            "connection_id": "vault_optuna", "conn_type": "postgres", "host": database.host, "port": database.port,
            "login": database.username, "password": PLANTED["study"], "schema": database.database})
        live.api("POST", "/api/v2/pools", expect=(200, 201), json={"name": "cpu_cores", "slots": 2})
        live.wait_for_dag("vault_pipeline")
        live.unpause("vault_pipeline")
        run_id = live.trigger("vault_pipeline")
        # 420 s: the whole pipeline on a busy 2-core machine (the suite's other workers) took 280 s once.
        assert live.wait_for_run("vault_pipeline", run_id, timeout=420) == "success", live.logs_tail()

        seen: dict[str, str] = {}
        with _viewer(live) as viewer:
            dag_ids = [dag["dag_id"] for dag in viewer.get("/api/v2/dags", params={"limit": 100}).json()["dags"]]
            assert "vault_pipeline" in dag_ids
            for dag_id in dag_ids:
                details = viewer.get(f"/api/v2/dags/{dag_id}/details")
                assert details.status_code == 200, details.text  # a viewer reads default_args: they must hold nothing
                seen[f"viewer: {dag_id} details"] = details.text
                for path in (f"/api/v2/dags/{dag_id}/tasks", f"/api/v2/dags/{dag_id}/dagRuns",
                             f"/ui/structure/structure_data?dag_id={dag_id}"):
                    seen[f"viewer: {path}"] = viewer.get(path).text
        for ti in live.task_instances("vault_pipeline", run_id):
            where = f"{ti['task_id']}[{ti['map_index']}]"
            seen[f"task log {where}"] = live.task_log("vault_pipeline", run_id, ti["task_id"], ti["try_number"],
                                                      ti["map_index"])
            entries = live.api("GET", f"/api/v2/dags/vault_pipeline/dagRuns/{run_id}/taskInstances/{ti['task_id']}"
                                      f"/xcomEntries", params={"map_index": ti["map_index"]}).json()["xcom_entries"]
            for entry in entries:
                seen[f"xcom {where} {entry['key']}"] = json.dumps(
                    live.xcom("vault_pipeline", run_id, ti["task_id"], entry["key"], ti["map_index"]), default=str)
        for name in ("api-server", "scheduler", "dag-processor", "log-server"):
            seen[f"component log {name}"] = live.component_log(name)

    files = {path: path.read_bytes() for base in (root, live.tmp_dir, Path(mlflow_server.folder))
             for path in base.rglob("*") if path.is_file()}
    assert any(path.name == "report.json" for path in files) and any(path.name == "config.yaml" for path in files)
    assert any(path.name == "mlflow.json" for path in files), "tracking wrote no record to search"
    # Controls: the searched texts hold the config (where the URL used to be) and the study's own log lines.
    assert "vault_optuna" in seen["viewer: vault_pipeline details"] and "vault_mlflow" in seen["viewer: vault_pipeline details"]
    assert any("postgresql+psycopg2" in text for where, text in seen.items() if where.startswith("task log"))
    leaks = {where: _found(text) for where, text in seen.items() if _found(text)}
    leaks.update({str(path): _found(data) for path, data in files.items() if _found(data)})
    assert not leaks, f"planted passwords found: {leaks}"
    # The study really ran on the connection's database, and the snapshot names the connection, not a URL.
    snapshot = yaml.safe_load(next(root.glob("runs/vault_pipeline/*/config.yaml")).read_text())
    assert snapshot["sweep"]["storage"] == "" and snapshot["sweep"]["storage_conn_id"] == "vault_optuna"
    summary = json.loads(next(root.glob("runs/vault_pipeline/*/sweep/summary.json")).read_text())
    assert summary["storage_kind"] == "postgresql+psycopg2" and summary["n_trials"] == 2
