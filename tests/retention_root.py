"""A storage root as a deployment leaves it after weeks (tests of stagewise.retention and the maintenance DAG):
finished, failed and running runs of pipeline ``ml`` of several ages, raw data, and registered model versions of
``digits``, one current, one its rollback target and one pinned. File times are set back to the runs' ages, and the
runs record the same dates (lineage.json's started_at, report.json's at)."""

from __future__ import annotations

import datetime as dt
import json
import os
from pathlib import Path

PIPELINE_DAG = "ml_pipeline"
MODEL = "digits"
RECORD = ("config.yaml", "lineage.json", "report.json", "report.html")
WORK = ("preprocess/shard-0.parquet", "sweep/trials.json", "train/s1/model.pt", "train/s1/metrics.json",
        "train/s1/final.pt", "train/s1/checkpoints/step-000000010.pt", "train/s1/best/step-1/model.distcp",
        "predictions/part-0.parquet", "predictions/manifest.json", "timeline/report--1--try1.json")
# run folder: (hours since it started, finished?)
RUNS = {"ancient": (100 * 24, True), "month_old": (20 * 24, True), "three_days": (3 * 24, True),
        "fresh": (1, True), "failed": (5 * 24, False), "running_quiet": (5 * 24, False), "running_busy": (1, False)}
PENDING_AGE_H = 10 * 24  # three_days' unsent tracking record, past pending_tracking_days 7
NUM_VERSIONS = 14


def version(number: int) -> str:
    return f"m-{number:012x}"


def _write(path: Path, size: int, when: dt.datetime, text: str | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text.encode() if text is not None else os.urandom(size))
    os.utime(path, (when.timestamp(), when.timestamp()))


def recorded(name: str, run: str, began: dt.datetime) -> str | None:
    """What a run records of its dates, as start_run (lineage.json) and the report step (report.json's ``at``) write
    them: the same moments its files' times say, so tests can move either alone."""
    if name == "report.json":
        at = {"started": began.isoformat(), "ended": (began + dt.timedelta(minutes=3)).isoformat()}
        return json.dumps({"at": at, "dag_id": PIPELINE_DAG, "run_id": run}, indent=2, sort_keys=True)
    if name == "lineage.json":
        return json.dumps({"code_version": "test", "started_at": began.isoformat()})
    return None


def build(root: Path, now: dt.datetime) -> dict[str, str]:
    """Write the storage root; returns ``{what: version}`` for current, rollback target, pinned and the one past
    keep_model_versions that nothing protects."""
    for run, (hours, finished) in RUNS.items():
        began = now - dt.timedelta(hours=hours)
        folder = root / "runs" / PIPELINE_DAG / run
        for index, name in enumerate(RECORD):
            if name.startswith("report") and not finished:
                continue
            text = recorded(name, run, began)
            _write(folder / name, 700, began + dt.timedelta(minutes=index if name.startswith("report") else 0), text)
        for name in WORK:
            text = json.dumps({"pad": "x" * 5_000}) if name.endswith(".json") else None  # JSON that parses
            _write(folder / name, 5_000, began + dt.timedelta(minutes=1), text)
    _write(root / "runs" / PIPELINE_DAG / "three_days" / "tracking/pending/report-1.json", 300,
           now - dt.timedelta(hours=PENDING_AGE_H))
    _write(root / "raw" / "digits" / "part-0.parquet", 9_000, now - dt.timedelta(days=400))
    for number in range(1, NUM_VERSIONS + 1):
        registered = now - dt.timedelta(days=NUM_VERSIONS + 1 - number)
        folder = root / "models" / MODEL / version(number)
        _write(folder / "model.pt", 2_000, registered)
        _write(folder / "card.json", 0, registered, json.dumps({"version": version(number), "study": ""}))
    pointer = {"version": version(1), "history": [version(2)]}  # rolled back to an old one: 1 current, 2 next back
    _write(root / "models" / MODEL / "current.json", 0, now, json.dumps(pointer))
    return {"current": version(1), "rollback": version(2), "pinned": version(3), "unprotected": version(4)}


def snapshot(root: Path) -> dict[str, tuple[int, float]]:
    """Every file under ``root`` with its size and time."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime) for p in root.rglob("*") if p.is_file()}
