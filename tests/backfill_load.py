"""An ingest run while a backfill of retrain runs holds the compute pool: the scenario behind the live test of light
tasks (tests/dags/test_light_tasks.py) and the benchmark ``ingest_wait_under_load`` (bench/ingest_wait.py).

Use: ``found = ingest_during_backfill(tmp_dir)``. A real Airflow (tests.live_airflow: SQLite, LocalExecutor,
parallelism 4, loopback only) over one tiny pipeline (the tests' digits config: 2 shards, a 2-trial sweep of 2 epochs).
A backfill of 3 retrain runs fills the compute pool (cpu_cores, 2 slots); once it is full and more heavy tasks wait
for it, an ingest run is triggered and followed to its end. About two and a half minutes on 2 cores.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

# Daily intervals, so a 3-day backfill is 3 runs.
PIPELINE = {"retrain": {"schedule": "0 0 * * *", "num_trials": 2},
            "sweep": {"num_trials": 2, "num_workers": 2, "epochs": 2}}
BACKFILL = {"dag_id": "ml_retrain", "from_date": "2026-01-01T00:00:00Z", "to_date": "2026-01-03T00:00:00Z",
            "max_active_runs": 3, "reprocess_behavior": "none"}
COMPUTE_POOL = "cpu_cores"


def _landed(shard: Path, folder: Path) -> Path:
    """New rows to ingest: a shard of the data set with its keys moved past every existing one."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    table = pq.read_table(shard)
    key = table.schema.get_field_index("row_id")
    folder.mkdir()
    pq.write_table(table.set_column(key, "row_id", pc.add(table.column(key), 1_000_000)), folder / "landed.parquet")
    return folder


def _backfill(live: Any, attempts: int = 30) -> dict[str, Any]:
    """Create the backfill, asking again while SQLite is locked (the api-server then answers 503)."""
    for _ in range(attempts):
        response = live._request("POST", "/api/v2/backfills", json=BACKFILL)
        if response.status_code in (200, 201):
            return response.json()
        if response.status_code != 503:
            break
        time.sleep(2)
    raise AssertionError(f"POST /api/v2/backfills: {response.status_code} {response.text[:2000]}")


def _trigger(live: Any, conf: dict[str, Any], attempts: int = 5) -> tuple[str, int]:
    """Trigger an ingest run; asks again while the api-server fails (500: SQLite locked by the backfill's writes, no
    run stored). Returns the run id and the attempts it took."""
    for attempt in range(1, attempts + 1):
        response = live._request("POST", "/api/v2/dags/ml_ingest/dagRuns", json={"logical_date": None, "conf": conf})
        if response.status_code == 200:
            return response.json()["dag_run_id"], attempt
        if response.status_code < 500:
            break
        time.sleep(1)
    raise AssertionError(f"POST /api/v2/dags/ml_ingest/dagRuns: {response.status_code} {response.text[:2000]}")


def _waiting_heavy(live: Any) -> list[dict[str, Any]]:
    """The backfill's task instances waiting for a slot of the compute pool (scheduled: a queued one has its slot)."""
    found = live.api("GET", "/api/v2/dags/ml_retrain/dagRuns/~/taskInstances", params={"limit": 1000}).json()
    return [ti for ti in found["task_instances"] if ti["pool"] == COMPUTE_POOL and ti["state"] == "scheduled"]


def ingest_during_backfill(tmp_dir: str | os.PathLike, min_waiting: int = 1) -> dict[str, Any]:
    """Run the scenario, triggering the ingest once the compute pool is full and at least ``min_waiting`` heavy tasks
    wait for it; returns the ingest ``run`` and its ``task`` (REST objects), the compute pool at the trigger
    (``pool``), the heavy task instances that were waiting then (``overtaken``, as they were at the ingest's end), the
    trigger's attempts and the number of backfill runs."""
    from tests.shared_stack import pipelines_airflow

    with pipelines_airflow(tmp_dir, {"ml": PIPELINE}) as stack:
        live, root = stack.live, stack.roots["ml"]
        source = _landed(sorted((root / "raw" / "digits").glob("*.parquet"))[0], Path(tmp_dir) / "landed")
        for kind in ("retrain", "ingest"):
            live.wait_for_dag(f"ml_{kind}", timeout=300)
            live.unpause(f"ml_{kind}")
        # SQLite takes the backfill's writes only with the scheduler stopped: beside it the api-server answers 503
        # ("database is locked") or the scheduler dies on a stale dag_run row.
        live.kill("scheduler")
        _backfill(live)
        live.restart_scheduler()

        def full() -> dict[str, Any] | None:
            pool = live.api("GET", f"/api/v2/pools/{COMPUTE_POOL}").json()
            return pool if pool["open_slots"] == 0 and len(_waiting_heavy(live)) >= min_waiting else None

        pool = live.wait_until(full, 900, "the backfill never filled the compute pool", interval=1.0)
        waiting = {(ti["dag_run_id"], ti["task_id"], ti["map_index"]) for ti in _waiting_heavy(live)}
        run_id, attempts = _trigger(live, {"source_uri": str(source)})
        assert live.wait_for_run("ml_ingest", run_id, timeout=900) == "success", live.logs_tail()
        run = live.api("GET", f"/api/v2/dags/ml_ingest/dagRuns/{run_id}").json()
        [task] = live.task_instances("ml_ingest", run_id)
        retrain = live.api("GET", "/api/v2/dags/ml_retrain/dagRuns").json()["dag_runs"]
        overtaken = [ti for backfill_run in {key[0] for key in waiting}
                     for ti in live.task_instances("ml_retrain", backfill_run)
                     if (ti["dag_run_id"], ti["task_id"], ti["map_index"]) in waiting]
    return {"run": run, "task": task, "pool": pool, "overtaken": overtaken, "trigger_attempts": attempts,
            "backfill_runs": sum(r["run_type"] == "backfill" for r in retrain)}
