"""One task whose sub-job sleeps past the execution-API token lifetime (see tests/dags/test_long_task.py).

Trigger conf: ``{"sleep_s": 30, "exit_code": 0}``; the sub-job is tests.dags.test_dags.slow_subjob.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from airflow.sdk import DAG, Param, get_current_context, task

with DAG(
    dag_id="long_task",
    schedule=None,
    start_date=datetime(2024, 1, 1),
    catchup=False,
    tags=["test"],
    params={"sleep_s": Param(30, type="number", minimum=0), "exit_code": Param(0, type="integer")},
):

    # One retry: a try lost to an expired token would show as try_number 2, which the test refuses.
    @task(retries=1, retry_delay=timedelta(seconds=1))
    def sleep_past_token():
        from stagewise.airflow import launch
        from stagewise.definitions.config import Profile

        context = get_current_context()
        params = context["params"]
        args = [str(params["sleep_s"]), "--exit-code", str(params["exit_code"])]
        return launch.run("tests.dags.test_dags.slow_subjob", args, Profile(), attempt=context["ti"].try_number)

    sleep_past_token()
