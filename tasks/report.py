"""The run report: ``runs/<dag_id>/<run_id>/report.json`` (schema in the design notes) and ``report.html`` beside it.

Run: ``python -m stagewise.report latest`` prints a short summary of the newest report under the storage
root, where its report.html is (``HTML <uri>``) and, as its last line, ``REPORT <uri>``.
``python -m stagewise.report html <run prefix or report.json URI>`` renders report.html again from the run's files.
"""

from __future__ import annotations

import argparse
import datetime as dt
import logging
from typing import Any

from stagewise.core import storage
from stagewise.core.cli import common_parser, parse_overrides, setup_logging
from stagewise.core.errors import DataError, UserError
from stagewise.definitions.loading import (
    SCRATCH_ENV_VAR,
    config_path,
    load_config,
    scratch_for_test_run,
    scratch_root,
)
from stagewise.definitions.pipelines import dag_id, name_of
from stagewise.reporting import cost as stage_cost
from stagewise.reporting import html as report_html
from stagewise.reporting import listing, notify, run_dates, timeline

log = logging.getLogger("stagewise.report")


def stage_timing(results: dict[str, list[dict[str, Any]]],
                 tasks: list[dict[str, Any]] | None = None) -> dict[str, dict[str, Any]]:
    """Per stage: summed sub-job seconds (``duration_s``: the work), summed task seconds (``task_s``: from Airflow's
    start of each task to its result, start-up included; where every task gave it), summed seconds its tasks waited
    to start once they could (``wait_s``: for a pool slot, an executor slot or the scheduler; from ``tasks``, the run's
    attempts by stagewise.reporting.timeline.records), the highest attempt, the number of sub-jobs and, for a stage
    that ran on a cluster, its ``cost`` (stagewise.reporting.cost: elapsed, CPU time, nodes, GPU-hours per attempt)."""
    waited = timeline.stage_waits(tasks or [])
    stages = {}
    for stage, items in results.items():
        items = [item for item in items if item]
        if not items:
            continue
        stages[stage] = {"duration_s": round(sum(float(i.get("duration_s", 0.0)) for i in items), 3),
                         "attempt": max(int(i.get("attempt", 1)) for i in items), "num_tasks": len(items)}
        if all(i.get("task_s") is not None for i in items):
            stages[stage]["task_s"] = round(sum(float(i["task_s"]) for i in items), 3)
        if stage in waited:
            stages[stage]["wait_s"] = waited[stage]
        if costs := [item["cost"] for item in items if isinstance(item.get("cost"), dict)]:
            stages[stage]["cost"] = costs[0] if len(costs) == 1 else stage_cost.summary(
                [entry for each in costs for entry in each.get("attempts") or []])
    return stages


def build_report(*, dag_id: str, run_id: str, out: str, stage_results: dict[str, list[dict[str, Any]]],
                 preprocess: dict[str, Any], sweep: dict[str, Any], training: list[dict[str, Any]],
                 evaluation: dict[str, Any], predictions: dict[str, Any], registry: dict[str, Any],
                 direction: str | None = None, tasks: list[dict[str, Any]] | None = None,
                 config: dict[str, Any] | None = None, tracking: dict[str, Any] | None = None,
                 reused: dict[str, str] | None = None, data_interval: dict[str, Any] | None = None,
                 dropped: dict[str, Any] | None = None) -> dict[str, Any]:
    """Assemble report.json, write report.html and then report.json (the commit); returns their URIs and headline numbers.

    ``direction``: the objective's (minimize or maximize); ``tasks``: the run's task attempts (stagewise.reporting.timeline);
    ``config``: the run's config snapshot (``config_uri``, ``config_hash``, ``config_source``); ``tracking``: the MLflow
    run's and model version's pages and the tracking gaps (stagewise.tracking.runs.links), when tracking is on;
    ``reused``: ``{step: "<dag_id>/<run_id>"}`` for work another run did (stagewise.reuse); ``data_interval``: the
    interval the run's input was read for (start, end, logical date), when its dataset.uri names one; ``dropped``: the
    files only a resume reads, dropped once the run succeeded (stagewise.reuse.leftovers.drop_finished).
    """
    report = {
        "at": run_dates.recorded_at(out, tasks),  # when it started and ended: what the runs page and retention date by
        "dag_id": dag_id,
        "run_id": run_id,
        "run_prefix": out,
        "config": config or {},
        "stages": stage_timing(stage_results, tasks),
        "data": {"rows": preprocess.get("rows"), "rows_dropped": preprocess.get("rows_dropped"),
                 "manifest_uri": preprocess.get("manifest_uri"), "fingerprint": preprocess.get("fingerprint")},
        "reused": reused or {},
        "data_interval": data_interval,
        "sweep": {key: sweep.get(key) for key in ("study_name", "n_trials", "n_complete", "n_pruned", "n_failed",
                                                  "best_value", "best_params", "best_trial", "epochs_consumed", "rows_consumed", "budget",
                                                  "importances", "trials_uri")},
        "training": [{key: stage.get(key) for key in ("stage", "world_size", "global_batch", "lr", "epochs", "steps",
                                                      "val_metric", "checkpoint_uri", "handed_epoch", "epochs_run",
                                                      "stopped_early", "lr_schedule", "optimizer", "init_from", "grad_clip_norm", "noise_scale",
                                                      "batch_decision", "grad_accum_steps", "per_process_batch",
                                                      "strategy", "fingerprint", "data_fingerprint", "reused_from",
                                                      "rows_per_epoch", "cost")}
                     for stage in training],
        "objective": {"metric": evaluation.get("objective"), "direction": direction, "test": evaluation.get("test_objective")},
        "test_metrics": {k: v for k, v in evaluation.items() if k.startswith("test_") and k != "test_objective"},
        "model_uri": training[-1].get("model_uri") if training else None,
        "registry": registry,
        "predictions": {"uri": predictions.get("uri"), "rows": predictions.get("rows"),
                        "rows_quarantined": predictions.get("rows_quarantined", 0),
                        "model_version": predictions.get("model_version")},
        "tasks": tasks or [],
    }
    details = _classification_details(evaluation.get("metrics_uri"))
    if details:
        report["classification"] = details
    if tracking is not None:
        report["tracking"] = tracking
    if dropped is not None:
        report["dropped"] = dropped
    if "test_accuracy" in evaluation:  # the design notes' headline for classifiers; a regressor has none
        report["test_accuracy"] = evaluation["test_accuracy"]
    if "test_baseline_rmse" in evaluation:
        report["baseline"] = {"what": "predicting the data set's mean target", "test_rmse": evaluation["test_baseline_rmse"]}
    sources = load_sources(report, out)
    for stage in report["training"]:  # each stage's throughput, beside what it cost
        stage["samples_per_s"] = stage_cost.samples_per_s((sources["stages"].get(stage["stage"]) or {}).get("history"))
    report["html_uri"] = write_html(report, out, sources)
    uri = storage.join(out, "report.json")
    storage.write_json(uri, report)  # last: report.json commits the report, report.html is already whole beside it
    log.info("report written to %s", uri)
    return {"report_uri": uri, "html_uri": report["html_uri"], "test_accuracy": report.get("test_accuracy"),
            "test_objective": report["objective"]["test"]}


def _classification_details(metrics_uri: str | None) -> dict[str, Any]:
    """The test split's confusion matrix and, for a binary model, its ROC and precision-recall curves and decision
    threshold, from evaluate's metrics.json (kept out of XCom: a curve is hundreds of points)."""
    if not metrics_uri:
        return {}
    try:
        recorded = storage.read_json(metrics_uri)
    except (FileNotFoundError, ValueError) as exc:
        log.warning("report: %s unreadable (%s): no confusion matrix or curves in the report", metrics_uri, exc)
        return {}
    return {key: recorded[key] for key in ("confusion_matrix", "curves", "decision_threshold") if key in recorded}


def load_sources(report: dict[str, Any], out: str) -> dict[str, Any]:
    """What the page draws besides report.json (stagewise.reporting.html.load_sources); an unreadable file leaves the
    page without it, never the run without its report."""
    try:
        return report_html.load_sources(report, out)
    except Exception:  # noqa: BLE001 - see the docstring
        log.exception("report: the stages' metrics.json or the sweep's trials could not be read for %s", out)
        return {"stages": {}, "trials": None}


def write_html(report: dict[str, Any], out: str, sources: dict[str, Any] | None = None) -> str | None:
    """report.html beside report.json, in one put; a rendering bug is logged and leaves report.json to stand alone."""
    try:
        return report_html.write(report, out, sources)
    except Exception:  # the page is a view of the run: the record (report.json) must not be lost to it
        log.exception("report.html could not be rendered for %s", out)
        return None


def build_inference_report(*, dag_id: str, run_id: str, out: str, model: dict[str, Any],
                           stage_results: dict[str, list[dict[str, Any]]], predictions: dict[str, Any],
                           tasks: list[dict[str, Any]] | None = None, config: dict[str, Any] | None = None,
                           tracking: dict[str, Any] | None = None) -> dict[str, Any]:
    """report.json (and report.html before it) of a batch_inference run: which model scored what, and how much was
    quarantined; ``tasks``: the run's task attempts (stagewise.reporting.timeline); ``config``: its config snapshot;
    ``tracking``: the MLflow model version it scored with, when the registry is MLflow's."""
    report = {"at": run_dates.recorded_at(out, tasks), "dag_id": dag_id, "run_id": run_id, "run_prefix": out,
              "config": config or {}, "stages": stage_timing(stage_results, tasks),
              "model_version": model["current"], "model_uri": model["model_uri"],
              "predictions": {"uri": predictions.get("uri"), "rows": predictions.get("rows"),
                              "rows_quarantined": predictions.get("rows_quarantined", 0)}, "tasks": tasks or []}
    if tracking is not None:
        report["tracking"] = tracking
    report["html_uri"] = write_html(report, out)
    uri = storage.join(out, "report.json")
    storage.write_json(uri, report)
    log.info("report written to %s", uri)
    return {"report_uri": uri, "rows": report["predictions"]["rows"]}


def _rows_left_out(rows: dict[str, int] | None) -> str:
    """How many training rows an epoch of the stage left out (the ranks' last partial batches), where any were."""
    if not rows or rows["trained"] >= rows["train"]:
        return ""
    left = rows["train"] - rows["trained"]
    return f", {left} of {rows['train']} train rows left out per epoch ({left / rows['train']:.1%})"


def summary_lines(report: dict[str, Any]) -> list[str]:
    sweep, stages = report["sweep"], report["stages"]
    metric = (report.get("objective") or {}).get("metric") or "accuracy"
    lines = [f"run {report['dag_id']} / {report['run_id']}",
             f"  data: {report['data']['rows']} rows by split, {report['data']['rows_dropped']} dropped as dirty",
             f"  sweep: {sweep['n_trials']} trials ({sweep['n_complete']} complete, {sweep['n_pruned']} pruned, "
             f"{sweep['n_failed']} failed), best val {metric} {sweep['best_value']:.4f}"]
    for stage in report["training"]:
        lines.append(f"  train {stage['stage']}: world size {stage['world_size']}, global batch {stage['global_batch']}, "
                     f"lr {stage['lr']:.4g}, {stage['epochs']} epochs, val {metric} {stage['val_metric']:.4f}"
                     + (f" (epoch {stage['handed_epoch']} handed on)" if stage.get("handed_epoch") else "")
                     + (f", stopped early after {stage['epochs_run']}" if stage.get("stopped_early") else "")
                     + _rows_left_out(stage.get("rows_per_epoch"))
                     + (f", {stage['samples_per_s']:.0f} samples/s" if stage.get("samples_per_s") is not None else "")
                     + (f"; cost {stage_cost.text(stage['cost'])}" if stage.get("cost") else ""))
    test = (report.get("objective") or {}).get("test")
    lines.append(f"  test {metric}: {test if test is not None else report['test_accuracy']:.4f}")
    baseline = report.get("baseline")
    if baseline:
        test_rmse = report.get("test_metrics", {}).get("test_rmse")
        versus = f" vs the model's {test_rmse:.4f}" if test_rmse is not None else ""
        lines.append(f"  baseline ({baseline['what']}): test rmse {baseline['test_rmse']:.4f}{versus}")
    registry = report.get("registry") or {}
    if registry.get("report_only"):
        lines.append(f"  registry (report only, nothing promoted): {registry['decision']}")
    elif registry:
        lines.append(f"  registry: {registry['version']} {'promoted to current' if registry['promoted'] else 'not promoted'}"
                     f" ({registry['reason']})")
    lines += [f"    {label}: {text}" for label, text in notify.decision_lines(registry)]
    lines.append(f"  predictions: {report['predictions']['rows']} rows by {report['predictions'].get('model_version')}, "
                 f"{report['predictions'].get('rows_quarantined', 0)} quarantined, at {report['predictions']['uri']}")
    if (dropped := report.get("dropped")) is not None:
        lines.append(f"  dropped after success: {len(dropped.get('files') or [])} file(s) only a resume reads "
                     f"(checkpoints, hand-offs, the split copy), {int(dropped.get('bytes') or 0):,} bytes"
                     + (f" ({dropped['kept']})" if dropped.get("kept") else ""))
    lines.append(stage_seconds_line(stages))
    return lines


def stage_seconds_line(stages: dict[str, dict[str, Any]]) -> str:
    """Each stage's own seconds, then in brackets with start-up and the seconds it waited to start (where known)."""
    def brackets(info: dict[str, Any]) -> str:
        parts = [f"{info['task_s']:.1f}"] if info.get("task_s") is not None else []
        parts += [f"waited {info['wait_s']:.1f}"] if info.get("wait_s") is not None else []
        return f" ({', '.join(parts)})" if parts else ""

    waited = sum(info.get("wait_s") or 0.0 for info in stages.values())
    return (f"  stage seconds (with start-up, waited to start; {waited:.1f} s waiting in all): "
            + ", ".join(f"{name} {info['duration_s']:.1f}{brackets(info)}" for name, info in stages.items()))


MAX_RUNS = 500  # listed newest first; older reports stay in storage and are reachable by URL


def list_reports(storage_root: str, dag_folder: str = "*") -> list[dict[str, Any]]:
    """Every ``runs/<dag>/<run>/report.json`` under the root (of one DAG folder, or all), newest first by when each
    run started as it recorded it (stagewise.reporting.run_dates: never a report's mtime, which retention's note
    rewrites), at most MAX_RUNS, each with its folder names, URI, file time and recorded dates."""
    reports = [item for item in listing.run_reports(storage_root) if dag_folder in ("*", item.parts[0])][:MAX_RUNS]
    dates = listing.report_dates(storage_root, reports)
    return [{"dag_folder": item.parts[0], "run_folder": item.parts[1], "modified": item.modified, "uri": item.uri,
             "dates": recorded} for item, recorded in zip(reports, dates, strict=True)]


_report_cache: dict[tuple[str, Any], dict[str, Any]] = {}


def read_report(uri: str, modified: dt.datetime | None = None) -> dict[str, Any]:
    """report.json as a dict, or ``{"_error": ...}`` when it cannot be read (one bad file must not hide a list).

    With ``modified`` (from the listing) a report is read once per version: on S3 a list would be a GET per run.
    """
    if modified is not None and (uri, modified) in _report_cache:
        return _report_cache[(uri, modified)]
    try:
        report = storage.read_json(uri)
    except (OSError, ValueError, DataError) as exc:
        return {"_error": f"cannot read {uri}: {exc}"}
    if not isinstance(report, dict):
        return {"_error": f"{uri} holds {type(report).__name__}, not an object"}
    if modified is not None:
        if len(_report_cache) >= 4 * MAX_RUNS:
            _report_cache.clear()
        _report_cache[(uri, modified)] = report
    return report


def latest_report(storage_root: str, dag_id: str) -> str:
    """The URI of the newest report.json of ``dag_id``'s runs."""
    reports = list_reports(storage_root, storage.safe_name(dag_id))
    if not reports:
        raise SystemExit(f"no report.json under {storage.join(storage_root, 'runs', dag_id)}")
    return reports[0]["uri"]


def _newest(storage_root: str, dag_id: str) -> dict[str, Any] | None:
    reports = list_reports(storage_root, storage.safe_name(dag_id))
    return reports[0] if reports else None


def _when(entry: dict[str, Any]) -> dt.datetime:
    """When a listed run ended (else started) as it recorded it; its report's mtime only where it recorded nothing."""
    return entry["dates"].newest or dt.datetime.min.replace(tzinfo=dt.UTC)


def latest_run(path: str | None, overrides: dict[str, Any], dag: str | None,
               production: bool = False) -> tuple[str, str | None]:
    """The report.json ``latest`` shows and a note on where it is from (None: the config's storage root, as written).

    Test runs (``airflow dags test``) of this Airflow home ran in a scratch root of their own (docs/ci.md), so a CI
    that reports after its test run must see that run, not production's newest: the test run's is shown when it is
    the newest of both; when production's is newer, which one is meant cannot be told, and the choice is asked for.
    ``production``: the config's storage root as written, whatever test runs did.
    """
    name = name_of(config_path(path))
    dag = dag or dag_id(name, "pipeline")
    if production and scratch_root():
        raise UserError(f"--production and ${SCRATCH_ENV_VAR} disagree: the variable puts every config in scratch; "
                        f"unset it to report production's runs")
    config = load_config(path, overrides)
    test_scratch = None if production else scratch_for_test_run(name)
    tested = _newest(load_config(path, overrides, test_scratch=test_scratch).storage_root, dag) if test_scratch else None
    if tested is None:
        ours = _newest(config.storage_root, dag)
        if ours is None:
            raise UserError(f"no report.json under {storage.join(config.storage_root, 'runs', dag)}")
        return ours["uri"], None
    where = f"under {test_scratch}"
    try:
        ours = _newest(config.storage_root, dag)
    except Exception as exc:  # production's storage out of a CI's reach: its test run is what it asks about
        log.info("production's storage_root %s not read (%s)", config.storage_root, exc)
        ours = None
    if ours is None or _when(tested) >= _when(ours):
        return tested["uri"], (f"a test run (airflow dags test) of this Airflow home, in scratch {where}, not in "
                               f"production's storage_root {config.storage_root} (--production reports its newest run)")
    raise UserError(f"which run to report? pipeline {name}'s newest test run (airflow dags test) is in scratch {where} "
                    f"({tested['run_folder']}, {_when(tested):%Y-%m-%d %H:%M:%S} UTC), production's storage_root "
                    f"{config.storage_root} has a newer one ({ours['run_folder']}, {_when(ours):%Y-%m-%d %H:%M:%S} "
                    f"UTC): give --production for production's, or {SCRATCH_ENV_VAR}={test_scratch} for the test "
                    f"run's; remove {test_scratch} once its test runs are done with")


def report_json_uri(target: str) -> str:
    """report.json's URI from a run prefix or from the report's own URI."""
    return target if target.rstrip("/").endswith(".json") else storage.join(target.rstrip("/"), "report.json")


def render_html(target: str) -> str:
    """Render report.html again from a finished run's files (its report.json and what the stages wrote)."""
    uri = report_json_uri(target)
    if not storage.exists(uri):
        raise UserError(f"{uri} does not exist: give a run prefix (runs/<dag_id>/<run_id>) or its report.json")
    return report_html.write(storage.read_json(uri), uri.rsplit("/", 1)[0])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Show a run report.")
    sub = parser.add_subparsers(dest="step", required=True)
    p_latest = sub.add_parser("latest", parents=[common_parser()], help="summarise the newest report")
    p_latest.add_argument("--dag-id", help="whose runs (default: the config's training DAG, <name>_pipeline)")
    p_latest.add_argument("--production", action="store_true",
                          help="the config's storage_root as written, even where this Airflow home's test runs "
                               "(airflow dags test) are in scratch (by default the newer of both; docs/ci.md)")
    p_html = sub.add_parser("html", help="render report.html again from a finished run's files")
    p_html.add_argument("run", help="the run prefix (runs/<dag_id>/<run_id> under the storage root) or its report.json")
    args = parser.parse_args(argv)
    setup_logging(quiet=True)
    if args.step == "html":
        try:
            print(f"HTML {render_html(args.run)}")
        except UserError as exc:
            raise SystemExit(str(exc)) from None
        return
    try:
        uri, note = latest_run(args.config, parse_overrides(args.override), args.dag_id, args.production)
    except UserError as exc:
        raise SystemExit(str(exc)) from None
    if note:
        print(note)
    for line in summary_lines(storage.read_json(uri)):
        print(line)
    html = uri.rsplit("/", 1)[0] + "/report.html"
    if storage.exists(html):
        print(f"HTML {html}")
    print(f"REPORT {uri}")


if __name__ == "__main__":
    main()
