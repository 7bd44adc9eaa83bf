"""Who may see what, and the headers every answer carries.

Run: imported by the pages (``stagewise.airflow.ui``). Airflow mounts a plugin's app as is, so each route depends on
Airflow's own ``get_user`` (the UI's ``_token`` cookie or an ``Authorization: Bearer`` JWT; none: 401, a bad one: 403)
and the auth manager's UI access; a run also needs read access to its DAG's runs (403).
"""

from collections.abc import Awaitable, Callable
from typing import Annotated, Any

from fastapi import Depends, HTTPException, Request
from fastapi.responses import Response


def user_dependency() -> Any:
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
