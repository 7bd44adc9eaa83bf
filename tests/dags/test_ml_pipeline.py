"""`airflow dags test ml_pipeline` on the digits demo: every stage really runs and the report holds."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.dags.conftest import airflow

pytestmark = [pytest.mark.airflow, pytest.mark.torchrun]


@pytest.fixture(scope="module")
def report(airflow_env) -> dict:
    """One full run with a trial budget and a row budget for the sweep set through the trigger conf (as the UI form
    would); the other pipelines' runs sweep on epochs."""
    conf = {"num_trials": 6, "num_sweep_workers": 2, "sweep_budget": "rows", "sweep_max_rows": 9000}
    airflow(airflow_env, "dags", "test", "ml_pipeline", "-c", json.dumps(conf))
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


def test_the_sweep_ran_on_the_row_budget_from_the_form(report):
    """create_study committed the row budget's subsets before the workers ran; every trial reported at rounds' ends
    (rows seen), the trials that were never pruned at all of them, and the report counts the rows they trained on."""
    run = Path(report["run_prefix"])
    subsets = json.loads((run / "sweep" / "subsets" / "manifest.json").read_text())
    ends = [r["rows_seen"] for r in subsets["rounds"]]
    assert ends[-1] == 9000 and len(ends) >= 3 and subsets["increments"]
    assert report["sweep"]["budget"] == "rows" and report["sweep"]["rows_consumed"] > 0
    trials = json.loads((run / "sweep" / "trials.json").read_text())["trials"]
    for trial in trials:
        steps = sorted(int(step) for step in trial["intermediate"])
        assert steps == ends[: len(steps)]
        if trial["state"] == "COMPLETE":
            assert steps == ends


def test_training_stages_grow_the_batch_and_rescale_lr(report):
    """Stage 2 runs 2 DDP processes with a larger global batch and a linearly rescaled lr."""
    s1, s2 = report["training"]
    assert (s1["stage"], s1["world_size"]) == ("s1", 1) and (s2["stage"], s2["world_size"]) == ("s2", 2)
    assert s2["global_batch"] > s1["global_batch"]
    assert s2["lr"] / s1["lr"] == pytest.approx(s2["global_batch"] / s1["global_batch"])


def test_each_stage_hands_on_its_best_epoch_and_the_report_says_which(report):
    """By default a stage hands on its best epoch on the objective: report.json names it, and its val metric is that
    epoch's in the stage's history (the first of equal epochs)."""
    import json
    from pathlib import Path

    for stage in report["training"]:
        history = json.loads((Path(report["run_prefix"]) / "train" / stage["stage"] / "metrics.json").read_text())["history"]
        values = [entry["val_metric"] for entry in history]
        assert stage["handed_epoch"] == values.index(max(values)) + 1 and stage["val_metric"] == max(values)
        assert stage["epochs_run"] == stage["epochs"] and stage["stopped_early"] is False


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


def test_first_model_is_registered_promoted_and_used_for_inference(report, airflow_env):
    """With no current model the gate promotes the new one; inference scores with exactly that version."""
    registry = report["registry"]
    assert registry["promoted"] and registry["reason"] == "no current model"
    assert registry["current"] == registry["version"] == report["predictions"]["model_version"]
    storage_root = Path(airflow_env["STAGEWISE_TEST_STORAGE"])
    card = json.loads((storage_root / "models" / "digits" / registry["version"] / "card.json").read_text())
    assert card["test_accuracy"] == report["test_accuracy"] and card["data_fingerprint"] and card["code_version"]
    assert json.loads((storage_root / "models" / "digits" / "current.json").read_text())["version"] == registry["version"]


def _with_rows_per_shard(airflow_env: dict, tmp_path: Path, rows: int) -> str:
    import yaml

    raw = yaml.safe_load(Path(airflow_env["STAGEWISE_CONFIG"]).read_text())
    raw["inference"]["rows_per_shard"] = rows
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


@pytest.mark.slow
def test_batch_inference_dag_scores_with_the_current_model(report, airflow_env, tmp_path):
    """batch_inference scores any raw-schema Parquet with the current model, quarantining unscorable rows."""
    import numpy as np
    import pyarrow as pa

    storage_root = Path(airflow_env["STAGEWISE_TEST_STORAGE"])
    source = pq.read_table(sorted((storage_root / "raw" / "digits").glob("*.parquet"))[0]).slice(0, 449)
    column = source.column("px_05").to_numpy().copy()
    column[:3] = np.nan
    dirty = source.set_column(source.column_names.index("px_05"), "px_05", pa.array(column))
    pq.write_table(dirty, tmp_path / "to_score.parquet", row_group_size=100)
    airflow({**airflow_env, "STAGEWISE_CONFIG": _with_rows_per_shard(airflow_env, tmp_path, 200)},
            "dags", "test", "ml_batch_inference", "-c", json.dumps({"input_uri": str(tmp_path / "to_score.parquet")}))
    found = sorted(storage_root.glob("runs/ml_batch_inference/*/report.json"))
    assert len(found) == 1
    inference = json.loads(found[0].read_text())
    assert inference["model_version"] == report["registry"]["current"]
    assert inference["predictions"]["rows"] == dirty.num_rows - 3 and inference["predictions"]["rows_quarantined"] == 3
    from stagewise.datasets.predictions import plan_inference

    shards = plan_inference(str(tmp_path / "to_score.parquet"), rows_per_shard=200)
    assert len(shards) == 3  # 449 rows in row groups of 100, about 200 rows a shard
    assert inference["stages"]["inference"]["num_tasks"] == len(shards) + 1  # the shards and the commit


@pytest.mark.slow
def test_a_cut_current_model_fails_batch_inference_once_per_shard_naming_the_file(report, airflow_env, tmp_path):
    """The current model.pt cut after registration: each infer_shard fails on its first try (no retry), naming the
    file and its registered version, and no predictions are committed. The file is restored for the tests after."""
    from stagewise.reporting import timeline

    storage_root = Path(airflow_env["STAGEWISE_TEST_STORAGE"])
    model = storage_root / "models" / "digits" / report["registry"]["current"] / "model.pt"
    before = {p.parent.name for p in storage_root.glob("runs/ml_batch_inference/*/timeline")}
    intact = model.read_bytes()
    try:
        model.write_bytes(intact[: len(intact) // 2])
        result = airflow(airflow_env, "dags", "test", "ml_batch_inference", check=False)
    finally:
        model.write_bytes(intact)
    [run] = [p for p in storage_root.glob("runs/ml_batch_inference/*") if p.name not in before]
    shards = [r for r in timeline.records(str(run)) if r["task_id"] == "infer_shard"]
    assert shards and {(r["try_number"], r["state"]) for r in shards} == {(1, "failed")}, shards
    assert f"{model}: its {len(intact) // 2} bytes hash to" in result.stdout + result.stderr
    assert not (run / "predictions" / "manifest.json").exists()


def test_out_of_bounds_conf_is_refused_naming_the_param(airflow_env):
    """A conf outside the Params' bounds never starts a run, and the error names the param."""
    result = airflow(airflow_env, "dags", "test", "ml_pipeline", "-c", json.dumps({"num_trials": 0}), check=False)
    assert result.returncode != 0
    assert "num_trials" in result.stdout + result.stderr


def test_report_lists_every_task_attempt_and_writes_its_page(report):
    """report.json's tasks hold every task of the run (mapped ones per map index) with a start and, but for the report
    task itself, an end and a success, each with its upstream tasks and the seconds it waited to start (so each stage
    has wait_s); report.html sits beside report.json and draws them."""
    tasks = report["tasks"]
    ids = {t["task_id"] for t in tasks}
    assert ids >= {"start_run", "plan_shards", "preprocess_stats", "reduce_stats", "preprocess_transform", "create_study",
                   "sweep_worker", "sweep_summary", "train_s1", "train_s2", "evaluate", "register_model", "gate_model",
                   "plan_inference", "infer_shard", "commit_predictions", "report"}
    assert sorted(t["map_index"] for t in tasks if t["task_id"] == "sweep_worker") == [0, 1]
    for entry in tasks:
        assert entry["start"] and entry["try_number"] >= 1
        assert entry["upstream"] is not None and entry["wait_s"] is not None and entry["wait_s"] >= 0, entry
        if entry["task_id"] != "report":
            assert entry["state"] == "success" and entry["end"] >= entry["start"], entry
    assert [t["upstream"] for t in tasks if t["task_id"] == "start_run"] == [[]]
    assert all(stage.get("wait_s") is not None for stage in report["stages"].values()), report["stages"]
    page = Path(report["html_uri"])
    assert page.parent == Path(report["run_prefix"]) and page.name == "report.html"
    text = page.read_text()
    for figure in ("fig-training", "fig-sweep", "fig-timeline", "fig-data"):
        assert f'data-figure="{figure}"' in text
