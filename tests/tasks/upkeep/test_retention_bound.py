"""The default retention policy keeps a year of hourly runs of the demo pipeline under 1 GB (issue 44 item 2),
shown by simulation: the policy's own planner (stagewise.upkeep.policy) runs daily, as the maintenance DAG's
default schedule does, over synthetic hourly runs until the storage they take has settled (keep_records_days and a
margin: from then on a day's runs come in as a day's records go out), measured just before each pass; the journal
is counted for the whole year.

Sizes assumed, each above what bench's run_storage_bytes measured of a finished `make demo` run once runs are small
(issue 44 items 1 and 3; measured in brackets): a finished run 1 MB (0.40 MB), of which its record (report.json,
report.html, config.yaml, lineage.json) 96 kB (84.5 kB); one run in 20 fails and leaves 1 MB; every run registers a
new model version of 256 kB (49.7 kB); every run's study takes 48 kB of journal (34.6 kB).
"""

from __future__ import annotations

import datetime as dt

from stagewise.definitions.retention import Retention
from stagewise.reporting.run_dates import RunDates
from stagewise.upkeep.inventory import FAILED, FINISHED, Entry, Models, ModelVersion, Run
from stagewise.upkeep.policy import MODEL, RUN, plan_models, plan_runs

MB, KB = 1_000_000, 1_000
RUN_FILES = {"config.yaml": 4 * KB, "lineage.json": 8 * KB, "report.json": 32 * KB, "report.html": 52 * KB,
             "preprocess/part-0.parquet": 300 * KB, "sweep/trials.json": 168 * KB, "train/s1/model.pt": 200 * KB,
             "train/s1/final.pt": 136 * KB, "predictions/part-0.parquet": 100 * KB}
RECORD_BYTES = 96 * KB
VERSION_BYTES, STUDY_BYTES = 256 * KB, 48 * KB
FAIL_EVERY = 20
GB = 1_000_000_000


def _run(number: int, began: dt.datetime) -> Run:
    failed = number % FAIL_EVERY == 0
    files = [Entry(path, size, began + dt.timedelta(minutes=0 if "/" not in path and not path.startswith("report") else 30))
             for path, size in RUN_FILES.items() if not (failed and path.startswith("report"))]
    run = Run("ml_retrain", f"run-{number}", f"mem://runs/ml_retrain/run-{number}", files)
    run.state = FAILED if failed else FINISHED
    run.dates = RunDates(began, None if failed else began + dt.timedelta(minutes=30), "report")  # as it recorded them
    return run


def _apply(runs: dict[str, Run], removals) -> None:
    for removal in removals:
        run = runs[removal.target.split("/", 1)[1]]
        if removal.what == RUN:
            del runs[run.run_folder]
            continue
        gone = {uri.removeprefix(run.prefix + "/") for uri in removal.files}
        run.files = [entry for entry in run.files if entry.path not in gone]


def simulate(policy: Retention, days: int) -> tuple[list[int], int]:
    """Hourly runs for ``days`` with a maintenance pass a day; the bytes of runs just before each pass (the most that
    is ever stored that day) and the peak bytes of model versions."""
    start = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    runs: dict[str, Run] = {}
    models = Models("digits")
    daily, models_peak = [], 0
    for hour in range(days * 24):
        now = start + dt.timedelta(hours=hour)
        runs[f"run-{hour}"] = _run(hour, now)
        if hour % FAIL_EVERY:
            models.versions.append(ModelVersion(f"m-{hour:012x}", f"mem://models/digits/{hour}",
                                                [Entry("model.pt", VERSION_BYTES, now)], now.isoformat()))
            models.protected = {models.versions[0].version: "current (the first, never beaten)"}
        if hour % 24 == 23:
            daily.append(sum(e.size for run in runs.values() for e in run.files))
            models_peak = max(models_peak, VERSION_BYTES * len(models.versions))
            _apply(runs, plan_runs(policy, list(runs.values()), now))
            gone = {r.target.split("/", 1)[1] for r in plan_models(policy, models) if r.what == MODEL}
            models.versions = [v for v in models.versions if v.version not in gone]
    return daily, models_peak


def test_a_year_of_hourly_demo_runs_stays_under_one_gigabyte_with_the_defaults():
    """With the default policy the runs settle once keep_records_days have passed (a record a day in, one out), at
    keep_runs whole runs, a few failed runs' leftovers and the records of keep_records_days. That steady state plus
    the kept model versions and the studies is under 1 GB, whether the studies are the default journal file each
    (studies_days of them) or a shared journal that keeps a deleted study's lines (the whole year's)."""
    policy = Retention()
    settled = policy.keep_records_days + 10
    daily, models = simulate(policy, settled + 20)
    steady = max(daily[settled:])
    assert max(daily) <= steady * 1.01  # nothing grows past the steady state
    assert abs(daily[-1] - daily[settled]) <= 0.01 * steady  # settled: the last 20 days hold what day `settled` did
    whole = policy.keep_runs + 24  # a day's runs wait for the next pass
    failed_leftovers = (policy.failed_days + 2) * 24 // FAIL_EVERY + 1
    records = (policy.keep_records_days + 1) * 24
    assert steady <= (whole + failed_leftovers) * sum(RUN_FILES.values()) + records * RECORD_BYTES
    assert models <= (policy.keep_model_versions + 1 + 24) * VERSION_BYTES
    per_study_files = (policy.studies_days + 1) * 24 * STUDY_BYTES
    shared_journal = 365 * 24 * STUDY_BYTES
    sizes = f"runs {steady:,} + models {models:,} + studies {per_study_files:,} (shared journal {shared_journal:,})"
    assert steady + models + per_study_files < GB, sizes
    assert steady + models + shared_journal < GB, sizes


def test_without_retention_nothing_goes_and_a_year_would_not_fit():
    """The bound is the policy's doing: with every knob off the planner removes nothing from a month of runs, so a
    year of them takes its runs' whole size, over 8 GB."""
    keep_all = Retention(keep_runs=None, keep_runs_days=None, keep_records_days=None, failed_days=None,
                         checkpoints_days=None, predictions_days=None, pending_tracking_days=None)
    start = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    runs = [_run(hour, start + dt.timedelta(hours=hour)) for hour in range(30 * 24)]
    assert plan_runs(keep_all, runs, start + dt.timedelta(days=400)) == []
    assert 365 * 24 * sum(RUN_FILES.values()) > 8 * GB
