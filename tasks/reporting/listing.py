"""Listings of many small JSON files (each run's report.json, each model version's card.json) that read only what changed.

Run: a library; the Stagewise pages (``stagewise.airflow.ui``) list every run with :func:`run_reports` on each request
and read the rows they show with :func:`run_rows`; ``stagewise.registry`` lists a model's versions through an
:class:`Index`.

Each call asks the storage what is there now and trusts nothing it saw before: locally one ``stat`` a file (mtime,
size, inode), on S3 one recursive listing of the prefix (each key's ETag and size, 1,000 keys a request). A file
added, rewritten or removed, by this process or any other, shows in the next call; only files whose version changed
are read again, and only when a page shows them (or filters on what they hold), so a page over 10,000 reports costs
10,000 stats and about 50 reads, not 10,000 reads.
"""

from __future__ import annotations

import contextvars
import datetime as dt
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from fsspec.implementations.local import LocalFileSystem

from stagewise.core import storage
from stagewise.core.errors import DataError

T = TypeVar("T")

# Remote reads of changed files at once: each is one small GET whose time is the round trip, not the bytes.
REMOTE_READERS = 16


@dataclass(frozen=True)
class Listed:
    """One file a scan found: ``<base>/<parts...>/<filename>``."""

    parts: tuple[str, ...]
    """The folder names between the base and the file (a run: its DAG folder and run folder)."""
    uri: str
    mtime: float | None
    """When it last changed, seconds since the epoch (local: its mtime, S3: LastModified)."""
    version: tuple[Any, ...]
    """What changes whenever the file does (local: mtime in ns, size, inode; S3: ETag, size)."""

    @property
    def modified(self) -> dt.datetime | None:
        return None if self.mtime is None else dt.datetime.fromtimestamp(self.mtime, dt.UTC)


def scan(base: str, depth: int, filename: str) -> list[Listed]:
    """Every ``<base>/<folder_1>/.../<folder_depth>/<filename>`` there now (none when ``base`` does not exist)."""
    fs, path = storage.filesystem(base)
    if isinstance(fs, LocalFileSystem):
        return _scan_local(base, path, depth, filename)
    return _scan_remote(fs, base, path, depth, filename)


def _scan_local(base: str, path: str, depth: int, filename: str) -> list[Listed]:
    found: list[Listed] = []
    prefix = base.rstrip("/")
    tail = "/" + filename

    def walk(folder: str, parts: tuple[str, ...]) -> None:
        try:
            entries = os.scandir(folder)
        except (FileNotFoundError, NotADirectoryError):  # removed while we walked: gone, as the next call says too
            return
        with entries:
            for entry in entries:
                if not entry.is_dir():  # from the directory entry itself: no stat
                    continue
                if len(parts) + 1 < depth:
                    walk(entry.path, (*parts, entry.name))
                    continue
                try:  # the one system call a file costs: this loop is the page's time with 10,000 runs
                    stat = os.stat(entry.path + tail)
                except (FileNotFoundError, NotADirectoryError):  # a run still going has no report yet
                    continue
                inner = (*parts, entry.name)
                found.append(Listed(inner, f"{prefix}/{'/'.join(inner)}{tail}", stat.st_mtime,
                                    (stat.st_mtime_ns, stat.st_size, stat.st_ino)))

    walk(path, ())
    return found


def _scan_remote(fs: Any, base: str, path: str, depth: int, filename: str) -> list[Listed]:
    root = path.rstrip("/")
    fs.invalidate_cache(root)  # s3fs keeps listings: another process's new run must show in this call
    try:
        found = fs.find(root, detail=True)  # one listing of every key under the prefix, no request per folder
    except FileNotFoundError:
        return []
    prefix = base.rstrip("/")
    listed = []
    for key, info in found.items():
        parts = key[len(root) + 1:].split("/")
        if len(parts) != depth + 1 or parts[-1] != filename or info.get("type") == "directory":
            continue
        stamp = _stamp(info)
        listed.append(Listed(tuple(parts[:-1]), "/".join((prefix, *parts)), stamp,
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
        self._ordered: dict[tuple[str, int, str], tuple[list[tuple[Any, ...]], list[Listed]]] = {}
        self._lock = threading.Lock()

    def files(self, base: str, depth: int, filename: str,
              order: Callable[[list[Listed]], list[Listed]] | None = None) -> list[Listed]:
        """Each file under ``base`` there now, in ``order`` (else the scan's); while no file came, went or changed,
        the last call's list (sorting 10,000 files on each request would cost as much as finding them). Do not change
        the list: calls share it."""
        listed = scan(base, depth, filename)
        versions = [(item.parts, item.version) for item in listed]
        key = (base, depth, filename)
        with self._lock:
            last = self._ordered.get(key)
            if last is not None and last[0] == versions:
                return last[1]
            there = {(base, *item.parts): item.version for item in listed}
            self._known = {name: hit for name, hit in self._known.items()  # what went, or changed, is forgotten
                           if name[0] != base or there.get(name) == hit[0]}
        ordered = order(listed) if order else listed
        with self._lock:
            self._ordered[key] = (versions, ordered)
        return ordered

    def summaries(self, base: str, items: list[Listed]) -> list[T]:
        """The summaries of ``items`` (from :meth:`files` of ``base``), reading those not read at their version."""
        with self._lock:
            hits = [self._known.get((base, *item.parts)) for item in items]
        found: list[T | None] = [hit[1] if hit is not None and hit[0] == item.version else None
                                 for item, hit in zip(items, hits, strict=True)]
        missing = [number for number, summary in enumerate(found) if summary is None]
        if missing:
            remote = "://" in base and not base.startswith("file://")
            made = self._summarise_all([items[number] for number in missing], remote)
            with self._lock:
                for number, summary in zip(missing, made, strict=True):
                    found[number] = summary
                    self._known[(base, *items[number].parts)] = (items[number].version, summary)
        return found  # type: ignore[return-value] - every None was filled

    def read(self, base: str, depth: int, filename: str) -> list[tuple[Listed, T]]:
        """Each file under ``base`` there now with its summary, in the scan's order."""
        listed = self.files(base, depth, filename)
        return list(zip(listed, self.summaries(base, listed), strict=True))

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
    where = {"dag_folder": dag_folder, "run_folder": run_folder, "uri": item.uri, "modified": item.modified}
    try:
        report = storage.read_json(item.uri)
    except (OSError, ValueError, DataError) as exc:
        return RunRow(**where, dag_id=dag_folder, run_id=run_folder, state="unreadable",
                      error=f"cannot read {item.uri}: {exc}")
    if not isinstance(report, dict):
        return RunRow(**where, dag_id=dag_folder, run_id=run_folder, state="unreadable",
                      error=f"{item.uri} holds {type(report).__name__}, not an object")
    metric, value = objective_of(report)
    sweep = report.get("sweep") if isinstance(report.get("sweep"), dict) else {}
    registry = report.get("registry") if isinstance(report.get("registry"), dict) else {}
    gate = {key: registry.get(key) for key in ("promoted", "version", "current")} if "promoted" in registry else None
    state = "no gate" if gate is None else "promoted" if gate["promoted"] else "kept"
    return RunRow(**where, dag_id=str(report.get("dag_id") or dag_folder), run_id=str(report.get("run_id") or run_folder),
                  metric=metric, value=value, sweep_best=sweep.get("best_value"), registry=gate, state=state)


_RUNS: Index[RunRow] = Index(run_row)


def _newest_first(listed: list[Listed]) -> list[Listed]:
    return sorted(listed, key=lambda item: (item.mtime or 0.0, item.parts), reverse=True)


def run_reports(storage_root: str) -> list[Listed]:
    """Every ``runs/<dag_folder>/<run_folder>/report.json`` under ``storage_root``, newest first, none read yet;
    nothing left out. :func:`run_rows` reads the ones a page shows. Calls share the list: do not change it."""
    return _RUNS.files(storage.join(storage_root, "runs"), 2, "report.json", _newest_first)


def run_rows(storage_root: str, reports: list[Listed]) -> list[RunRow]:
    """The rows of ``reports`` (from :func:`run_reports` of ``storage_root``), each report read once per version."""
    return _RUNS.summaries(storage.join(storage_root, "runs"), reports)
