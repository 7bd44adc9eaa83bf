"""A running task's log reads through the REST API (as the UI does) without served-log errors, and the
log server, like every other listener of the stack, is on loopback only.

Run: ``pytest -m airflow tests/dags/test_served_logs.py`` (a real api-server, scheduler and dag-processor;
about a minute).

Invariant: while a task runs, the api-server fetches its log from the worker's log server at
``http://<ti.hostname>:<[logging] worker_log_server_port>``; with no server there (``--skip-serve-logs``)
it logs ``Could not read served logs … Connection refused``. The stack starts Airflow's log-server app
on 127.0.0.1 itself and records 127.0.0.1 as the task's hostname, so the read succeeds on loopback.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.live_airflow import is_loopback, listening_sockets, process_tree

TEST_DAGS = Path(__file__).resolve().parent / "test_dags"
SLEEP_S = 40


@pytest.mark.airflow
def test_running_task_log_reads_from_a_loopback_log_server(live_airflow):  # noqa: F811
    """While the task runs, GET .../logs/1 returns its lines; the api-server logs no served-log error;
    the log server listens, on loopback only, and so does everything else the stack started."""
    live = live_airflow(TEST_DAGS)
    live.wait_for_dag("long_task")
    live.unpause("long_task")
    run_id = live.trigger("long_task", {"sleep_s": SLEEP_S, "exit_code": 0})

    def running_log() -> str | None:
        [ti] = live.task_instances("long_task", run_id)
        if ti["state"] != "running":
            return None
        text = live.task_log("long_task", run_id, "sleep_past_token")
        return text if "slow sub-job:" in text else None

    text = live.wait_until(running_log, 120, "the task never showed a running log with the sub-job's lines")
    listeners = [address for proc in live.processes.values() for address in listening_sockets(process_tree(proc.pid))]
    state = live.wait_for_run("long_task", run_id, timeout=SLEEP_S + 120)

    assert "Could not read served logs" not in text, text[-4000:]
    assert f"http://127.0.0.1:{live.log_server_port}/log/" in text, f"not read from the log server: {text[-4000:]}"
    assert "Could not read served logs" not in live.component_log("api-server"), live.logs_tail()
    assert any(address.endswith(f":{live.log_server_port}") for address in listeners), \
        f"no log server on port {live.log_server_port}: {listeners}"
    assert all(is_loopback(address) for address in listeners), f"listening beyond loopback: {listeners}"
    assert state == "success", live.logs_tail()
