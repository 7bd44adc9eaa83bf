"""A run's task attempts as small files: ``runs/<dag_id>/<run_id>/timeline/<task>--<map_index>--try<N>.json``.

Run: nothing to run; the Airflow glue writes an attempt's record when it starts and again when it ends (one put
each, so a reader sees a whole record, never half of one), and the report step lists them into report.json's
``tasks`` and report.html's task timeline. A record without an end is an attempt still running, or one killed
before it could say how it ended.

A record also names the task's upstream tasks (and, for a task without any, when its run started), so the report can
tell how long each attempt waited to start once it could have (:func:`waits`): for a pool slot, an executor slot or
the scheduler. Airflow's task runtime exposes no queued time, so "could have started" is the last upstream attempt's
end (the run's start for a first task; the previous try's end for a retry, its retry delay included).
"""

from __future__ import annotations

import datetime as dt
import logging
from typing import Any

from stagewise.core import storage
from stagewise.core.errors import DataError

log = logging.getLogger("stagewise.timeline")

FIELDS = ("task_id", "map_index", "try_number", "state", "start", "end", "upstream", "ready")
# The task ids of each stage of report.json's "stages" (a train stage's task is train_<stage>, its own stage).
STAGE_TASKS = {"preprocess": ("plan_shards", "preprocess_stats", "reduce_stats", "preprocess_transform", "commit_preprocess"),
               "sweep": ("create_study", "sweep_worker", "sweep_summary"), "evaluate": ("evaluate",),
               "registry": ("register_model", "gate_model"),
               "inference": ("resolve_model", "plan_inference", "infer_shard", "commit_predictions")}


def folder(out: str) -> str:
    return storage.join(out, "timeline")


def record_uri(out: str, task_id: str, map_index: int, try_number: int) -> str:
    return storage.join(folder(out), f"{storage.safe_name(task_id)}--{map_index}--try{try_number}.json")


def iso(moment: dt.datetime | None = None) -> str:
    """UTC ISO 8601 with an offset, as the report and its charts read it back."""
    return (moment or dt.datetime.now(dt.UTC)).astimezone(dt.UTC).isoformat()


def record(out: str, *, task_id: str, map_index: int, try_number: int, state: str, start: str | None = None,
           end: str | None = None, upstream: list[str] | None = None, ready: str | None = None) -> dict[str, Any]:
    """Write (or rewrite) one attempt's record; a start already recorded is kept (a deferred task starts twice).

    ``upstream``: the task ids it waits for; ``ready``: when a task without upstream tasks could start (its run's start).
    """
    uri = record_uri(out, task_id, map_index, try_number)
    earlier = storage.read_json(uri) if storage.exists(uri) else {}
    entry = {"task_id": task_id, "map_index": map_index, "try_number": try_number, "state": state,
             "start": earlier.get("start") or start or iso(), "end": end,
             "upstream": sorted(upstream) if upstream is not None else earlier.get("upstream"),
             "ready": earlier.get("ready") or ready}
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
    return waits(sorted(found, key=lambda e: (e["start"] or "", e["task_id"], e["map_index"], e["try_number"])))


def _seconds(later: str, earlier: str) -> float:
    return (dt.datetime.fromisoformat(later) - dt.datetime.fromisoformat(earlier)).total_seconds()


def waits(found: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each record with ``wait_s``: seconds from when the attempt could have started to its start (see the module's
    docstring); None where that moment is unknown (an upstream task that left no ended record, an older record)."""
    ends: dict[str, str] = {}
    tries: dict[tuple[str, int, int], str] = {}
    for entry in found:
        if entry.get("end"):
            ends[entry["task_id"]] = max(ends.get(entry["task_id"], entry["end"]), entry["end"])
            tries[(entry["task_id"], entry["map_index"], entry["try_number"])] = entry["end"]
    timed = []
    for entry in found:
        upstream = entry.get("upstream")
        if (entry.get("try_number") or 1) > 1:
            ready = tries.get((entry["task_id"], entry["map_index"], entry["try_number"] - 1))
        elif upstream:
            known = [ends[task] for task in upstream if task in ends]
            ready = max(known) if len(known) == len(upstream) else None
        else:
            ready = entry.get("ready") if upstream is not None else None
        wait = round(max(0.0, _seconds(entry["start"], ready)), 3) if ready and entry.get("start") else None
        timed.append({**entry, "wait_s": wait})
    return timed


def stage_of(task_id: str) -> str | None:
    """The report.json stage a task's time counts under (None: a run-level task such as start_run or report)."""
    if task_id.startswith("train_"):
        return task_id
    return next((stage for stage, tasks in STAGE_TASKS.items() if task_id in tasks), None)


def stage_waits(found: list[dict[str, Any]]) -> dict[str, float]:
    """Per stage, the summed ``wait_s`` of its tasks' attempts (like its summed duration_s; unknown waits count 0)."""
    totals: dict[str, float] = {}
    for entry in found:
        stage = stage_of(entry["task_id"])
        if stage is not None and entry.get("wait_s") is not None:
            totals[stage] = round(totals.get(stage, 0.0) + entry["wait_s"], 3)
    return totals
