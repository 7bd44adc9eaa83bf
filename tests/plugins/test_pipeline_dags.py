"""The DAG file builds every pipeline's family; a task's process builds only its own DAG; a broken config or a
registry clash turns only its own pipeline's DAGs into ones that fail naming the file."""

from __future__ import annotations

import yaml

from tests.conftest import unnamed


def _folder(tmp_path, storage_root, configs: dict[str, dict]):
    folder = tmp_path / "pipelines"
    folder.mkdir()
    for name, changes in configs.items():
        (folder / f"{name}.yaml").write_text(yaml.safe_dump({**unnamed(storage_root / name), **changes}))
    return folder


def test_a_tasks_process_builds_only_the_dag_it_runs_and_loads_no_other_config(tmp_path, storage_root, monkeypatch):
    """With Airflow's parsing context set (as in a task's process), only that DAG is built: the other pipeline's
    config is not even validated (its broken file costs nothing and fails nothing)."""
    from stagewise.airflow.dags import build_pipelines

    folder = _folder(tmp_path, storage_root, {"fraud": {}, "churn": {}})
    (folder / "churn.yaml").write_text("storage_root: [")  # would be a placeholder family in a full parse
    monkeypatch.setenv("_AIRFLOW_PARSING_CONTEXT_DAG_ID", "fraud_retrain")
    namespace: dict = {}
    assert build_pipelines(namespace, str(folder)) == ["fraud_retrain"]
    assert "train_s2" in namespace["fraud_retrain"].task_ids


def test_a_broken_config_or_a_registry_clash_breaks_only_its_own_family(tmp_path, storage_root, monkeypatch):
    """A full parse: `bad` (invalid key) and the two pipelines sharing one registry name get DAGs whose only task
    fails naming the file and the reason; `good` is built whole."""
    from stagewise.airflow.dags import build_pipelines

    monkeypatch.delenv("_AIRFLOW_PARSING_CONTEXT_DAG_ID", raising=False)
    shared = {"storage_root": str(storage_root), "registry": {"model_name": "shared"}}
    folder = _folder(tmp_path, storage_root, {"good": {}, "bad": {"sweeep": {}}, "twin_a": shared, "twin_b": shared})
    namespace: dict = {}
    added = build_pipelines(namespace, str(folder))
    assert len(added) == 16 and set(added) == set(namespace)
    assert "config_error" not in namespace["good_pipeline"].task_ids and "train_s1" in namespace["good_pipeline"].task_ids
    for name, reason in (("bad", "sweeep: unknown key"), ("twin_a", "registry.model_name 'shared'"),
                         ("twin_b", "registry.model_name 'shared'")):
        for kind in ("pipeline", "retrain", "batch_inference", "ingest"):
            dag = namespace[f"{name}_{kind}"]
            assert dag.task_ids == ["config_error"] and reason in dag.doc_md and str(folder / f"{name}.yaml") in dag.doc_md


def test_every_task_runs_with_its_dags_params_though_they_are_set_after_the_tasks(tmp_path, storage_root, monkeypatch):
    """The DAGs get their Params once their tasks exist (no copy per task); what a task runs with is what Airflow
    merges at run time (process_params): the DAG's defaults, the trigger conf over them, its bounds enforced."""
    import pytest
    from airflow.sdk.definitions.param import ParamValidationError, process_params

    from stagewise.airflow.dags import build_pipelines

    monkeypatch.delenv("_AIRFLOW_PARSING_CONTEXT_DAG_ID", raising=False)
    namespace: dict = {}
    build_pipelines(namespace, str(_folder(tmp_path, storage_root, {"fraud": {}})))
    for dag_id, wanted in (("fraud_pipeline", "num_trials"), ("fraud_retrain", "num_trials"),
                           ("fraud_batch_inference", "model_version"), ("fraud_ingest", "source_uri")):
        dag = namespace[dag_id]
        conf = {"source_uri": "/data/new"} if dag_id == "fraud_ingest" else {}  # ingest's one Param has no default
        defaults = {name: dag.params.get_param(name).value for name in dag.params}
        assert wanted in defaults
        for task in dag.tasks:
            assert dict(task.params) == {}
            assert process_params(dag, task, conf, suppress_exception=False) == {**defaults, **conf}
    training = namespace["fraud_pipeline"]
    sweep = training.get_task("create_study")
    assert process_params(training, sweep, {"num_trials": 3}, suppress_exception=False)["num_trials"] == 3
    with pytest.raises(ParamValidationError, match="num_trials"):
        process_params(training, sweep, {"num_trials": 0}, suppress_exception=False)
