"""When the scheduled DAGs (retrain, maintenance) first run once unpaused, as docs/operations.md says: with catchup off
Airflow's trigger timetable schedules the newest cron time already past, so unpausing runs the DAG at once; an
``airflow.start_date`` in the future holds the first run until the first cron time on or after it."""

from __future__ import annotations

import datetime as dt

import pendulum
import yaml

from tests.conftest import REPO_ROOT, base_config

SCHEDULED = ("ml_retrain", "ml_maintenance")


def _first_runs(tmp_path, storage_root, monkeypatch, airflow: dict, last=None) -> dict:
    """When each scheduled DAG's next run is due, as the scheduler plans it for a DAG with no run yet (or whose last
    scheduled run is ``last``, a DagRunInfo)."""
    from airflow.dag_processing.dagbag import DagBag
    from airflow.serialization.serialized_objects import DagSerialization

    path = tmp_path / "team.yaml"
    path.write_text(yaml.safe_dump({**base_config(storage_root), "airflow": airflow}))
    monkeypatch.setenv("STAGEWISE_CONFIG", str(path))
    bag = DagBag(dag_folder=str(REPO_ROOT / "dags"))
    assert bag.import_errors == {}
    found = {}
    for dag_id in SCHEDULED:  # as the scheduler holds it: serialized, then read back
        dag = DagSerialization.from_dict(DagSerialization.to_dict(bag.get_dag(dag_id)))
        found[dag_id] = dag.next_dagrun_info(last_automated_run_info=last).run_after
    return found


def test_unpausing_a_scheduled_dag_runs_its_newest_past_cron_time_at_once(tmp_path, storage_root, monkeypatch):
    """Default settings (start_date 2026-01-01, catchup off): each scheduled DAG's first run is due already, so the
    scheduler starts it as soon as the DAG is unpaused, not at the next cron time."""
    now = pendulum.now("UTC")
    for dag_id, run_after in _first_runs(tmp_path, storage_root, monkeypatch, {}).items():
        assert run_after <= now, f"{dag_id}: first run at {run_after}, after now {now}"


def test_a_start_date_ahead_holds_the_first_run_until_then(tmp_path, storage_root, monkeypatch):
    """airflow.start_date a week ahead: no first run is due now; each waits for its first cron time from that day."""
    ahead = (pendulum.now("UTC") + dt.timedelta(days=7)).date()
    start = pendulum.datetime(ahead.year, ahead.month, ahead.day, tz="UTC")
    for dag_id, run_after in _first_runs(tmp_path, storage_root, monkeypatch, {"start_date": ahead.isoformat()}).items():
        assert run_after >= start, f"{dag_id}: first run at {run_after}, before start_date {start}"


def test_unpausing_after_a_long_pause_runs_the_newest_missed_time_once(tmp_path, storage_root, monkeypatch):
    """The last scheduled run in January, paused since: the next run is the newest cron time past, due now (one run,
    not one per missed time)."""
    from airflow.timetables.base import DagRunInfo

    january = pendulum.datetime(2026, 1, 4, 3, tz="UTC")
    now = pendulum.now("UTC")
    runs = _first_runs(tmp_path, storage_root, monkeypatch, {}, DagRunInfo.interval(january, january))
    for dag_id, run_after in runs.items():
        assert now - dt.timedelta(days=7) < run_after <= now, f"{dag_id}: next run at {run_after}, now {now}"
