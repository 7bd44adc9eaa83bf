"""One task that runs longer than the execution-API token lifetime, watched while it runs and after it ends.

Run: ``pytest -m airflow tests/dags/test_long_task.py`` (a real api-server, scheduler and dag-processor; about a
minute). One stack and one run serve both tests, in file order: the first reads the log while the task runs, the
second waits for the end.

Invariants:
- The worker's execution-API token (``[execution_api] jwt_expiration_time``) is refreshed while a task runs, so a
  long sub-job ends ``success`` on its first try instead of failing on a 403 when it reports its result. The
  lifetime is shortened to 15 s with no leeway: the supervisor heartbeats every 5-10 s (``[workers]
  min_heartbeat_interval`` = 5, but a heartbeat that falls due just after a wake-up waits for the next one) and
  every answer carries a refreshed token, so 15 s leaves margin, while 10 s with no leeway was measured to expire
  between two heartbeats.
- While a task runs, the api-server fetches its log from the worker's log server at
  ``http://<ti.hostname>:<[logging] worker_log_server_port>``; with no server there (``--skip-serve-logs``) it
  logs ``Could not read served logs … Connection refused``. The stack starts Airflow's log-server app on 127.0.0.1
  itself and records 127.0.0.1 as the task's hostname, so the read succeeds on loopback.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

import pytest

from tests.live_airflow import LiveAirflow, is_loopback, listening_sockets, process_tree

pytestmark = pytest.mark.airflow

TEST_DAGS = Path(__file__).resolve().parent / "test_dags"
TOKEN_LIFETIME_S = 15
SLEEP_S = 3 * TOKEN_LIFETIME_S


def _duration_s(ti: dict) -> float:
    start, end = (datetime.fromisoformat(ti[key].replace("Z", "+00:00")) for key in ("start_date", "end_date"))
    return (end - start).total_seconds()


@pytest.fixture(scope="module")
def long_run(tmp_path_factory):
    """A stack with a 15 s execution-API token and no leeway, and a run of long_task sleeping 3x that: (live, run_id)."""
    env = {"AIRFLOW__EXECUTION_API__JWT_EXPIRATION_TIME": str(TOKEN_LIFETIME_S),
           "AIRFLOW__API_AUTH__JWT_LEEWAY": "0"}  # an expired token is refused at once, not 10 s later
    with LiveAirflow(tmp_path_factory.mktemp("long_task"), TEST_DAGS, env) as live:
        live.wait_for_dag("long_task")
        live.unpause("long_task")
        yield live, live.trigger("long_task", {"sleep_s": SLEEP_S, "exit_code": 0})


def test_running_task_log_reads_from_a_loopback_log_server(long_run):
    """While the task runs, GET .../logs/1 returns its lines; the api-server logs no served-log error;
    the log server listens, on loopback only, and so does everything else the stack started."""
    live, run_id = long_run

    def running_log() -> str | None:
        [ti] = live.task_instances("long_task", run_id)
        if ti["state"] != "running":
            return None
        text = live.task_log("long_task", run_id, "sleep_past_token")
        return text if "slow sub-job:" in text else None

    text = live.wait_until(running_log, 120, "the task never showed a running log with the sub-job's lines")
    listeners = [address for proc in live.processes.values() for address in listening_sockets(process_tree(proc.pid))]

    assert "Could not read served logs" not in text, text[-4000:]
    assert f"http://127.0.0.1:{live.log_server_port}/log/" in text, f"not read from the log server: {text[-4000:]}"
    assert "Could not read served logs" not in live.component_log("api-server"), live.logs_tail()
    assert any(address.endswith(f":{live.log_server_port}") for address in listeners), \
        f"no log server on port {live.log_server_port}: {listeners}"
    assert all(is_loopback(address) for address in listeners), f"listening beyond loopback: {listeners}"


@pytest.mark.slow
def test_task_longer_than_token_lifetime_succeeds_first_try(long_run):
    """The sub-job sleeps 3x the token lifetime; the run succeeds, once, and its result reaches XCom."""
    live, run_id = long_run
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
