"""The run report (schema in the design notes). (Every sub-job's --help: tests/test_cli_help.py.)"""

from __future__ import annotations

import pytest

from stagewise.core import storage
from stagewise.report import build_report, stage_timing, summary_lines

REQUIRED_KEYS = {"dag_id", "run_id", "stages", "sweep", "training", "test_accuracy", "model_uri", "predictions"}


def _inputs(out: str) -> dict:
    """What the DAG hands build_report: sub-job results as they come back through XCom."""
    return dict(
        dag_id="ml_pipeline", run_id="manual__2024-01-01T00:00:00+00:00", out=out,
        stage_results={"preprocess": [{"duration_s": 1.5, "attempt": 1}, {"duration_s": 2.0, "attempt": 2}],
                       "train_s1": [{"duration_s": 10.0}], "infer": [None, {}]},
        preprocess={"rows": {"train": 10, "validation": 3, "test": 3}, "rows_dropped": 1, "manifest_uri": f"{out}/m.json"},
        sweep={"study_name": "s", "n_trials": 4, "n_complete": 3, "n_pruned": 1, "n_failed": 0, "best_value": 0.9,
               "best_params": {"lr": 0.01}, "epochs_consumed": 9, "not_reported": "x"},
        training=[{"stage": "s1", "world_size": 1, "global_batch": 32, "lr": 0.05, "epochs": 2, "steps": 70,
                   "val_metric": 0.9, "checkpoint_uri": f"{out}/train/s1/final.pt", "model_uri": f"{out}/train/s1/model.pt"},
                  {"stage": "s2", "world_size": 2, "global_batch": 128, "lr": 0.2, "epochs": 2, "steps": 20,
                   "val_metric": 0.95, "checkpoint_uri": f"{out}/train/s2/final.pt", "model_uri": f"{out}/train/s2/model.pt"}],
        evaluation={"test_accuracy": 0.93},
        predictions={"uri": f"{out}/predictions/manifest.json", "rows": 16, "model_version": "m-abc"},
        registry={"version": "m-abc", "promoted": True, "reason": "no current model", "current": "m-abc"},
    )


def test_build_report_writes_the_documented_keys(tmp_path):
    """report.json lands at <run prefix>/report.json with every key the design notes promise."""
    out = str(tmp_path / "runs" / "ml_pipeline" / "r1")
    inputs = _inputs(out)
    result = build_report(**inputs)
    assert result["report_uri"] == storage.join(out, "report.json")
    report = storage.read_json(result["report_uri"])
    assert REQUIRED_KEYS <= set(report)
    assert (report["dag_id"], report["run_id"]) == (inputs["dag_id"], inputs["run_id"])
    assert report["test_accuracy"] == result["test_accuracy"] == inputs["evaluation"]["test_accuracy"]
    assert report["model_uri"] == inputs["training"][-1]["model_uri"], "the last stage's model is the run's model"
    assert [stage["stage"] for stage in report["training"]] == ["s1", "s2"]
    assert report["predictions"]["rows"] == inputs["predictions"]["rows"]
    for key in ("n_trials", "n_complete", "n_pruned", "n_failed", "best_value", "best_params"):
        assert report["sweep"][key] == inputs["sweep"][key]
    assert "not_reported" not in report["sweep"]
    assert "preprocess" in report["stages"] and "infer" not in report["stages"], "stages with no result are left out"


def test_report_without_training_has_no_model(tmp_path):
    """A run that trained nothing reports model_uri null instead of failing."""
    inputs = {**_inputs(str(tmp_path)), "training": []}
    report = storage.read_json(build_report(**inputs)["report_uri"])
    assert report["model_uri"] is None and report["training"] == []


def test_stage_timing_sums_durations_and_takes_the_highest_attempt():
    """Per stage: seconds summed over its sub-jobs, the highest attempt seen, and how many sub-jobs ran."""
    timing = stage_timing({"preprocess": [{"duration_s": 1.25, "attempt": 1}, {"duration_s": 2.5, "attempt": 3},
                                          {"duration_s": 0.25, "attempt": 2}],
                           "evaluate": [{"duration_s": 4.0}],
                           "skipped": [None, {}]})
    assert timing["preprocess"] == {"duration_s": pytest.approx(4.0), "attempt": 3, "num_tasks": 3}
    assert timing["evaluate"]["attempt"] == 1, "attempt defaults to the first"
    assert "skipped" not in timing


def test_summary_lines_read_back_a_written_report(tmp_path):
    """The human summary shows the run, the test accuracy and the prediction rows of the report."""
    report = storage.read_json(build_report(**_inputs(str(tmp_path)))["report_uri"])
    text = "\n".join(summary_lines(report))
    assert "ml_pipeline" in text and "test accuracy: 0.9300" in text and "16 rows" in text


def test_a_regression_report_is_driven_by_its_objective_and_shows_the_baseline(tmp_path):
    """With rmse minimised there is no test_accuracy key; the objective, the test metrics and the mean baseline are
    reported and the summary prints the baseline beside the model's test RMSE."""
    inputs = {**_inputs(str(tmp_path)),
              "evaluation": {"test_rmse": 55.5, "test_mae": 44.0, "test_baseline_rmse": 77.25, "test_loss": 0.5,
                             "test_objective": 55.5, "objective": "rmse"}, "direction": "minimize"}
    result = build_report(**inputs)
    report = storage.read_json(result["report_uri"])
    assert "test_accuracy" not in report and result["test_accuracy"] is None
    assert report["objective"] == {"metric": "rmse", "direction": "minimize", "test": 55.5}
    assert report["baseline"]["test_rmse"] == 77.25 and report["test_metrics"]["test_baseline_rmse"] == 77.25
    text = "\n".join(summary_lines(report))
    assert "test rmse: 55.5000" in text and "test rmse 77.2500 vs the model's 55.5000" in text


def test_reports_are_listed_newest_first_per_dag_and_a_bad_one_reads_as_an_error(tmp_path):
    """list_reports finds every runs/<dag>/<run>/report.json newest first (one DAG's, or all), latest_report names the
    newest of a DAG, and read_report turns an unreadable or non-object report into an error entry, not an exception."""
    import os

    from stagewise.report import latest_report, list_reports, read_report

    root = str(tmp_path)
    for age, (dag, run) in enumerate([("ml_pipeline", "new"), ("retrain", "middle"), ("ml_pipeline", "old")]):
        uri = storage.join(root, "runs", dag, run, "report.json")
        storage.write_json(uri, {"run_id": run})
        os.utime(uri, (1_700_000_000 - age * 60, 1_700_000_000 - age * 60))
    assert [e["run_folder"] for e in list_reports(root)] == ["new", "middle", "old"]
    assert [e["run_folder"] for e in list_reports(root, "ml_pipeline")] == ["new", "old"]
    assert latest_report(root, "ml_pipeline") == storage.join(root, "runs", "ml_pipeline", "new", "report.json")
    assert list_reports(str(tmp_path / "empty")) == []
    broken = storage.join(root, "runs", "ml_pipeline", "old", "report.json")
    storage.write_bytes(broken, b"[1, 2]")
    assert read_report(broken)["_error"].endswith("holds list, not an object")
    storage.write_bytes(broken, b"{not json")
    assert read_report(broken)["_error"].startswith(f"cannot read {broken}")


def test_latest_is_the_run_that_started_last_as_recorded_not_the_report_retention_rewrote_last(tmp_path):
    """A report rewritten by retention's note (a fresh mtime) does not become the latest run: runs are ordered by the
    start they recorded (report.json's ``at``), so `stagewise.report latest` keeps naming the newest run."""
    import os

    from stagewise.report import latest_report, list_reports

    root = str(tmp_path)
    for run, started in [("september", "2026-09-03T10:00:00+00:00"), ("today", "2026-12-01T10:00:00+00:00")]:
        uri = storage.join(root, "runs", "ml_pipeline", run, "report.json")
        storage.write_json(uri, {"at": {"started": started, "ended": started}, "run_id": run})
    rewritten = storage.join(root, "runs", "ml_pipeline", "september", "report.json")
    os.utime(rewritten, (2_000_000_000, 2_000_000_000))  # retention's note wrote it last
    assert [e["run_folder"] for e in list_reports(root, "ml_pipeline")] == ["today", "september"]
    assert latest_report(root, "ml_pipeline").endswith("/today/report.json")


def test_stage_seconds_are_given_with_and_without_the_tasks_start_up():
    """duration_s sums the sub-jobs' own seconds; task_s sums each task's seconds from Airflow's start, start-up
    included, and is left out where a task did not give it (no figure that silently misses a part)."""
    timing = stage_timing({"preprocess": [{"duration_s": 1.0, "task_s": 5.5}, {"duration_s": 2.0, "task_s": 6.0}],
                           "train_s1": [{"duration_s": 10.0, "attempt": 2}]})
    assert timing["preprocess"] == {"duration_s": 3.0, "task_s": 11.5, "attempt": 1, "num_tasks": 2}
    assert timing["train_s1"] == {"duration_s": 10.0, "attempt": 2, "num_tasks": 1}



def test_the_report_says_how_many_train_rows_an_epoch_left_out(tmp_path):
    """A stage whose epoch left rows out (the ranks' last partial batches) says how many in report.json and the
    summary; one that trained every row says nothing."""
    inputs = _inputs(str(tmp_path))
    inputs["training"][0]["rows_per_epoch"] = {"trained": 1120, "train": 1120}
    inputs["training"][1]["rows_per_epoch"] = {"trained": 1024, "train": 1120}
    report = storage.read_json(build_report(**inputs)["report_uri"])
    assert report["training"][1]["rows_per_epoch"] == {"trained": 1024, "train": 1120}
    s1, s2 = [line for line in summary_lines(report) if line.startswith("  train ")]
    assert "left out" not in s1 and s2.endswith(", 96 of 1120 train rows left out per epoch (8.6%)")


def test_each_stage_reports_the_seconds_its_tasks_waited_to_start():
    """wait_s per stage sums its tasks' waits from the run's timeline (a pool slot, the scheduler), beside duration_s
    and task_s; a stage none of whose waits is known has no wait_s."""
    tasks = [{"task_id": "preprocess_stats", "wait_s": 40.0}, {"task_id": "commit_preprocess", "wait_s": 2.5},
             {"task_id": "train_s1", "wait_s": None}, {"task_id": "start_run", "wait_s": 1.0}]
    timing = stage_timing({"preprocess": [{"duration_s": 1.0, "task_s": 5.5}], "train_s1": [{"duration_s": 10.0}]}, tasks)
    assert timing["preprocess"] == {"duration_s": 1.0, "task_s": 5.5, "wait_s": 42.5, "attempt": 1, "num_tasks": 1}
    assert "wait_s" not in timing["train_s1"]


def test_the_summary_line_shows_each_stages_wait_and_the_whole_runs(tmp_path):
    """The stage-seconds line gives the work, the seconds with start-up and the seconds waited per stage, and the
    waiting of every stage together; report.json keeps each attempt's wait_s in its task list."""
    from stagewise.reporting import timeline

    out = str(tmp_path)
    timeline.record(out, task_id="start_run", map_index=-1, try_number=1, state="success",
                    start="2026-01-01T10:00:03+00:00", end="2026-01-01T10:00:05+00:00", upstream=[],
                    ready="2026-01-01T10:00:00+00:00")
    timeline.record(out, task_id="preprocess_stats", map_index=0, try_number=1, state="success",
                    start="2026-01-01T10:01:05+00:00", end="2026-01-01T10:01:09+00:00", upstream=["start_run"])
    inputs = _inputs(out)
    inputs["stage_results"]["preprocess"][0]["task_s"] = 3.0
    inputs["stage_results"]["preprocess"][1]["task_s"] = 4.0
    report = storage.read_json(build_report(**inputs, tasks=timeline.records(out))["report_uri"])
    assert report["stages"]["preprocess"]["wait_s"] == 60.0
    assert [task["wait_s"] for task in report["tasks"]] == [3.0, 60.0]
    [line] = [line for line in summary_lines(report) if line.startswith("  stage seconds")]
    assert "60.0 s waiting in all" in line and "preprocess 3.5 (7.0, waited 60.0)" in line and line.endswith("train_s1 10.0")


def test_the_report_records_when_its_run_started_and_ended_first_in_the_file(tmp_path):
    """report.json's ``at``: the start lineage.json recorded (else the first task attempt's) and the report's own
    moment; it leads the file, so a listing reads its head alone (stagewise.reporting.run_dates)."""
    import datetime as dt
    import json

    from stagewise.reporting import run_dates

    out = tmp_path / "runs" / "ml_pipeline" / "r1"
    out.mkdir(parents=True)
    (out / "lineage.json").write_text(json.dumps({"started_at": "2026-09-03T10:00:00+00:00"}))
    before = dt.datetime.now(dt.UTC)
    uri = build_report(**_inputs(str(out)))["report_uri"]
    report = storage.read_json(uri)
    assert report["at"]["started"] == "2026-09-03T10:00:00+00:00"
    assert before <= dt.datetime.fromisoformat(report["at"]["ended"]) <= dt.datetime.now(dt.UTC)
    assert (out / "report.json").read_text().startswith('{\n  "at": {')
    assert run_dates.read_report_dates(uri).started == dt.datetime(2026, 9, 3, 10, tzinfo=dt.UTC)
    (out / "lineage.json").unlink()
    tasks = [{"task_id": "start_run", "start": "2026-09-04T08:00:00+00:00", "end": "2026-09-04T08:00:05+00:00"}]
    report = storage.read_json(build_report(**_inputs(str(out)), tasks=tasks)["report_uri"])
    assert report["at"]["started"] == "2026-09-04T08:00:00+00:00"
