"""Stagewise in the Airflow UI: runs, a run's report and the model registry, served by the api-server.

Run: loaded by ``plugins/stagewise_ui_plugin.py`` and mounted at ``/stagewise`` on the api-server (the UI's
*Stagewise* entry and each DAG run's *Stagewise report* tab open it); ``create_app()`` builds it for tests.

Every page needs the caller's Airflow login: Airflow mounts a plugin's app as is, so each route depends on
Airflow's own ``get_user`` (the UI's ``_token`` cookie or an ``Authorization: Bearer`` JWT; none: 401, a bad
one: 403) and the auth manager's UI access; a run also needs read access to its DAG's runs (403). Reads go through
``stagewise.core.storage`` under the storage root of every pipeline of the deployment (``$STAGEWISE_PIPELINES``, see
``stagewise.definitions.pipelines``), so an ``s3://`` root works with the api-server's AWS environment.
Everything taken from storage is HTML-escaped, and a DAG or run id becomes a path only through
``stagewise.core.storage.safe_name`` after '/', '\\' and '.'/'..' are refused.

Every response, errors included, carries ``X-Content-Type-Options: nosniff``, ``Referrer-Policy: same-origin`` and a
Content-Security-Policy that lets only Airflow's own pages frame it and fetches nothing. report.html runs its inline
plotly in a sandbox (an opaque origin: no cookies, no Airflow DOM, no requests), and an error names what is missing,
never a storage path.
"""

import base64
import hashlib
import html
import json
import logging
import math
from collections.abc import Awaitable, Callable, Iterable
from typing import Annotated, Any
from urllib.parse import quote

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Request
from fastapi.responses import HTMLResponse, Response

from stagewise.core import storage
from stagewise.core.errors import DataError, UserError
from stagewise.definitions.config import PipelineConfig
from stagewise.definitions.loading import load_config
from stagewise.definitions.pipelines import discover
from stagewise.registry import model_names
from stagewise.report import list_reports, read_report

URL_PREFIX = "/stagewise"

log = logging.getLogger("stagewise.ui")


# -- config and storage -----------------------------------------------------------------------------

_config_cache: dict[tuple, dict[str, PipelineConfig]] = {}


def pipeline_configs() -> dict[str, PipelineConfig]:
    """Every pipeline of the deployment that loads, by name, read again only when a file changes (the api-server runs
    for days). A config that does not load is left out and named in the api-server's log, not on the page."""
    try:
        pipelines = discover()
        key = tuple((pipeline.name, str(pipeline.path), pipeline.path.stat().st_mtime_ns) for pipeline in pipelines)
    except (UserError, OSError) as exc:
        log.error("pipelines: %s", exc)  # paths go to the api-server's log, not the page
        raise HTTPException(500, "pipeline config: the pipelines cannot be read (set STAGEWISE_PIPELINES or "
                                 "STAGEWISE_CONFIG for the api-server; its log says why)") from None
    if key not in _config_cache:
        _config_cache.clear()
        loaded = {}
        for pipeline in pipelines:
            try:
                loaded[pipeline.name] = load_config(pipeline.path)
            except UserError as exc:
                log.error("pipeline %s: %s", pipeline.name, exc)
        if pipelines and not loaded:
            raise HTTPException(500, "the pipeline config is invalid: the api-server's log says why")
        _config_cache[key] = loaded
    return _config_cache[key]


def storage_roots() -> dict[str, list[str]]:
    """Each storage root the pipelines use, with the names of the pipelines writing there (two may share one)."""
    roots: dict[str, list[str]] = {}
    for name, config in pipeline_configs().items():
        roots.setdefault(config.storage_root, []).append(name)
    return roots


def path_segment(value: str, what: str) -> str:
    """``value`` as one folder name under the storage root; refuses anything that could leave its folder."""
    if not value or value in (".", "..") or any(char in value for char in "/\\\0"):
        raise HTTPException(400, f"{what} {value!r} is not a valid id (no '/', '\\', or '.'/'..')")
    return storage.safe_name(value)  # a folder name maps to itself, an Airflow run id to its folder


# -- auth ---------------------------------------------------------------------------------------------

def _user_dependency() -> Any:
    """A dependency giving the logged-in Airflow user allowed into the UI: 401 without a login, 403 without access."""
    from airflow.api_fastapi.app import get_auth_manager
    from airflow.api_fastapi.auth.managers.models.resource_details import AccessView
    from airflow.api_fastapi.core_api.security import get_user

    def ui_user(user: Annotated[Any, Depends(get_user)]) -> Any:
        if not get_auth_manager().is_authorized_view(access_view=AccessView.WEBSITE, user=user):
            raise HTTPException(403, "Forbidden")
        return user

    return ui_user


def can_read_runs(user: Any, dag_id: str) -> bool:
    """Whether the auth manager lets ``user`` read the runs of DAG ``dag_id`` (as the Grid view needs)."""
    from airflow.api_fastapi.app import get_auth_manager
    from airflow.api_fastapi.auth.managers.models.resource_details import DagAccessEntity, DagDetails

    return get_auth_manager().is_authorized_dag(method="GET", access_entity=DagAccessEntity.RUN,
                                                details=DagDetails(id=dag_id), user=user)


# -- response headers ---------------------------------------------------------------------------------

def csp(*directives: str) -> str:
    return "; ".join(directives)


# Fetch nothing, be framed only by Airflow's own pages: what a JSON answer or an error needs.
BASE_CSP = csp("default-src 'none'", "base-uri 'none'", "form-action 'none'", "frame-ancestors 'self'")
# report.html: inline plotly.js, styles and draw script, in an opaque origin; blob:/data: images and downloads are
# the modebar's "download plot as png"
REPORT_SANDBOX = "allow-scripts allow-downloads"
REPORT_CSP = csp(f"sandbox {REPORT_SANDBOX}", BASE_CSP, "script-src 'unsafe-inline'", "style-src 'unsafe-inline'",
                 "img-src data: blob:")
SECURITY_HEADERS = {"X-Content-Type-Options": "nosniff", "Referrer-Policy": "same-origin"}


async def security_headers(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
    """Middleware: the headers of every response, errors too; a response that sets its own CSP (a page's) keeps it."""
    response = await call_next(request)
    response.headers.update(SECURITY_HEADERS)
    response.headers.setdefault("Content-Security-Policy", BASE_CSP)
    return response


# -- HTML ---------------------------------------------------------------------------------------------

STYLE = """
:root { --blue: #017cee; --ink: #1a202c; --muted: #5f6b7a; --line: #e2e8f0; --head: #f7fafc; }
* { box-sizing: border-box; }
body { margin: 0; font: 14px/1.45 -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial, sans-serif;
       color: var(--ink); background: #fff; }
header { display: flex; align-items: baseline; gap: 20px; padding: 12px 24px; border-bottom: 1px solid var(--line); }
header .brand { font-weight: 700; font-size: 16px; color: var(--ink); text-decoration: none; }
header nav a { margin-right: 14px; color: var(--muted); text-decoration: none; font-weight: 500; }
header nav a.on { color: var(--blue); border-bottom: 2px solid var(--blue); padding-bottom: 2px; }
main { padding: 16px 24px 32px; max-width: 1400px; }
h1 { font-size: 20px; margin: 4px 0 4px; }
h1.run-id { font-family: ui-monospace, Menlo, Consolas, monospace; font-size: 17px; } h2 { font-size: 16px; margin: 22px 0 8px; }
.sub { color: var(--muted); margin: 0 0 14px; } .crumbs { color: var(--muted); margin-bottom: 6px; }
a { color: var(--blue); } code, .mono { font-family: ui-monospace, Menlo, Consolas, monospace; font-size: 12.5px; }
table { border-collapse: collapse; min-width: 420px; margin: 6px 0 10px; } table.wide { width: 100%; }
th, td { text-align: left; padding: 7px 10px; border-bottom: 1px solid var(--line); vertical-align: top; }
th { background: var(--head); font-weight: 600; color: #334155; white-space: nowrap; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; }
tbody tr:hover { background: #f1f7fe; }
.badge { display: inline-block; padding: 1px 8px; border-radius: 10px; font-size: 12px; font-weight: 600; }
.ok { background: #dcfce7; color: #166534; } .no { background: #f1f5f9; color: #475569; }
.cur { background: #dbeafe; color: #1e40af; } .err { background: #fee2e2; color: #991b1b; }
.cards { display: flex; flex-wrap: wrap; gap: 12px; margin: 10px 0 4px; }
.card { border: 1px solid var(--line); border-radius: 8px; padding: 10px 14px; min-width: 170px; }
.card .label { color: var(--muted); font-size: 12px; } .card .value { font-size: 20px; font-weight: 600; }
.card .note { color: var(--muted); font-size: 12px; max-width: 320px; }
details summary { cursor: pointer; color: var(--blue); }
details.card-of { margin: 6px 0; }
details.card-of table { max-width: 900px; } details.card-of td:first-child { width: 200px; color: var(--muted); }
.blocks { display: flex; flex-wrap: wrap; gap: 0 36px; align-items: flex-start; }
.empty { color: var(--muted); padding: 20px 0; }
/* a fixed height, the report scrolling inside: sizing the frame to its content would grow charts sized to it */
iframe.report { width: 100%; height: calc(100vh - 150px); min-height: 480px; border: 1px solid var(--line); display: block; }
"""

# A page runs no script: it needs its one inline <style> (allowed by its hash) and the report's frame.
PAGE_CSP = csp(BASE_CSP, f"style-src 'sha256-{base64.b64encode(hashlib.sha256(STYLE.encode()).digest()).decode()}'",
               "frame-src 'self'")


def esc(value: Any) -> str:
    return html.escape("" if value is None else str(value), quote=True)


def fmt(value: Any) -> str:
    """A value for a table cell: floats to 4 significant places, containers as compact JSON; escaped."""
    if value is None:
        return '<span class="sub">–</span>'
    if isinstance(value, bool):
        return esc("yes" if value else "no")
    if isinstance(value, float):
        return esc(f"{value:.4g}" if math.isfinite(value) else str(value))
    if isinstance(value, dict | list):
        return f'<span class="mono">{esc(json.dumps(value, sort_keys=True, default=str))}</span>'
    return esc(value)


def params_text(params: Any) -> str:
    """Hyperparameters as ``name value`` pairs, numbers shortened (the sweep's floats carry 17 digits)."""
    if not isinstance(params, dict) or not params:
        return fmt(params)
    return " · ".join(f"{esc(k)} <b>{fmt(v)}</b>" for k, v in sorted(params.items()))


def _link(href: str, text: Any) -> str:
    return f'<a href="{esc(href)}">{esc(text)}</a>'


def page(request: Request, title: str, body: str, section: str, active: str) -> HTMLResponse:
    root = request.scope.get("root_path", "")
    nav = "".join(f'<a href="{esc(root + href)}" class="{"on" if key == active else ""}">{label}</a>'
                  for key, href, label in (("runs", "/", "Runs"), ("registry", "/registry", "Model registry")))
    document = (f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{esc(title)} · Stagewise</title>'
                f'<meta name="viewport" content="width=device-width, initial-scale=1"><style>{STYLE}</style></head>'
                f'<body><header><a class="brand" href="{esc(root + "/")}">Stagewise</a><nav>{nav}</nav></header>'
                f'<main data-stagewise-section="{esc(section)}">{body}</main></body></html>')
    return HTMLResponse(document, headers={"Content-Security-Policy": PAGE_CSP})


def table(headers: Iterable[str], rows: Iterable[Iterable[str]], numeric: Iterable[int] = (), wide: bool = False) -> str:
    """An HTML table; cells are already-escaped HTML."""
    numeric = set(numeric)
    head = "".join(f'<th class="{"num" if i in numeric else ""}">{esc(h)}</th>' for i, h in enumerate(headers))
    body = "".join("<tr>" + "".join(f'<td class="{"num" if i in numeric else ""}">{cell}</td>'
                                    for i, cell in enumerate(row)) + "</tr>" for row in rows)
    return f"<table{' class=wide' if wide else ''}><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def gate_badge(registry: dict[str, Any] | None) -> str:
    if not isinstance(registry, dict) or "promoted" not in registry:
        return '<span class="sub">–</span>'
    if registry.get("promoted"):
        return f'<span class="badge ok">promoted</span> <span class="mono">{esc(registry.get("version"))}</span>'
    return f'<span class="badge no">kept current</span> <span class="mono">{esc(registry.get("current"))}</span>'


def objective_of(report: dict[str, Any]) -> tuple[str, Any]:
    """The run's objective metric name and its test value (older reports: test_accuracy)."""
    objective = report.get("objective") if isinstance(report.get("objective"), dict) else {}
    metric = objective.get("metric") or ("accuracy" if "test_accuracy" in report else None)
    value = objective.get("test") if objective.get("test") is not None else report.get(f"test_{metric}")
    return metric or "", value


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
    return "".join(f" · {link}" for link in links)


def run_href(root: str, dag_id: str, run_id: str) -> str:
    return f"{root}/runs/{quote(dag_id, safe='')}/{quote(run_id, safe='')}"


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
    if predictions:
        cards.append(("Predictions", fmt(predictions.get("rows")),
                      f"{fmt(predictions.get('rows_quarantined', 0))} quarantined"))
    parts = ['<div class="cards">' + "".join(
        f'<div class="card"><div class="label">{esc(label)}</div><div class="value">{val}</div>'
        f'<div class="note">{note}</div></div>' for label, val, note in cards) + "</div>"]
    training = [stage for stage in report.get("training") or [] if isinstance(stage, dict)]
    if training:
        parts.append("<h2>Training stages</h2>" + table(
            ["stage", "world size", "global batch", "lr", "epochs", "steps", f"validation {metric or 'metric'}"],
            ([fmt(s.get(k)) for k in ("stage", "world_size", "global_batch", "lr", "epochs", "steps", "val_metric")]
             for s in training), numeric=range(1, 7)))
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


# -- routes -------------------------------------------------------------------------------------------

def create_app() -> FastAPI:
    """The Stagewise pages as a FastAPI app (Airflow mounts it at ``URL_PREFIX``)."""
    app = FastAPI(title="Stagewise", docs_url=None, redoc_url=None, openapi_url=None)
    app.middleware("http")(security_headers)
    ui_user = _user_dependency()
    router = APIRouter(dependencies=[Depends(ui_user)])  # every page, so none can be added without the login
    User = Annotated[Any, Depends(ui_user)]  # FastAPI resolves it once per request

    @router.get("/", response_class=HTMLResponse)
    def runs(request: Request, user: User) -> HTMLResponse:
        roots = storage_roots()
        root = request.scope.get("root_path", "")
        allowed: dict[str, bool] = {}
        rows = []
        entries = sorted((entry for storage_root in roots for entry in list_reports(storage_root)),
                         key=lambda entry: entry["modified"].timestamp() if entry["modified"] else 0.0, reverse=True)
        for entry in entries:
            report = read_report(entry["uri"], entry["modified"])
            dag_id = str(report.get("dag_id") or entry["dag_folder"])
            if dag_id not in allowed:
                allowed[dag_id] = can_read_runs(user, dag_id)
            if not allowed[dag_id]:
                continue
            run_id = str(report.get("run_id") or entry["run_folder"])
            href = run_href(root, entry["dag_folder"], entry["run_folder"])
            metric, value = objective_of(report)
            when = entry["modified"].strftime("%Y-%m-%d %H:%M UTC") if entry["modified"] else ""
            if "_error" in report:
                rows.append([esc(dag_id), _link(href, run_id), esc(when), "", "", "", f'<span class="badge err">'
                             f'unreadable</span> {esc(report["_error"])}'])
                continue
            best = (report.get("sweep") or {}).get("best_value") if isinstance(report.get("sweep"), dict) else None
            rows.append([esc(dag_id), _link(href, run_id), esc(when), esc(metric), fmt(value), fmt(best),
                         gate_badge(report.get("registry"))])
        where = ", ".join(f"<code>{esc(storage_root)}/runs/</code> ({esc(', '.join(names))})"
                          for storage_root, names in roots.items())
        body = (f"<h1>Stagewise runs</h1><p class='sub'>Every run with a report under {where}, newest first. "
                f"Open a run for its report.</p>")
        body += table(["DAG", "run", "reported", "objective", "test value", "sweep best", "gate"], rows, numeric=(4, 5),
                      wide=True) \
            if rows else "<p class='empty'>No run has written a report yet: trigger a pipeline's <code>&lt;name&gt;_pipeline</code> DAG.</p>"
        return page(request, "Runs", body, "runs", "runs")

    def _run_folder(user: Any, dag_id: str, run_id: str) -> tuple[str, dict[str, Any]]:
        dag_folder, run_folder = path_segment(dag_id, "DAG id"), path_segment(run_id, "run id")
        if not can_read_runs(user, dag_id):  # before looking: no answer tells an outsider which runs exist
            raise HTTPException(403, "Forbidden")
        for storage_root in storage_roots():  # DAG ids are unique across pipelines; roots are few
            prefix = storage.join(storage_root, "runs", dag_folder, run_folder)
            report_uri = storage.join(prefix, "report.json")
            if storage.exists(report_uri):
                return prefix, read_report(report_uri)
        raise HTTPException(404, f"no report for run {run_id!r} of DAG {dag_id!r}")

    @router.get("/runs/{dag_id}/{run_id}", response_class=HTMLResponse)
    def run_page(request: Request, dag_id: str, run_id: str, user: User) -> HTMLResponse:
        prefix, report = _run_folder(user, dag_id, run_id)
        root = request.scope.get("root_path", "")
        here = run_href(root, path_segment(dag_id, "DAG id"), path_segment(run_id, "run id"))
        shown_dag, shown_run = report.get("dag_id") or dag_id, report.get("run_id") or run_id
        has_html = storage.exists(storage.join(prefix, "report.html"))
        head = (f"<div class='crumbs'>{_link(root + '/', 'Runs')} › {esc(shown_dag)}</div>"
                f"<h1 class='run-id' data-stagewise-run-id='{esc(shown_run)}'>{esc(shown_run)}</h1>"
                f"<p class='sub'>DAG <b>{esc(shown_dag)}</b> · files under <code>{esc(prefix)}</code> · "
                f"{_link(here + '/report.json', 'report.json')}"
                + (f" · {_link(here + '/report.html', 'open the report on its own')}" if has_html else "")
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
        prefix, _ = _run_folder(user, dag_id, run_id)
        uri = storage.join(prefix, "report.html")
        if not storage.exists(uri):
            raise HTTPException(404, f"run {run_id!r} has no report.html yet (its report.json is on the run page)")
        return Response(storage.read_bytes(uri), media_type="text/html; charset=utf-8",
                        headers={"Content-Security-Policy": REPORT_CSP})

    @router.get("/runs/{dag_id}/{run_id}/report.json")
    def report_json(dag_id: str, run_id: str, user: User) -> Response:
        _, report = _run_folder(user, dag_id, run_id)
        return Response(json.dumps(report, indent=2, sort_keys=True, default=str), media_type="application/json")

    @router.get("/registry", response_class=HTMLResponse)
    def registry_page(request: Request) -> HTMLResponse:
        from stagewise import registry

        root = request.scope.get("root_path", "")
        configs = pipeline_configs()
        body = ("<h1>Model registry</h1><p class='sub'>Versions under each pipeline's <code>models/</code>; the gate "
                "moves <em>current</em>, batch inference scores with it.</p>")
        models = []  # (storage root, model name, the pipelines registering it): each pipeline's own model first
        for storage_root, pipeline_names in storage_roots().items():
            own = {configs[name].registry.model_name: name for name in pipeline_names}
            found = model_names(storage_root)
            models += [(storage_root, name, own[name]) for name in own if name in found]
            models += [(storage_root, name, "") for name in found if name not in own]
        in_mlflow = {name: config for name, config in configs.items() if config.registry.backend == "mlflow"}
        for name, config in sorted(in_mlflow.items()):  # linked, not fetched: this page never waits on another server
            model_url = f"{config.tracking.mlflow_uri}/#/models/{quote(config.registry.model_name, safe='')}"
            body += (f"<section data-stagewise-mlflow-model='{esc(config.registry.model_name)}'><h2>"
                     f"{esc(config.registry.model_name)}</h2><p class='sub'>pipeline <b>{esc(name)}</b> keeps its versions "
                     f"in MLflow's Model Registry; the gate moves <em>@champion</em>: "
                     f"<a href=\"{esc(model_url)}\" target=\"_blank\" rel=\"noopener\">open it in MLflow</a></p></section>")
        if not models and not in_mlflow:
            body += "<p class='empty'>No model registered yet: a finished <code>&lt;name&gt;_pipeline</code> run registers one.</p>"
        for storage_root, name, pipeline in models:
            try:
                pointer, pointer_error = registry.pointer(storage_root, name), ""
            except DataError as exc:  # a torn current.json hides this name's current version, not the page
                pointer, pointer_error = {}, f"<p class='err'>{esc(exc)}</p>"
            cards = registry.versions(storage_root, name)
            current = pointer.get("version")
            body += (f"<section data-stagewise-model='{esc(name)}'><h2>{esc(name)}</h2><p class='sub'>"
                     + (f"pipeline <b>{esc(pipeline)}</b> · " if pipeline else "")
                     + f"<code>{esc(storage_root)}/models/{esc(name)}</code></p>{pointer_error}")
            body += (f"<p>Current: <span class='badge cur mono'>{esc(current)}</span> since {esc(pointer.get('moved_at'))}"
                     f" · {esc(pointer.get('reason'))}</p>" if current else "<p class='sub'>No current version.</p>")
            chain = [*pointer.get("history", []), *([current] if current else [])]
            if chain:
                body += ("<p class='sub'>Promotion history (oldest first): "
                         + " → ".join(f"<span class='mono'>{esc(v)}</span>" for v in chain) + "</p>")
            rows = []
            for card in cards:
                objective = card.get("objective") or "accuracy"
                source = str(card.get("source_run") or "")  # "<dag_id>/<run_id>"
                source_dag, _, source_run = source.partition("/")
                try:
                    source_cell = _link(run_href(root, path_segment(source_dag, "DAG id"),
                                                 path_segment(source_run, "run id")), source)
                except HTTPException:  # not a run of this storage root's layout: shown, not linked
                    source_cell = esc(source)
                version = card.get("version")
                rows.append([f"<span class='mono'>{esc(version)}</span>"
                             + (" <span class='badge cur'>current</span>" if version == current else ""),
                             esc(card.get("registered_at")), esc(objective), fmt(card.get(f"test_{objective}")),
                             fmt(card.get(f"val_{objective}")), source_cell,
                             f"<a href='#card-{esc(name)}-{esc(version)}'>card</a>"])
            body += table(["version", "registered", "objective", "test", "validation", "source run", "card"], rows,
                          numeric=(3, 4), wide=True) if rows else "<p class='sub'>No version cards.</p>"
            for card in cards:  # each version's card in full; the current one open
                version = card.get("version")
                details = table(["field", "value"], ([esc(k), params_text(v) if isinstance(v, dict) else fmt(v)]
                                                     for k, v in sorted(card.items())))
                body += (f"<details class='card-of' id='card-{esc(name)}-{esc(version)}'{' open' if version == current else ''}>"
                         f"<summary>Card of <span class='mono'>{esc(version)}</span>"
                         f"{' (current)' if version == current else ''}</summary>{details}</details>")
            body += "</section>"
        return page(request, "Model registry", body, "registry", "registry")

    app.include_router(router)
    return app

