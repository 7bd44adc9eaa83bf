"""An ingest run during a backfill of retrain runs: how long it takes end to end against its one task's own time.

Run: ``python -m bench --only ingest_wait_under_load`` (``make bench ONLY=ingest_wait_under_load``), a few minutes.

The scenario is tests.backfill_load's (a real Airflow, LocalExecutor; 3 retrain runs backfilled over a tiny pipeline
fill the compute pool and queue more heavy tasks; then an ingest run). ours: the ingest run's wall time (queued to
end); baseline: its ``ingest`` task's own time (Airflow's start to end of the task). Goal: at most 3, so a light task
never waits behind the heavy ones (issue 44: 5 s of work took 9 minutes when ingest shared the compute pool and
weighed less than training).
"""

from __future__ import annotations

import datetime as dt
import tempfile
from typing import Any


def _seconds(later: str, earlier: str) -> float:
    return (dt.datetime.fromisoformat(later) - dt.datetime.fromisoformat(earlier)).total_seconds()


def ingest_wait_under_load() -> dict[str, Any]:
    """ours: the ingest run's wall time; baseline: its task's own time (see the module's docstring)."""
    from tests.backfill_load import ingest_during_backfill

    with tempfile.TemporaryDirectory(prefix="bench-ingest-") as tmp:
        found = ingest_during_backfill(tmp)
    run, task = found["run"], found["task"]
    started = task["start_date"]
    return {"ours": _seconds(run["end_date"], run["queued_at"]), "baseline": _seconds(task["end_date"], started),
            "unit": "s (ingest run wall / its task's own time)",
            "details": {"queued_to_task_start_s": round(_seconds(started, run["queued_at"]), 2),
                        "task_pool": task["pool"], "task_priority_weight": task["priority_weight"],
                        "compute_pool_at_trigger": {key: found["pool"][key] for key in
                                                    ("slots", "running_slots", "scheduled_slots", "queued_slots")},
                        "heavy_waiting_at_trigger": len(found["overtaken"]),
                        "of_them_started_after_ingest": sum(ti["start_date"] is None or ti["start_date"] > started
                                                            for ti in found["overtaken"]),
                        "trigger_attempts": found["trigger_attempts"], "backfill_runs": found["backfill_runs"]}}
