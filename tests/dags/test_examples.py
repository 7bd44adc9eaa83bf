"""The examples run end to end through `airflow dags test <example>_pipeline` with config changes only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.dags.conftest import REPO_ROOT, airflow, make_airflow_env

pytestmark = [pytest.mark.airflow, pytest.mark.torchrun]
# Parallel sweep workers are ml_pipeline's tests' to guard; one worker saves a process per run, and the seeded sweep
# no longer depends on how two workers race.
ONE_SWEEP_WORKER = {"num_sweep_workers": 1}


def _report_of(tmp_path_factory, example: str, *args: str) -> dict:
    """One `airflow dags test <example>_pipeline` of examples/<example>.yaml on scratch storage; its report.json."""
    storage_root = tmp_path_factory.mktemp(f"{example}_storage")
    env = make_airflow_env(tmp_path_factory.mktemp(f"{example}_home"), str(storage_root), storage_root,
                           base_config=REPO_ROOT / "examples" / f"{example}.yaml")
    airflow(env, "dags", "test", f"{example}_pipeline", *args)
    found = sorted(Path(storage_root).glob(f"runs/{example}_pipeline/*/report.json"))
    assert len(found) == 1, found
    return json.loads(found[0].read_text())


@pytest.fixture(scope="module")
def cnn_report(tmp_path_factory) -> dict:
    """examples/digits_cnn.yaml (its spec, image column, search space and objective), with a 6-trial sweep."""
    return _report_of(tmp_path_factory, "digits_cnn", "-c", json.dumps({"num_trials": 6, **ONE_SWEEP_WORKER}))


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
    """The tutorial-style script (examples/ddp_tutorial.py) as every trial and both stages, with a 6-trial sweep (each
    trial is a torchrun job of its own)."""
    return _report_of(tmp_path_factory, "ddp_tutorial", "-c", json.dumps({"num_trials": 6, **ONE_SWEEP_WORKER}))


def test_ddp_tutorial_script_runs_as_pruned_trials_and_growing_batch_stages(tutorial_report):
    """The user's script is each sweep trial (Hyperband prunes some through report()) and both stages, s2 from s1's
    model at a larger global batch; its model is evaluated, registered under its own name and scores every row."""
    sweep, (s1, s2) = tutorial_report["sweep"], tutorial_report["training"]
    assert sweep["n_trials"] == 6 and sweep["n_pruned"] >= 1 and sweep["n_complete"] >= 1
    assert set(sweep["best_params"]) == {"lr", "weight_decay", "hidden", "dropout"}
    assert (s1["world_size"], s2["world_size"]) == (1, 2) and s2["global_batch"] > s1["global_batch"]
    assert s1["val_metric"] is not None and s2["val_metric"] is not None  # from the script's last report()
    assert tutorial_report["registry"]["model_name"] == "digits_ddp_tutorial"
    assert tutorial_report["test_accuracy"] >= 0.9
    assert tutorial_report["predictions"]["rows"] == 1797


@pytest.fixture(scope="module")
def diabetes_report(tmp_path_factory) -> dict:
    """examples/diabetes.yaml: a float target, a Regressor, rmse minimised."""
    return _report_of(tmp_path_factory, "diabetes", "-c", json.dumps(ONE_SWEEP_WORKER))


def test_diabetes_example_beats_the_mean_baseline(diabetes_report):
    """The regressor's test RMSE (the minimised objective, in the target's units) clearly beats predicting the mean."""
    objective, baseline = diabetes_report["objective"], diabetes_report["baseline"]["test_rmse"]
    assert objective["metric"] == "rmse" and "test_accuracy" not in diabetes_report
    assert objective["test"] == diabetes_report["test_metrics"]["test_rmse"]
    assert objective["test"] < 0.9 * baseline, (objective["test"], baseline)


def test_diabetes_example_runs_every_stage_with_a_float_target(diabetes_report):
    """Its sweep prunes, two stages grow the global batch, the registry keeps its own name, predictions are floats for every row."""
    import pyarrow.parquet as pq

    sweep, (s1, s2) = diabetes_report["sweep"], diabetes_report["training"]
    assert sweep["n_pruned"] >= 1 and sweep["n_complete"] >= 1
    assert s2["global_batch"] > s1["global_batch"] and s2["world_size"] == 2
    assert diabetes_report["registry"]["model_name"] == "diabetes_mlp" and diabetes_report["registry"]["promoted"]
    assert (Path(diabetes_report["run_prefix"]).parents[2] / "models" / "diabetes_mlp").is_dir()
    bundle = torch.load(diabetes_report["model_uri"], weights_only=True)
    assert bundle["spec"]["path"] == "examples.diabetes:DiabetesMLP" and bundle["data"]["num_classes"] is None
    predictions = json.loads(Path(diabetes_report["predictions"]["uri"]).read_text())
    table = pq.read_table(predictions["files"][0]["uri"])
    assert diabetes_report["predictions"]["rows"] == 442
    assert str(table.schema.field("prediction").type) == "float"
    assert 25 <= table.column("prediction").to_numpy().mean() <= 346, "predictions are in the target's units"
