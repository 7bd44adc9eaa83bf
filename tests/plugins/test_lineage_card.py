"""A model card names the code its run started with (issue 34): start_run records the Stagewise version and the
user's source fingerprints in <run>/lineage.json, and register_model copies them; an upgrade of Stagewise or an edit
of the spec between the start and the registration changes neither."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
from types import SimpleNamespace

from airflow.sdk.execution_time.context import set_current_context

from stagewise import registry
from stagewise.airflow import steps
from stagewise.airflow.params import pipeline_params
from stagewise.core import storage
from stagewise.definitions.loading import load_config
from stagewise.reporting import lineage
from tests.conftest import base_config

SPEC = "from stagewise.spec import ModelSpec\nfrom team_layers import WIDTH\n\n\nclass TeamSpec(ModelSpec):\n    default_params = {params}\n"


def _context(config_path, **extra) -> dict:
    params = {name: param.resolve() for name, param in pipeline_params(load_config(config_path)).items()}
    return {"ti": SimpleNamespace(try_number=1, task_id="register_model", map_index=-1), "run_id": "manual__1",
            "params": params, "dag": SimpleNamespace(dag_id="team_pipeline", params=params),
            "dag_run": SimpleNamespace(conf={}), **extra}


def _installed_as(monkeypatch, version: str) -> None:
    """This process runs Stagewise ``version``, installed (no checkout: the code version is the package's)."""
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: version if name == "stagewise" else real(name))
    monkeypatch.setattr(lineage, "CHECKOUT_ROOT", None)


def test_the_card_names_the_version_and_sources_the_run_started_with(write_config, storage_root, tmp_path, monkeypatch):
    (tmp_path / "team_layers.py").write_text("WIDTH = 8\n")
    (tmp_path / "team_spec.py").write_text(SPEC.format(params="{}"))
    spec, helper = str((tmp_path / "team_spec.py").resolve()), str((tmp_path / "team_layers.py").resolve())
    raw = base_config(storage_root)
    raw["model"] = {"spec": "team_spec:TeamSpec"}
    path = write_config(raw)
    _installed_as(monkeypatch, "0.1.0")
    with set_current_context(_context(path)):
        run = steps.start_run(config_file=str(path))
    recorded = storage.read_json(storage.join(run["out"], "lineage.json"))
    assert recorded["stagewise_version"] == "0.1.0" and recorded["code_version"] == "stagewise 0.1.0"
    assert recorded["source_fingerprints"] == {
        helper: hashlib.sha256(b"WIDTH = 8\n").hexdigest(),
        spec: hashlib.sha256((tmp_path / "team_spec.py").read_bytes()).hexdigest()}

    # After the start: Stagewise upgraded in place, the spec and its helper edited.
    _installed_as(monkeypatch, "0.1.1")
    (tmp_path / "team_layers.py").write_text("WIDTH = 16\n")
    (tmp_path / "team_spec.py").write_text(SPEC.format(params="{'x': 1}"))
    model = tmp_path / "model.pt"
    model.write_bytes(b"weights")
    storage.write_json(storage.join(run["out"], "preprocess", "manifest.json"), {"features": ["a"], "splits": {}})
    with set_current_context(_context(path)):
        registered = steps.register_model(run, {"model_uri": str(model), "val_metric": 0.9, "stage": "s2"},
                                          {"test_accuracy": 0.9}, {"best_params": {"lr": 0.1}})

    card = registry.card(str(storage_root), registered["model_name"], registered["version"])
    assert (card["stagewise_version"], card["code_version"]) == ("0.1.0", "stagewise 0.1.0"), "the run's, not 0.1.1"
    assert card["source_fingerprints"] == recorded["source_fingerprints"], "as they were at the start, not now"
    assert card["source_fingerprint"] == recorded["source_fingerprint"]
    assert card["lineage_uri"] == storage.join(run["out"], "lineage.json")
    assert lineage.record(steps.run_config(run))["source_fingerprint"] != recorded["source_fingerprint"], \
        "a fingerprint taken now sees the edits"
    json.dumps(card)  # the card stays plain JSON


def test_a_run_that_recorded_no_lineage_says_its_card_names_the_registering_code(write_config, storage_root, tmp_path,
                                                                                 monkeypatch):
    """A run started before runs recorded lineage (no lineage.json): the card names this process's code and says so
    (lineage_uri None, no fingerprints), rather than failing the registration."""
    _installed_as(monkeypatch, "0.1.1")
    manifest = tmp_path / "manifest.json"
    manifest.write_text("{}")
    card = registry.model_card(load_config(write_config()), trained={"val_metric": 0.9, "stage": "s2"},
                               evaluation={"test_accuracy": 0.9}, best_params={}, study="st", source_run="p/r",
                               manifest_uri=str(manifest), run_out=str(tmp_path / "runs" / "p" / "r"))
    assert (card["stagewise_version"], card["lineage_uri"], card["source_fingerprints"]) == ("0.1.1", None, {})


def test_the_runs_mlflow_parent_is_tagged_with_the_version_it_started_with(write_config, storage_root, monkeypatch):
    """start_run hands the run's lineage to MLflow too: with the server down, the parent run it leaves to the first
    task that reaches the server carries the Stagewise and code version of the start."""
    from stagewise.tracking.runs import parent_state
    from tests.mlflow_server import free_port

    raw = base_config(storage_root)
    raw["tracking"] = {"mlflow_uri": f"http://127.0.0.1:{free_port()}", "timeout_s": 1}
    path = write_config(raw)
    _installed_as(monkeypatch, "0.1.0")
    with set_current_context(_context(path)):
        run = steps.start_run(config_file=str(path))
    tags = parent_state(run["out"])["pending_parent"]["tags"]
    assert (tags["stagewise.stagewise_version"], tags["stagewise.code_version"]) == ("0.1.0", "stagewise 0.1.0")
