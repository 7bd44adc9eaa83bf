"""A run started by `airflow dags test` (docs/ci.md) is safe by default: start_run puts it in a scratch root of its own
under AIRFLOW_HOME (or $STAGEWISE_SCRATCH_ROOT's) and says so first; a pipeline named in $STAGEWISE_TEST_RUNS_WRITE
writes production. Any other run is untouched."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
from airflow.sdk.execution_time.context import set_current_context
from airflow.utils.types import DagRunTriggeredByType

from stagewise import registry
from stagewise.airflow import steps
from stagewise.airflow.params import pipeline_params
from stagewise.definitions.config import ConfigError
from stagewise.definitions.loading import SCRATCH_ENV_VAR, TEST_RUNS_WRITE_ENV_VAR, load_config

BY_TEST = {"triggering_user_name": "dag_test"}  # what the task SDK's dag run of DAG.test() carries (no triggered_by)


def _files(folder: Path) -> dict[str, str]:
    return {str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(folder.rglob("*")) if path.is_file()}


def _start(path: Path, mode: str = "pipeline", **dag_run: object) -> dict:
    params = {name: param.resolve() for name, param in pipeline_params(load_config(path)).items()}
    context = {"ti": SimpleNamespace(try_number=1), "run_id": "manual__1", "params": params,
               "dag": SimpleNamespace(dag_id=f"ml_{'retrain' if mode == 'retrain' else 'pipeline'}", params=params),
               "dag_run": SimpleNamespace(conf={}, **dag_run)}
    steps._cached_config.cache_clear()
    with set_current_context(context):
        return steps.start_run(mode=mode, config_file=str(path))


@pytest.fixture
def production(write_config, storage_root, tmp_path, monkeypatch) -> Path:
    """The pipeline ml's config; its storage root's registry has a current model from the study 'prod_study'; no
    CI variable, no opt-in, AIRFLOW_HOME a folder of its own."""
    for name in (SCRATCH_ENV_VAR, TEST_RUNS_WRITE_ENV_VAR):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AIRFLOW_HOME", str(tmp_path / "home"))
    path = write_config()
    config = load_config(path)
    model = tmp_path / "prod.pt"
    model.write_bytes(b"production weights")
    card = registry.register(str(storage_root), config.registry.model_name, str(model),
                             {"test_accuracy": 0.99, "study": "prod_study"})
    registry.promote(str(storage_root), config.registry.model_name, card["version"])
    return path


def test_a_test_run_retrains_in_its_own_scratch_and_says_so_first(production, storage_root, tmp_path, caplog):
    """Without $STAGEWISE_SCRATCH_ROOT a retrain started by a test runs under $AIRFLOW_HOME/stagewise-scratch/ml: its
    snapshot says so (report-only storage registry, no MLflow, journal in scratch), its warm start is the scratch
    registry's (none), not production's study; its input is still production's; not a byte of production changed;
    start_run's first log line names the scratch root and the opt-in."""
    before = _files(storage_root)
    with caplog.at_level(logging.INFO):
        run = _start(production, mode="retrain", **BY_TEST)
    scratch = tmp_path / "home" / "stagewise-scratch" / "ml"
    assert run["out"].startswith(str(scratch)) and run["config"].startswith(str(scratch))
    config = steps.run_config(run)
    assert config.storage_root == str(scratch) and config.storage_conn_id == ""
    assert (config.registry.backend, config.registry.report_only, config.tracking.mlflow_uri) == ("storage", True, "")
    assert config.sweep.storage == f"journal://{scratch / 'optuna' / 'studies' / '{study}.journal'}"
    assert config.sweep.warm_start_from == "" and run["overrides"]["sweep.warm_start_from"] == ""
    assert config.dataset.uri == str(storage_root / "raw" / "digits"), "the input is read where production reads it"
    assert _files(storage_root) == before, "nothing under the production storage root changed"
    first = caplog.records[0]
    assert first.name == "stagewise.start_run" and f"under {scratch.parent}" in first.getMessage()
    assert f"${TEST_RUNS_WRITE_ENV_VAR}=ml" in first.getMessage()


def test_a_pipeline_opted_in_by_name_writes_production(production, storage_root, monkeypatch, caplog):
    """$STAGEWISE_TEST_RUNS_WRITE naming ml: the test run is production's (its warm start is production's study)."""
    monkeypatch.setenv(TEST_RUNS_WRITE_ENV_VAR, "diabetes, ml")
    with caplog.at_level(logging.INFO):
        run = _start(production, mode="retrain", **BY_TEST)
    assert run["out"].startswith(str(storage_root)) and run["overrides"]["sweep.warm_start_from"] == "prod_study"
    assert "writes its production storage_root" in caplog.records[0].getMessage()


def test_under_the_ci_variable_a_test_run_is_in_ci_mode(production, tmp_path, monkeypatch):
    """$STAGEWISE_SCRATCH_ROOT wins over the test run's own root, as docs/ci.md's recipe relies on: the input too is
    the scratch root's."""
    monkeypatch.setenv(SCRATCH_ENV_VAR, str(tmp_path / "ci"))
    config = steps.run_config(_start(production, **BY_TEST))
    assert config.storage_root == str(tmp_path / "ci" / "ml")
    assert config.dataset.uri == "raw/digits"


def test_only_a_test_run_is_put_in_scratch(production, storage_root):
    """A run from the UI, REST, a schedule or an older SDK without either field runs where its config says."""
    for dag_run in ({"triggered_by": DagRunTriggeredByType.UI, "triggering_user_name": "admin"},
                    {"triggered_by": DagRunTriggeredByType.TIMETABLE}, {}):
        assert _start(production, **dag_run)["out"].startswith(str(storage_root)), dag_run
    for dag_run in ({"triggered_by": DagRunTriggeredByType.TEST}, {"triggered_by": "test"}, BY_TEST):
        assert steps.started_by_test(SimpleNamespace(**dag_run)), dag_run
    assert not steps.started_by_test(None)


def test_the_opt_in_takes_pipeline_names_only(production, monkeypatch):
    """A wildcard or a typo in the opt-in fails the test run's start naming the variable (no blanket opt-in)."""
    for value in ("*", "ml;diabetes"):
        monkeypatch.setenv(TEST_RUNS_WRITE_ENV_VAR, value)
        with pytest.raises(Exception, match=TEST_RUNS_WRITE_ENV_VAR) as raised:
            _start(production, **BY_TEST)
        assert "no pipeline name" in str(raised.value)
    with pytest.raises(ConfigError):
        from stagewise.definitions.loading import opted_in_test_runs

        opted_in_test_runs()


def test_a_test_run_of_ingest_writes_nothing_into_production(production, storage_root, tmp_path):
    """`airflow dags test <name>_ingest` would copy into production's data set: it fails naming the opt-in, and no
    byte under the production storage root changed."""
    from airflow.sdk.exceptions import AirflowFailException

    before = _files(storage_root)
    context = {"ti": SimpleNamespace(try_number=1), "run_id": "manual__1", "params": {"source_uri": str(tmp_path)},
               "dag": SimpleNamespace(dag_id="ml_ingest", params={}), "dag_run": SimpleNamespace(conf={}, **BY_TEST)}
    with set_current_context(context), pytest.raises(AirflowFailException, match=TEST_RUNS_WRITE_ENV_VAR):
        steps.ingest(str(production))
    assert _files(storage_root) == before
