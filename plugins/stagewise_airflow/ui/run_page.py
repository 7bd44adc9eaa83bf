"""A run's page (``/runs/<dag_id>/<run_id>``): its report.html framed in a sandbox, or its report.json as tables; and
the report's own files (``report.html``, ``report.json``) beside it.

Run: ``register(router, User)`` adds the routes (``stagewise.airflow.ui.create_app``). A DAG or run id becomes a path only
through ``path_segment``; read access to the DAG's runs is checked before looking, so no answer tells an outsider
which runs exist.
"""

import json
from typing import Any

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import HTMLResponse, Response

from stagewise.airflow.ui.access import REPORT_CSP, REPORT_SANDBOX, can_read_runs
from stagewise.airflow.ui.approvals import waiting_body, waiting_run
from stagewise.airflow.ui.layout import esc, fmt, gate_badge, link, page, params_text, run_href, table
from stagewise.airflow.ui.pipelines import pipelines
from stagewise.airflow.ui.storage_access import Storage, StorageProblem, path_segment, read_each, storages
from stagewise.core import assets, storage
from stagewise.report import read_report
from stagewise.reporting.listing import objective_of


def mlflow_links(report: dict[str, Any]) -> str:
    """The header's links to the run's MLflow run and model version, and its tracking gaps (empty when not tracked)."""
    tracking = report.get("tracking") if isinstance(report.get("tracking"), dict) else {}
    links = []
    if isinstance(tracking.get("run_url"), str) and tracking["run_url"].startswith(("http://", "https://")):
        links.append(f'<a data-stagewise-link="mlflow-run" href="{esc(tracking["run_url"])}" target="_blank" '
                     f'rel="noopener">MLflow run</a>')
    if isinstance(tracking.get("model_version_url"), str) and tracking["model_version_url"].startswith(("http://", "https://")):
        links.append(f'<a data-stagewise-link="mlflow-model" href="{esc(tracking["model_version_url"])}" target="_blank" '
                     f'rel="noopener">MLflow model {esc(tracking.get("model_version_label") or "version")}</a>')
    gaps = [gap for gap in tracking.get("gaps") or [] if isinstance(gap, dict)]
    if gaps:
        links.append(f'<span class="badge err" title="{esc("; ".join(str(g.get("error")) for g in gaps))}">tracking gap in '
                     f'{esc(", ".join(str(g.get("task")) for g in gaps))}</span>')
    return "".join(f" · {item}" for item in links)


TRAINING_COLUMNS = (("stage", "stage"), ("world_size", "world size"), ("global_batch", "global batch"), ("lr", "lr"),
                    ("epochs", "epochs"), ("steps", "steps"), ("val_metric", "validation"), ("samples_per_s", "samples/s"))
# What a stage cost on a cluster (stagewise.reporting.cost), summed over its attempts: shown where any stage has it.
COST_COLUMNS = (("nodes", "nodes"), ("elapsed_s", "elapsed s"), ("cpu_time_s", "CPU s"), ("gpu_hours", "GPU h"))


def stages_table(training: list[dict[str, Any]], metric: str | None) -> str:
    """The run's train stages: shape, validation, samples/s and, where any stage ran on a cluster, its cost."""
    costed = any(isinstance(s.get("cost"), dict) for s in training)
    heads = [f"validation {metric or 'metric'}" if key == "val_metric" else label for key, label in TRAINING_COLUMNS]
    rows = []
    for s in training:
        spent = s.get("cost") if isinstance(s.get("cost"), dict) else {}
        row = [fmt(s.get(key)) for key, _ in TRAINING_COLUMNS]
        if costed:
            attempts = spent.get("attempts") if isinstance(spent.get("attempts"), list) else []
            row += [fmt(spent.get(key)) for key, _ in COST_COLUMNS]
            row.append(f"{len(attempts)} attempt(s), {esc(spent.get('source'))}" if spent else "")
        rows.append(row)
    if costed:
        heads += [label for _, label in COST_COLUMNS] + ["cost from"]
    return table(heads, rows, numeric=range(1, len(heads) - 1 if costed else len(heads)))


def summary_html(report: dict[str, Any]) -> str:
    """The report.json as cards and tables: what a run page shows when the run has no report.html."""
    metric, value = objective_of(report)
    sweep = report.get("sweep") if isinstance(report.get("sweep"), dict) else {}
    registry = report.get("registry") if isinstance(report.get("registry"), dict) else {}
    predictions = report.get("predictions") if isinstance(report.get("predictions"), dict) else {}
    cards = []
    if metric:
        cards.append(("Test " + metric, fmt(value), ""))
    if sweep:
        cards.append(("Sweep best", fmt(sweep.get("best_value")),
                      f"{fmt(sweep.get('n_complete'))} complete, {fmt(sweep.get('n_pruned'))} pruned of "
                      f"{fmt(sweep.get('n_trials'))} trials"))
    if registry:
        cards.append(("Gate", gate_badge(registry), esc(registry.get("reason"))))
    if isinstance(registry.get("approval"), dict) and registry["approval"].get("decision"):
        decided = registry["approval"]
        cards.append(("Approval", esc(str(decided["decision"]).replace("_", " ")),
                      esc(f"by {decided.get('by') or 'nobody'} at {decided.get('at')}: {decided.get('note') or 'no note'}")))
    if predictions:
        cards.append(("Predictions", fmt(predictions.get("rows")),
                      f"{fmt(predictions.get('rows_quarantined', 0))} quarantined"))
    parts = ['<div class="cards">' + "".join(
        f'<div class="card"><div class="label">{esc(label)}</div><div class="value">{val}</div>'
        f'<div class="note">{note}</div></div>' for label, val, note in cards) + "</div>"]
    training = [stage for stage in report.get("training") or [] if isinstance(stage, dict)]
    if training:
        parts.append("<h2>Training stages</h2>" + stages_table(training, metric))
    if sweep:
        parts.append("<h2>Sweep</h2>" + table(
            ["study", "trials", "complete", "pruned", "failed", "best value", "best params"],
            [[fmt(sweep.get(k)) for k in ("study_name", "n_trials", "n_complete", "n_pruned", "n_failed", "best_value")]
             + [params_text(sweep.get("best_params"))]], numeric=range(1, 6)))
    data = report.get("data") if isinstance(report.get("data"), dict) else {}
    if data:
        rows = data.get("rows") if isinstance(data.get("rows"), dict) else {"rows": data.get("rows")}
        parts.append("<h2>Data</h2>" + table(
            [*(f"rows {k}" for k in rows), "dropped as dirty", "quarantined at inference"],
            [[fmt(v) for v in rows.values()] + [fmt(data.get("rows_dropped")), fmt(predictions.get("rows_quarantined"))]],
            numeric=range(len(rows) + 2)))
    tests = report.get("test_metrics") if isinstance(report.get("test_metrics"), dict) else {}
    if tests:
        parts.append("<h2>Test metrics</h2>" + table(list(tests), [[fmt(v) for v in tests.values()]], range(len(tests))))
    stages = report.get("stages") if isinstance(report.get("stages"), dict) else {}
    if stages:
        parts.append("<h2>Stage timings</h2>" + table(
            ["stage", "seconds (sub-jobs summed)", "highest attempt", "sub-jobs"],
            ([esc(name)] + [fmt(s.get(k)) if isinstance(s, dict) else "" for k in ("duration_s", "attempt", "num_tasks")]
             for name, s in stages.items()), numeric=(1, 2, 3)))
    if registry:
        parts.append("<h2>Registry</h2>" + table(["model", "this run's version", "decision", "reason", "current now"], [[
            fmt(registry.get("model_name")), f'<span class="mono">{esc(registry.get("version"))}</span>',
            gate_badge(registry), esc(registry.get("reason")), f'<span class="mono">{esc(registry.get("current"))}</span>']]))
    shown = {"dag_id", "run_id", "run_prefix", "objective", "sweep", "registry", "predictions", "training", "data",
             "test_metrics", "stages", "test_accuracy", "tracking"}
    rest = {k: v for k, v in report.items() if k not in shown}
    if rest:
        parts.append("<h2>More</h2>" + table(["key", "value"], ([esc(k), fmt(v)] for k, v in rest.items())))
    # side by side where the page is wide enough, like a dashboard's panels
    return parts[0] + "<div class='blocks'>" + "".join(f"<div class='block'>{part}</div>" for part in parts[1:]) + "</div>"


def register(router: APIRouter, User: Any) -> None:  # noqa: N803 - the request's user, as FastAPI resolves it
    """Add a run's page, its report.html and its report.json to ``router``."""

    def _run_folder(user: Any, dag_id: str, run_id: str) -> tuple[Storage, str, dict[str, Any], bool]:
        """The storage holding the run, its folder there, its report and whether it has a report.html."""
        dag_folder, run_folder = path_segment(dag_id, "DAG id"), path_segment(run_id, "run id")
        if not can_read_runs(user, dag_id):  # before looking: no answer tells an outsider which runs exist
            raise HTTPException(403, "Forbidden")
        found = pipelines()
        places = storages(found)
        # the DAG's own pipeline's storage; a DAG no pipeline holds now (renamed, removed): every storage
        owners = [place for place in places if any(dag_id in found[name].dag_ids for name in place.names)]

        def look(place: Storage) -> tuple[str, dict[str, Any], bool] | None:
            prefix = storage.join(place.root, "runs", dag_folder, run_folder)
            report_uri = storage.join(prefix, "report.json")
            if not storage.exists(report_uri):
                return None
            return prefix, read_report(report_uri), storage.exists(storage.join(prefix, "report.html"))

        looked = read_each(owners or places, look)
        for place, result in looked.items():
            if result is not None and not isinstance(result, StorageProblem):
                return place, *result
        if problems := [str(result) for result in looked.values() if isinstance(result, StorageProblem)]:
            raise HTTPException(503, "; ".join(problems))
        raise HTTPException(404, f"no report for run {run_id!r} of DAG {dag_id!r}")

    @router.get("/runs/{dag_id}/{run_id}", response_class=HTMLResponse)
    def run_page(request: Request, dag_id: str, run_id: str, user: User) -> HTMLResponse:
        try:
            _, prefix, report, has_html = _run_folder(user, dag_id, run_id)
        except HTTPException as exc:  # no report yet: a run waiting at its gate says so, with the way to answer
            waiting = waiting_run(storages(pipelines()), dag_id, run_id) if exc.status_code == 404 else None
            if waiting is None:
                raise
            return page(request, run_id, waiting_body(waiting, dag_id, run_id), "run", "runs")
        root = request.scope.get("root_path", "")
        here = run_href(root, path_segment(dag_id, "DAG id"), path_segment(run_id, "run id"))
        shown_dag, shown_run = report.get("dag_id") or dag_id, report.get("run_id") or run_id
        head = (f"<div class='crumbs'>{link(root + '/', 'Runs')} › {esc(shown_dag)}</div>"
                f"<h1 class='run-id' data-stagewise-run-id='{esc(shown_run)}'>{esc(shown_run)}</h1>"
                f"<p class='sub'>DAG <b>{esc(shown_dag)}</b> · files under <code>{esc(prefix)}</code> · "
                f"{link(here + '/report.json', 'report.json')}"
                + (f" · {link(here + '/report.html', 'open the report on its own')}" if has_html else "")
                + mlflow_links(report) + "</p>")
        if "_error" in report:
            content = f"<p><span class='badge err'>unreadable</span> {esc(report['_error'])}</p>"
        elif has_html:
            content = (f'<iframe id="stagewise-report" class="report" title="report of {esc(shown_run)}" '
                       f'sandbox="{REPORT_SANDBOX}" src="{esc(here + "/report.html")}"></iframe>')
        else:
            content = summary_html(report)
        body = head + (f"<section data-stagewise-section='report' data-stagewise-report='{'html' if has_html else 'summary'}'>"
                       f"{content}</section>")
        return page(request, str(shown_run), body, "run", "runs")

    @router.get("/runs/{dag_id}/{run_id}/report.html", response_class=HTMLResponse)
    def report_html(dag_id: str, run_id: str, user: User) -> Response:
        place, prefix, _, has_html = _run_folder(user, dag_id, run_id)
        if not has_html:
            raise HTTPException(404, f"run {run_id!r} has no report.html yet (its report.json is on the run page)")
        # The page links its storage root's plotly.js (stagewise.core.assets): put back inline for the sandbox.
        read = read_each([place], lambda place: assets.inline(storage.read_bytes(storage.join(prefix, "report.html")),
                                                              prefix))[place]
        if isinstance(read, StorageProblem):
            raise HTTPException(503, str(read))
        return Response(read, media_type="text/html; charset=utf-8", headers={"Content-Security-Policy": REPORT_CSP})

    @router.get("/runs/{dag_id}/{run_id}/report.json")
    def report_json(dag_id: str, run_id: str, user: User) -> Response:
        _, _, report, _ = _run_folder(user, dag_id, run_id)
        return Response(json.dumps(report, indent=2, sort_keys=True, default=str), media_type="application/json")
