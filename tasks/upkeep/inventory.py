"""What a pipeline keeps under its storage root, as retention sees it: its runs (state, age, files and bytes), its
registered model versions, and what protects either. Read once per retention pass; nothing here removes anything.

A run's state needs no Airflow: ``report.json`` is written last (the commit), so a run that has one finished; a run
without one is running while it shows a sign of life within ``retention.idle_hours`` (a recorded task attempt, or a
file changed, never one dated later than now), or Airflow says it runs (the maintenance DAG passes its running runs);
else it failed. Its dates (start, end, last recorded activity) are what the run recorded
(stagewise.reporting.run_dates), each later than now taken as now; file times date it only where it recorded none.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from fsspec.implementations.local import LocalFileSystem

from stagewise.core import storage
from stagewise.core.errors import DataError
from stagewise.reporting import run_dates
from stagewise.reporting.run_dates import UNKNOWN, RunDates
from stagewise.upkeep.progress import Progress

log = logging.getLogger("stagewise.retention")

FINISHED, RUNNING, FAILED = "finished", "running", "failed"
REPORT = "report.json"
REWRITTEN = (REPORT, "report.html")  # the files retention's note rewrites: never a sign of a run's own life
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
    dates: RunDates = UNKNOWN
    """When it started and ended as it recorded them (an unfinished run: no end), none later than the pass's now."""
    activity: dt.datetime | None = None
    """Its latest recorded moment (a task attempt's start or end, its start), as recorded (it may lie ahead of now):
    what a failed run's idle time counts from."""

    @property
    def ref(self) -> str:
        return f"{self.dag_folder}/{self.run_folder}"

    @property
    def started(self) -> dt.datetime:
        """Its recorded start; unknown (no record, no file): the epoch."""
        return self.dates.started or EPOCH

    @property
    def last_activity(self) -> dt.datetime:
        return self.activity or self.dates.ended or self.started  # the policy takes one to come as now

    def changed_since(self, moment: dt.datetime, now: dt.datetime) -> bool:
        """Whether a file changed after ``moment``: a sign of life only (a time later than ``now`` is none; report.json
        and report.html are not, retention itself rewrites them)."""
        return any(moment < entry.modified <= now for entry in self.files if entry.path not in REWRITTEN)


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


def _entries(prefix: str, progress: Progress | None = None) -> dict[str, list[Entry]]:
    """Every file under ``prefix`` grouped by its first path segment below it, with its size and time; a file or
    folder that goes while it is listed (another pass) is left out."""
    fs, path = storage.filesystem(prefix)
    if isinstance(fs, LocalFileSystem):
        return _local_entries(path, progress)
    if not fs.isdir(path):
        return {}
    base = path.rstrip("/") + "/"
    grouped: dict[str, list[Entry]] = {}
    for found, info in fs.find(path, detail=True).items():  # one listing of the prefix (1,000 keys a request)
        if info.get("type", "file") != "file" or not found.startswith(base):
            continue
        first, _, rest = found[len(base):].partition("/")
        if rest:
            grouped.setdefault(first, []).append(Entry(rest, int(info.get("size") or 0), modified(info)))
    if progress is not None:
        progress.add(len(grouped), sum(len(files) for files in grouped.values()))
    return grouped


def _local_entries(path: str, progress: Progress | None) -> dict[str, list[Entry]]:
    """:func:`_entries` of a local folder, one sub-folder at a time so that a long listing says how far it got."""
    try:
        tops = sorted(entry.name for entry in os.scandir(path) if entry.is_dir(follow_symlinks=False))
    except (FileNotFoundError, NotADirectoryError):
        return {}
    grouped: dict[str, list[Entry]] = {}
    for top in tops:
        files: list[Entry] = []
        start = os.path.join(path, top)
        for folder, _, names in os.walk(start):
            for name in names:
                full = os.path.join(folder, name)
                try:
                    stat = os.stat(full, follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if not os.path.islink(full):
                    files.append(Entry(os.path.relpath(full, start).replace(os.sep, "/"), stat.st_size,
                                       dt.datetime.fromtimestamp(stat.st_mtime, dt.UTC)))
        if files:
            grouped[top] = files
        if progress is not None:
            progress.add(1, len(files))
    return grouped


def list_runs(storage_root: str, dag_ids: Iterable[str], now: dt.datetime, idle_hours: float,
              running: Iterable[str] = (), quiet_dags: Iterable[str] = ()) -> list[Run]:
    """The run folders of ``dag_ids`` under the root, each with its state and dates. ``running``: ``<dag_id>/<run_id>``
    of runs Airflow reports running; ``quiet_dags``: DAGs Airflow reports no queued or running run of (the maintenance
    DAG asks), whose unfinished runs are failed once idle for QUIET_GRACE rather than ``idle_hours``."""
    told = {"/".join(storage.safe_name(part) for part in ref.split("/", 1)) for ref in running if "/" in ref}
    quiet = {storage.safe_name(dag) for dag in quiet_dags}
    runs = []
    listing, dating = Progress("listing runs"), Progress("reading run records")
    for dag_id in dag_ids:
        folder = storage.safe_name(dag_id)
        prefix = storage.join(storage_root, "runs", folder)
        for run_folder, files in sorted(_entries(prefix, listing).items()):
            run = Run(folder, run_folder, storage.join(prefix, run_folder), files)
            date(run, now)
            dating.add(1)
            if run.ref in told or _running_again(run, now, idle_hours):
                run.state = RUNNING
            elif any(entry.path == REPORT for entry in files):
                run.state = FINISHED
            else:
                idle = QUIET_GRACE if folder in quiet else dt.timedelta(hours=idle_hours)
                # a recorded time to come is no sign of life (a skewed clock would keep a dead run running forever)
                recent = run.activity is not None and now - idle < run.activity <= now
                alive = recent or run.changed_since(now - idle, now)
                run.state = RUNNING if alive else FAILED
            runs.append(run)
    listing.done()
    dating.done()
    return runs


def _read(uri: str, read: Any) -> Any:
    """``read(uri)``, or None where the file went (another pass) or is torn: a record that says nothing."""
    try:
        return read(uri)
    except (OSError, ValueError, DataError) as exc:
        log.warning("%s not read (%s): dated without it", uri, exc)
        return None


def date(run: Run, now: dt.datetime) -> None:
    """Set ``run.dates`` and ``run.activity`` from what it recorded (stagewise.reporting.run_dates), each later than
    ``now`` taken as ``now``. Without any record: the time of its config.yaml or lineage.json (written once, never
    rewritten), else of its report (retention pins a report's dates before it rewrites one), else of its oldest file."""
    paths = {entry.path: entry for entry in run.files}
    found = None
    if REPORT in paths:
        found = _read(storage.join(run.prefix, REPORT), lambda uri: run_dates.read_report_dates(uri, run.run_folder))
    recorded = begun = None
    if found is None:  # an unfinished run (or a report recording no dates): its task attempts say how far it got
        attempts = [e for e in run.files if e.path.startswith("timeline/") and e.path.endswith(".json")]
        recorded = run_dates.from_attempts([_read(storage.join(run.prefix, e.path), storage.read_json) for e in attempts])
        begun = run_dates.started_of(run.prefix) if "lineage.json" in paths else None
        started = begun or (recorded.started if recorded else None) or run_dates.from_run_id(run.run_folder)
        if started is None:
            kept = [paths[name] for name in ("config.yaml", "lineage.json", REPORT) if name in paths]
            stamp = min((entry.modified for entry in kept or run.files), default=None)
            found = run_dates.from_mtime(stamp)
        else:
            found = RunDates(started, None, "lineage" if started == begun else "tasks" if recorded else "run id")
    if any(when > now for when in (found.started, found.ended) if when):
        log.warning("%s records %s, later than now (%s): taken as now, so its age counts from now", run.ref,
                    run_dates.iso(max(w for w in (found.started, found.ended) if w)), run_dates.iso(now))
    run.dates = found.as_of(now)
    moments = [m for m in (begun, recorded.ended if recorded else None, found.ended, found.started) if m]
    run.activity = max(moments) if moments else None  # as recorded: the policy takes a time to come as now


def _running_again(run: Run, now: dt.datetime, idle_hours: float) -> bool:
    """A finished run whose files changed well after its recorded end, recently: cleared and running again."""
    if not any(entry.path == REPORT for entry in run.files) or run.dates.ended is None:
        return False
    return run.changed_since(max(run.dates.ended + RERUN_SLACK, now - dt.timedelta(hours=idle_hours)), now)


def list_models(storage_root: str, name: str) -> list[ModelVersion]:
    """Model ``name``'s registered versions in the storage registry (a folder with a card), oldest first."""
    prefix = storage.join(storage_root, "models", name)
    versions = []
    for version, files in _entries(prefix).items():
        if not any(entry.path == "card.json" for entry in files):
            continue  # not a registered version (a half-written one is the registry's to finish)
        card = [entry for entry in files if entry.path == "card.json"][0]
        folder = storage.join(prefix, version)
        recorded = _read(storage.join(folder, "card.json"), storage.read_json)  # registered_at: what the registry wrote
        when = run_dates.moment(recorded.get("registered_at")) if isinstance(recorded, dict) else None
        versions.append(ModelVersion(version, folder, files, (when or card.modified).isoformat()))
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
