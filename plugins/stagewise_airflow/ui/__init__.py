"""Stagewise in the Airflow UI: runs, a run's report and the model registry, served by the api-server.

Run: mounted at ``/stagewise`` on the api-server by the Stagewise plugin (``stagewise.airflow.plugin``: the UI's
*Stagewise* entry and each DAG run's *Stagewise report* tab open it); ``create_app()`` builds it, for tests too.

One module a page, over their shared parts (lowest first; imports only point down):
``access`` (login, per-DAG read access, headers) → ``layout`` (style, page frame, tables) → ``pipelines`` (what
Airflow's DB holds) → ``storage_access`` (each pipeline's storage, within a deadline) → ``runs_page``, ``run_page``,
``registry_page``.

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

from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI

from stagewise.airflow.ui import registry_page, run_page, runs_page
from stagewise.airflow.ui.access import security_headers, user_dependency
from stagewise.airflow.ui.pipelines import Pipeline, pipelines
from stagewise.airflow.ui.storage_access import Storage, StorageProblem, read_each, storages

URL_PREFIX = "/stagewise"

__all__ = ["URL_PREFIX", "Pipeline", "Storage", "StorageProblem", "create_app", "pipelines", "read_each", "storages"]


def create_app() -> FastAPI:
    """The Stagewise pages as a FastAPI app (Airflow mounts it at ``URL_PREFIX``)."""
    app = FastAPI(title="Stagewise", docs_url=None, redoc_url=None, openapi_url=None)
    app.middleware("http")(security_headers)
    ui_user = user_dependency()
    router = APIRouter(dependencies=[Depends(ui_user)])  # every page, so none can be added without the login
    User = Annotated[Any, Depends(ui_user)]  # noqa: N806 - FastAPI resolves it once per request
    for module in (runs_page, run_page, registry_page):
        module.register(router, User)
    app.include_router(router)
    return app
