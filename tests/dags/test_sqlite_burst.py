"""`make up`'s embedded SQLite under a burst: 30 REST triggers in a few seconds, with the scheduler scheduling.

Before: 26 of 30 answered HTTP 500 (`database is locked`) and the scheduler and dag-processor exited. Now every
answer is 200 or a clear refusal, every component lives on, every accepted run exists once, and a run id at the
log path's limit runs end to end while one character more is refused at trigger.
"""

from __future__ import annotations

import os
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytestmark = pytest.mark.airflow

REPO_ROOT = Path(__file__).resolve().parents[2]
BURST = 30

DAG_FILE = '''
from airflow.sdk import DAG, task

with DAG("burst", schedule=None, tags=["burst"]):
    @task
    def hello():
        return 1

    hello()
'''


def make_up_settings(home: Path) -> dict[str, str]:
    """The database and scheduler settings scripts/airflow_env.sh (what `make up` sources) gives a SQLite home."""
    env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", str(home)), "AIRFLOW_HOME": str(home),
           "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home}/airflow.db"}
    shown = subprocess.run(["bash", "-c", ". scripts/airflow_env.sh && env -0"], cwd=REPO_ROOT, env=env, check=True,
                           capture_output=True, text=True).stdout
    settings = dict(item.split("=", 1) for item in shown.split("\0") if "=" in item)
    return {key: value for key, value in settings.items()
            if key.startswith(("AIRFLOW__DATABASE__", "AIRFLOW__SCHEDULER__")) and key != "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"}


@pytest.mark.slow
def test_thirty_triggers_in_a_burst_keep_every_component_alive_and_make_each_run_once(live_airflow, tmp_path):
    dags = tmp_path / "dags"
    dags.mkdir()
    (dags / "burst.py").write_text(DAG_FILE)
    settings = make_up_settings(tmp_path / "make_up_home")
    assert settings["AIRFLOW__DATABASE__SQL_ALCHEMY_CONNECT_ARGS"] == "stagewise.airflow.sqlite.CONNECT_ARGS"
    live = live_airflow(dags, settings)
    live.wait_for_dag("burst")
    live.unpause("burst")  # the scheduler creates and runs them while the burst lands

    def post(number: int):
        return live.client.post("/api/v2/dags/burst/dagRuns", timeout=120,
                                json={"logical_date": None, "dag_run_id": f"burst_{number:02d}"})

    started = time.monotonic()
    with ThreadPoolExecutor(BURST) as pool:
        answers = list(pool.map(post, range(BURST)))
    took = time.monotonic() - started
    statuses = [answer.status_code for answer in answers]
    assert all(status == 200 or 400 <= status < 500 or status == 503 for status in statuses), \
        [(answer.status_code, answer.text[:300]) for answer in answers if answer.status_code >= 500 and answer.status_code != 503]
    accepted = sorted(answer.json()["dag_run_id"] for answer in answers if answer.status_code == 200)
    assert len(accepted) >= BURST // 2, f"most of the burst is accepted: {statuses}, in {took:.1f} s"

    longest = "x" * 248
    assert live.client.post("/api/v2/dags/burst/dagRuns", json={"logical_date": None, "dag_run_id": longest}
                            ).status_code == 200
    refused = live.client.post("/api/v2/dags/burst/dagRuns", json={"logical_date": None, "dag_run_id": longest + "x"})
    assert refused.status_code == 400 and "{1,248}" in refused.text
    assert live.wait_for_run("burst", longest, timeout=120) == "success"  # Airflow's log path holds it

    for name, process in live.processes.items():
        assert process.poll() is None, f"{name} exited ({process.returncode}) after the burst"
    runs = live.api("GET", "/api/v2/dags/burst/dagRuns", params={"limit": 100}).json()["dag_runs"]
    made = sorted(run["dag_run_id"] for run in runs if run["dag_run_id"].startswith("burst_"))
    assert made == accepted  # each accepted run exists exactly once, and no refused one half-exists
    health = live.api("GET", "/api/v2/monitor/health").json()
    assert health["scheduler"]["status"] == "healthy"
