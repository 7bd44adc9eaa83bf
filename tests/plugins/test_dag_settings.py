"""The pipeline's ``airflow`` section reaches its DAGs: owner, tags, run limit, start date, default_args, callbacks."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from types import SimpleNamespace

import yaml

from stagewise.core import storage
from stagewise.reporting import timeline
from tests.conftest import REPO_ROOT, base_config


def _bag(tmp_path: Path, storage_root: Path, monkeypatch, airflow: dict):
    from airflow.dag_processing.dagbag import DagBag

    raw = {**base_config(storage_root), "airflow": airflow}
    path = tmp_path / "team.yaml"
    path.write_text(yaml.safe_dump(raw))
    monkeypatch.setenv("STAGEWISE_CONFIG", str(path))
    return DagBag(dag_folder=str(REPO_ROOT / "dags"))


def test_the_teams_dag_settings_and_callbacks_reach_every_dag_beside_stagewises_own(tmp_path, storage_root, monkeypatch):
    """Owner, extra tags, max_active_runs, start_date/catchup and default_args are the config's; a task's
    on_failure_callback is Stagewise's bookkeeping first, then the team's callback, and both fire."""
    from tests.plugins import team_callbacks

    bag = _bag(tmp_path, storage_root, monkeypatch, {
        "owner": "ml-platform", "tags": ["team-x"], "max_active_runs": 2, "start_date": "2025-06-01", "catchup": True,
        "default_args": {"email": ["oncall@example.com"]},
        "on_failure_callback": ["tests.plugins.team_callbacks:page"]})
    assert bag.import_errors == {}
    for dag_id in ("ml_pipeline", "ml_retrain", "ml_batch_inference", "ml_ingest"):
        dag = bag.get_dag(dag_id)
        assert "team-x" in dag.tags and "stagewise" in dag.tags and dag.max_active_runs == 2 and dag.catchup
        assert dag.start_date.date() == dt.date(2025, 6, 1)
        for task in dag.tasks:
            assert task.owner == "ml-platform" and task.email == ["oncall@example.com"]
            ours, theirs = task.on_failure_callback
            assert theirs is team_callbacks.page and ours.__module__ == "stagewise.airflow.steps"
            retry = task.on_retry_callback  # Airflow keeps a single callback as it is or as a list of one
            assert [hook.__module__ for hook in (retry if isinstance(retry, list) else [retry])] == ["stagewise.airflow.steps"]

    # Called in order, as Airflow calls a list: Stagewise records the failed attempt, then the team's callback runs.
    ti = SimpleNamespace(task_id="train_s1", map_index=-1, try_number=1, start_date=None,
                         xcom_pull=lambda **_: None)
    context = {"ti": ti, "dag": SimpleNamespace(dag_id="ml_pipeline"), "run_id": "manual__1"}
    for hook in bag.get_dag("ml_pipeline").get_task("train_s1").on_failure_callback:
        hook(context)
    assert team_callbacks.CALLED[-1] == "train_s1"
    recorded = timeline.records(storage.run_prefix(str(storage_root), "ml_pipeline", "manual__1"))
    assert [(r["task_id"], r["state"]) for r in recorded] == [("train_s1", "failed")]


def test_a_callback_that_does_not_import_breaks_only_its_own_pipeline_naming_the_key(tmp_path, storage_root, monkeypatch):
    """A typo in a callback path: that pipeline's four DAGs keep their ids but hold one task that fails naming the key,
    without retry; a second pipeline in the same folder parses as usual; the DAG file has no import error, the check
    file alone has one, naming the file and the key."""
    from airflow.dag_processing.dagbag import DagBag

    folder = tmp_path / "pipelines"
    folder.mkdir()
    for name, airflow in (("typo", {"on_failure_callback": ["tests.plugins.team_callbacks:pgae"]}), ("fine", {})):
        raw = {**base_config(storage_root / name), "name": name, "airflow": airflow}
        (folder / f"{name}.yaml").write_text(yaml.safe_dump(raw))
    monkeypatch.setenv("STAGEWISE_PIPELINES", str(folder))
    bag = DagBag(dag_folder=str(REPO_ROOT / "dags"))
    check_file = str(REPO_ROOT / "dags" / "stagewise_pipelines_check.py")
    assert list(bag.import_errors) == [check_file]
    assert f"{folder / 'typo.yaml'}: ImportError: airflow.on_failure_callback: cannot import" in bag.import_errors[check_file]
    for kind in ("pipeline", "retrain", "batch_inference", "ingest"):
        broken, fine = bag.get_dag(f"typo_{kind}"), bag.get_dag(f"fine_{kind}")
        assert [task.task_id for task in broken.tasks] == ["config_error"] and broken.tasks[0].retries == 0
        assert "airflow.on_failure_callback: cannot import tests.plugins.team_callbacks:pgae" in broken.doc_md
        assert str(folder / "typo.yaml") in broken.doc_md and "config error" in broken.tags
        assert "config_error" not in fine.task_ids and "config error" not in fine.tags


def test_without_an_airflow_section_the_dags_keep_their_defaults(tmp_path, storage_root, monkeypatch):
    """No section: owner stagewise, 4 concurrent runs (retrain 1), no catchup, the DAGs' own tags."""
    bag = _bag(tmp_path, storage_root, monkeypatch, {})
    assert (bag.get_dag("ml_pipeline").max_active_runs, bag.get_dag("ml_retrain").max_active_runs) == (4, 1)
    assert set(bag.get_dag("ml_retrain").tags) == {"stagewise", "ml", "retrain"} and not bag.get_dag("ml_retrain").catchup
    assert {task.owner for task in bag.get_dag("ml_ingest").tasks} == {"stagewise"}


def test_a_large_model_args_stays_out_of_every_dags_default_args(tmp_path, storage_root, monkeypatch):
    """A 10 MB string in model.args sat in every DAG's default_args (the serialized DAG, REST's DAG details): each DAG
    now carries a digest of model.args and no more, whatever their size, and the api-server's pages read the rest of
    the config from it as before."""
    import hashlib
    import json

    from airflow.serialization.serialized_objects import DagSerialization

    from stagewise.airflow.ui.pipelines import _pipeline_of

    args = {"blob": "x" * 10_000_000, "width": 8}
    raw = {**base_config(storage_root), "model": {"args": args}}
    path = tmp_path / "team.yaml"
    path.write_text(yaml.safe_dump(raw, width=1 << 30))
    monkeypatch.setenv("STAGEWISE_CONFIG", str(path))
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(REPO_ROOT / "dags"))
    assert bag.import_errors == {} and len(bag.dags) == 5
    encoded = json.dumps(args, sort_keys=True).encode()
    for dag in bag.dags.values():
        carried = dag.default_args["stagewise_pipeline"]
        assert carried["config"]["model"]["args"] == {}
        assert carried["model_args"] == {"sha256": hashlib.sha256(encoded).hexdigest(), "bytes": len(encoded)}
        serialized = DagSerialization.to_dict(dag)
        assert len(json.dumps(serialized)) < 200_000, dag.dag_id
        name, config = _pipeline_of(dag.dag_id, serialized)
        assert (name, config.storage_root, config.model.spec) == ("ml", str(storage_root), raw["model"].get(
            "spec", config.model.spec))
