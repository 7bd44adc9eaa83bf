"""A run's record is its own (issue 53 item 3): retention dates runs by what they recorded, never by file times; takes
a time to come as now; notes what it removes before it removes it; finishes a pass that stopped; two passes at once
end without a traceback; a long pass says how far it got; and the dry run counts what the real pass removes."""

from __future__ import annotations

import datetime as dt
import errno
import json
import logging
import os
import shutil
import threading

import pytest

from stagewise import retention
from stagewise.core import storage
from stagewise.definitions.loading import load_config
from stagewise.upkeep import inventory, progress, removal
from tests import retention_root
from tests.conftest import base_config

RUNS = f"runs/{retention_root.PIPELINE_DAG}"
YEAR_1970, YEAR_2099 = 0.0, dt.datetime(2099, 1, 1, tzinfo=dt.UTC).timestamp()


def _config(storage_root, write_config, **retention_keys):
    raw = base_config(storage_root)
    raw["retention"] = {"pinned_versions": [retention_root.version(3)], **retention_keys}
    return write_config(raw)


def _job(config, tmp_path, *args):
    result = tmp_path / "result.json"
    retention.main(["--config", str(config), "--result-file", str(result), *args])
    return json.loads(result.read_text())


def _touch_all(folder, stamp):
    for path in folder.rglob("*"):
        os.utime(path, (stamp, stamp))


def _targets(result):
    return {(r["what"], r["target"]) for r in result["removals"]}


def test_a_run_is_dated_by_its_record_not_its_file_times(storage_root, write_config, tmp_path):
    """A fresh finished run whose files all carry 1970 mtimes keeps everything (before: it went whole, record
    included), and a failed run whose files carry 2099 mtimes is failed, idle since its recorded start, and loses its
    leftovers past failed_days (before: running forever); the inventory reads the dates the runs recorded."""
    now = dt.datetime.now(dt.UTC)
    retention_root.build(storage_root, now)
    _touch_all(storage_root / RUNS / "fresh", YEAR_1970)
    _touch_all(storage_root / RUNS / "failed", YEAR_2099)
    runs = {run.run_folder: run for run in inventory.list_runs(str(storage_root), [retention_root.PIPELINE_DAG], now, 48)}
    assert runs["fresh"].state == inventory.FINISHED and runs["fresh"].dates.source == "report"
    assert abs(runs["fresh"].started - (now - dt.timedelta(hours=1))) < dt.timedelta(seconds=1)
    assert runs["failed"].state == inventory.FAILED and runs["failed"].dates.source == "lineage"
    assert abs(runs["failed"].last_activity - (now - dt.timedelta(days=5))) < dt.timedelta(seconds=1)
    planned = _targets(_job(_config(storage_root, write_config), tmp_path, "--dry-run",
                            "--running", f"{retention_root.PIPELINE_DAG}/running_quiet"))
    assert not any(target == "ml_pipeline/fresh" for _, target in planned)
    assert ("run files", "ml_pipeline/failed") in planned


def test_a_run_that_recorded_no_dates_is_dated_by_files_retention_never_rewrites(storage_root, tmp_path):
    """An older run with no dates in its report nor lineage.json: its config.yaml's time (never rewritten) dates it,
    not its report's (which an old retention pass rewrote today); an Airflow run id's moment comes before either."""
    now = dt.datetime.now(dt.UTC)
    retention_root.build(storage_root, now)
    folder = storage_root / RUNS / "month_old"
    (folder / "report.json").write_text(json.dumps({"dag_id": retention_root.PIPELINE_DAG, "run_id": "month_old"}))
    (folder / "lineage.json").write_text("{}")
    runs = {run.run_folder: run for run in inventory.list_runs(str(storage_root), [retention_root.PIPELINE_DAG], now, 48)}
    assert runs["month_old"].dates.source == "mtime"
    assert abs(runs["month_old"].started - (now - dt.timedelta(days=20))) < dt.timedelta(seconds=1)
    moment = "manual__2026-09-03T10_00_00_00_00-1a2b3c4d"  # safe_name of manual__2026-09-03T10:00:00+00:00
    shutil.copytree(folder, storage_root / RUNS / moment)
    runs = {run.run_folder: run for run in inventory.list_runs(str(storage_root), [retention_root.PIPELINE_DAG], now, 48)}
    assert runs[moment].dates.source == "run id"
    assert runs[moment].started == dt.datetime(2026, 9, 3, 10, tzinfo=dt.UTC)


def test_times_to_come_are_taken_as_now(storage_root, write_config, tmp_path, caplog):
    """A finished run that recorded a start in 2099 is as new as can be (no age: nothing of it goes, it ranks first),
    with a warning naming it; a failed run whose every recorded time lies ahead is no longer running for it."""
    now = dt.datetime.now(dt.UTC)
    retention_root.build(storage_root, now)
    ancient = storage_root / RUNS / "ancient" / "report.json"
    report = json.loads(ancient.read_text())
    report["at"] = {"started": "2099-01-01T00:00:00+00:00", "ended": "2099-01-01T01:00:00+00:00"}
    ancient.write_text(json.dumps(report, indent=2, sort_keys=True))
    failed = storage_root / RUNS / "failed"
    (failed / "lineage.json").write_text(json.dumps({"started_at": "2099-01-01T00:00:00+00:00"}))
    _touch_all(failed, YEAR_2099)
    with caplog.at_level(logging.WARNING, logger="stagewise.retention"):
        runs = {run.run_folder: run for run in inventory.list_runs(str(storage_root), [retention_root.PIPELINE_DAG],
                                                                   now, 48)}
    assert runs["ancient"].started == now and runs["ancient"].state == inventory.FINISHED
    assert runs["failed"].state == inventory.FAILED
    assert any("ml_pipeline/ancient records 2099-01-01" in message for message in caplog.messages)
    planned = _targets(_job(_config(storage_root, write_config), tmp_path, "--dry-run"))
    assert not any(target == "ml_pipeline/ancient" for _, target in planned)


def _fail_writes_to(monkeypatch, marker: str):
    """Every write of a file whose URI holds ``marker`` fails as on a full disk."""
    real = storage.write_bytes

    def write_bytes(uri, data):
        if marker in uri:
            raise OSError(errno.ENOSPC, "No space left on device", uri)
        real(uri, data)

    monkeypatch.setattr(storage, "write_bytes", write_bytes)


def test_on_a_full_disk_nothing_goes_unnoted(storage_root, write_config, tmp_path, monkeypatch, capsys):
    """The pass's note cannot be written: the job exits 1 naming the note and nothing is removed (before: checkpoints
    went, then the note failed). A run's report cannot take its note: that run keeps every file, the pass stops there,
    and every run that lost files before it says so in its report."""
    retention_root.build(storage_root, dt.datetime.now(dt.UTC))
    config = _config(storage_root, write_config)
    before = retention_root.snapshot(storage_root)
    _fail_writes_to(monkeypatch, "/retention/")
    with pytest.raises(SystemExit) as stopped:
        _job(config, tmp_path)
    assert stopped.value.code == 1 and "could not be written" in capsys.readouterr().out  # the job's log: stdout
    assert {p: v for p, v in retention_root.snapshot(storage_root).items() if not p.startswith("retention/")} == before

    monkeypatch.undo()
    _fail_writes_to(monkeypatch, "/month_old/report.json")  # three_days (newer) comes first in the plan
    with pytest.raises(SystemExit):
        _job(config, tmp_path)
    after = retention_root.snapshot(storage_root)
    assert {p for p in before if "/month_old/" in p} <= set(after)  # month_old kept every file
    assert (storage_root / RUNS / "ancient").exists()  # and the pass went no further
    lost = {p for p in before if "/three_days/" in p} - set(after)
    noted = json.loads((storage_root / RUNS / "three_days" / "report.json").read_text())["retention"]
    assert lost and sum(entry["files"] for entry in noted) == len(lost)


class Crash(Exception):
    """The process dying midway through a pass."""


def test_a_pass_stopped_midway_is_finished_by_the_next(storage_root, write_config, tmp_path, monkeypatch):
    """A pass that dies after its second removal leaves its note 'removing'; the next pass finishes it: the storage
    ends exactly as after one uninterrupted pass, each run's report notes each removal once, and the stopped pass's
    note names the pass that finished it."""
    now = dt.datetime.now(dt.UTC)
    retention_root.build(storage_root, now)
    whole = tmp_path / "uninterrupted"
    shutil.copytree(storage_root, whole, copy_function=shutil.copy2)
    at = ["--now", now.isoformat(), "--running", f"{retention_root.PIPELINE_DAG}/running_quiet"]
    _job(_config(whole, write_config, keep_runs_days=2), tmp_path, *at)
    config = _config(storage_root, write_config, keep_runs_days=2)
    real, calls = removal.remove_files, []

    def dying(uris, progress=None):
        calls.append(uris)
        if len(calls) == 3:
            raise Crash
        return real(uris, progress)

    monkeypatch.setattr(removal, "remove_files", dying)
    with pytest.raises(Crash):
        _job(config, tmp_path, *at)
    monkeypatch.undo()
    notes = sorted((storage_root / "retention" / "ml" / "passes").glob("*.json"))
    assert [json.loads(p.read_text())["state"] for p in notes] == ["removing"]
    finished = _job(config, tmp_path, *at)

    def files(root):
        return {p: v[0] for p, v in retention_root.snapshot(root).items() if not p.startswith(("retention/", "assets/"))
                and not p.endswith(("report.json", "report.html"))}

    assert files(storage_root) == files(whole)
    first = json.loads(notes[0].read_text())
    assert first["state"] == "done" and first["finished_by"] == finished["pass"]
    for run in ("three_days", "month_old"):
        kinds = [e["removed"] for e in json.loads((storage_root / RUNS / run / "report.json").read_text())["retention"]]
        assert len(kinds) == len(set(kinds)), (run, kinds)


def test_two_passes_at_once_end_without_a_traceback(storage_root, write_config, tmp_path):
    """Two real passes started together over 150 old runs: both return, one removes and the other says another pass
    holds the storage; every old run is gone. Two removals of one plan at once (no lock between them: a dry run's
    list applied twice) both finish though files vanish under them."""
    now = dt.datetime.now(dt.UTC)
    retention_root.build(storage_root, now)
    for number in range(150):
        shutil.copytree(storage_root / RUNS / "ancient", storage_root / RUNS / f"ancient{number:03d}",
                        copy_function=shutil.copy2)
    config = load_config(_config(storage_root, write_config))
    results, errors = [], []

    def one():
        try:
            results.append(retention.run(config, False, [f"{retention_root.PIPELINE_DAG}/running_quiet"]))
        except Exception as exc:  # what the test looks for
            errors.append(exc)

    threads = [threading.Thread(target=one) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == [] and len(results) == 2
    assert not list((storage_root / RUNS).glob("ancient*"))
    assert sum("skipped" in result for result in results) <= 1

    for number in range(150):
        shutil.copytree(storage_root / RUNS / "month_old", storage_root / RUNS / f"again{number:03d}",
                        copy_function=shutil.copy2)
    plan, _ = retention.plan(config, now + dt.timedelta(days=200))
    threads = [threading.Thread(target=lambda: removal.apply(plan, False, now)) for _ in range(2)]
    failures = []
    threading.excepthook = lambda hook: failures.append(hook.exc_value)
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        threading.excepthook = threading.__excepthook__
    assert failures == [] and not list((storage_root / RUNS).glob("again*"))


def test_a_long_pass_says_how_far_it_got(storage_root, write_config, tmp_path, monkeypatch, capsys):
    """With the progress interval at zero every step logs its counts and rate: the listing (runs, files), the reading
    of records, and the removal (removals, files, files/s)."""
    retention_root.build(storage_root, dt.datetime.now(dt.UTC))
    monkeypatch.setattr(progress, "PROGRESS_S", 0.0)
    _job(_config(storage_root, write_config), tmp_path)
    lines = [line.split("stagewise.retention: ", 1)[-1] for line in capsys.readouterr().out.splitlines()
             if "files/s" in line]  # the job logs to stdout, as the Airflow task log shows it
    listed = [m for m in lines if m.startswith("listing runs")]
    assert listed
    assert listed[-1].startswith(f"listing runs done: {len(retention_root.RUNS)} runs")
    assert any(m.startswith("reading run records") for m in lines)
    assert any(m.startswith("retention removal done") and " removals, " in m for m in lines)


def test_the_dry_run_counts_what_the_real_pass_removes_studies_included(storage_root, write_config, tmp_path):
    """Runs, model versions and a study in its own journal file (the default layout): the dry run's counts by kind are
    the real pass's, and the files gone from disk are exactly as many and as large as both say (before: a study
    counted 0 files and its file went)."""
    import optuna

    from stagewise.study.studies import open_storage, storage_url

    now = dt.datetime.now(dt.UTC)
    retention_root.build(storage_root, now)
    raw = base_config(storage_root)
    del raw["sweep"]["storage"]
    raw["retention"] = {"pinned_versions": [retention_root.version(3)]}
    config = write_config(raw)
    url = storage_url(load_config(config).sweep, "ml_pipeline__old")
    study = optuna.create_study(study_name="ml_pipeline__old", storage=open_storage(url))
    study.optimize(lambda trial: trial.suggest_float("x", 0, 1), n_trials=1)
    later = ["--now", (now + dt.timedelta(days=91)).isoformat()]
    before = retention_root.snapshot(storage_root)
    planned = _job(config, tmp_path, "--dry-run", *later)
    assert planned["by_kind"]["study"] == {"count": 1, "files": 1, "bytes": planned["by_kind"]["study"]["bytes"]}
    done = _job(config, tmp_path, *later)
    assert done["by_kind"] == planned["by_kind"]
    gone = set(before) - set(retention_root.snapshot(storage_root))
    assert len(gone) == planned["total_files"] == done["total_files"]
    assert sum(before[path][0] for path in gone) == planned["total_bytes"]


def test_model_versions_are_ordered_by_their_cards_registration_not_file_times(storage_root, write_config, tmp_path):
    """The newest card file whose registered_at says 2001 is the oldest version: it goes past keep_model_versions,
    and the version its file time alone would have named stays."""
    versions = retention_root.build(storage_root, dt.datetime.now(dt.UTC))
    newest = retention_root.version(retention_root.NUM_VERSIONS)
    card = storage_root / "models" / retention_root.MODEL / newest / "card.json"
    stamp = card.stat().st_mtime
    card.write_text(json.dumps({"version": newest, "study": "", "registered_at": "2001-01-01T00:00:00Z"}))
    os.utime(card, (stamp, stamp))
    planned = _targets(_job(_config(storage_root, write_config), tmp_path, "--dry-run"))
    gone = {target.split("/", 1)[1] for what, target in planned if what == "model version"}
    assert gone == {newest} and versions["unprotected"] not in gone


def test_start_runs_lineage_records_the_runs_start(storage_root, write_config):
    """lineage.json (start_run writes it first) holds started_at: what dates a run that has no report yet."""
    from stagewise.reporting import lineage, run_dates

    out = str(storage_root / "runs" / "ml_pipeline" / "r1")
    before = dt.datetime.now(dt.UTC)
    lineage.write(out, load_config(_config(storage_root, write_config)))
    assert before <= run_dates.started_of(out) <= dt.datetime.now(dt.UTC)
