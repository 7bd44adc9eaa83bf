"""The DAG file builds every pipeline's family; a task's process builds only its own DAG; a broken, clashing or deleted
config changes only its own pipeline: it keeps its last valid DAGs (a running run keeps its tasks) and refuses new runs,
or, never valid, gets DAGs that fail naming the file."""

from __future__ import annotations

import pytest
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


KINDS = ("pipeline", "retrain", "batch_inference", "ingest", "maintenance")
FIRST_TASK = {"ingest": "ingest", "maintenance": "apply_retention"}  # the others start with start_run


def _first_task_fails(dag) -> bool:
    """Whether the DAG's first task is the refusal (fails naming the error) rather than the real start."""
    first = dag.get_task(next((task for kind, task in FIRST_TASK.items() if dag.dag_id.endswith(f"_{kind}")), "start_run"))
    return first.python_callable.__name__ == "_fail_with"


def _build(folder, monkeypatch, task: tuple[str, str] | None = None) -> dict:
    from stagewise.airflow.dags import build_pipelines

    if task is None:
        monkeypatch.delenv("_AIRFLOW_PARSING_CONTEXT_DAG_ID", raising=False)
        monkeypatch.delenv("_AIRFLOW_PARSING_CONTEXT_TASK_ID", raising=False)
    else:
        monkeypatch.setenv("_AIRFLOW_PARSING_CONTEXT_DAG_ID", task[0])
        monkeypatch.setenv("_AIRFLOW_PARSING_CONTEXT_TASK_ID", task[1])
    namespace: dict = {}
    assert set(build_pipelines(namespace, str(folder))) == set(namespace)
    return namespace


def test_a_config_that_never_loaded_or_clashes_first_time_gets_failing_dags_of_its_own(tmp_path, storage_root, monkeypatch):
    """A full parse with no last valid version: `bad` (invalid key) gets DAGs whose only task fails naming the file and
    the reason; of two pipelines sharing one registry name only the newer file is refused; `good` is built whole."""
    import os

    shared = {"storage_root": str(storage_root), "registry": {"model_name": "shared"}}
    folder = _folder(tmp_path, storage_root, {"good": {}, "bad": {"sweeep": {}}, "twin_a": shared, "twin_b": shared})
    os.utime(folder / "twin_b.yaml", (2e9, 2e9))  # written after twin_a: twin_b introduced the clash
    namespace = _build(folder, monkeypatch)
    assert len(namespace) == 4 * len(KINDS)
    assert "train_s1" in namespace["good_pipeline"].task_ids and not _first_task_fails(namespace["good_pipeline"])
    assert "train_s1" in namespace["twin_a_pipeline"].task_ids and not _first_task_fails(namespace["twin_a_pipeline"])
    for name, reason in (("bad", "sweeep: unknown key"), ("twin_b", "registry.model_name 'shared'")):
        for kind in KINDS:
            dag = namespace[f"{name}_{kind}"]
            assert dag.task_ids == ["config_error"] and reason in dag.doc_md and str(folder / f"{name}.yaml") in dag.doc_md


def test_a_broken_or_deleted_config_keeps_its_last_valid_dags_and_refuses_new_runs(tmp_path, storage_root, monkeypatch):
    """Once `fraud` has loaded, a typo or deleting its file keeps every one of its DAGs at that version (a running run
    keeps its tasks, in the dag-processor and in a task's own process) while a new run's first task fails naming the
    file and key; `churn` is built as before."""
    folder = _folder(tmp_path, storage_root, {"fraud": {}, "churn": {}})
    before = _build(folder, monkeypatch)
    raw = yaml.safe_load((folder / "fraud.yaml").read_text())
    raw["evaluate"]["min_test_acuracy"] = raw["evaluate"].pop("min_test_accuracy")
    (folder / "fraud.yaml").write_text(yaml.safe_dump(raw))
    for change in ("typo", "deleted"):
        if change == "deleted":
            (folder / "fraud.yaml").unlink()
        after = _build(folder, monkeypatch)
        assert set(after) == set(before)
        for dag_id, dag in before.items():
            assert after[dag_id].task_ids == dag.task_ids, f"{change}: {dag_id} changed shape"
            assert _first_task_fails(after[dag_id]) == dag_id.startswith("fraud_"), change
        start = after["fraud_pipeline"].get_task("start_run")
        with pytest.raises(Exception, match="min_test_acuracy: unknown key" if change == "typo" else "fraud.yaml.* is gone"):
            start.python_callable(*start.op_args)
        in_task = _build(folder, monkeypatch, task=("fraud_pipeline", "train_s2"))
        assert in_task["fraud_pipeline"].task_ids == before["fraud_pipeline"].task_ids
        assert _first_task_fails(_build(folder, monkeypatch, task=("fraud_pipeline", "start_run"))["fraud_pipeline"])


def test_a_clash_refuses_the_file_that_introduced_it_never_both(tmp_path, storage_root, monkeypatch):
    """`old` loaded first; then `newer` claims its registry name (whatever the files' times say) and a third file takes
    its pipeline name: `old` keeps its DAGs, `newer` is refused, and the name thief's error names both files."""
    import os

    from stagewise.airflow.dags import PipelineConfigErrors, check_pipelines

    folder = _folder(tmp_path, storage_root, {"old": {"registry": {"model_name": "shared"}}})
    _build(folder, monkeypatch)
    (folder / "newer.yaml").write_text(yaml.safe_dump({**yaml.safe_load((folder / "old.yaml").read_text())}))
    os.utime(folder / "old.yaml", (2e9, 2e9))  # touched later, yet still the one that was there first
    (folder / "thief.yaml").write_text(yaml.safe_dump({**yaml.safe_load((folder / "old.yaml").read_text()),
                                                       "name": "old"}))
    namespace = _build(folder, monkeypatch)
    assert not _first_task_fails(namespace["old_pipeline"]) and "train_s1" in namespace["old_pipeline"].task_ids
    assert namespace["newer_pipeline"].task_ids == ["config_error"]
    with pytest.raises(PipelineConfigErrors) as caught:
        check_pipelines(str(folder))
    message = str(caught.value)
    assert f"{folder / 'newer.yaml'}: registry.model_name 'shared'" in message and f"is already {folder / 'old.yaml'}'s" in message
    assert f"{folder / 'thief.yaml'}: name: pipeline name 'old' is taken by {folder / 'old.yaml'}" in message
    (folder / "newer.yaml").unlink()
    (folder / "thief.yaml").unlink()
    check_pipelines(str(folder))  # all fixed: no error


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
