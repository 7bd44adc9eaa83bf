"""The pipeline's registry steps stay within the config's model name: gate, and batch inference's model lookup."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from airflow.sdk.exceptions import AirflowFailException
from airflow.sdk.execution_time.context import set_current_context

from stagewise import registry
from stagewise.airflow import steps
from tests.conftest import base_config


def _run(config_path: Path) -> dict:
    return {"dag_id": "test", "run_id": config_path.stem, "config": str(config_path), "overrides": {}, "out": "unused"}


def _version(root: Path, tmp_path: Path, name: str, accuracy: float) -> str:
    model = tmp_path / f"{name}.pt"
    model.write_bytes(name.encode() * 10)
    return registry.register(str(root), name, str(model), {"test_accuracy": accuracy})["version"]


def test_gate_and_inference_lookup_see_only_their_own_model_name(write_config, storage_root, tmp_path):
    """With a digits model current, a diabetes config's gate promotes its first model and its inference scores with it.

    Before, the diabetes model was gated against the digits model and batch inference used the digits model.
    """
    raw = base_config(storage_root)
    raw["registry"] = {"model_name": "diabetes"}
    digits_run, diabetes_run = _run(write_config()), _run(write_config(raw, "diabetes.yaml"))
    digits = _version(storage_root, tmp_path, "digits", 0.97)
    diabetes = _version(storage_root, tmp_path, "diabetes", 0.30)
    # The task's Airflow context: the try number and the batch_inference form's model_version Param.
    with set_current_context({"ti": SimpleNamespace(try_number=1), "params": {"model_version": ""}}):
        assert steps.gate_model(digits_run, {"version": digits})["promoted"]
        gated = steps.gate_model(diabetes_run, {"version": diabetes})
        assert gated["promoted"] and gated["reason"] == "no current model" and gated["model_name"] == "diabetes"
        assert gated["model_uri"] == str(storage_root / "models" / "diabetes" / diabetes / "model.pt")
        assert steps.resolve_model(diabetes_run)["current"] == diabetes
        assert steps.resolve_model(digits_run)["current"] == digits
    with set_current_context({"ti": SimpleNamespace(try_number=1), "params": {"model_version": digits}}):
        with pytest.raises(AirflowFailException, match=f"'{digits}' is not registered under .*/models/diabetes"):
            steps.resolve_model(diabetes_run)
