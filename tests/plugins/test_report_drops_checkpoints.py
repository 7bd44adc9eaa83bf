"""The training DAG drops its finished stages' optimizer-carrying files only in its report task (steps.write_report,
stagewise.reuse.leftovers), and that task runs only when every task before it succeeded: a run that fails anywhere
keeps every checkpoint, so a retry or a clear resumes from them."""

from __future__ import annotations

import inspect

import yaml

from tests.conftest import unnamed


def test_only_a_succeeded_run_reaches_the_drop(tmp_path, storage_root, monkeypatch):
    """The report task waits for all its upstream tasks to succeed (trigger rule all_success) and every training
    stage is upstream of it; the drop is called from the report step and nowhere else in the Airflow glue."""
    from stagewise.airflow import steps
    from stagewise.airflow.dags import build_pipelines

    folder = tmp_path / "pipelines"
    folder.mkdir()
    (folder / "digits.yaml").write_text(yaml.safe_dump(unnamed(storage_root)))
    monkeypatch.setenv("_AIRFLOW_PARSING_CONTEXT_DAG_ID", "digits_pipeline")
    namespace: dict = {}
    build_pipelines(namespace, str(folder))
    dag = namespace["digits_pipeline"]
    report = dag.get_task("report")
    assert report.trigger_rule == "all_success"
    upstream = report.get_flat_relative_ids(upstream=True)
    stages = [task_id for task_id in dag.task_ids if task_id.startswith("train_")]
    assert stages and set(stages) <= upstream
    assert "drop_finished" in inspect.getsource(steps.write_report)
    glue = "".join(inspect.getsource(function) for name, function in inspect.getmembers(steps, inspect.isfunction)
                   if name != "write_report" and function.__module__ == steps.__name__)
    assert "drop_finished" not in glue
