"""`airflow dags test ml_pipeline` on the digits demo: every stage really runs and the report holds."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.dags.conftest import airflow

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def report(airflow_env) -> dict:
    """One full run with a trial budget set through the trigger conf (as the UI form would)."""
    airflow(airflow_env, "dags", "test", "ml_pipeline", "-c", json.dumps({"num_trials": 6, "num_sweep_workers": 2}))
    found = sorted(Path(airflow_env["STAGEWISE_TEST_STORAGE"]).glob("runs/ml_pipeline/*/report.json"))
    assert len(found) == 1, found
    return json.loads(found[0].read_text())


def test_report_has_the_contract_keys(report):
    """report.json carries at least the keys of the design contract."""
    for key in ("dag_id", "run_id", "stages", "sweep", "training", "test_accuracy", "model_uri", "predictions"):
        assert key in report
    assert report["dag_id"] == "ml_pipeline"
    for stage in ("preprocess", "sweep", "train_s1", "train_s2", "evaluate", "inference"):
        assert report["stages"][stage]["attempt"] >= 1 and report["stages"][stage]["duration_s"] > 0


def test_sweep_used_the_conf_budget_and_pruned(report):
    """The trigger conf's budget is exact; every trial ended complete, pruned or failed."""
    sweep = report["sweep"]
    assert sweep["n_trials"] == 6
    assert sweep["n_complete"] + sweep["n_pruned"] + sweep["n_failed"] == 6
    assert sweep["n_complete"] >= 1 and set(sweep["best_params"]) >= {"lr"}


def test_training_stages_grow_the_batch_and_rescale_lr(report):
    """Stage 2 runs 2 DDP processes with a larger global batch and a linearly rescaled lr."""
    s1, s2 = report["training"]
    assert (s1["stage"], s1["world_size"]) == ("s1", 1) and (s2["stage"], s2["world_size"]) == ("s2", 2)
    assert s2["global_batch"] > s1["global_batch"]
    assert s2["lr"] / s1["lr"] == pytest.approx(s2["global_batch"] / s1["global_batch"])


def test_digits_test_accuracy_is_at_least_095(report):
    """The demo's model is good: at least 0.95 on the held-out test split."""
    assert report["test_accuracy"] >= 0.95


def test_predictions_manifest_lists_every_row_once(report):
    """The committed manifest lists files whose rows cover the 1,797 digits exactly once."""
    manifest = json.loads(Path(report["predictions"]["uri"]).read_text())
    keys = []
    for entry in manifest["files"]:
        table = pq.read_table(entry["uri"])
        assert table.num_rows == entry["rows"]
        assert set(table.column_names) >= {"row_id", "prediction", "probabilities", "model_version"}
        keys += table.column("row_id").to_pylist()
    assert report["predictions"]["rows"] == len(keys) == len(set(keys)) == 1797
    assert Path(report["model_uri"]).exists()


def test_out_of_bounds_conf_is_refused_naming_the_param(airflow_env):
    """A conf outside the Params' bounds never starts a run, and the error names the param."""
    result = airflow(airflow_env, "dags", "test", "ml_pipeline", "-c", json.dumps({"num_trials": 0}), check=False)
    assert result.returncode != 0
    assert "num_trials" in result.stdout + result.stderr
