"""The operator hooks that record each task attempt for the run's timeline (stagewise.airflow.steps.timeline_hooks)."""

from __future__ import annotations

import datetime as dt
from types import SimpleNamespace

import pytest

from stagewise.airflow import steps
from stagewise.core import storage
from stagewise.reporting import timeline

RUN_ID = "manual__2026-01-01T10:00:00+00:00"


def _context(task_id: str, map_index: int, try_number: int, run: dict | None = None) -> dict:
    """A task's context; ``run`` is what its xcom_pull of start_run answers (None: start_run has not returned)."""
    start = dt.datetime(2026, 1, 1, 10, 0, tzinfo=dt.UTC)
    ti = SimpleNamespace(task_id=task_id, map_index=map_index, try_number=try_number, start_date=start,
                         xcom_pull=lambda task_ids, map_indexes: run if (task_ids, map_indexes) == ("start_run", -1) else None)
    return {"ti": ti, "dag": SimpleNamespace(dag_id="ml_pipeline"), "run_id": RUN_ID}


@pytest.fixture
def configured(write_config, storage_root, monkeypatch):
    monkeypatch.setenv("STAGEWISE_CONFIG", str(write_config()))
    steps._cached_config.cache_clear()
    yield storage.run_prefix(str(storage_root), "ml_pipeline", "manual__2026-01-01T10:00:00+00:00")
    steps._cached_config.cache_clear()


def test_hooks_record_the_start_then_the_outcome_under_the_run_prefix(configured):
    """pre_execute writes a running record with the TI's start; post_execute / on_retry_callback close it with an end."""
    hooks = steps.timeline_hooks()
    hooks["pre_execute"](_context("preprocess_stats", 2, 1))
    assert [(r["task_id"], r["map_index"], r["state"], r["end"]) for r in timeline.records(configured)] == [
        ("preprocess_stats", 2, "running", None)]
    hooks["on_retry_callback"](_context("preprocess_stats", 2, 1))
    hooks["pre_execute"](_context("preprocess_stats", 2, 2))
    hooks["post_execute"](_context("preprocess_stats", 2, 2), {"rows": 1})
    found = timeline.records(configured)
    assert [(r["try_number"], r["state"]) for r in found] == [(1, "up_for_retry"), (2, "success")]
    assert all(r["start"] == "2026-01-01T10:00:00+00:00" and r["end"] > r["start"] for r in found)
    assert set(steps.timeline_hooks()) == {"pre_execute", "post_execute", "on_retry_callback", "on_failure_callback"}


def test_a_failing_record_never_fails_the_task(configured, monkeypatch, caplog):
    """Storage trouble while recording is a warning in the task log, not an exception out of the hook."""
    def broken(*args, **kwargs):
        raise OSError("bucket unreachable")

    monkeypatch.setattr(timeline, "record", broken)
    steps.timeline_hooks()["on_failure_callback"](_context("train_s1", -1, 1))
    assert "could not record failed of train_s1: bucket unreachable" in caplog.text


@pytest.mark.service
def test_an_s3_run_records_its_timeline_on_s3_when_this_process_defaults_to_local_files(configured, s3_bucket, storage_root,
                                                                                         tmp_path):
    """The hooks place records by the run's own config (start_run's result), not by this process's default config."""
    import yaml

    from tests.conftest import base_config

    s3_config = tmp_path / "s3.yaml"
    s3_config.write_text(yaml.safe_dump({**base_config(storage_root), "storage_root": f"{s3_bucket}/root"}))
    run = {"config": str(s3_config), "overrides": {}, "out": storage.run_prefix(f"{s3_bucket}/root", "ml_pipeline", RUN_ID)}
    hooks = steps.timeline_hooks()
    hooks["pre_execute"](_context("start_run", -1, 1))  # no record yet: the run's place is not known before it returns
    hooks["post_execute"](_context("start_run", -1, 1), run)
    hooks["pre_execute"](_context("train_s1", -1, 1, run))
    hooks["on_failure_callback"](_context("train_s1", -1, 1, run))
    assert [(r["task_id"], r["state"]) for r in timeline.records(run["out"])] == [("start_run", "success"),
                                                                                  ("train_s1", "failed")]
    assert timeline.records(configured) == [], "nothing of the s3 run went to the process's local storage root"


def test_a_tasks_seconds_count_from_airflows_start_of_the_attempt():
    """A stage's seconds with start-up: from the attempt's start_date (Airflow's) to now; none without one."""
    import datetime as dt
    from types import SimpleNamespace

    from stagewise.airflow.steps import task_seconds

    started = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=4.5)
    assert 4.5 <= task_seconds({"ti": SimpleNamespace(start_date=started)}) < 60
    assert task_seconds({"ti": SimpleNamespace(start_date=None)}) is None


def test_an_attempt_records_its_upstream_tasks_and_a_first_task_its_runs_start(configured):
    """What the report measures waiting from: a task's upstream task ids, and for one without any its run's start."""
    started = dt.datetime(2026, 1, 1, 9, 59, 30, tzinfo=dt.UTC)
    hooks = steps.timeline_hooks()
    for task_id, upstream in (("plan_shards", {"start_run"}), ("lonely", set())):
        context = _context(task_id, -1, 1)
        context["ti"].task = SimpleNamespace(upstream_task_ids=upstream)
        context["dag_run"] = SimpleNamespace(start_date=started)
        hooks["pre_execute"](context)
        hooks["post_execute"](context, {"rows": 1})
    found = {r["task_id"]: r for r in timeline.records(configured)}
    assert (found["plan_shards"]["upstream"], found["plan_shards"]["ready"]) == (["start_run"], None)
    assert (found["lonely"]["upstream"], found["lonely"]["ready"]) == ([], "2026-01-01T09:59:30+00:00")
    assert found["lonely"]["wait_s"] == 30.0
