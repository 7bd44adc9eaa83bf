"""Every DAG of a pipeline gives its light tasks the bookkeeping profile (pool, fixed weight) and its heavy tasks their
own profiles, so a light task never queues behind another run's training or sweep (issue 44 item 5)."""

from __future__ import annotations

import yaml

from stagewise.definitions.bookkeeping import BOOKKEEPING_POOL, BOOKKEEPING_WEIGHT
from tests.conftest import unnamed

LIGHT = {"start_run", "plan_shards", "reduce_stats", "commit_preprocess", "create_study", "sweep_summary",
         "register_model", "gate_model", "plan_inference", "commit_predictions", "report", "resolve_model", "ingest"}
HEAVY = {"preprocess_stats", "preprocess_transform", "sweep_worker", "train_s1", "train_s2", "evaluate", "infer_shard"}


def _dags(tmp_path, raw: dict, monkeypatch) -> dict:
    from stagewise.airflow.dags import build_pipelines

    folder = tmp_path / "pipelines"
    folder.mkdir()
    (folder / "fraud.yaml").write_text(yaml.safe_dump(raw))
    for name in ("_AIRFLOW_PARSING_CONTEXT_DAG_ID", "_AIRFLOW_PARSING_CONTEXT_TASK_ID"):
        monkeypatch.delenv(name, raising=False)
    namespace: dict = {}
    build_pipelines(namespace, str(folder))
    return namespace


def test_light_tasks_carry_the_bookkeeping_pool_and_an_absolute_weight(tmp_path, storage_root, monkeypatch):
    """In the training, retrain, batch inference and ingest DAGs every light task is in the bookkeeping pool with a
    fixed weight above every heavy task's, which keep their profiles' pools and Stagewise's default weight (1,
    absolute: older runs first)."""
    dags = _dags(tmp_path, unnamed(storage_root), monkeypatch)
    seen = set()
    for kind in ("pipeline", "retrain", "batch_inference", "ingest"):
        dag = dags[f"fraud_{kind}"]
        for task in dag.tasks:
            seen.add(task.task_id)
            if task.task_id in LIGHT:
                assert (task.pool, task.weight_rule, task.priority_weight) == (
                    BOOKKEEPING_POOL, "absolute", BOOKKEEPING_WEIGHT), (kind, task.task_id)
            else:
                assert task.task_id in HEAVY, task.task_id
                # Absolute: a downstream sum would add the light tasks' own weights and outrank them.
                assert (task.pool, task.weight_rule, task.priority_weight) == ("cpu_cores", "absolute", 1), task.task_id
    assert seen == LIGHT | HEAVY


def test_the_users_bookkeeping_profile_reaches_the_tasks(tmp_path, storage_root, monkeypatch):
    """profiles.bookkeeping in the pipeline config sets the light tasks' pool, weight and retries, start_run's too (a
    bad conf still fails it without retry: the user's error)."""
    raw = unnamed(storage_root)
    raw["pools"]["light"] = {"slots": 3}
    raw["profiles"]["bookkeeping"] = {"pool": "light", "priority_weight": 77, "weight_rule": "downstream", "retries": 4}
    dag = _dags(tmp_path, raw, monkeypatch)["fraud_pipeline"]
    report, start = dag.get_task("report"), dag.get_task("start_run")
    assert (report.pool, report.priority_weight, report.weight_rule, report.retries) == ("light", 77, "downstream", 4)
    assert (start.pool, start.retries) == ("light", 4)
    assert dag.get_task("train_s1").pool == "cpu_cores"


def test_create_study_drawing_data_subsets_stays_in_the_compute_pool(tmp_path, storage_root, monkeypatch):
    """A sweep on a row budget draws its subsets in create_study (a sub-job over the data): that task is work."""
    raw = unnamed(storage_root)
    raw["sweep"]["validation_rows"] = 100
    dag = _dags(tmp_path, raw, monkeypatch)["fraud_pipeline"]
    assert dag.get_task("create_study").pool == "cpu_cores"
    assert dag.get_task("sweep_summary").pool == BOOKKEEPING_POOL
