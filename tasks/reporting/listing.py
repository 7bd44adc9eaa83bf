"""Listings of many small JSON files (each run's report.json, each model version's card.json) that read only what changed.

Run: a library; the Stagewise pages (``stagewise.airflow.ui``) list every run with :func:`run_reports` on each request
and read the rows they show with :func:`run_rows`; ``stagewise.registry`` lists a model's versions through an
:class:`Index`.

Every call asks the storage what is there now; what it costs differs:

- Local storage: a folder's mtime changes whenever an entry in it is added, removed or renamed into place (every
  write of stagewise.core.storage is a rename). A call stats the base folder and each group folder (a DAG's runs
  folder), lists again only a group whose mtime moved (or moved within RACY_S of looking: mtimes can be coarse), and
  otherwise stats only the item folders that had no file yet (runs in flight, failed runs). A file written in place
  (no rename) changes no folder: the rows a page shows are stat'ed again before use (:meth:`Index.summaries` with
  ``recheck``), and every FULL_SCAN_S a call stats every file. So a page over 10,000 reports costs a few dozen stats,
  not 10,000 reads or 10,000 stats.
- S3: one recursive listing of the prefix (each key's ETag and size, 1,000 keys a request); S3 has no folder mtimes.

Only files whose version changed are read again, and only when a page shows them (or filters on what they hold).
"""

from __future__ import annotations

import contextvars
import datetime as dt
import math
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from fsspec.implementations.local import LocalFileSystem

from stagewise.core import storage
from stagewise.core.errors import DataError
from stagewise.reporting import run_dates
from stagewise.reporting.run_dates import RunDates

T = TypeVar("T")

# Remote reads of changed files at once: each is one small GET whose time is the round trip, not the bytes.
REMOTE_READERS = 16
# Local: every file is stat'ed at least this often (catches a file rewritten in place that no page showed) ...
FULL_SCAN_S = 60.0
# ... and a folder whose mtime is this recent is listed again (a second change within a coarse mtime's tick).
RACY_S = 2.0


@dataclass(frozen=True)
class Listed:
    """One file a scan found: ``<base>/<parts...>/<filename>``."""

    parts: tuple[str, ...]
    """The folder names between the base and the file (a run: its DAG folder and run folder)."""
    uri: str
    path: str
    """Where the file is for its filesystem (local: the path, S3: bucket/key)."""
    mtime: float | None
    """When it last changed, seconds since the epoch (local: its mtime, S3: LastModified)."""
    version: tuple[Any, ...]
    """What changes whenever the file does (local: mtime in ns, size, inode; S3: ETag, size)."""

    @property
    def modified(self) -> dt.datetime | None:
        return None if self.mtime is None else dt.datetime.fromtimestamp(self.mtime, dt.UTC)


def scan(base: str, depth: int, filename: str) -> list[Listed]:
    """Every ``<base>/<folder_1>/.../<folder_depth>/<filename>`` there now (none when ``base`` does not exist);
    ``depth`` 1 or 2."""
    return scan_versioned(base, depth, filename)[1]


_trees: dict[tuple[str, int, str], _LocalTree] = {}
_trees_lock = threading.Lock()


def scan_versioned(base: str, depth: int, filename: str) -> tuple[Any, list[Listed]]:
    """:func:`scan` and a token equal to the last call's exactly when the listing is (calls share the list: do not
    change it)."""
    if depth not in (1, 2):
        raise ValueError(f"depth {depth}: a listing looks one or two folders down")
    fs, path = storage.filesystem(base)
    if isinstance(fs, LocalFileSystem):
        with _trees_lock:
            tree = _trees.setdefault((base, depth, filename), _LocalTree(base, path, depth, filename))
        return tree.scan()
    listed = _scan_remote(fs, base, path, depth, filename)
    return [(item.parts, item.version) for item in listed], listed


def recheck(item: Listed) -> Listed | None:
    """``item`` as its file is now (None: gone); remote files are taken as listed (a HEAD each would cost a page)."""
    if "://" in item.uri and not item.uri.startswith("file://"):
        return item
    try:
        stat = os.stat(item.path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    version = (stat.st_mtime_ns, stat.st_size, stat.st_ino)
    return item if version == item.version else Listed(item.parts, item.uri, item.path, stat.st_mtime, version)


def _mtime_ns(path: str) -> int | None:
    try:
        return os.stat(path).st_mtime_ns
    except (FileNotFoundError, NotADirectoryError):
        return None


class _LocalTree:
    """What the last scan of one local base found, reused where its folders' mtimes say nothing changed."""

    def __init__(self, base: str, path: str, depth: int, filename: str) -> None:
        self.base, self.path, self.depth, self.filename = base.rstrip("/"), path.rstrip("/"), depth, filename
        self.lock = threading.Lock()  # one scan of a base at a time: a request waiting for it reuses it
        self.full_at = -math.inf
        self.top: int | None = None  # the base folder's mtime when its groups were listed
        self.groups: list[tuple[str, ...]] = []
        # group -> (its mtime before it was listed, its files, its item folders without the file yet)
        self.seen: dict[tuple[str, ...], tuple[int | None, list[Listed], list[str]]] = {}
        self.generation = 0
        self.listed: list[Listed] = []

    def scan(self) -> tuple[Any, list[Listed]]:
        with self.lock:
            now = time.time()
            full = time.monotonic() - self.full_at > FULL_SCAN_S
            if full:
                self.full_at = time.monotonic()
            changed = self._list_groups(full, now)
            for group in self.groups:
                changed = self._refresh(group, full, now) or changed
            for group in set(self.seen) - set(self.groups):
                del self.seen[group]
            if changed:
                self.generation += 1
                self.listed = [item for group in self.groups for item in self.seen[group][1]]
            return (id(self), self.generation), self.listed

    def forget(self) -> None:
        """A file was found changed or gone behind the folders' backs: stat every file at the next scan."""
        self.full_at = -math.inf

    def _trusted(self, mtime: int | None, before: int | None, full: bool, now: float) -> bool:
        return not full and mtime is not None and mtime == before and now - mtime / 1e9 > RACY_S

    def _list_groups(self, full: bool, now: float) -> bool:
        if self.depth == 1:  # the base holds the item folders itself
            self.groups = [()]
            return False
        mtime = _mtime_ns(self.path)  # before listing: a change while we list shows as a newer mtime next time
        if self._trusted(mtime, self.top, full, now):
            return False
        self.top = mtime
        groups = sorted((entry.name,) for entry in _folders(self.path))
        changed, self.groups = groups != self.groups, groups
        return changed

    def _refresh(self, group: tuple[str, ...], full: bool, now: float) -> bool:
        folder = "/".join((self.path, *group))
        mtime = _mtime_ns(folder)
        before = self.seen.get(group)
        if before is not None and self._trusted(mtime, before[0], full, now):
            # the same item folders as last time: only those without the file yet can have gained it
            gained = [item for name in before[2] if (item := self._item(group, name)) is not None]
            if not gained:
                return False
            names = {item.parts[-1] for item in gained}
            self.seen[group] = (mtime, [*before[1], *gained], [name for name in before[2] if name not in names])
            return True
        files, waiting = [], []
        for entry in _folders(folder):
            item = self._item(group, entry.name)
            if item is None:
                waiting.append(entry.name)
            else:
                files.append(item)
        self.seen[group] = (mtime, files, waiting)
        return before is None or before[1] != files

    def _item(self, group: tuple[str, ...], name: str) -> Listed | None:
        parts = (*group, name)
        path = "/".join((self.path, *parts, self.filename))
        try:  # the one system call a file costs
            stat = os.stat(path)
        except (FileNotFoundError, NotADirectoryError):  # a run still going has no report yet
            return None
        return Listed(parts, "/".join((self.base, *parts, self.filename)), path, stat.st_mtime,
                      (stat.st_mtime_ns, stat.st_size, stat.st_ino))


def _folders(path: str) -> list[os.DirEntry[str]]:
    """The sub-folders of ``path`` (none when it went), told from their directory entries: no stat each."""
    try:
        with os.scandir(path) as entries:
            return [entry for entry in entries if entry.is_dir()]
    except (FileNotFoundError, NotADirectoryError):
        return []


def _scan_remote(fs: Any, base: str, path: str, depth: int, filename: str) -> list[Listed]:
    root = path.rstrip("/")
    try:
        found = fs.find(root, detail=True)  # fresh (storage.filesystem keeps no listings): one listing of every key
    except FileNotFoundError:
        return []
    prefix = base.rstrip("/")
    listed = []
    for key, info in found.items():
        parts = key[len(root) + 1:].split("/")
        if len(parts) != depth + 1 or parts[-1] != filename or info.get("type") == "directory":
            continue
        stamp = _stamp(info)
        listed.append(Listed(tuple(parts[:-1]), "/".join((prefix, *parts)), key, stamp,
                             (info.get("ETag") or info.get("etag") or stamp, info.get("size"))))
    return listed


def _stamp(info: dict[str, Any]) -> float | None:
    stamp = info.get("mtime") or info.get("LastModified") or info.get("last_modified")
    if isinstance(stamp, dt.datetime):
        return (stamp if stamp.tzinfo else stamp.replace(tzinfo=dt.UTC)).timestamp()
    return float(stamp) if isinstance(stamp, int | float) else None


class Index(Generic[T]):
    """What ``summarise`` makes of the files a scan finds, made when first asked for and once per version of a file.

    :meth:`files` lists without reading, so a page reads only the files it shows (and those a filter needs); the
    summaries of files that went are dropped at each listing, so memory follows what exists. Pages are served from a
    thread pool: two calls at once may both read a changed file, never mix their results.
    """

    def __init__(self, summarise: Callable[[Listed], T]) -> None:
        self._summarise = summarise
        self._known: dict[tuple[str, ...], tuple[tuple[Any, ...], T]] = {}  # by (base, *parts): (version, summary)
        self._ordered: dict[tuple[str, int, str], tuple[Any, list[Listed]]] = {}
        self._lock = threading.Lock()

    def files(self, base: str, depth: int, filename: str,
              order: Callable[[list[Listed]], list[Listed]] | None = None) -> list[Listed]:
        """Each file under ``base`` there now, in ``order`` (else the scan's); while no file came, went or changed,
        the last call's list (sorting 10,000 files on each request would cost more than finding them). Do not change
        the list: calls share it."""
        token, listed = scan_versioned(base, depth, filename)
        key = (base, depth, filename)
        with self._lock:
            last = self._ordered.get(key)
            if last is not None and last[0] == token:
                return last[1]
            there = {(base, *item.parts): item.version for item in listed}
            self._known = {name: hit for name, hit in self._known.items()  # what went, or changed, is forgotten
                           if name[0] != base or there.get(name) == hit[0]}
        ordered = order(listed) if order else listed
        with self._lock:
            self._ordered[key] = (token, ordered)
        return ordered

    def summaries(self, base: str, items: list[Listed], recheck_files: bool = False) -> list[T | None]:
        """The summaries of ``items`` (from :meth:`files` of ``base``), reading those not read at their version.
        ``recheck_files``: stat each file first (the rows a page shows: a file rewritten in place, or gone since the
        listing, is read again, or None)."""
        if recheck_files:
            now = [recheck(item) for item in items]
            if any(found is not item for found, item in zip(now, items, strict=True)):
                with _trees_lock:  # the listing missed it: its next scan stats every file
                    for tree in _trees.values():
                        if tree.base == base.rstrip("/"):
                            tree.forget()
            present = [item for item in now if item is not None]
            made = iter(self.summaries(base, present))
            return [None if item is None else next(made) for item in now]
        with self._lock:
            hits = [self._known.get((base, *item.parts)) for item in items]
        found: list[T | None] = [hit[1] if hit is not None and hit[0] == item.version else None
                                 for item, hit in zip(items, hits, strict=True)]
        missing = [number for number, summary in enumerate(found) if summary is None]
        if missing:
            remote = "://" in base and not base.startswith("file://")
            made_now = self._summarise_all([items[number] for number in missing], remote)
            with self._lock:
                for number, summary in zip(missing, made_now, strict=True):
                    found[number] = summary
                    self._known[(base, *items[number].parts)] = (items[number].version, summary)
        return found

    def read(self, base: str, depth: int, filename: str) -> list[tuple[Listed, T]]:
        """Each file under ``base`` there now with its summary, in the scan's order."""
        listed = self.files(base, depth, filename)
        return list(zip(listed, self.summaries(base, listed), strict=True))  # type: ignore[arg-type] - none missing

    def _summarise_all(self, items: list[Listed], remote: bool) -> list[T]:
        if not remote or len(items) < 2:  # local reads are bound by parsing, which threads do not speed up
            return [self._summarise(item) for item in items]
        with ThreadPoolExecutor(min(REMOTE_READERS, len(items)), thread_name_prefix="stagewise-listing") as pool:
            # each read carries the caller's storage options (stagewise.core.storage.using_options)
            futures = [pool.submit(contextvars.copy_context().run, self._summarise, item) for item in items]
            return [future.result() for future in futures]


# -- runs: one row per report.json under runs/<dag_folder>/<run_folder>/ ------------------------------------------

STATES = ("promoted", "kept", "no gate", "unreadable")
"""A run's state as its report records it: the gate promoted its model, kept the current one, the run has no gate
(report only, batch inference), or its report.json cannot be read."""


@dataclass(frozen=True, kw_only=True)
class RunRow:
    """What the runs page shows of one run's report.json."""

    dag_folder: str
    run_folder: str
    uri: str
    modified: dt.datetime | None
    """When report.json last changed (retention's note changes it too): never what a run is dated by."""
    started: dt.datetime | None = None
    ended: dt.datetime | None = None
    """When the run started and ended as it recorded them (stagewise.reporting.run_dates)."""
    dag_id: str
    run_id: str
    metric: str = ""
    value: Any = None
    sweep_best: Any = None
    registry: dict[str, Any] | None = None
    """The gate's decision: promoted, version, current (only these keys)."""
    state: str = "no gate"
    error: str = ""


def objective_of(report: dict[str, Any]) -> tuple[str, Any]:
    """The run's objective metric name and its test value (older reports: test_accuracy)."""
    objective = report.get("objective") if isinstance(report.get("objective"), dict) else {}
    metric = objective.get("metric") or ("accuracy" if "test_accuracy" in report else None)
    value = objective.get("test") if objective.get("test") is not None else report.get(f"test_{metric}")
    return metric or "", value


def run_row(item: Listed) -> RunRow:
    """``item``'s report.json as a row; a report that cannot be read is a row in state ``unreadable`` with its error."""
    dag_folder, run_folder = item.parts
    fallback = run_dates.from_mtime(item.mtime)
    where = {"dag_folder": dag_folder, "run_folder": run_folder, "uri": item.uri, "modified": item.modified,
             "started": fallback.started, "ended": fallback.ended}
    try:
        report = storage.read_json(item.uri)
    except (OSError, ValueError, DataError) as exc:
        return RunRow(**where, dag_id=dag_folder, run_id=run_folder, state="unreadable",
                      error=f"cannot read {item.uri}: {exc}")
    if not isinstance(report, dict):
        return RunRow(**where, dag_id=dag_folder, run_id=run_folder, state="unreadable",
                      error=f"{item.uri} holds {type(report).__name__}, not an object")
    dates = (run_dates.from_report(report, run_folder) or fallback).as_of(dt.datetime.now(dt.UTC))
    where.update(started=dates.started, ended=dates.ended)
    metric, value = objective_of(report)
    sweep = report.get("sweep") if isinstance(report.get("sweep"), dict) else {}
    registry = report.get("registry") if isinstance(report.get("registry"), dict) else {}
    gate = {key: registry.get(key) for key in ("promoted", "version", "current")} if "promoted" in registry else None
    state = "no gate" if gate is None else "promoted" if gate["promoted"] else "kept"
    return RunRow(**where, dag_id=str(report.get("dag_id") or dag_folder), run_id=str(report.get("run_id") or run_folder),
                  metric=metric, value=value, sweep_best=sweep.get("best_value"), registry=gate, state=state)


def dates_of(item: Listed) -> RunDates:
    """When ``item``'s run started and ended as it recorded them (most reports: from the file's head alone); a report
    that records none, or cannot be read, by its file's time (stagewise.reporting.run_dates' last fallback: retention
    pins the dates into a report before it rewrites one). A time to come is taken as now."""
    try:
        found = run_dates.read_report_dates(item.uri, item.parts[-1])
    except (OSError, ValueError, DataError):
        found = None
    return (found or run_dates.from_mtime(item.mtime)).as_of(dt.datetime.now(dt.UTC))


_RUNS: Index[RunRow] = Index(run_row)
_DATES: Index[RunDates] = Index(dates_of)  # read once per version of a report, as the rows are


def _started(dates: RunDates | None) -> float:
    return dates.started.timestamp() if dates is not None and dates.started is not None else 0.0


def run_reports(storage_root: str) -> list[Listed]:
    """Every ``runs/<dag_folder>/<run_folder>/report.json`` under ``storage_root``, newest first by when the run
    started (as it recorded it), nothing left out; only the dates of each report are read (once per version of the
    file), :func:`run_rows` reads the ones a page shows. Calls share the list: do not change it."""
    base = storage.join(storage_root, "runs")

    def newest_first(listed: list[Listed]) -> list[Listed]:  # only called when a report came, went or changed
        _DATES.files(base, 2, "report.json")  # forgets the dates of reports that went
        keyed = zip(_DATES.summaries(base, listed), listed, strict=True)
        return [item for _, item in sorted(keyed, key=lambda pair: (_started(pair[0]), pair[1].parts), reverse=True)]

    return _RUNS.files(base, 2, "report.json", newest_first)


def report_dates(storage_root: str, reports: list[Listed]) -> list[RunDates]:
    """The recorded dates of ``reports`` (from :func:`run_reports` of ``storage_root``), read once per version."""
    return _DATES.summaries(storage.join(storage_root, "runs"), reports)  # type: ignore[return-value] - never None


def run_rows(storage_root: str, reports: list[Listed], recheck_files: bool = False) -> list[RunRow | None]:
    """The rows of ``reports`` (from :func:`run_reports` of ``storage_root``), each report read once per version;
    ``recheck_files``: stat each report first (the rows a page shows), None for one gone since the listing."""
    return _RUNS.summaries(storage.join(storage_root, "runs"), reports, recheck_files)
