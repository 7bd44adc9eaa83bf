"""Where a run's gate decision is read and answered: its Stagewise page and its approval task's Required Actions page
(a leaf: steps.py names the links in the request, approval.py is the task they point at)."""

from __future__ import annotations

from typing import Any

TASK_ID = "approve_model"


def links(run: dict[str, Any]) -> dict[str, str]:
    """The run's Stagewise report page and its approval task's Required Actions page, on the configured base URL."""
    from urllib.parse import quote

    from airflow.configuration import conf

    base = (conf.get("api", "base_url", fallback="") or "").rstrip("/")
    dag, run_id = quote(run["dag_id"], safe=""), quote(run["run_id"], safe="")
    return {"report_url": f"{base}/stagewise/runs/{dag}/{run_id}",
            "required_actions_url": f"{base}/dags/{dag}/runs/{run_id}/tasks/{TASK_ID}/required_actions?map_index=-1"}
