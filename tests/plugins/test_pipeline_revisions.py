"""A pipelines folder delivered as git-sync delivers it (a symlink swapped atomically onto each revision's folder): the
last valid version of each pipeline is keyed by the folder as configured and the pipeline's name, so a typo in a new
revision keeps the running run's tasks; a clash and a deletion in one revision are both reported; the registry's owner
record keeps a contested model name; a rename in place keeps the registry; a retired pipeline's schedule stops."""

from __future__ import annotations

import os

import pytest
import yaml

from stagewise.config import check
from stagewise.models import owners
from tests.conftest import unnamed
from tests.plugins.test_pipeline_dags import KINDS, _build, _first_task_fails


class GitSync:
    """A sync root whose link ``pipelines`` points at one revision folder at a time, swapped as git-sync swaps it."""

    def __init__(self, root):
        self.root, self.revision = root, 0
        root.mkdir()
        self.link = root / "pipelines"

    def publish(self, configs: dict[str, dict], mtimes: dict[str, float] | None = None):
        """A new revision holding ``configs`` (file stem -> raw config); the link moves onto it in one rename."""
        self.revision += 1
        folder = self.root / f"rev-{self.revision:04d}"
        folder.mkdir()
        for stem, raw in configs.items():
            (folder / f"{stem}.yaml").write_text(yaml.safe_dump(raw))
        for stem, mtime in (mtimes or {}).items():
            os.utime(folder / f"{stem}.yaml", (mtime, mtime))
        partial = self.root / "pipelines.partial"
        partial.symlink_to(folder.name)
        os.replace(partial, self.link)
        return self.link


@pytest.fixture
def sync(tmp_path, monkeypatch):
    monkeypatch.setenv("STAGEWISE_STATE_DIR", str(tmp_path / "state"))
    return GitSync(tmp_path / "git")


def _check_errors(folder, monkeypatch) -> str:
    """check_pipelines' import error (empty when every pipeline loads), as the dag-processor parses it."""
    from stagewise.airflow.dags import PipelineConfigErrors, check_pipelines

    monkeypatch.delenv("_AIRFLOW_PARSING_CONTEXT_DAG_ID", raising=False)
    monkeypatch.delenv("_AIRFLOW_PARSING_CONTEXT_TASK_ID", raising=False)

    try:
        check_pipelines(str(folder))
    except PipelineConfigErrors as exc:
        return str(exc)
    return ""


def _retired(dag) -> bool:
    return "retired" in dag.tags and "retired:" in dag.doc_md and dag.timetable.__class__.__name__ == "NullTimetable"


def test_a_git_sync_swap_through_revisions_keeps_each_pipelines_last_valid_version(sync, storage_root, monkeypatch):
    """rev1 fraud and churn load (fraud registers: the registry's owner record). rev2: a typo in fraud; its DAGs keep
    their shape and the typo is reported. rev3: fraud fixed, copycat (an older file) claims fraud's model name and
    churn is deleted: both reported, fraud keeps the name, churn's DAGs retire (no schedule). rev4: all restored."""
    fraud, churn = unnamed(storage_root / "fraud"), unnamed(storage_root / "churn")
    link = sync.publish({"fraud": fraud, "churn": churn})
    first = _build(link, monkeypatch)
    owners.claim(str(storage_root / "fraud"), "digits", "fraud", str(link / "fraud.yaml"), "fraud_pipeline/r1")
    assert str(link / "fraud.yaml") in first["fraud_pipeline"].doc_md  # the configured path, not a revision's

    typo = yaml.safe_load(yaml.safe_dump(fraud))
    typo["evaluate"]["min_test_acuracy"] = typo["evaluate"].pop("min_test_accuracy")
    sync.publish({"fraud": typo, "churn": churn})
    second = _build(link, monkeypatch)
    assert {dag_id: dag.task_ids for dag_id, dag in second.items()} == {dag_id: dag.task_ids for dag_id, dag in first.items()}
    assert _first_task_fails(second["fraud_pipeline"]) and not _first_task_fails(second["churn_pipeline"])
    in_task = _build(link, monkeypatch, task=("fraud_pipeline", "train_s2"))  # a running run's next task
    assert in_task["fraud_pipeline"].task_ids == first["fraud_pipeline"].task_ids
    assert "min_test_acuracy: unknown key" in _check_errors(link, monkeypatch)

    sync.publish({"fraud": fraud, "copycat": fraud}, mtimes={"copycat": 1e9})  # copycat's file looks older
    third = _build(link, monkeypatch)
    assert not _first_task_fails(third["fraud_pipeline"]) and "train_s1" in third["fraud_pipeline"].task_ids
    assert third["copycat_pipeline"].task_ids == ["config_error"]
    # a run's first task judges the clash as the full parse does, though it builds only its own DAG
    assert _build(link, monkeypatch, task=("copycat_pipeline", "start_run"))["copycat_pipeline"].task_ids == ["config_error"]
    assert all(_retired(third[f"churn_{kind}"]) for kind in KINDS)
    assert third["churn_pipeline"].task_ids == first["churn_pipeline"].task_ids  # churn's running runs finish
    assert not _retired(third["fraud_retrain"]) and third["fraud_retrain"].timetable.__class__.__name__ != "NullTimetable"
    errors = _check_errors(link, monkeypatch)
    assert f"{link / 'copycat.yaml'}: registry.model_name 'digits'" in errors and f"{link / 'fraud.yaml'}'s" in errors
    assert f"{link / 'churn.yaml'}: the config file of pipeline 'churn' is gone" in errors
    with pytest.raises(SystemExit) as cli:  # the CLI on the deployment's host names the same files
        check(str(link))
    assert f"{link / 'copycat.yaml'}: registry.model_name" in str(cli.value) and "'churn' is gone" in str(cli.value)
    assert f"{link / 'fraud.yaml'}: registry.model_name" not in str(cli.value)

    sync.publish({"fraud": fraud, "churn": churn})
    fourth = _build(link, monkeypatch)
    assert _check_errors(link, monkeypatch) == ""
    assert not any(_first_task_fails(dag) or "retired" in dag.tags for dag in fourth.values())
    assert fourth["churn_retrain"].timetable.__class__.__name__ != "NullTimetable"
    assert len(list((sync.root.parent / "state" / "last-valid").iterdir())) == 1  # one key through every revision


def test_a_rename_in_place_keeps_the_registry_and_retires_the_old_names_dags(sync, storage_root, monkeypatch):
    """fraud.yaml's `name:` becomes fraud2: no clash in the deployment nor in the CLI (with or without the deployment's
    state); fraud2 is built whole, fraud's DAGs stay for their running runs, retired; fraud2's first registration
    takes the owner record over, so a newcomer claiming the name is refused; --forget drops the old DAGs."""
    from stagewise.config import main

    fraud = unnamed(storage_root)
    link = sync.publish({"fraud": fraud})
    _build(link, monkeypatch)
    owners.claim(str(storage_root), "digits", "fraud", str(link / "fraud.yaml"), "fraud_pipeline/r1")

    sync.publish({"fraud": {**fraud, "name": "fraud2"}})
    renamed = _build(link, monkeypatch)
    assert not _first_task_fails(renamed["fraud2_pipeline"]) and "train_s1" in renamed["fraud2_pipeline"].task_ids
    assert all(_retired(renamed[f"fraud_{kind}"]) and _first_task_fails(renamed[f"fraud_{kind}"]) for kind in KINDS)
    assert "renamed to 'fraud2'" in renamed["fraud_retrain"].doc_md
    assert _check_errors(link, monkeypatch) == ""
    check(str(link))  # exit 0, as the deployment: no error
    monkeypatch.setenv("STAGEWISE_STATE_DIR", str(sync.root.parent / "ci-state"))
    check(str(link))  # a CI host without the deployment's state agrees
    monkeypatch.setenv("STAGEWISE_STATE_DIR", str(sync.root.parent / "state"))

    owners.claim(str(storage_root), "digits", "fraud2", str(link / "fraud.yaml"), "fraud2_pipeline/r1")
    assert owners.read(str(storage_root), "digits") == owners.Owner("fraud2", "fraud.yaml", ("fraud",))
    sync.publish({"fraud": {**fraud, "name": "fraud2"}, "copycat": fraud}, mtimes={"copycat": 1e9})
    errors = _check_errors(link, monkeypatch)
    assert f"{link / 'copycat.yaml'}: registry.model_name 'digits'" in errors and "fraud.yaml's" in errors
    with pytest.raises(SystemExit, match="copycat.yaml: registry.model_name 'digits'"):
        check(str(link))

    sync.publish({"fraud": {**fraud, "name": "fraud2"}})
    main(["--forget", "fraud", "--pipelines", str(link)])
    assert not any(dag_id.startswith("fraud_") for dag_id in _build(link, monkeypatch))
