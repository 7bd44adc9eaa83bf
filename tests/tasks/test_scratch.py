"""CI mode ($STAGEWISE_SCRATCH_ROOT, stagewise.definitions.loading): every config a process loads keeps its run, sweep
journal and registry under the scratch root, reaches no outside registry, and its gate reports without promoting."""

from __future__ import annotations

from pathlib import Path

import pytest

from stagewise import registry
from stagewise.definitions.config import ConfigError
from stagewise.definitions.loading import SCRATCH_ENV_VAR, load_config, snapshot
from tests.conftest import base_config, unnamed


def _production(storage_root: Path) -> dict:
    """base_config as production has it: an MLflow registry and tracking, S3 keys, a shared Optuna database."""
    raw = base_config(storage_root)
    raw.update(storage_conn_id="prod_s3", tracking={"mlflow_uri": "https://mlflow.prod.example", "conn_id": "prod_mlflow"})
    raw["registry"]["backend"] = "mlflow"
    raw["sweep"]["storage"] = "postgresql+psycopg2://optuna@db.prod.example/optuna"
    return raw


def test_the_scratch_root_takes_storage_journal_tracking_and_registry(write_config, storage_root, tmp_path, monkeypatch):
    """Under $STAGEWISE_SCRATCH_ROOT nothing of the config points at production: storage is <scratch>/<name>, read with
    the CI's own environment; the journal is under it; MLflow is off; the registry is the scratch one, report-only.
    A dotted override (what a trigger Param becomes) cannot move storage back out."""
    scratch = tmp_path / "ci"
    monkeypatch.setenv(SCRATCH_ENV_VAR, str(scratch))
    config = load_config(write_config(_production(storage_root)), {"storage_root": str(storage_root),
                                                                   "registry.report_only": False})
    assert config.storage_root == str(scratch / "ml") and config.storage_conn_id == ""
    assert config.sweep.storage == f"journal://{scratch / 'ml' / 'optuna' / 'studies' / '{study}.journal'}"
    assert (config.tracking.mlflow_uri, config.tracking.conn_id) == ("", "")
    assert (config.registry.backend, config.registry.report_only) == ("storage", True)


def test_without_the_variable_the_config_is_untouched(write_config, storage_root, monkeypatch):
    """The mode is the variable's alone: unset (or empty), the production config loads as written."""
    monkeypatch.setenv(SCRATCH_ENV_VAR, "")
    config = load_config(write_config(_production(storage_root)))
    assert config.storage_root == str(storage_root) and config.registry.backend == "mlflow"
    assert not config.registry.report_only and config.tracking.mlflow_uri


def test_an_unnamed_pipeline_takes_its_file_name_and_its_snapshot_loads_back_unchanged(write_config, storage_root,
                                                                                     tmp_path, monkeypatch):
    """A config without a name key gets <scratch>/<file stem>; its run snapshot (config.yaml, loaded by every later
    task with the variable still set) keeps that root rather than moving to <scratch>/config, and hashes the same."""
    scratch = tmp_path / "ci"
    monkeypatch.setenv(SCRATCH_ENV_VAR, f"file://{scratch}")
    config = load_config(write_config(unnamed(storage_root), name="team_b.yaml"))
    assert config.storage_root == str(scratch / "team_b") and config.name == "team_b"
    text, digest = snapshot(config)
    copy = scratch / "team_b" / "runs" / "team_b_pipeline" / "r1" / "config.yaml"
    copy.parent.mkdir(parents=True)
    copy.write_text(text)
    for where in (copy, f"file://{copy}"):
        again = load_config(where)
        assert again == config and snapshot(again)[1] == digest


def test_a_remote_scratch_root_is_refused(write_config, monkeypatch):
    """The scratch root holds the sweep's journal file, so it must be a local folder; the error names the variable."""
    monkeypatch.setenv(SCRATCH_ENV_VAR, "s3://ci-bucket/scratch")
    with pytest.raises(ConfigError, match=SCRATCH_ENV_VAR):
        load_config(write_config())


def _register(config, tmp_path: Path, tag: str, accuracy: float) -> str:
    model = tmp_path / f"{tag}.pt"
    model.write_bytes(tag.encode() * 10)
    return registry.register(config.storage_root, config.registry.model_name, str(model),
                             {"test_accuracy": accuracy})["version"]


def test_a_report_only_gate_says_what_it_would_do_and_moves_nothing(write_config, storage_root, tmp_path, caplog):
    """registry.report_only: a better model is 'would promote', a worse one 'would refuse', in the decision and the
    log; the pointer file stays byte for byte; inference is handed the model that would be current."""
    config = load_config(write_config(), {"registry.report_only": True})
    name = config.registry.model_name
    incumbent = _register(config, tmp_path, "a", 0.90)
    registry.promote(config.storage_root, name, incumbent)
    pointer = Path(registry.pointer_uri(config.storage_root, name))
    before = pointer.read_bytes()

    better = _register(config, tmp_path, "b", 0.95)
    with caplog.at_level("INFO", logger="stagewise.registry"):
        decision = registry.gate_registered(config, {"version": better}, str(tmp_path / "run"))
    assert decision["decision"].startswith(f"would promote {better}: test_accuracy 0.9500 > current 0.9000")
    assert decision["would_promote"] and not decision["promoted"] and decision["report_only"]
    assert decision["current"] == better and decision["model_uri"].endswith(f"{better}/model.pt")
    assert decision["decision"] in caplog.text

    worse = _register(config, tmp_path, "c", 0.80)
    decision = registry.gate_registered(config, {"version": worse}, str(tmp_path / "run"))
    assert decision["decision"].startswith(f"would refuse {worse}: ") and not decision["would_promote"]
    assert decision["current"] == incumbent
    assert pointer.read_bytes() == before and registry.current(config.storage_root, name)["version"] == incumbent


def test_report_only_with_the_mlflow_registry_is_a_config_error(write_config, storage_root):
    """The report-only gate judges in the storage registry; asked of MLflow's it is refused at load, naming the key."""
    raw = _production(storage_root)
    raw["registry"]["report_only"] = True
    with pytest.raises(ConfigError, match="registry: .*report_only"):
        load_config(write_config(raw))


def test_a_test_runs_scratch_reads_the_input_where_production_has_it(write_config, storage_root, tmp_path, monkeypatch):
    """load_config(test_scratch=...) (a test run's own scratch root): CI mode under it, but a relative dataset.uri and
    inference.input_uri stay production's, made absolute against the file's own (relative) storage root; its snapshot
    loads back unchanged; $STAGEWISE_TEST_RUNS_WRITE naming the pipeline, or the CI variable, leaves no scratch to give."""
    from stagewise.definitions.loading import TEST_RUNS_WRITE_ENV_VAR, scratch_for_test_run

    monkeypatch.delenv(SCRATCH_ENV_VAR, raising=False)
    monkeypatch.delenv(TEST_RUNS_WRITE_ENV_VAR, raising=False)
    monkeypatch.setenv("AIRFLOW_HOME", str(tmp_path / "home"))
    raw = _production(storage_root)
    raw.update(storage_root="storage")  # relative to the config's folder: tmp_path / "storage"
    raw["inference"]["input_uri"] = "incoming/today"
    scratch = scratch_for_test_run("ml")
    assert scratch == str(tmp_path / "home" / "stagewise-scratch")
    config = load_config(write_config(raw), test_scratch=scratch)
    assert config.storage_root == str(tmp_path / "home" / "stagewise-scratch" / "ml")
    assert (config.registry.backend, config.registry.report_only, config.tracking.mlflow_uri) == ("storage", True, "")
    assert config.dataset.uri == str(storage_root / "raw" / "digits")
    assert config.inference.input_uri == str(storage_root / "incoming" / "today")
    copy = tmp_path / "snapshot.yaml"
    copy.write_text(snapshot(config)[0])
    assert load_config(copy, test_scratch=scratch) == config == load_config(copy)

    monkeypatch.setenv(TEST_RUNS_WRITE_ENV_VAR, "diabetes,ml")
    assert scratch_for_test_run("ml") is None and scratch_for_test_run("team") == scratch
    monkeypatch.setenv(SCRATCH_ENV_VAR, str(tmp_path / "ci"))
    assert scratch_for_test_run("team") is None, "the CI variable already puts every config in scratch"
