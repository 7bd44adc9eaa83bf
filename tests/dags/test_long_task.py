"""A task that runs longer than the execution-API token lifetime still finishes and records success.

Run: ``pytest -m airflow tests/dags/test_long_task.py`` (a real api-server, scheduler and dag-processor;
about a minute).

Invariant: the worker's execution-API token (``[execution_api] jwt_expiration_time``) is refreshed
while a task runs, so a long sub-job ends ``success`` on its first try instead of failing on a 403
when it reports its result. The lifetime is shortened to 15 s with no leeway: the supervisor
heartbeats every 5-10 s (``[workers] min_heartbeat_interval`` = 5, but a heartbeat that falls due
just after a wake-up waits for the next one) and every answer carries a refreshed token, so 15 s
leaves margin, while 10 s with no leeway was measured to expire between two heartbeats.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

import pytest

TEST_DAGS = Path(__file__).resolve().parent / "test_dags"
TOKEN_LIFETIME_S = 15
SLEEP_S = 3 * TOKEN_LIFETIME_S


def _duration_s(ti: dict) -> float:
    start, end = (datetime.fromisoformat(ti[key].replace("Z", "+00:00")) for key in ("start_date", "end_date"))
    return (end - start).total_seconds()


@pytest.mark.airflow
def test_task_longer_than_token_lifetime_succeeds_first_try(live_airflow):  # noqa: F811
    """The sub-job sleeps 3x the token lifetime; the run succeeds, once, and its result reaches XCom."""
    live = live_airflow(TEST_DAGS, env={
        "AIRFLOW__EXECUTION_API__JWT_EXPIRATION_TIME": str(TOKEN_LIFETIME_S),
        "AIRFLOW__API_AUTH__JWT_LEEWAY": "0",  # an expired token is refused at once, not 10 s later
    })
    live.wait_for_dag("long_task")
    live.unpause("long_task")
    run_id = live.trigger("long_task", {"sleep_s": SLEEP_S, "exit_code": 0})
    state = live.wait_for_run("long_task", run_id, timeout=SLEEP_S + 120)

    tis = live.task_instances("long_task", run_id)
    logs = "\n".join(f"=== task log, try {n}\n{live.task_log('long_task', run_id, ti['task_id'], n)[-6000:]}"
                     for ti in tis for n in range(1, (ti["try_number"] or 0) + 1))
    assert state == "success", f"run ended {state}: {tis}\n{logs}\n{live.logs_tail()}"
    [ti] = tis
    assert (ti["task_id"], ti["state"], ti["try_number"]) == ("sleep_past_token", "success", 1), f"{ti}\n{logs}"
    assert _duration_s(ti) > SLEEP_S > TOKEN_LIFETIME_S, ti
    assert live.xcom("long_task", run_id, "sleep_past_token") | {"duration_s": None} == {
        "slept_s": pytest.approx(SLEEP_S, abs=1), "attempt": 1, "duration_s": None}
    # The refresh really happened: no execution-API call was refused for an expired token.
    assert "Signature has expired" not in live.component_log("api-server")
    assert live.stray_processes() == [], "the sub-job outlived its task"
