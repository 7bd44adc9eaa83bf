"""The ``<name>_maintenance`` DAG's one task: the pipeline's retention policy (stagewise.retention) applied in the
task process, told by Airflow which of the pipeline's DAGs have no queued or running run.

A run started by ``airflow dags test`` of a pipeline whose test runs may not write production (docs/ci.md) is a dry
run: it lists what would go and removes nothing.
"""

from __future__ import annotations

import logging
from typing import Any

from airflow.sdk import get_current_context

from stagewise.airflow.steps import inline, started_by_test
from stagewise.definitions.loading import config_path, load_config, scratch_for_test_run
from stagewise.definitions.pipelines import name_of

log = logging.getLogger("stagewise.retention")
ACTIVE_STATES = ["queued", "running"]


def quiet_dags(ti: Any, dag_ids: list[str]) -> list[str]:
    """Those of ``dag_ids`` with no queued or running run, by Airflow's count; a DAG it cannot count is not quiet."""
    quiet = []
    for dag_id in dag_ids:
        try:
            if ti.get_dr_count(dag_id=dag_id, states=ACTIVE_STATES) == 0:
                quiet.append(dag_id)
        except Exception as exc:  # unknown means possibly running: the idle rule decides for its runs
            log.warning("could not count %s's active runs (%s): its unfinished runs are judged by idle_hours", dag_id, exc)
    return quiet


def apply_retention(config_file: str) -> dict[str, Any]:
    """Remove what the retention policy of the DAG's own config names; returns the totals (never the full list: an
    XCom carries small values)."""
    from stagewise import retention

    context = get_current_context()
    path = str(config_path(config_file))
    config = load_config(config_file)
    if not config.name:
        config = config.model_copy(update={"name": name_of(path)})
    dry_run = started_by_test(context["dag_run"]) and scratch_for_test_run(name_of(path)) is not None
    if dry_run:
        log.warning("test run (airflow dags test): retention of %s is a dry run, nothing is removed; set "
                    "$STAGEWISE_TEST_RUNS_WRITE=%s to let its test runs remove (docs/ci.md)", name_of(path), name_of(path))
    quiet = quiet_dags(context["ti"], retention.run_dags(config))
    result = inline(config, lambda: retention.run(config, dry_run, quiet_dags=quiet))
    return {key: value for key, value in result.items() if key != "removals"} | {"num_removals": len(result["removals"])}
