"""The model registry page (``/registry``): each model name's versions, the current one, its history and the cards.

Run: ``register(router, User)`` adds its route (``stagewise.airflow.ui.create_app``). A model shows to whoever may read
the runs of one DAG that writes it (docs/airflow-ui.md).

A model's versions show VERSIONS_PER_PAGE at a time, newest first, with their cards; ``?model=<name>&page=N`` pages
that model ("versions 51–100 of 1,000"). Cards come through stagewise.registry.versions, which reads a card again
only when its file changed.
"""

from collections.abc import Iterable
from typing import Any
from urllib.parse import quote

from fastapi import APIRouter, HTTPException, Query, Request
from fastapi.responses import HTMLResponse

from stagewise.airflow.ui.access import can_read_runs
from stagewise.airflow.ui.approvals import pending_html
from stagewise.airflow.ui.layout import esc, fmt, link, page, pager, params_text, run_href, table
from stagewise.airflow.ui.pipelines import pipelines
from stagewise.airflow.ui.storage_access import (
    Storage,
    StorageProblem,
    path_segment,
    read_each,
    storage_error,
    storages,
)
from stagewise.core.errors import DataError
from stagewise.models import approval
from stagewise.registry import model_names

VERSIONS_PER_PAGE = 50
HISTORY_SHOWN = 20  # the promotion history's latest versions; the line says how many earlier ones it leaves out


def register(router: APIRouter, User: Any) -> None:  # noqa: N803 - the request's user, as FastAPI resolves it
    """Add the registry page to ``router``."""

    @router.get("/registry", response_class=HTMLResponse)
    def registry_page(request: Request, user: User, model: str = "",
                      number: int = Query(1, alias="page", ge=1)) -> HTMLResponse:
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
                models[name] = (pointer, pointer_error, registry.versions(place.root, name),
                                approval.open_request(registry.models_prefix(place.root, name)))
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
                     f"<a href=\"{esc(model_url)}\" target=\"_blank\" rel=\"noopener\">open it in MLflow</a></p>"
                     + (pending_html(waiting) if (waiting := approval.open_request(registry.models_prefix(
                         config.storage_root, config.registry.model_name))) else "") + "</section>")
        if not models and not in_mlflow and not problems:
            body += "<p class='empty'>No model registered yet: a finished <code>&lt;name&gt;_pipeline</code> run registers one.</p>"
        for storage_root, name, pipeline, (pointer, pointer_error, cards, waiting) in models:
            body += (f"<section data-stagewise-model='{esc(name)}'><h2>{esc(name)}</h2><p class='sub'>"
                     + (f"pipeline <b>{esc(pipeline)}</b> · " if pipeline else "")
                     + f"<code>{esc(storage_root)}/models/{esc(name)}</code></p>"
                     + (f"<p class='err'>{esc(pointer_error)}</p>" if pointer_error else ""))
            current = pointer.get("version")
            body += (f"<p>Current: <span class='badge cur mono'>{esc(current)}</span> since {esc(pointer.get('moved_at'))}"
                     f" · {esc(pointer.get('reason'))}</p>" if current else "<p class='sub'>No current version.</p>")
            body += pending_html(waiting) if waiting else ""
            chain = [*pointer.get("history", []), *([current] if current else [])]
            if chain:
                earlier = len(chain) - HISTORY_SHOWN
                body += ("<p class='sub'>Promotion history (oldest first): "
                         + (f"{earlier:,} earlier versions → " if earlier > 0 else "")
                         + " → ".join(f"<span class='mono'>{esc(v)}</span>" for v in chain[-HISTORY_SHOWN:]) + "</p>")
            last = max(1, -(-len(cards) // VERSIONS_PER_PAGE))
            shown_page = min(number, last) if name == model else 1  # the other models stay on their first page
            cards_shown = cards[(shown_page - 1) * VERSIONS_PER_PAGE:shown_page * VERSIONS_PER_PAGE]
            bar = pager(root + "/registry", {"model": name}, shown_page, VERSIONS_PER_PAGE, len(cards), "versions")
            rows = []
            for card in cards_shown:
                objective = card.get("objective") or "accuracy"
                source = str(card.get("source_run") or "")  # "<dag_id>/<run_id>"
                source_dag, _, source_run = source.partition("/")
                try:
                    source_cell = link(run_href(root, path_segment(source_dag, "DAG id"),
                                                 path_segment(source_run, "run id")), source)
                except HTTPException:  # not a run of this storage root's layout: shown, not linked
                    source_cell = esc(source)
                version = card.get("version")
                rows.append([f"<span class='mono'>{esc(version)}</span>"
                             + (" <span class='badge cur'>current</span>" if version == current else ""),
                             esc(card.get("registered_at")), esc(objective), fmt(card.get(f"test_{objective}")),
                             fmt(card.get(f"val_{objective}")), source_cell,
                             f"<a href='#card-{esc(name)}-{esc(version)}'>card</a>"])
            body += bar + table(["version", "registered", "objective", "test", "validation", "source run", "card"], rows,
                                numeric=(3, 4), wide=True) + bar if rows else "<p class='sub'>No version cards.</p>"
            for card in cards_shown:  # each listed version's card in full; the current one open
                version = card.get("version")
                details = table(["field", "value"], ([esc(k), params_text(v) if isinstance(v, dict) else fmt(v)]
                                                     for k, v in sorted(card.items())))
                body += (f"<details class='card-of' id='card-{esc(name)}-{esc(version)}'{' open' if version == current else ''}>"
                         f"<summary>Card of <span class='mono'>{esc(version)}</span>"
                         f"{' (current)' if version == current else ''}</summary>{details}</details>")
            body += "</section>"
        return page(request, "Model registry", body, "registry", "registry")
