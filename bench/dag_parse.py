"""DAG parse time: each DAG file as a fresh ``python <file>`` process (Airflow's best-practices check)."""

from __future__ import annotations

import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
TRIVIAL_DAG = '''
import pendulum
from airflow.sdk import dag, task


@dag(schedule=None, start_date=pendulum.datetime(2026, 1, 1, tz="UTC"), catchup=False)
def trivial():
    @task
    def hello():
        return 1

    hello()


trivial()
'''


def _parse_seconds(path: Path, repeats: int = 5) -> float:
    """Median wall time of ``python <file>`` with the repo's Airflow settings (scripts/airflow_env.sh)."""
    command = f". scripts/airflow_env.sh && exec python {path}"
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        subprocess.run(["bash", "-c", command], cwd=REPO_ROOT, env=dict(os.environ), check=True, capture_output=True)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def dag_parse(rows: int = 0) -> dict[str, Any]:
    """The slowest DAG file's parse time / a trivial one-task DAG file's, both as fresh processes."""
    with tempfile.TemporaryDirectory(prefix="bench-dag-parse-") as tmp:
        trivial = Path(tmp) / "trivial.py"
        trivial.write_text(TRIVIAL_DAG)
        baseline = _parse_seconds(trivial)
        ours = {path.name: _parse_seconds(path) for path in sorted((REPO_ROOT / "dags").glob("*.py"))}
    slowest = max(ours, key=ours.get)
    return {"ours": ours[slowest], "baseline": baseline, "unit": "s per parse",
            "details": {"slowest": slowest, "per_file_s": {name: round(s, 3) for name, s in ours.items()},
                        "trivial_s": round(baseline, 3)}}
