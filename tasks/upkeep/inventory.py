"""What a pipeline keeps under its storage root, as retention sees it: its runs (state, age, files and bytes), its
registered model versions, and what protects either. Read once per retention pass; nothing here removes anything.

A run's state needs no Airflow: ``report.json`` is written last (the commit), so a run that has one finished; a run
without one is running while any of its files changed within ``retention.idle_hours`` (or Airflow says it runs: the
maintenance DAG passes its running runs), else it failed.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from stagewise.core import storage

log = logging.getLogger("stagewise.retention")

FINISHED, RUNNING, FAILED = "finished", "running", "failed"
REPORT = "report.json"
EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
# A run that started between Airflow's answer and the listing must not look failed: quiet DAGs still get this long.
QUIET_GRACE = dt.timedelta(hours=1)
# The report's own task records its end after report.json; a change later than this is a cleared run at work again.
RERUN_SLACK = dt.timedelta(minutes=10)


@dataclass(frozen=True)
class Entry:
    """One stored file: its path relative to what holds it (a run or model version folder), bytes and last change."""

    path: str
    size: int
    modified: dt.datetime


@dataclass
class Run:
    """One run folder ``runs/<dag folder>/<run folder>`` and everything under it."""

    dag_folder: str
    run_folder: str
    prefix: str
    files: list[Entry]
    state: str = FAILED
    protected: str = ""  # why nothing of it may go (an MLflow version's artifact, another running run's reuse)

    @property
    def ref(self) -> str:
        return f"{self.dag_folder}/{self.run_folder}"

    @property
    def ended(self) -> dt.datetime:
        """When it finished (its report's time) or, unfinished, when any of its files last changed."""
        report = [entry.modified for entry in self.files if entry.path == REPORT]
        return report[0] if report else self.last_change

    @property
    def last_change(self) -> dt.datetime:
        return max((entry.modified for entry in self.files), default=EPOCH)


@dataclass
class ModelVersion:
    """A registered version's folder ``models/<name>/<version>/``."""

    version: str
    prefix: str
    files: list[Entry]
    registered_at: str = ""


@dataclass
class Models:
    """One model name's versions (storage registry) and those never removed, each with why."""

    name: str
    versions: list[ModelVersion] = field(default_factory=list)
    protected: dict[str, str] = field(default_factory=dict)


def modified(info: dict[str, Any]) -> dt.datetime:
    """When a storage object last changed, in UTC; unknown: the epoch (oldest)."""
    return storage.modified_time(info) or EPOCH


def _entries(prefix: str) -> dict[str, list[Entry]]:
    """Every file under ``prefix`` grouped by its first path segment below it, with its size and time."""
    fs, path = storage.filesystem(prefix)
    if not fs.isdir(path):
        return {}
    base = path.rstrip("/") + "/"
    grouped: dict[str, list[Entry]] = {}
    for found, info in fs.find(path, detail=True).items():
        if info.get("type", "file") != "file" or not found.startswith(base):
            continue
        first, _, rest = found[len(base):].partition("/")
        if rest:
            grouped.setdefault(first, []).append(Entry(rest, int(info.get("size") or 0), modified(info)))
    return grouped


def list_runs(storage_root: str, dag_ids: Iterable[str], now: dt.datetime, idle_hours: float,
              running: Iterable[str] = (), quiet_dags: Iterable[str] = ()) -> list[Run]:
    """The run folders of ``dag_ids`` under the root, each with its state. ``running``: ``<dag_id>/<run_id>`` of runs
    Airflow reports running; ``quiet_dags``: DAGs Airflow reports no queued or running run of (the maintenance DAG
    asks), whose unfinished runs are failed once idle for QUIET_GRACE rather than ``idle_hours``."""
    told = {"/".join(storage.safe_name(part) for part in ref.split("/", 1)) for ref in running if "/" in ref}
    quiet = {storage.safe_name(dag) for dag in quiet_dags}
    runs = []
    for dag_id in dag_ids:
        folder = storage.safe_name(dag_id)
        prefix = storage.join(storage_root, "runs", folder)
        for run_folder, files in sorted(_entries(prefix).items()):
            run = Run(folder, run_folder, storage.join(prefix, run_folder), files)
            if run.ref in told or _running_again(run, now, idle_hours):
                run.state = RUNNING
            elif any(entry.path == REPORT for entry in files):
                run.state = FINISHED
            else:
                idle = QUIET_GRACE if folder in quiet else dt.timedelta(hours=idle_hours)
                run.state = RUNNING if now - run.last_change < idle else FAILED
            runs.append(run)
    return runs


def _running_again(run: Run, now: dt.datetime, idle_hours: float) -> bool:
    """A finished run whose files changed well after its report, recently: cleared and running again."""
    report = [entry.modified for entry in run.files if entry.path == REPORT]
    return bool(report) and now - run.last_change < dt.timedelta(hours=idle_hours) and (
        run.last_change - report[0] > RERUN_SLACK)


def list_models(storage_root: str, name: str) -> list[ModelVersion]:
    """Model ``name``'s registered versions in the storage registry (a folder with a card), oldest first."""
    prefix = storage.join(storage_root, "models", name)
    versions = []
    for version, files in _entries(prefix).items():
        if not any(entry.path == "card.json" for entry in files):
            continue  # not a registered version (a half-written one is the registry's to finish)
        card = [entry for entry in files if entry.path == "card.json"][0]
        versions.append(ModelVersion(version, storage.join(prefix, version), files, card.modified.isoformat()))
    return sorted(versions, key=lambda v: v.registered_at)


def protect_runs(runs: list[Run], prefixes: Iterable[str], why: str) -> None:
    """Mark every run that holds one of ``prefixes`` (URIs of files or folders) as protected, saying ``why``."""
    wanted = [p.rstrip("/") for p in prefixes if p]
    for run in runs:
        if any(p == run.prefix or p.startswith(run.prefix + "/") for p in wanted):
            run.protected = run.protected or why


def cache_sources(storage_root: str, pipeline: str) -> set[str]:
    """``<dag folder>/<run folder>`` of every run whose outputs the pipeline's step cache (stagewise.reuse) serves."""
    fs, path = storage.filesystem(storage.join(storage_root, "cache", storage.safe_name(pipeline)))
    if not fs.isdir(path):
        return set()
    sources = set()
    for found in fs.glob(path.rstrip("/") + "/*/*.json"):
        try:
            entry = storage.parse_json(found, fs.cat_file(found))
        except Exception as exc:  # an unreadable entry protects nothing; the cache's own lookup ignores it too
            log.warning("cache entry %s unreadable, skipped: %s", found, exc)
            continue
        dag, _, run = str(entry.get("source_run", "")).partition("/")
        if dag and run:
            sources.add(f"{storage.safe_name(dag)}/{storage.safe_name(run)}")
    return sources
