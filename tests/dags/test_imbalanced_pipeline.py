"""`airflow dags test` of examples/imbalanced.yaml: about 3 % positives, the built-in classifier with balanced class
weights and auprc as the objective, from the sweep to the gate; report.json's test auprc is scikit-learn's on the
written predictions, and inference writes the score and the label at the threshold chosen on validation."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.dags.conftest import REPO_ROOT, airflow, make_airflow_env

pytestmark = [pytest.mark.airflow, pytest.mark.torchrun]


@pytest.fixture(scope="module")
def imbalanced_run(tmp_path_factory) -> tuple[dict, Path]:
    """One run of the example, a 3-trial sweep with one worker; its report.json and storage root."""
    storage_root = tmp_path_factory.mktemp("imbalanced_storage")
    env = make_airflow_env(tmp_path_factory.mktemp("imbalanced_home"), str(storage_root), storage_root,
                           base_config=REPO_ROOT / "examples" / "imbalanced.yaml")
    airflow(env, "dags", "test", "imbalanced_pipeline", "-c", json.dumps({"num_trials": 3, "num_sweep_workers": 1}))
    (found,) = sorted(storage_root.glob("runs/imbalanced_pipeline/*/report.json"))
    return json.loads(found.read_text()), storage_root


def _table(manifest_uri: str) -> pa.Table:
    manifest = json.loads(Path(manifest_uri.removeprefix("file://")).read_text())
    return pa.concat_tables([pq.read_table(entry["uri"].removeprefix("file://")) for entry in manifest["files"]])


def test_auprc_decides_from_the_sweep_to_the_gate(imbalanced_run):
    """The study's best value, each stage's best epoch and the epoch it hands on, and the gate all follow validation
    or test auprc, maximised."""
    report, _ = imbalanced_run
    assert report["objective"]["metric"] == "auprc" and report["objective"]["direction"] == "maximize"
    trials = json.loads(Path(report["sweep"]["trials_uri"].removeprefix("file://")).read_text())
    assert trials["metric"] == "auprc" and trials["direction"] == "maximize"
    assert report["sweep"]["best_value"] == max(t["value"] for t in trials["trials"] if t.get("value") is not None)
    for stage in report["training"]:
        history = json.loads((Path(report["run_prefix"]) / "train" / stage["stage"] / "metrics.json").read_text())["history"]
        values = [entry["val_metrics"]["auprc"] for entry in history]
        assert [entry["val_metric"] for entry in history] == values
        assert stage["handed_epoch"] == values.index(max(values)) + 1
    gate = report["registry"]
    assert gate["metric"] == "test_auprc" and gate["direction"] == "maximize"
    assert gate["candidate_value"] == report["objective"]["test"] == report["test_metrics"]["test_auprc"]


def test_report_auprc_equals_scikit_learns_on_the_written_predictions(imbalanced_run):
    """Join the written scores to the test split's labels by key: average_precision_score is report.json's test
    auprc within the binned curve's documented bound, and the model clearly beats the 3 % base rate."""
    from sklearn.metrics import average_precision_score, roc_auc_score

    from stagewise.datasets.columns import SPLITS
    from stagewise.datasets.keys import split_of
    from stagewise.definitions.loading import load_config
    from stagewise.definitions.metrics import CURVE_TOLERANCE

    report, storage_root = imbalanced_run
    config = load_config(Path(report["config"]["config_uri"].removeprefix("file://")))
    # the split files go once the run succeeds; the split is a function of the key, so the raw rows give it again
    raw = pa.concat_tables([pq.read_table(path) for path in sorted((storage_root / "raw" / "imbalanced").glob("*.parquet"))])
    test = raw.filter(pa.array(split_of(raw.column("row_id"), config.preprocess.split) == SPLITS.index("test")))
    predictions = _table(report["predictions"]["uri"])
    scores = dict(zip(predictions.column("row_id").to_pylist(), predictions.column("score").to_pylist()))
    labels = np.asarray(test.column("label").to_pylist())
    written = np.asarray([scores[key] for key in test.column("row_id").to_pylist()])
    assert len(labels) == report["test_metrics"]["test_rows"]
    assert 0.01 < labels.mean() < 0.06
    assert abs(report["test_metrics"]["test_auprc"] - average_precision_score(labels, written)) <= CURVE_TOLERANCE
    assert abs(report["test_metrics"]["test_auroc"] - roc_auc_score(labels, written)) <= CURVE_TOLERANCE
    assert report["test_metrics"]["test_auprc"] > 0.3


def test_inference_labels_at_the_validation_threshold_and_the_report_draws_the_curves(imbalanced_run):
    """The label written is the positive class where the score reaches the bundle's threshold (chosen on validation
    for the best F1); report.json has the confusion matrix, both curves and the threshold, and report.html draws them."""
    import torch

    report, _ = imbalanced_run
    bundle = torch.load(report["model_uri"], weights_only=True)
    threshold = bundle["extra"]["decision_threshold"]
    assert 0.0 < threshold < 1.0 and bundle["extra"]["threshold_rule"] == {"rule": "f1", "target": None}
    predictions = _table(report["predictions"]["uri"])
    scores = np.asarray(predictions.column("score").to_pylist())
    assert np.array_equal(np.asarray(predictions.column("prediction").to_pylist()), (scores >= threshold).astype(int))
    details = report["classification"]
    assert details["decision_threshold"]["value"] == threshold
    counts = np.asarray(details["confusion_matrix"]["counts"])
    assert counts.shape == (2, 2) and counts.sum() == report["test_metrics"]["test_rows"]
    assert details["curves"]["roc"]["fpr"][0] == 0.0 and len(details["curves"]["pr"]["precision"]) > 10
    html = (Path(report["run_prefix"]) / "report.html").read_text()
    assert "Precision-recall" in html and "ROC" in html and "Confusion matrix" in html
