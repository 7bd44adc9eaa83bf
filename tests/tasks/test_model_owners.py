"""The registry records who holds a model name: the first pipeline to register under it keeps it; a pipeline renamed in
place (same config file, new name) takes it over; the CLI check decides a contested name from that record, whatever
the files' times say, as the deployment does (tests/plugins/test_pipeline_revisions.py)."""

from __future__ import annotations

import os

import pytest
import yaml

from stagewise import registry
from stagewise.config import check
from stagewise.definitions.loading import load_config
from stagewise.models import owners
from tests.conftest import unnamed


def test_the_first_registration_records_the_owner_and_only_a_rename_in_place_moves_it(tmp_path, storage_root):
    """register_for writes models/<name>/owner.json once; another pipeline's registration leaves it; the same config
    file under a new name (a rename) takes it over, its old name kept; an unreadable record reads as none."""
    folder = tmp_path / "pipelines"
    folder.mkdir()
    path = folder / "fraud.yaml"
    path.write_text(yaml.safe_dump(unnamed(storage_root)))
    config = load_config(path)
    model = tmp_path / "model.pt"
    model.write_bytes(b"weights")
    card = {"test_accuracy": 0.9, "objective": "accuracy", "config_source": str(path)}
    root, name = config.storage_root, config.registry.model_name
    assert owners.read(root, name) is None
    registry.register_for(config, str(tmp_path / "run"), str(model), card, dag_id="fraud_pipeline", run_id="r1")
    assert owners.read(root, name) == owners.Owner("fraud", "fraud.yaml")

    other = owners.claim(root, name, "churn", str(folder / "churn.yaml"), "churn_pipeline/r1")
    assert other == owners.Owner("fraud", "fraud.yaml")  # registered second: the first keeps the name
    renamed = config.model_copy(update={"name": "fraud2"})
    model.write_bytes(b"weights, retrained")
    registry.register_for(renamed, str(tmp_path / "run2"), str(model), card, dag_id="fraud2_pipeline", run_id="r2")
    assert owners.read(root, name) == owners.Owner("fraud2", "fraud.yaml", ("fraud",))

    (storage_root / "models" / name / "owner.json").write_text("{not json")
    assert owners.read(root, name) is None  # the callers fall back to their own rule


def test_the_cli_keeps_a_contested_model_name_with_the_pipeline_the_registry_names(tmp_path, storage_root, monkeypatch):
    """Two files share a storage root and model name; the file that registered first is the newer one on disk. With no
    owner record the CLI refuses the newer file; with one it refuses the other, naming the record."""
    monkeypatch.setenv("STAGEWISE_STATE_DIR", str(tmp_path / "state"))  # a CI host: no last valid versions
    folder = tmp_path / "pipelines"
    folder.mkdir()
    for name in ("fraud", "copycat"):
        (folder / f"{name}.yaml").write_text(yaml.safe_dump(unnamed(storage_root)))
    os.utime(folder / "fraud.yaml", (2e9, 2e9))
    with pytest.raises(SystemExit, match=f"{folder / 'fraud.yaml'}: registry.model_name 'digits'"):
        check(str(folder))
    config = load_config(folder / "fraud.yaml")
    owners.claim(config.storage_root, "digits", "fraud", str(folder / "fraud.yaml"), "fraud_pipeline/r1")
    with pytest.raises(SystemExit) as refused:
        check(str(folder))
    assert f"{folder / 'copycat.yaml'}: registry.model_name 'digits'" in str(refused.value)
    assert "it registered there first" in str(refused.value)
    assert f"{folder / 'fraud.yaml'}: registry.model_name" not in str(refused.value)
