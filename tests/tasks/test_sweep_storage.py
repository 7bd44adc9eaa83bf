"""Sweep storage and outcomes: journal and PostgreSQL, warm start, failing trials, plots."""

from __future__ import annotations

import optuna
import pytest
import yaml

from stagewise.core.errors import UserError
from stagewise.definitions.loading import load_config
from stagewise.study.studies import create, open_storage
from stagewise.study.summary import summarize
from stagewise.sweep import run_worker


def _config(config_path, **sweep):
    raw = yaml.safe_load(config_path.read_text())
    raw["sweep"].update({"epochs": 2, "num_trials": 3, "num_workers": 1, **sweep})
    config_path.write_text(yaml.safe_dump(raw))
    return load_config(config_path)


def _run_sweep(config, name: str, out: str) -> dict:
    create(config, name)
    run_worker(config, name, 0, out)
    return summarize(config, name, out)


def test_journal_sweep_summarizes_and_writes_plots(digits_run):
    """A finished sweep yields best params, counts by state, and HTML plots under the run prefix."""
    config_path, out = digits_run
    summary = _run_sweep(_config(config_path), "plots", out)
    assert summary["n_trials"] == 3 and summary["n_complete"] >= 1 and "lr" in summary["best_params"]
    assert any(uri.endswith("optimization_history.html") for uri in summary["plots"])


@pytest.mark.service
def test_postgresql_storage_runs_the_same_sweep(digits_run, postgres_url):
    """The production storage: the same worker code on PostgreSQL gives the same budget and a best trial."""
    config_path, out = digits_run
    config = _config(config_path, storage=postgres_url.replace("postgresql://", "postgresql+psycopg2://"))
    summary = _run_sweep(config, "pg", out)
    assert summary["n_trials"] == 3 and summary["storage_kind"] == "postgresql+psycopg2"
    study = optuna.load_study(study_name="pg", storage=open_storage(config.sweep.storage))
    assert len(study.trials) == 3


def test_new_study_warm_starts_from_an_earlier_best(digits_run):
    """A run told to warm-start tries the earlier study's best params first; a cold one does not."""
    config_path, out = digits_run
    first = _run_sweep(_config(config_path), "first", out)
    config = _config(config_path, warm_start_from="first", num_trials=1)
    create(config, "second")
    run_worker(config, "second", 0, out)
    study = optuna.load_study(study_name="second", storage=open_storage(config.sweep.storage))
    assert study.trials[0].params == first["best_params"]
    assert study.trials[0].user_attrs["warm_start_of"].startswith("first#")


def test_unknown_warm_start_study_is_a_user_error(digits_run):
    """Warm-starting from a study that does not exist fails without retry, naming the key."""
    config_path, _ = digits_run
    with pytest.raises(UserError, match="sweep.warm_start_from: study 'nope'"):
        create(_config(config_path, warm_start_from="nope"), "third")


def test_failing_trials_are_recorded_and_an_all_failed_sweep_says_why(digits_run, monkeypatch):
    """An objective that raises is a FAIL trial with its message; when all fail, the summary fails naming the cause."""
    config_path, out = digits_run
    config = _config(config_path)

    def broken_model(spec, data, params):
        raise MemoryError("model too big for this worker")

    monkeypatch.setattr("stagewise.models.building.build", broken_model)
    create(config, "doomed")
    run_worker(config, "doomed", 0, out)
    study = optuna.load_study(study_name="doomed", storage=open_storage(config.sweep.storage))
    assert [t.state.name for t in study.trials] == ["FAIL"] * 3
    assert "model too big" in study.trials[0].user_attrs["error"]
    with pytest.raises(UserError, match=r"none of 3 trials completed.*3 x MemoryError: model too big"):
        summarize(config, "doomed", out)


@pytest.mark.service
def test_a_study_on_a_connection_runs_from_the_environment_url_and_records_only_its_scheme(digits_run, postgres_url,
                                                                                           monkeypatch):
    """sweep.storage_conn_id: create, the worker and the summary open the database the task put in
    $STAGEWISE_STUDY_STORAGE; the summary names the scheme, never the URL with its password."""
    import json
    from pathlib import Path

    from stagewise.core import contract

    config_path, out = digits_run
    config = _config(config_path, storage="", storage_conn_id="optuna_db")
    url = postgres_url.replace("postgresql://postgres@", "postgresql+psycopg2://postgres:planted-pw-7Hq@")
    monkeypatch.setenv(contract.STUDY_STORAGE, url)
    summary = _run_sweep(config, "conn", out)
    assert summary["n_trials"] == 3 and summary["storage_kind"] == "postgresql+psycopg2"
    written = json.dumps(summary) + "".join(path.read_text(errors="replace") for path in Path(out).rglob("*.json"))
    assert "planted-pw-7Hq" not in written
