"""The examples run end to end through `airflow dags test ml_pipeline` with config changes only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.dags.conftest import REPO_ROOT, airflow, make_airflow_env

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cnn_report(tmp_path_factory) -> dict:
    """One ml_pipeline run of examples/digits_cnn.yaml (its spec, search space and objective) on scratch storage."""
    storage_root = tmp_path_factory.mktemp("cnn_storage")
    env = make_airflow_env(tmp_path_factory.mktemp("cnn_home"), str(storage_root), storage_root,
                           base_config=REPO_ROOT / "examples" / "digits_cnn.yaml")
    airflow(env, "dags", "test", "ml_pipeline", "-c", json.dumps({"num_trials": 6, "num_sweep_workers": 2}))
    found = sorted(Path(storage_root).glob("runs/ml_pipeline/*/report.json"))
    assert len(found) == 1, found
    return json.loads(found[0].read_text())


def test_cnn_example_reaches_095_test_accuracy(cnn_report):
    """The CNN on 1x8x8 digit images is as good as the demo's MLP: test accuracy >= 0.95, the objective reported."""
    assert cnn_report["objective"]["metric"] == "accuracy"
    assert cnn_report["objective"]["test"] == cnn_report["test_accuracy"] >= 0.95


def test_cnn_example_runs_every_stage_with_its_own_model(cnn_report):
    """Its sweep prunes, its two stages grow the global batch, the registered bundle is the CNN, predictions cover every row."""
    sweep, (s1, s2) = cnn_report["sweep"], cnn_report["training"]
    assert sweep["n_trials"] == 6 and sweep["n_pruned"] >= 1 and "hidden" not in sweep["best_params"]
    assert s2["global_batch"] > s1["global_batch"] and s2["world_size"] == 2
    bundle = torch.load(cnn_report["model_uri"], weights_only=True)
    assert bundle["spec"] == {"path": "examples.digits_cnn:DigitsCNN", "args": {"channels": 16}}
    assert cnn_report["predictions"]["rows"] == 1797


@pytest.fixture(scope="module")
def tutorial_report(tmp_path_factory) -> dict:
    """One ml_pipeline run of examples/ddp_tutorial.yaml: the tutorial script as every trial and both stages."""
    storage_root = tmp_path_factory.mktemp("tutorial_storage")
    env = make_airflow_env(tmp_path_factory.mktemp("tutorial_home"), str(storage_root), storage_root,
                           base_config=REPO_ROOT / "examples" / "ddp_tutorial.yaml")
    airflow(env, "dags", "test", "ml_pipeline")
    found = sorted(Path(storage_root).glob("runs/ml_pipeline/*/report.json"))
    assert len(found) == 1, found
    return json.loads(found[0].read_text())


def test_ddp_tutorial_script_runs_as_pruned_trials_and_growing_batch_stages(tutorial_report):
    """The user's script is each sweep trial (Hyperband prunes some through report()) and both stages, s2 from s1's
    model at a larger global batch; its model is evaluated, registered under its own name and scores every row."""
    sweep, (s1, s2) = tutorial_report["sweep"], tutorial_report["training"]
    assert sweep["n_trials"] == 8 and sweep["n_pruned"] >= 1 and sweep["n_complete"] >= 1
    assert set(sweep["best_params"]) == {"lr", "weight_decay", "hidden", "dropout"}
    assert (s1["world_size"], s2["world_size"]) == (1, 2) and s2["global_batch"] > s1["global_batch"]
    assert s1["val_metric"] is not None and s2["val_metric"] is not None  # from the script's last report()
    assert tutorial_report["registry"]["model_name"] == "digits_ddp_tutorial"
    assert tutorial_report["test_accuracy"] >= 0.9
    assert tutorial_report["predictions"]["rows"] == 1797
