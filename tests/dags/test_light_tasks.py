"""Light tasks never wait behind heavy ones, on a real scheduler: an ingest run during a backfill of retrain runs
(tests/backfill_load.py) runs in the bookkeeping pool and starts before heavy tasks that were already waiting for the
compute pool when it was triggered. Its wall time against its own is the benchmark ingest_wait_under_load."""

from __future__ import annotations

import pytest

from stagewise.definitions.bookkeeping import BOOKKEEPING_POOL, BOOKKEEPING_WEIGHT
from tests.backfill_load import ingest_during_backfill

pytestmark = [pytest.mark.airflow, pytest.mark.torchrun, pytest.mark.slow]  # about 2.5 minutes on 2 cores


def test_an_ingest_during_a_backfill_overtakes_the_heavy_tasks_waiting_for_the_pool(tmp_path):
    """With the compute pool full and three or more heavy tasks of the backfill waiting for it (more than its two slots
    take in the seconds an ingest needs), the ingest task (bookkeeping pool, fixed weight) starts before at least one
    of them: it queues behind none of the backfill's work."""
    found = ingest_during_backfill(tmp_path, min_waiting=3)
    task = found["task"]
    assert found["backfill_runs"] == 3
    assert (task["pool"], task["priority_weight"], task["state"]) == (BOOKKEEPING_POOL, BOOKKEEPING_WEIGHT, "success")
    assert found["overtaken"], "heavy tasks were waiting for the compute pool when the ingest was triggered"
    order = [(ti["task_id"], ti["map_index"], ti["start_date"]) for ti in found["overtaken"]]
    assert any(start is None or start > task["start_date"] for _, _, start in order), (task["start_date"], order)
