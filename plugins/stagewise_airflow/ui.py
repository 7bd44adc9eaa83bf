"""Stagewise in the Airflow UI: runs, a run's report and the model registry, served by the api-server.

Run: loaded by ``plugins/stagewise_ui_plugin.py`` and mounted at ``/stagewise`` on the api-server (the UI's
*Stagewise* entry and each DAG run's *Stagewise report* tab open it); ``create_app()`` builds it for tests.

Every page needs the caller's Airflow login: Airflow mounts a plugin's app as is, so each route depends on
Airflow's own ``get_user`` (the UI's ``_token`` cookie or an ``Authorization: Bearer`` JWT; none: 401, a bad
one: 403) and the auth manager's UI access; a run also needs read access to its DAG's runs (403).

The pipelines are the ones the DAG file built: each serialized DAG tagged ``stagewise`` in Airflow's metadata DB
carries its pipeline's name and config (``stagewise.airflow.wiring.dag_settings``), so the api-server needs neither
the pipelines folder nor a variable. Reads go through ``stagewise.core.storage`` under each pipeline's storage root,
with that pipeline's own connection (``storage_conn_id``, as s3fs arguments scoped to the call; empty: the
api-server's AWS environment), every storage at once within STORAGE_DEADLINE_S: a storage that fails or is slow shows
its error in place of its own rows ("pipeline x: storage unreachable: NoCredentialsError"), never a path, and the
other pipelines' rows render. Everything taken from storage is HTML-escaped, and a DAG or run id becomes a path only through
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
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar
from urllib.parse import quote

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Request
from fastapi.responses import HTMLResponse, Response

from stagewise.airflow.credentials import StorageConnectionError, storage_options
from stagewise.airflow.wiring import PIPELINE_DEFAULT_ARG
from stagewise.core import storage
from stagewise.core.errors import DataError
from stagewise.definitions.config import PipelineConfig
from stagewise.registry import model_names
from stagewise.report import list_reports, read_report

URL_PREFIX = "/stagewise"

log = logging.getLogger("stagewise.ui")

T = TypeVar("T")


# -- pipelines: the DAGs Airflow holds ----------------------------------------------------------------

@dataclass(frozen=True)
class Pipeline:
    """A pipeline as the DAG file built it: its name, config and the DAGs carrying it."""

    name: str
    config: PipelineConfig
    dag_ids: tuple[str, ...]
    retired: bool = False
    """Every DAG of it is stale (its file deleted, or forgotten): its runs and models stay readable, marked retired."""


# (dag_id, dag_hash) -> (pipeline name, config) the serialized DAG carries, None for none: validated once per version
_carried: dict[tuple[str, str], tuple[str, PipelineConfig] | None] = {}
_carried_lock = threading.Lock()  # pages are served from a thread pool


def pipelines() -> dict[str, Pipeline]:
    """Every pipeline whose DAGs Airflow holds, by name: the latest serialized version of each DAG tagged
    ``stagewise`` (a stale one too: its pipeline is retired, its runs and models still shown) carries its pipeline's
    name and config in default_args (PIPELINE_DEFAULT_ARG, set by stagewise.airflow.wiring.dag_settings), so the
    api-server needs neither the pipelines folder nor a variable.
    A DAG carrying none (a config that never loaded) or one that does not validate here is left out, and named in the
    api-server's log."""
    from airflow.models.dag import DagModel, DagTag
    from airflow.models.dag_version import DagVersion
    from airflow.models.serialized_dag import SerializedDagModel
    from airflow.utils.session import create_session
    from sqlalchemy import func, select
    from sqlalchemy.exc import SQLAlchemyError

    latest = (select(DagVersion.dag_id, func.max(DagVersion.version_number).label("number"))
              .join(SerializedDagModel, SerializedDagModel.dag_version_id == DagVersion.id)
              .group_by(DagVersion.dag_id).subquery())
    query = (select(SerializedDagModel.id, SerializedDagModel.dag_id, SerializedDagModel.dag_hash, DagModel.is_stale)
             .join(DagVersion, SerializedDagModel.dag_version_id == DagVersion.id)
             .join(latest, (DagVersion.dag_id == latest.c.dag_id) & (DagVersion.version_number == latest.c.number))
             .join(DagModel, DagModel.dag_id == SerializedDagModel.dag_id)
             .where(DagModel.dag_id.in_(select(DagTag.dag_id).where(DagTag.name == "stagewise")))
             .order_by(SerializedDagModel.dag_id))
    try:
        with create_session() as session:
            rows = session.execute(query).all()
            with _carried_lock:
                known = {(dag_id, dag_hash): _carried[(dag_id, dag_hash)] for _, dag_id, dag_hash, _ in rows
                         if (dag_id, dag_hash) in _carried}
            stale = {dag_id for _, dag_id, _, is_stale in rows if is_stale}  # gone from the file, or forgotten
            stale |= set(session.scalars(select(DagTag.dag_id).where(DagTag.name == "retired")))  # deleted, kept
            for row_id, dag_id, dag_hash, _ in rows:  # a new version's data only: it is the large column
                if (dag_id, dag_hash) not in known:
                    known[(dag_id, dag_hash)] = _pipeline_of(dag_id, session.get(SerializedDagModel, row_id).data)
    except SQLAlchemyError as exc:
        log.error("the Airflow metadata DB: %s", exc)
        raise HTTPException(503, "the Airflow metadata DB cannot be read: the api-server's log says why") from None
    with _carried_lock:  # older versions leave: the api-server runs for days
        _carried.clear()
        _carried.update(known)
    found: dict[str, Pipeline] = {}
    for key in sorted(known):  # a pipeline's DAGs carry one config; the first DAG's stands for them
        if (carried := known[key]) is not None:
            name, config = carried
            earlier = found.get(name)
            dag_ids = (*(earlier.dag_ids if earlier else ()), key[0])
            found[name] = Pipeline(name, earlier.config if earlier else config, dag_ids, stale.issuperset(dag_ids))
    return found


def _pipeline_of(dag_id: str, data: Any) -> tuple[str, PipelineConfig] | None:
    """The pipeline a serialized DAG carries in its default_args, validated; None when it carries none or a bad one."""
    from airflow.serialization.serialized_objects import BaseSerialization

    encoded = (((data or {}).get("dag") or {}).get("default_args") or {}).get("__var", {}).get(PIPELINE_DEFAULT_ARG)
    if encoded is None:
        return None
    try:
        carried = BaseSerialization.deserialize(encoded)
        return str(carried["name"]), PipelineConfig.model_validate(carried["config"])
    except Exception as exc:  # noqa: BLE001 - a DAG this api-server cannot read hides that DAG, not the pages
        log.error("DAG %s: its Stagewise pipeline config does not load here: %s", dag_id, exc)
        return None


# -- storage: each pipeline's own, through its connection, within a deadline ---------------------------

# What one page waits for a pipeline's storage; a read still running then goes on in the background, bounded by
# botocore's own timeouts (STORAGE_CLIENT_CONFIG), and its rows show the error.
STORAGE_DEADLINE_S = 5.0
STORAGE_CLIENT_CONFIG = {"connect_timeout": 2, "read_timeout": 3, "retries": {"mode": "standard", "max_attempts": 2}}


@dataclass(frozen=True)
class Storage:
    """One storage root as the pipelines writing there reach it: with their connection (two may share a root)."""

    root: str
    conn_id: str
    names: tuple[str, ...]

    def label(self) -> str:
        return f"pipeline{'s' if len(self.names) > 1 else ''} {', '.join(self.names)}"


class StorageProblem(Exception):
    """A storage that did not answer, or not in time: its message names the pipelines and the cause, never a path."""


def storages(found: dict[str, Pipeline]) -> list[Storage]:
    """Each (storage root, connection) the pipelines use, with the names of the pipelines using it."""
    grouped: dict[tuple[str, str], list[str]] = {}
    for name, pipeline in sorted(found.items()):
        grouped.setdefault((pipeline.config.storage_root, pipeline.config.storage_conn_id), []).append(name)
    return [Storage(root, conn_id, tuple(names)) for (root, conn_id), names in grouped.items()]


def _read_as(place: Storage, read: Callable[[Storage], T]) -> T:
    """``read(place)`` with the place's own connection: s3fs arguments scoped to this call, never the environment."""
    options: dict[str, Any] = {}
    if "://" in place.root and not place.root.startswith("file://"):
        options = {**storage_options(place.conn_id), "config_kwargs": STORAGE_CLIENT_CONFIG}
    with storage.using_options(options):
        return read(place)


def read_each(places: Iterable[Storage], read: Callable[[Storage], T],
              deadline_s: float | None = None) -> dict[Storage, T | StorageProblem]:
    """``read(place)`` for every place at once, each with its own connection; what fails or is still running at the
    deadline is a StorageProblem naming its pipelines and the cause (the details go to the api-server's log)."""
    deadline_s = STORAGE_DEADLINE_S if deadline_s is None else deadline_s
    boxes: dict[Storage, dict[str, Any]] = {}
    threads = []
    for place in places:
        box = boxes[place] = {}

        def run(place: Storage = place, box: dict[str, Any] = box) -> None:
            try:
                box["value"] = _read_as(place, read)
            except BaseException as exc:  # noqa: BLE001 - whatever it is, it is this storage's error alone
                box["error"] = exc

        thread = threading.Thread(target=run, name=f"stagewise-ui-storage-{len(threads)}", daemon=True)
        thread.start()
        threads.append(thread)
    end = time.monotonic() + deadline_s
    for thread in threads:
        thread.join(max(0.0, end - time.monotonic()))
    results: dict[Storage, T | StorageProblem] = {}
    for place, box in boxes.items():
        if "value" in box:
            results[place] = box["value"]
        elif "error" in box:
            results[place] = _problem(place, box["error"])
        else:
            log.warning("%s: storage %s gave no answer within %g s", place.label(), place.root, deadline_s)
            results[place] = StorageProblem(f"{place.label()}: storage unreachable: no answer within {deadline_s:g} s")
    return results


def _problem(place: Storage, error: BaseException) -> StorageProblem:
    log.warning("%s: storage %s cannot be read: %s: %s", place.label(), place.root, type(error).__name__, error)
    if isinstance(error, StorageConnectionError):
        return StorageProblem(f"{place.label()}: {error}")
    return StorageProblem(f"{place.label()}: storage unreachable: {type(error).__name__}")


def path_segment(value: str, what: str) -> str:
    """``value`` as one folder name under the storage root; refuses anything that could leave its folder."""
    if not value or value in (".", "..") or any(char in value for char in "/\\\0"):
        raise HTTPException(400, f"{what} {value!r} is not a valid id (no '/', '\\', or '.'/'..')")
    return storage.safe_name(value)  # a folder name maps to itself, an Airflow run id to its folder


def storage_error(place: Storage, problem: StorageProblem) -> str:
    """A storage's error in place of what it holds, marked with its pipelines' names."""
    return (f"<span class='badge err' data-stagewise-storage-error='{esc(', '.join(place.names))}'>storage error</span> "
            f"{esc(problem)}")


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
                rows.append([esc(dag_id), _link(href, run_id), esc(when), "", "", "", f'<span class="badge err">'
                             f'unreadable</span> {esc(report["_error"])}'])
                continue
            best = (report.get("sweep") or {}).get("best_value") if isinstance(report.get("sweep"), dict) else None
            retired = any(dag_id in pipeline.dag_ids and pipeline.retired for pipeline in found.values())
            rows.append([esc(dag_id) + (' <span class="badge">retired</span>' if retired else ""), _link(href, run_id),
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
        _, prefix, report, has_html = _run_folder(user, dag_id, run_id)
        root = request.scope.get("root_path", "")
        here = run_href(root, path_segment(dag_id, "DAG id"), path_segment(run_id, "run id"))
        shown_dag, shown_run = report.get("dag_id") or dag_id, report.get("run_id") or run_id
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
        place, prefix, _, has_html = _run_folder(user, dag_id, run_id)
        if not has_html:
            raise HTTPException(404, f"run {run_id!r} has no report.html yet (its report.json is on the run page)")
        read = read_each([place], lambda place: storage.read_bytes(storage.join(prefix, "report.html")))[place]
        if isinstance(read, StorageProblem):
            raise HTTPException(503, str(read))
        return Response(read, media_type="text/html; charset=utf-8", headers={"Content-Security-Policy": REPORT_CSP})

    @router.get("/runs/{dag_id}/{run_id}/report.json")
    def report_json(dag_id: str, run_id: str, user: User) -> Response:
        _, _, report, _ = _run_folder(user, dag_id, run_id)
        return Response(json.dumps(report, indent=2, sort_keys=True, default=str), media_type="application/json")

    @router.get("/registry", response_class=HTMLResponse)
    def registry_page(request: Request, user: User) -> HTMLResponse:
        from stagewise import registry

        root = request.scope.get("root_path", "")
        found = pipelines()
        configs = {name: pipeline.config for name, pipeline in found.items()}
        allowed: dict[str, bool] = {}

        def may_read(dag_ids: Iterable[str]) -> bool:
            """Whether the user may read one of these DAGs' runs (asked once per DAG and page)."""
            for dag_id in dag_ids:
                if dag_id not in allowed:
                    allowed[dag_id] = can_read_runs(user, dag_id)
                if allowed[dag_id]:
                    return True
            return False

        def writers(root_uri: str, model: str, cards: list[dict[str, Any]]) -> list[str]:
            """The DAGs that write ``model`` under ``root_uri``: those of the pipelines registering it there; for a model
            no pipeline registers now (renamed, removed), the DAGs its versions came from."""
            owners = [dag_id for name, pipeline in found.items() if pipeline.config.storage_root == root_uri
                      and pipeline.config.registry.model_name == model for dag_id in pipeline.dag_ids]
            sources = (str(card.get("source_run") or "").partition("/")[0] for card in cards)
            return owners or [dag_id for dag_id in sources if dag_id]
        body = ("<h1>Model registry</h1><p class='sub'>Versions under each pipeline's <code>models/</code>; the gate "
                "moves <em>current</em>, batch inference scores with it.</p>")

        def registered(place: Storage) -> dict[str, tuple[dict[str, Any], str, list[dict[str, Any]]]]:
            """Each model name under the place's models/: its pointer, the pointer's error and its version cards."""
            models = {}
            for name in model_names(place.root):
                try:
                    pointer, pointer_error = registry.pointer(place.root, name), ""
                except DataError as exc:  # a torn current.json hides this name's current version, not the page
                    pointer, pointer_error = {}, str(exc)
                models[name] = (pointer, pointer_error, registry.versions(place.root, name))
            return models

        models = []  # (storage root, model name, the pipeline registering it, what is there)
        problems, seen = [], set()
        for place, result in read_each(storages(found), registered).items():
            if isinstance(result, StorageProblem):  # in place of its models
                problems.append((place, result))
                continue
            own = {configs[name].registry.model_name: name for name in place.names}  # each pipeline's own model first
            for name, pipeline in [*((n, own[n]) for n in own if n in result), *((n, "") for n in result if n not in own)]:
                if not may_read(writers(place.root, name, result[name][2])):  # its cards tell what a run of it did
                    continue
                if (place.root, name) not in seen:  # two connections to one root list the same models
                    seen.add((place.root, name))
                    models.append((place.root, name, pipeline, result[name]))
        for place, problem in problems:
            if not may_read(dag_id for name in place.names for dag_id in found[name].dag_ids):
                continue
            body += (f"<section data-stagewise-storage-error='{esc(', '.join(place.names))}'><h2>"
                     f"{esc(', '.join(configs[name].registry.model_name for name in place.names))}</h2>"
                     f"<p>{storage_error(place, problem)}</p></section>")
        in_mlflow = {name: config for name, config in configs.items()
                     if config.registry.backend == "mlflow" and may_read(found[name].dag_ids)}
        for name, config in sorted(in_mlflow.items()):  # linked, not fetched: this page never waits on another server
            model_url = f"{config.tracking.mlflow_uri}/#/models/{quote(config.registry.model_name, safe='')}"
            body += (f"<section data-stagewise-mlflow-model='{esc(config.registry.model_name)}'><h2>"
                     f"{esc(config.registry.model_name)}</h2><p class='sub'>pipeline <b>{esc(name)}</b> keeps its versions "
                     f"in MLflow's Model Registry; the gate moves <em>@champion</em>: "
                     f"<a href=\"{esc(model_url)}\" target=\"_blank\" rel=\"noopener\">open it in MLflow</a></p></section>")
        if not models and not in_mlflow and not problems:
            body += "<p class='empty'>No model registered yet: a finished <code>&lt;name&gt;_pipeline</code> run registers one.</p>"
        for storage_root, name, pipeline, (pointer, pointer_error, cards) in models:
            body += (f"<section data-stagewise-model='{esc(name)}'><h2>{esc(name)}</h2><p class='sub'>"
                     + (f"pipeline <b>{esc(pipeline)}</b> · " if pipeline else "")
                     + f"<code>{esc(storage_root)}/models/{esc(name)}</code></p>"
                     + (f"<p class='err'>{esc(pointer_error)}</p>" if pointer_error else ""))
            current = pointer.get("version")
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

