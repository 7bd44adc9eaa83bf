"""stagewise.reporting.listing: every report listed, newest first, read only when asked for and once per version."""

from __future__ import annotations

import datetime as dt
import json
import os
import shutil
from pathlib import Path

import pytest

from stagewise.core import storage
from stagewise.reporting import listing


def write(root: Path, dag: str, run: str, stamp: float, **report) -> Path:
    path = root / "runs" / dag / run / "report.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"dag_id": dag, "run_id": run, **report}))
    os.utime(path, (stamp, stamp))
    return path


@pytest.fixture
def trusting(monkeypatch):
    """Folder mtimes trusted at once (no racy window) and no periodic full scan: the listing's cheap path."""
    monkeypatch.setattr(listing, "RACY_S", 0.0)
    monkeypatch.setattr(listing, "FULL_SCAN_S", 1e9)


def test_every_report_is_listed_newest_first_and_only_asked_rows_are_read(storage_root, monkeypatch, trusting):
    """3,000 reports over two DAG folders (and a run folder without a report): all listed, newest first, no row read
    (only each report's dates, once per version); asking for 5 rows reads 5 reports, asking again reads none."""
    for number in range(3000):
        write(storage_root, f"dag{number % 2}", f"run{number:04d}", 1_700_000_000 + number)
    (storage_root / "runs" / "dag0" / "in_flight").mkdir()
    reads = []
    real = storage.read_json
    monkeypatch.setattr(storage, "read_json", lambda uri: reads.append(uri) or real(uri))
    reports = listing.run_reports(str(storage_root))
    assert len(reports) == 3000 and reads == []
    assert [item.parts[1] for item in reports[:3]] == ["run2999", "run2998", "run2997"]
    rows = listing.run_rows(str(storage_root), reports[:5])
    assert [row.run_id for row in rows] == ["run2999", "run2998", "run2997", "run2996", "run2995"] and len(reads) == 5
    listing.run_rows(str(storage_root), reports[:5])
    assert len(reads) == 5
    assert listing.run_reports(str(storage_root)) is reports  # nothing changed: the same list, not sorted again


def test_changes_by_another_writer_show_in_the_next_call(storage_root, trusting):
    """A new run folder, a report written into a folder that had none, a report rewritten in place (no folder's
    mtime moves: the rows a page shows are stat'ed again) and a removed run each show in the next call."""
    for number in range(20):
        write(storage_root, "dag", f"run{number:02d}", 1_700_000_000 + number, objective={"metric": "a", "test": 0.1})
    waiting = storage_root / "runs" / "dag" / "waiting"
    waiting.mkdir()
    root = str(storage_root)
    assert len(listing.run_reports(root)) == 20
    write(storage_root, "dag", "run20", 1_700_000_100)
    assert listing.run_reports(root)[0].parts == ("dag", "run20")
    write(storage_root, "dag", "waiting", 1_700_000_200)
    reports = listing.run_reports(root)
    assert len(reports) == 22 and reports[0].parts == ("dag", "waiting")

    oldest = reports[-1]  # run00, rewritten in place with a later time
    assert listing.run_rows(root, [oldest], recheck_files=True)[0].value == 0.1
    path = write(storage_root, "dag", "run00", 1_700_000_300, objective={"metric": "a", "test": 0.9})
    assert listing.run_rows(root, [oldest], recheck_files=True)[0].value == 0.9
    assert listing.run_reports(root)[0].parts == ("dag", "run00")  # the recheck made the next listing look again

    path.unlink()  # the report gone, its folder kept
    assert listing.run_rows(root, [listing.run_reports(root)[0]], recheck_files=True) == [None]
    shutil.rmtree(storage_root / "runs" / "dag" / "run01")
    reports = listing.run_reports(root)
    assert len(reports) == 20 and ("dag", "run01") not in {item.parts for item in reports}


def test_a_report_that_cannot_be_read_is_a_row_saying_so(storage_root):
    """A torn report.json and one holding a list are rows in state 'unreadable' with the reason, not errors."""
    (storage_root / "runs" / "dag" / "torn").mkdir(parents=True)
    (storage_root / "runs" / "dag" / "torn" / "report.json").write_text('{"dag_id": ')
    (storage_root / "runs" / "dag" / "list").mkdir()
    (storage_root / "runs" / "dag" / "list" / "report.json").write_text("[]")
    rows = {row.run_folder: row for row in listing.run_rows(str(storage_root), listing.run_reports(str(storage_root)))}
    assert rows["torn"].state == "unreadable" and "is not valid JSON" in rows["torn"].error
    assert rows["list"].state == "unreadable" and rows["list"].error.endswith("holds list, not an object")


def test_states_follow_the_gate(storage_root):
    """promoted, kept (the gate kept the current model) and no gate (report only, batch inference)."""
    write(storage_root, "dag", "a", 1, registry={"promoted": True, "version": "v2", "current": "v2"})
    write(storage_root, "dag", "b", 2, registry={"promoted": False, "version": "v3", "current": "v2"})
    write(storage_root, "dag", "c", 3, registry={"report_only": True, "decision": "x"})
    write(storage_root, "dag", "d", 4)
    rows = {row.run_folder: row.state for row in listing.run_rows(str(storage_root),
                                                                   listing.run_reports(str(storage_root)))}
    assert rows == {"a": "promoted", "b": "kept", "c": "no gate", "d": "no gate"}


def test_runs_are_dated_by_what_they_recorded_not_by_when_their_report_changed(storage_root):
    """A run of 2026-09-03 whose report retention rewrote today is listed by its recorded start, after a run of
    2026-11-30 (before: first, dated today); a report that records no dates is dated by its file's time until
    retention notes in it, which pins that date into the report first, so the rewrite moves nothing."""
    from stagewise.upkeep import removal
    from stagewise.upkeep.policy import Removal

    today = dt.datetime.now(dt.UTC).timestamp()
    write(storage_root, "dag", "september", today, at={"started": "2026-09-03T10:00:00+00:00",
                                                       "ended": "2026-09-03T10:20:00+00:00"})
    write(storage_root, "dag", "november", dt.datetime(2026, 11, 30, tzinfo=dt.UTC).timestamp(),
          at={"started": "2026-11-30T08:00:00+00:00", "ended": "2026-11-30T08:30:00+00:00"})
    older = dt.datetime(2026, 6, 1, tzinfo=dt.UTC)
    write(storage_root, "dag", "undated", older.timestamp())
    root = str(storage_root)
    reports = listing.run_reports(root)
    assert [item.parts[1] for item in reports] == ["november", "september", "undated"]
    dates = {item.parts[1]: d for item, d in zip(reports, listing.report_dates(root, reports), strict=True)}
    assert dates["september"].started == dt.datetime(2026, 9, 3, 10, tzinfo=dt.UTC)
    assert dates["september"].source == "report" and dates["undated"].source == "mtime"
    rows = {row.run_folder: row for row in listing.run_rows(root, reports)}
    assert rows["september"].started.date() == dt.date(2026, 9, 3) and rows["september"].ended.minute == 20

    prefix = str(storage_root / "runs" / "dag" / "undated")
    removal.note_in_report(prefix, [Removal("checkpoints", "dag/undated", "old", (), 0, prefix, dates["undated"])],
                           "2026-12-02T00:00:00Z")
    reports = listing.run_reports(root)
    redated = dict(zip((item.parts[1] for item in reports), listing.report_dates(root, reports), strict=True))
    assert redated["undated"].started == older and redated["undated"].source == "report"
    assert [item.parts[1] for item in reports][-1] == "undated"
