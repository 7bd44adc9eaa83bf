"""The raw-data Asset: one per data set location, shared by ingest's outlet and retrain's schedule."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.conftest import base_config

REPO_ROOT = Path(__file__).resolve().parents[2]


def _dags_for(tmp_path: Path, monkeypatch, dataset_uri: str) -> dict:
    """Parse the DAG folder with Airflow's DagBag under a config whose dataset.uri is ``dataset_uri``."""
    from airflow.dag_processing.dagbag import DagBag

    storage_root = tmp_path / "storage"
    raw = base_config(storage_root)
    raw["dataset"]["uri"] = dataset_uri
    config_path = tmp_path / f"pipeline-{dataset_uri.replace('/', '_')}.yaml"
    config_path.write_text(yaml.safe_dump(raw))
    monkeypatch.setenv("STAGEWISE_CONFIG", str(config_path))
    bag = DagBag(dag_folder=str(REPO_ROOT / "dags"))
    assert bag.import_errors == {}
    return {"ingest": bag.dags["ml_ingest"].get_task("ingest").outlets[0],
            "retrain": bag.dags["ml_retrain"].timetable.asset_condition.objects[0]}


def test_a_changed_dataset_uri_yields_a_new_asset_shared_by_ingest_and_retrain(tmp_path, monkeypatch):
    """After dataset.uri changes, ingest's outlet is an asset with the new URI and a name of its own (Airflow binds a
    name to its first URI, so reusing the old name leaves the new asset inactive and ingest failing), and retrain is
    scheduled on exactly that asset."""
    first = _dags_for(tmp_path, monkeypatch, "raw/digits")
    second = _dags_for(tmp_path, monkeypatch, "raw/digits_v2")
    for assets, folder in ((first, "raw/digits"), (second, "raw/digits_v2")):
        assert assets["ingest"] == assets["retrain"], "retrain listens to the asset ingest emits"
        assert assets["ingest"].uri == f"file://{tmp_path / 'storage' / folder}"
        assert assets["ingest"].name.startswith("stagewise_raw_data")
    assert first["ingest"].name != second["ingest"].name
    assert _dags_for(tmp_path, monkeypatch, "raw/digits")["ingest"] == first["ingest"], "the same location, the same asset"


@pytest.mark.airflow
@pytest.mark.slow
def test_ingest_after_a_dataset_uri_change_emits_an_event_on_the_new_asset(tmp_path):
    """`airflow dags test ml_ingest` under one dataset.uri, then under another: the second run's outlet asset is active
    (no 'inactive assets' refusal) and an asset event for the new location is recorded."""
    import json
    import sqlite3

    from stagewise.datasets.demo import write_digits
    from tests.dags.conftest import airflow, make_airflow_env

    storage_root = tmp_path / "storage"
    (tmp_path / "home").mkdir()
    env = make_airflow_env(tmp_path / "home", str(storage_root), tmp_path)
    new_data = tmp_path / "new"
    write_digits(str(new_data), num_shards=1)
    raw = yaml.safe_load(Path(env["STAGEWISE_CONFIG"]).read_text())
    raw["dataset"]["uri"] = "raw/digits_moved"
    moved_config = tmp_path / "moved.yaml"
    moved_config.write_text(yaml.safe_dump(raw))
    conf = json.dumps({"source_uri": str(new_data)})
    airflow(env, "dags", "test", "ml_ingest", "-c", conf)
    second = airflow({**env, "STAGEWISE_CONFIG": str(moved_config)}, "dags", "test", "ml_ingest", "-c", conf)
    assert "inactive assets" not in second.stdout + second.stderr
    with sqlite3.connect(tmp_path / "home" / "airflow.db") as db:
        uris = [row[0] for row in db.execute("SELECT asset.uri FROM asset_event JOIN asset ON asset.id = asset_event.asset_id")]
    assert f"file://{storage_root}/raw/digits_moved" in uris, uris
