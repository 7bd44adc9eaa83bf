"""A run's task attempts as small files: ``runs/<dag_id>/<run_id>/timeline/<task>--<map_index>--try<N>.json``.

Run: nothing to run; the Airflow glue writes an attempt's record when it starts and again when it ends (one put
each, so a reader sees a whole record, never half of one), and the report step lists them into report.json's
``tasks`` and report.html's task timeline. A record without an end is an attempt still running, or one killed
before it could say how it ended.
"""

from __future__ import annotations

import datetime as dt
import logging
from typing import Any

from stagewise.core import storage
from stagewise.core.errors import DataError

log = logging.getLogger("stagewise.timeline")

FIELDS = ("task_id", "map_index", "try_number", "state", "start", "end")


def folder(out: str) -> str:
    return storage.join(out, "timeline")


def record_uri(out: str, task_id: str, map_index: int, try_number: int) -> str:
    return storage.join(folder(out), f"{storage.safe_name(task_id)}--{map_index}--try{try_number}.json")


def iso(moment: dt.datetime | None = None) -> str:
    """UTC ISO 8601 with an offset, as the report and its charts read it back."""
    return (moment or dt.datetime.now(dt.UTC)).astimezone(dt.UTC).isoformat()


def record(out: str, *, task_id: str, map_index: int, try_number: int, state: str, start: str | None = None,
           end: str | None = None) -> dict[str, Any]:
    """Write (or rewrite) one attempt's record; a start already recorded is kept (a deferred task starts twice)."""
    uri = record_uri(out, task_id, map_index, try_number)
    earlier = storage.read_json(uri) if storage.exists(uri) else {}
    entry = {"task_id": task_id, "map_index": map_index, "try_number": try_number, "state": state,
             "start": earlier.get("start") or start or iso(), "end": end}
    storage.write_json(uri, entry)
    return entry


def records(out: str) -> list[dict[str, Any]]:
    """Every recorded attempt of the run, by start time; an unreadable record is skipped with a warning."""
    fs, path = storage.filesystem(folder(out))
    if not fs.exists(path):
        return []
    found = []
    for name in sorted(fs.glob(path + "/*.json")):
        uri = fs.unstrip_protocol(name) if "://" in out else name
        try:
            entry = storage.read_json(uri)
        except (OSError, ValueError, DataError) as exc:
            log.warning("skipping timeline record %s: %s", uri, exc)
            continue
        found.append({key: entry.get(key) for key in FIELDS})
    return sorted(found, key=lambda e: (e["start"] or "", e["task_id"], e["map_index"], e["try_number"]))
