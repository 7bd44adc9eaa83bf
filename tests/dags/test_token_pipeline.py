"""`airflow dags test` of examples/token_transformer.yaml: a transformer over exact int64, variable-length token ids,
a categorical and a float column, through every stage (sweep, two growing-batch stages with a cosine schedule,
clipping and best-epoch hand-on, evaluation, the gate, batch inference)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from stagewise.datasets.demo import TOKEN_ID_BASE
from tests.dags.conftest import REPO_ROOT, airflow, make_airflow_env

pytestmark = [pytest.mark.airflow, pytest.mark.torchrun]


@pytest.fixture(scope="module")
def token_run(tmp_path_factory) -> tuple[dict, Path]:
    """One run of the example, a 4-trial sweep with one worker; its report.json and storage root."""
    storage_root = tmp_path_factory.mktemp("token_storage")
    env = make_airflow_env(tmp_path_factory.mktemp("token_home"), str(storage_root), storage_root,
                           base_config=REPO_ROOT / "examples" / "token_transformer.yaml")
    airflow(env, "dags", "test", "token_transformer_pipeline", "-c", json.dumps({"num_trials": 4, "num_sweep_workers": 1}))
    (found,) = sorted(storage_root.glob("runs/token_transformer_pipeline/*/report.json"))
    return json.loads(found.read_text()), storage_root


def test_the_transformer_learns_the_token_task(token_run):
    """Which ids a sequence holds decides its label: the spec learns it from exact ids (float32 would merge every id
    above 2^60 into a handful of values, and the test accuracy would stay near chance)."""
    report, _ = token_run
    assert report["objective"]["metric"] == "accuracy"
    assert report["test_accuracy"] >= 0.95


def test_stages_decay_on_a_cosine_clip_and_hand_on_their_best_epoch(token_run):
    """Each stage's lr falls along its cosine after warmup, the pre-clip gradient norm is logged per epoch, and the
    epoch handed on is the best one on validation accuracy."""
    report, _ = token_run
    for stage in report["training"]:
        assert stage["lr_schedule"]["type"] == "cosine" and stage["grad_clip_norm"] == 1.0
        history = json.loads((Path(report["run_prefix"]) / "train" / stage["stage"] / "metrics.json").read_text())["history"]
        rates = [entry["lr"] for entry in history]
        assert rates[-1] < rates[len(rates) // 2] < max(rates)
        assert all(entry["grad_norm"] > 0 for entry in history)
        values = [entry["val_metric"] for entry in history]
        assert stage["handed_epoch"] == values.index(max(values)) + 1


def test_the_card_records_the_specs_own_hyperparameters(token_run):
    """The spec's optimizer reads its own hyperparameters (embedding_lr_scale); the model keeps them with the swept ones,
    and its data description says how each typed column was stored."""
    from stagewise.models.bundle import load_bundle

    report, _ = token_run
    bundle = load_bundle(report["model_uri"])
    assert {"dim", "heads", "layers", "buckets", "embedding_lr_scale", "lr", "weight_decay"} <= set(bundle.params)
    assert bundle.params["dim"] == report["sweep"]["best_params"].get("dim", bundle.params["dim"])
    tokens, channel = bundle.data.input("tokens"), bundle.data.input("channel")
    assert (tokens.dtype, tokens.variable, tokens.shape) == ("int64", True, [16]) and tokens.max_value >= TOKEN_ID_BASE
    assert channel.num_categories == 5  # four channels and id 0 for any other


def test_batch_inference_scores_every_raw_row_from_its_typed_columns(token_run):
    """Inference encodes the raw rows as preprocessing did (ids, categories, padding): every row is scored, none is
    quarantined, and the predictions agree with the labels as well as evaluation said."""
    report, storage_root = token_run
    manifest = json.loads(Path(report["predictions"]["uri"].removeprefix("file://")).read_text())
    predictions = pa.concat_tables([pq.read_table(entry["uri"].removeprefix("file://")) for entry in manifest["files"]])
    raw = pa.concat_tables([pq.read_table(path) for path in sorted((storage_root / "raw" / "tokens").glob("*.parquet"))])
    assert predictions.num_rows == raw.num_rows and manifest.get("rows_quarantined", 0) == 0
    assert min(min(row) for row in raw.column("tokens").to_pylist()) >= TOKEN_ID_BASE
    labels = dict(zip(raw.column("row_id").to_pylist(), raw.column("label").to_pylist()))
    right = sum(labels[key] == predicted for key, predicted in
                zip(predictions.column("row_id").to_pylist(), predictions.column("prediction").to_pylist()))
    assert right / raw.num_rows >= 0.95
