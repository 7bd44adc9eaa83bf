"""The runs page (``/``): every run with a report under each pipeline's storage root, newest first.

Run: ``register(router, User)`` adds its route (``stagewise.airflow.ui.create_app``).
"""

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse

from stagewise.airflow.ui.access import can_read_runs
from stagewise.airflow.ui.layout import esc, fmt, gate_badge, link, objective_of, page, run_href, table
from stagewise.airflow.ui.pipelines import pipelines
from stagewise.airflow.ui.storage_access import StorageProblem, read_each, storage_error, storages
from stagewise.report import list_reports, read_report


def register(router: APIRouter, User: Any) -> None:  # noqa: N803 - the request's user, as FastAPI resolves it
    """Add the runs page to ``router``."""

    @router.get("/", response_class=HTMLResponse)
    def runs(request: Request, user: User) -> HTMLResponse:
        found = pipelines()
        places = storages(found)
        root = request.scope.get("root_path", "")
        allowed: dict[str, bool] = {}

        def may_read(dag_id: str) -> bool:
            if dag_id not in allowed:
                allowed[dag_id] = can_read_runs(user, dag_id)
            return allowed[dag_id]

        listed = read_each(places, lambda place: [(entry, read_report(entry["uri"], entry["modified"]))
                                                  for entry in list_reports(place.root)])
        rows, entries, seen = [], [], set()
        for place, result in listed.items():
            if isinstance(result, StorageProblem):  # in place of its runs, for whoever may read one of its DAGs
                if any(may_read(dag_id) for name in place.names for dag_id in found[name].dag_ids):
                    rows.append([esc(", ".join(place.names)), "", "", "", "", "", storage_error(place, result)])
                continue
            for entry, report in result:  # two connections to one root list the same runs
                if entry["uri"] not in seen:
                    seen.add(entry["uri"])
                    entries.append((entry, report))
        entries.sort(key=lambda pair: pair[0]["modified"].timestamp() if pair[0]["modified"] else 0.0, reverse=True)
        for entry, report in entries:
            dag_id = str(report.get("dag_id") or entry["dag_folder"])
            if not may_read(dag_id):
                continue
            run_id = str(report.get("run_id") or entry["run_folder"])
            href = run_href(root, entry["dag_folder"], entry["run_folder"])
            metric, value = objective_of(report)
            when = entry["modified"].strftime("%Y-%m-%d %H:%M UTC") if entry["modified"] else ""
            if "_error" in report:
                rows.append([esc(dag_id), link(href, run_id), esc(when), "", "", "", f'<span class="badge err">'
                             f'unreadable</span> {esc(report["_error"])}'])
                continue
            best = (report.get("sweep") or {}).get("best_value") if isinstance(report.get("sweep"), dict) else None
            retired = any(dag_id in pipeline.dag_ids and pipeline.retired for pipeline in found.values())
            rows.append([esc(dag_id) + (' <span class="badge">retired</span>' if retired else ""), link(href, run_id),
                         esc(when), esc(metric), fmt(value), fmt(best), gate_badge(report.get("registry"))])
        roots: dict[str, list[str]] = {}
        for place in places:
            roots.setdefault(place.root, []).extend(place.names)
        where = ", ".join(f"<code>{esc(storage_root)}/runs/</code> ({esc(', '.join(names))})"
                          for storage_root, names in roots.items())
        body = (f"<h1>Stagewise runs</h1><p class='sub'>Every run with a report under {where}, newest first. "
                f"Open a run for its report.</p>" if where else
                "<h1>Stagewise runs</h1><p class='sub'>Airflow holds no Stagewise pipeline's DAGs yet.</p>")
        body += table(["DAG", "run", "reported", "objective", "test value", "sweep best", "gate"], rows, numeric=(4, 5),
                      wide=True) \
            if rows else "<p class='empty'>No run has written a report yet: trigger a pipeline's <code>&lt;name&gt;_pipeline</code> DAG.</p>"
        return page(request, "Runs", body, "runs", "runs")
