"""A pending approval on the Stagewise pages: the run page of a run waiting at its gate, and the registry page's
model names, each with a link to the decision under Airflow's Required Actions."""

from typing import Any

from stagewise.airflow.ui.layout import esc
from stagewise.airflow.ui.storage_access import Storage, StorageProblem, read_each
from stagewise.models import approval
from stagewise.registry import model_names, models_prefix


def open_requests(root: str) -> dict[str, dict[str, Any]]:
    """Each model name's open approval request under the storage root ``root``."""
    found = {}
    for name in model_names(root):
        request = approval.open_request(models_prefix(root, name))
        if request is not None:
            found[name] = request
    return found


def waiting_run(places: list[Storage], dag_id: str, run_id: str) -> dict[str, Any] | None:
    """The open request of run ``dag_id``/``run_id`` in any of ``places``, with its model name; None if none."""
    wanted = f"{dag_id}/{run_id}"
    for result in read_each(places, lambda place: open_requests(place.root)).values():
        if isinstance(result, StorageProblem):
            continue
        for name, request in result.items():
            if request.get("run") == wanted:
                return {**request, "model_name": name}
    return None


def pending_html(request: dict[str, Any]) -> str:
    """One waiting decision: the version, why it waits, since when, and the link to answer it in Airflow."""
    url = str(request.get("required_actions_url") or "")
    action = (f" <a data-stagewise-link='required-actions' href='{esc(url)}'>Decide under Required Actions</a>"
              if url.startswith(("http://", "https://", "/")) else "")
    return (f"<p data-stagewise-pending='{esc(request.get('version'))}'><span class='badge warn'>waiting for approval"
            f"</span> version <span class='mono'>{esc(request.get('version'))}</span> from run "
            f"<code>{esc(request.get('run'))}</code> since {esc(request.get('asked_at'))}: {esc(request.get('reason'))}; "
            + (f"compared with <span class='mono'>{esc(request['compared'])}</span>." if request.get("compared") else
               "no model is current yet.") + f"{action}</p>")


def waiting_body(request: dict[str, Any], dag_id: str, run_id: str) -> str:
    """The run page of a run that has no report yet because its gate waits for a person."""
    return (f"<h1 class='run-id' data-stagewise-run-id='{esc(run_id)}'>{esc(run_id)}</h1>"
            f"<p class='sub'>DAG <b>{esc(dag_id)}</b> · model <b>{esc(request['model_name'])}</b> · the report is "
            f"written once the gate's decision is taken</p>"
            f"<section data-stagewise-section='approval'>{pending_html(request)}</section>")
