"""Run a DAG's run again, whole: ``python -m tests.dags.run_again DAG_ID LOGICAL_DATE [CONF]``.

``airflow dags test`` replaces the run of a logical date with a new one whose id carries the time it is started; this
fixes that time to the logical date, so the new run has the old run's id and every task runs again in the same run
folder with the earlier tries' work still in it: what clearing a finished run from its first task does, without a
scheduler. (The sub-jobs see exactly what a clear leaves them.)
"""

from __future__ import annotations

import json
import sys

import pendulum
from airflow.utils.cli import get_bagged_dag


def main(argv: list[str]) -> None:
    dag_id, when = argv[0], pendulum.parse(argv[1])
    conf = json.loads(argv[2]) if len(argv) > 2 else None
    run = get_bagged_dag(bundle_names=None, dag_id=dag_id, dagfile_path=None).test(
        run_after=when, logical_date=when, run_conf=conf)
    state = str(getattr(run.state, "value", run.state))
    print(f"RUN {run.run_id} {state}")
    sys.exit(0 if state == "success" else 1)


if __name__ == "__main__":
    main(sys.argv[1:])
