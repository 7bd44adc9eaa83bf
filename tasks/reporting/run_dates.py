"""When a run started and ended, as the run itself recorded it; never a file's mtime where the run said.

Run: a library; the runs page (stagewise.reporting.listing) and retention (stagewise.upkeep.inventory) date runs
with it. Where the dates come from, first found wins (docs/operations.md, "A run's dates"):

1. report.json's ``at`` (``started``, ``ended``): written by the report step, the run's commit. Its key sorts first
   in the file, so a listing reads only the head of each report.
2. The run's recorded task attempts: report.json's ``tasks``, or for a run without a report its ``timeline/``
   records (stagewise.reporting.timeline): the earliest start, the latest end.
3. lineage.json's ``started_at`` (start_run writes it before the config snapshot).
4. The moment in its Airflow run id (``manual__2026-09-03T10:00:00+00:00``, ``scheduled__...``).
5. Last, for runs older than these records: the mtime of a file retention never rewrites before it has pinned the
   dates: a report retention notes in gets ``at`` first (:func:`pin`), and config.yaml is never rewritten at all.

A time later than ``now`` is taken as ``now`` (:meth:`RunDates.as_of`): a skewed clock makes a run new, never eternal.
"""

from __future__ import annotations

import datetime as dt
import json
import re
from dataclasses import dataclass
from typing import Any

from stagewise.core import storage
from stagewise.core.errors import DataError
from stagewise.reporting import lineage

REPORT_HEAD_BYTES = 4096  # ``at`` sorts first in report.json (sorted keys): a head this long holds it
_HEAD = re.compile(r'^\{\s*"at":\s*(\{[^{}]*\})')
# Airflow's run ids: <run type>__<ISO moment>; safe_name turns ':' and '+' into '_' (and appends a hash).
_RUN_ID_MOMENT = re.compile(r"__(\d{4})-(\d{2})-(\d{2})T(\d{2})[:_](\d{2})[:_](\d{2})")


@dataclass(frozen=True)
class RunDates:
    """A run's start and end (None: unknown, e.g. the end of an unfinished run) and which record said so."""

    started: dt.datetime | None
    ended: dt.datetime | None
    source: str
    """report, tasks, lineage, run id, mtime or none: where the dates were read (a log or page can say)."""

    def as_of(self, now: dt.datetime) -> RunDates:
        """These dates with any later than ``now`` taken as ``now``."""
        return RunDates(*(None if when is None else min(when, now) for when in (self.started, self.ended)),
                        self.source)

    @property
    def newest(self) -> dt.datetime | None:
        """The latest moment known (its end, else its start): what a listing orders by."""
        return self.ended or self.started

    def record(self) -> dict[str, str | None]:
        """The dates as report.json's ``at``."""
        return {"started": iso(self.started), "ended": iso(self.ended)}


UNKNOWN = RunDates(None, None, "none")


def iso(moment: dt.datetime | None) -> str | None:
    return None if moment is None else moment.astimezone(dt.UTC).isoformat()


def moment(value: Any) -> dt.datetime | None:
    """An ISO 8601 time as an aware UTC datetime (no offset: UTC); None for anything else."""
    if not isinstance(value, str) or not value:
        return None
    try:
        found = dt.datetime.fromisoformat(value)
    except ValueError:
        return None
    return (found if found.tzinfo else found.replace(tzinfo=dt.UTC)).astimezone(dt.UTC)


def from_at(at: Any) -> RunDates | None:
    """report.json's ``at``, when it names a start."""
    if isinstance(at, dict) and (started := moment(at.get("started"))) is not None:
        return RunDates(started, moment(at.get("ended")), "report")
    return None


def from_attempts(attempts: Any) -> RunDates | None:
    """The earliest start and latest end (or start) of recorded task attempts (timeline records)."""
    if not isinstance(attempts, list):
        return None
    starts = [m for a in attempts if isinstance(a, dict) and (m := moment(a.get("start"))) is not None]
    ends = [m for a in attempts if isinstance(a, dict) for m in (moment(a.get("end")), moment(a.get("start"))) if m]
    return RunDates(min(starts), max(ends), "tasks") if starts else None


def from_run_id(run_folder: str) -> dt.datetime | None:
    """The moment an Airflow run id names (its logical date or when it was triggered); None for a custom id."""
    found = _RUN_ID_MOMENT.search(run_folder)
    if found is None:
        return None
    try:
        return dt.datetime(*map(int, found.groups()), tzinfo=dt.UTC)
    except ValueError:
        return None


def from_report(report: dict[str, Any], run_folder: str = "") -> RunDates | None:
    """A finished run's dates from its report: ``at``, else its task attempts, else its run id's moment."""
    if (found := from_at(report.get("at"))) or (found := from_attempts(report.get("tasks"))):
        return found
    if (started := from_run_id(run_folder)) is not None:
        return RunDates(started, None, "run id")
    return None


def read_report_dates(uri: str, run_folder: str = "") -> RunDates | None:
    """report.json's dates, reading only its head when ``at`` leads it (every report the report step writes); None
    when the report records none (then the caller's fallback: its mtime)."""
    local = "://" not in uri or uri.startswith("file://")  # a plain open: fsspec's costs more than the read here
    with (open(uri.removeprefix("file://"), "rb") if local else _remote_open(uri)) as handle:
        head = handle.read(REPORT_HEAD_BYTES)
        found = _HEAD.match(head.decode("utf-8", "replace"))
        if found is not None:
            try:
                if (dates := from_at(json.loads(found.group(1)))) is not None:
                    return dates
            except ValueError:
                pass
        data = head + handle.read()
    report = storage.parse_json(uri, data)
    if not isinstance(report, dict):
        raise DataError(f"{uri} holds {type(report).__name__}, not an object")
    return from_report(report, run_folder)


def _remote_open(uri: str) -> Any:
    fs, path = storage.filesystem(uri)
    return fs.open(path, "rb")


def from_mtime(stamp: dt.datetime | float | None) -> RunDates:
    """The last fallback: a file's time, for a run that recorded none (see the module's docstring)."""
    if isinstance(stamp, int | float):
        stamp = dt.datetime.fromtimestamp(stamp, dt.UTC)
    return UNKNOWN if stamp is None else RunDates(stamp, stamp, "mtime")


def started_of(out: str) -> dt.datetime | None:
    """lineage.json's ``started_at`` (start_run's moment); None for a run that began before runs recorded it."""
    try:
        recorded = lineage.read(out)
    except (OSError, ValueError, DataError):
        return None
    return moment(recorded.get("started_at")) if isinstance(recorded, dict) else None


def recorded_at(out: str, attempts: list[dict[str, Any]] | None, now: dt.datetime | None = None) -> dict[str, Any]:
    """report.json's ``at`` as the report step writes it: the run's start (lineage.json's, else its first task
    attempt's) and its end, now."""
    ended = now or dt.datetime.now(dt.UTC)
    started = started_of(out) or getattr(from_attempts(attempts), "started", None) or ended
    return RunDates(min(started, ended), ended, "report").record()


def pin(report: dict[str, Any], dates: RunDates) -> dict[str, Any]:
    """``report`` with ``at`` set to ``dates`` where it had none: a rewrite (retention's note) then moves no date."""
    if from_at(report.get("at")) is None and dates.started is not None:
        report["at"] = dates.record()
    return report
