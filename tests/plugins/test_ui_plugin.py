"""The Stagewise pages in the api-server: mounted by Airflow's own plugin code, behind Airflow's auth, reading storage.

The app under test is Airflow's: the plugin loaded as Airflow's loader does (the package's entry point), mounted by
``airflow.api_fastapi.app.init_plugins``, with the simple auth manager (its /auth/token route) and Airflow's
middlewares (the UI's ``_token`` cookie) in front, so a request is authenticated exactly as on the api-server.
The pipelines are what the api-server finds in Airflow's metadata DB (a copy of the repo-local one, this module's
alone): serialized DAGs carrying their pipeline's config, as the dag-processor writes them; no STAGEWISE_* variable.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from stagewise import registry, report
from stagewise.core import storage
from stagewise.definitions.loading import load_config
from stagewise.definitions.pipelines import KINDS
from tests.conftest import base_config

PASSWORD = "stagewise-test-password"
JWT_SECRET = "stagewise-ui-plugin-tests-" + "0" * 48  # one per process: Airflow caches its JWT validator
RUN_ID = "manual__2026-11-22T15:28:40.036542+00:00"
ODD_RUN_ID = "manual__<img src=x onerror=alert(1)>"
REPORT_PAGE = "<!doctype html><html><body><div id='charts' data-stagewise-section='charts'>plots</div></body></html>"


def load_plugin():
    """The plugin class, found the way Airflow's loader finds it: the ``airflow.plugins`` entry point."""
    from importlib.metadata import entry_points

    (entry,) = [entry for entry in entry_points(group="airflow.plugins") if entry.name == "stagewise"]
    return entry.load()


def write_run(storage_root: str, run_id: str, *, test_accuracy: float = 0.91, html: str | None = None,
              dag_id: str = "ml_pipeline", tracking: dict | None = None) -> str:
    """A finished ml_pipeline run's report.json (written by stagewise.report itself); its report.html replaced by ``html``,
    or removed (a run reported before report.html existed) when ``html`` is None."""
    out = storage.run_prefix(storage_root, dag_id, run_id)
    report.build_report(
        dag_id=dag_id, run_id=run_id, out=out,
        stage_results={"preprocess": [{"duration_s": 1.5, "attempt": 1}], "train_s1": [{"duration_s": 4.0, "attempt": 2}]},
        preprocess={"rows": {"train": 1200, "validation": 300, "test": 297}, "rows_dropped": 3},
        sweep={"study_name": "ml_pipeline-x", "n_trials": 6, "n_complete": 4, "n_pruned": 2, "n_failed": 0,
               "best_value": 0.93, "best_params": {"lr": 0.01}},
        training=[{"stage": "s1", "world_size": 1, "global_batch": 64, "lr": 0.05, "epochs": 2, "val_metric": 0.9},
                  {"stage": "s2", "world_size": 2, "global_batch": 128, "lr": 0.1, "epochs": 2, "val_metric": 0.92}],
        evaluation={"objective": "accuracy", "test_objective": test_accuracy, "test_accuracy": test_accuracy,
                    "test_loss": 0.3},
        predictions={"uri": storage.join(out, "predictions"), "rows": 297, "rows_quarantined": 1},
        registry={"model_name": "digits", "version": "m-abc", "promoted": True, "reason": "no current model",
                  "current": "m-abc"}, tracking=tracking)
    page = storage.join(out, "report.html")
    if html is not None:
        storage.write_bytes(page, html.encode())
    else:
        fs, path = storage.filesystem(page)
        fs.rm(path)
    return out


def csp_directives(answer) -> dict[str, str]:
    """The answer's Content-Security-Policy as {directive: its sources}."""
    policy = answer.headers["content-security-policy"]
    return {name: rest.strip() for name, _, rest in (part.strip().partition(" ") for part in policy.split(";"))}


def register_two_versions(storage_root: str, tmp_path: Path) -> tuple[str, str]:
    """Two registered digits models, the second promoted over the first by the gate."""
    found = []
    for i, accuracy in enumerate((0.90, 0.95)):
        model = tmp_path / f"model{i}.pt"
        model.write_bytes(f"weights {i}".encode())
        card = registry.register(storage_root, "digits", str(model), {
            "test_accuracy": accuracy, "objective": "accuracy", "direction": "maximize", "val_accuracy": accuracy - 0.01,
            "source_run": f"ml_pipeline/{RUN_ID}", "lr": 0.01})
        registry.gate(storage_root, "digits", card["version"], "test_accuracy", 0.0)
        found.append(card["version"])
    return found[0], found[1]


BUNDLE = "stagewise-ui-tests"


def _reconnect() -> None:
    """Airflow's ORM on the database $AIRFLOW__DATABASE__SQL_ALCHEMY_CONN names now."""
    from airflow import settings

    settings.dispose_orm(do_log=False)
    settings.configure_vars()
    settings.configure_orm()


@pytest.fixture(scope="module")
def airflow_db(tmp_path_factory):
    """A copy of the repo-local Airflow DB (migrated by `make airflow-init`) for this module alone: tests publish their
    pipelines' DAGs there as the dag-processor would, and the DAGs the copy already held are stale (hidden)."""
    import sqlite3

    from airflow import settings

    url = settings.engine.url
    if url.get_backend_name() != "sqlite" or not url.database:
        pytest.fail(f"the UI tests copy the repo-local SQLite DB (scripts/airflow_env.sh, make airflow-init), not {url!r}")
    copy = tmp_path_factory.mktemp("airflow-db") / "airflow.db"
    source, target = sqlite3.connect(url.database), sqlite3.connect(copy)
    try:
        source.backup(target)
        target.execute("UPDATE dag SET is_stale = 1")
        target.execute("INSERT OR IGNORE INTO dag_bundle (name, active) VALUES (?, 1)", (BUNDLE,))
        target.commit()
    finally:
        source.close()
        target.close()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", f"sqlite:///{copy}")
        patch.setenv("AIRFLOW__CORE__MIN_SERIALIZED_DAG_UPDATE_INTERVAL", "0")  # each test's DAGs replace the last's
        _reconnect()
        yield copy
    _reconnect()


def pipeline_dags(name: str, config) -> list:
    """One small DAG per kind of pipeline ``name``, with the DAG settings (tags, default_args) the DAG file gives."""
    from airflow.providers.standard.operators.empty import EmptyOperator
    from airflow.sdk import DAG

    from stagewise.airflow import wiring
    from stagewise.definitions.pipelines import KINDS

    dags = []
    for kind in KINDS:
        with DAG(f"{name}_{kind}", schedule=None, auto_register=False, **wiring.dag_settings(config, name)) as built:
            EmptyOperator(task_id="start_run")
        dags.append(built)
    return dags


def publish(dags, keep_stale: bool = False) -> None:
    """These DAGs, and no others, in the DB: serialized and written as the dag-processor writes them; the DAGs held
    before are deleted (``airflow dags delete``), or with ``keep_stale`` left stale, as a deleted file leaves them."""
    from airflow.api.common.delete_dag import delete_dag
    from airflow.dag_processing.collection import update_dag_parsing_results_in_db
    from airflow.models.dag import DagModel
    from airflow.serialization.serialized_objects import LazyDeserializedDAG
    from airflow.utils.session import create_session
    from sqlalchemy import select, update

    with create_session() as session:
        if keep_stale:
            session.execute(update(DagModel).values(is_stale=True))
        else:
            for dag_id in session.scalars(select(DagModel.dag_id)).all():
                delete_dag(dag_id, session=session)
        update_dag_parsing_results_in_db(BUNDLE, None, [LazyDeserializedDAG.from_dag(dag) for dag in dags], {}, None,
                                         set(), session=session)


def write_yaml(path: Path, raw: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(raw))
    return path


def publish_pipelines(tmp_path: Path, raws: dict[str, dict]) -> None:
    """Each raw config, loaded from its file as the DAG file loads it, published as its pipeline's DAGs."""
    from stagewise.definitions.loading import load_config

    dags = []
    tmp_path.mkdir(parents=True, exist_ok=True)
    for name, raw in raws.items():
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump({**raw, "name": name}))
        dags += pipeline_dags(name, load_config(path))
    publish(dags)


@pytest.fixture
def airflow_api(monkeypatch, tmp_path, airflow_db):
    """A factory: ``airflow_api(storage_root)`` -> (TestClient of an Airflow api-server app with our plugin, admin JWT),
    with pipeline ``ml`` on ``storage_root`` (and the test's own config sections) published in the DB; with None, the
    pipelines the test published itself."""
    from airflow import plugins_manager
    from airflow.api_fastapi import app as api_app
    from airflow.api_fastapi.core_api.app import init_middlewares
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    passwords = tmp_path / "passwords.json"
    passwords.write_text(json.dumps({"admin": PASSWORD}))
    monkeypatch.setenv("AIRFLOW__CORE__AUTH_MANAGER",
                       "airflow.api_fastapi.auth.managers.simple.simple_auth_manager.SimpleAuthManager")
    monkeypatch.setenv("AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS", "admin:admin")
    monkeypatch.setenv("AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS", "False")
    monkeypatch.setenv("AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE", str(passwords))
    monkeypatch.setenv("AIRFLOW__API_AUTH__JWT_SECRET", JWT_SECRET)
    for variable in ("STAGEWISE_PIPELINES", "STAGEWISE_CONFIG"):  # the pages need neither
        monkeypatch.delenv(variable, raising=False)
    plugin = load_plugin()
    monkeypatch.setattr(plugins_manager, "get_fastapi_plugins", lambda: (plugin.fastapi_apps, []))
    from stagewise.airflow.ui import storage_access

    # A loaded CI machine can take seconds to import s3fs and sign a request: only the deadline test races the deadline.
    monkeypatch.setattr(storage_access, "STORAGE_DEADLINE_S", 60.0)
    clients = []

    def start(storage_root: str | None, **sections):
        if storage_root is not None:
            raw = base_config(Path("/unused"))
            raw["storage_root"] = storage_root
            raw.update(sections)  # top-level config sections of the test's own
            publish_pipelines(tmp_path / f"pipelines-{len(clients)}", {"ml": raw})
        api_app.purge_cached_app()
        app = FastAPI()
        api_app.init_plugins(app)  # what the api-server does with every plugin's fastapi_apps
        api_app.init_auth_manager(app)
        init_middlewares(app)
        client = TestClient(app, base_url="http://127.0.0.1")
        clients.append(client)
        answer = client.post("/auth/token", json={"username": "admin", "password": PASSWORD})
        assert answer.status_code in (200, 201), answer.text
        return client, answer.json()["access_token"]

    yield start
    for client in clients:
        client.close()
    api_app.purge_cached_app()


def test_the_plugin_mounts_the_app_and_links_each_dag_run_to_its_report():
    """The nav entry opens the runs list, the dag_run view fills the run's ids into the run page's URL."""
    plugin = load_plugin()
    assert [app["url_prefix"] for app in plugin.fastapi_apps] == ["/stagewise"]
    views = {view["destination"]: view for view in plugin.external_views}
    assert views["nav"]["href"] == "stagewise/"
    assert views["dag_run"]["href"] == "stagewise/runs/{DAG_ID}/{RUN_ID}"


@pytest.mark.parametrize("path", ["/stagewise/", f"/stagewise/runs/ml_pipeline/{RUN_ID}", "/stagewise/registry",
                                  f"/stagewise/runs/ml_pipeline/{RUN_ID}/report.json"])
def test_every_page_refuses_a_caller_without_an_airflow_login(airflow_api, storage_root, path):
    """Airflow mounts a plugin's app without auth: ours must refuse no token (401) and a forged one (403)."""
    write_run(str(storage_root), RUN_ID)
    client, _ = airflow_api(str(storage_root))
    assert client.get(path).status_code == 401
    forged = client.get(path, headers={"Authorization": "Bearer not.a.jwt"})
    assert forged.status_code == 403, forged.text  # Airflow: "Invalid JWT token"
    assert RUN_ID not in forged.text


def test_runs_list_and_run_page_for_a_logged_in_user(airflow_api, storage_root):
    """The list shows each run with its objective, test value and gate; the run page summarises report.json."""
    write_run(str(storage_root), RUN_ID, test_accuracy=0.9123)
    write_run(str(storage_root), "manual__2026-11-23T10:00:00+00:00", test_accuracy=0.8765)
    client, token = airflow_api(str(storage_root))
    bearer = {"Authorization": f"Bearer {token}"}

    listing = client.get("/stagewise/", headers=bearer)
    assert listing.status_code == 200, listing.text
    assert RUN_ID in listing.text and "manual__2026-11-23T10:00:00+00:00" in listing.text
    assert "0.9123" in listing.text and "0.8765" in listing.text and "promoted" in listing.text
    folder = storage.safe_name(RUN_ID)
    assert f'href="/stagewise/runs/ml_pipeline/{folder}"' in listing.text  # links use the storage folder

    for run in (RUN_ID, folder):  # the Airflow run id (the dag_run tab's link) and the folder name both open it
        page = client.get(f"/stagewise/runs/ml_pipeline/{run}", headers=bearer)
        assert page.status_code == 200, page.text
        assert f"data-stagewise-run-id='{RUN_ID}'" in page.text
        assert "data-stagewise-section='report' data-stagewise-report='summary'" in page.text
        assert "Training stages" in page.text and "0.9123" in page.text
    assert client.get(f"/stagewise/runs/ml_pipeline/{RUN_ID}/report.json", headers=bearer).json()["run_id"] == RUN_ID
    assert client.get(f"/stagewise/runs/ml_pipeline/{RUN_ID}/report.html", headers=bearer).status_code == 404
    assert client.get("/stagewise/runs/ml_pipeline/no_such_run", headers=bearer).status_code == 404


def test_a_retired_pipelines_runs_stay_readable_marked_retired(airflow_api, storage_root, tmp_path):
    """After its file is deleted and it is forgotten, Airflow holds its DAGs stale: the runs list still shows its runs
    (marked retired) and its run pages open; a live pipeline's runs carry no mark."""
    write_run(str(storage_root), RUN_ID, test_accuracy=0.9123)
    client, token = airflow_api(str(storage_root))
    bearer = {"Authorization": f"Bearer {token}"}
    assert '<span class="badge">retired</span>' not in client.get("/stagewise/", headers=bearer).text
    raw = base_config(tmp_path / "other")
    raw["storage_root"] = str(tmp_path / "other")
    publish(pipeline_dags("other", load_config(write_yaml(tmp_path / "other.yaml", {**raw, "name": "other"}))),
            keep_stale=True)  # ml's file deleted and forgotten: its DAGs stale, another pipeline live
    listing = client.get("/stagewise/", headers=bearer)
    assert listing.status_code == 200 and RUN_ID in listing.text and "0.9123" in listing.text
    assert 'ml_pipeline <span class="badge">retired</span>' in listing.text
    assert client.get(f"/stagewise/runs/ml_pipeline/{RUN_ID}", headers=bearer).status_code == 200


def test_runs_and_registry_of_every_pipeline_the_dag_file_builds(airflow_api, tmp_path):
    """The DAG file names its pipelines folder (build_pipelines(globals(), folder)) and the api-server has no
    STAGEWISE_* variable: the pages find the pipelines in the serialized DAGs. Two pipelines with their own storage
    roots: the list shows both pipelines' runs, each run page opens from its own root, and the registry shows each
    pipeline's model under its name; a third config that does not load is left out of the pages."""
    from stagewise.airflow import ui
    from stagewise.airflow.dags import build_pipelines

    folder, roots = tmp_path / "pipelines", {"ml": tmp_path / "ml_root", "cnn": tmp_path / "cnn_root"}
    folder.mkdir()
    for name, root in roots.items():
        raw = {**base_config(root), "name": name, "registry": {"model_name": f"{name}_model"}}
        (folder / f"{name}.yaml").write_text(yaml.safe_dump(raw))
        write_run(str(root), f"{name}_run", dag_id=f"{name}_pipeline", test_accuracy=0.81 if name == "ml" else 0.82)
        model = tmp_path / f"{name}.pt"
        model.write_bytes(name.encode())
        registry.register(str(root), f"{name}_model", str(model), {"test_accuracy": 0.8, "objective": "accuracy",
                                                                 "source_run": f"{name}_pipeline/{name}_run"})
    (folder / "broken.yaml").write_text("storage_root: [")
    built: dict = {}
    build_pipelines(built, str(folder))  # what the DAG file does; the dag-processor writes them to the DB
    assert "broken_pipeline" in built
    for dag in built.values():  # the pipeline rides in default_args, which no task takes and no trigger form shows
        assert "stagewise_pipeline" not in dag.params
        for task in dag.tasks:
            assert "stagewise_pipeline" not in (getattr(task, "op_kwargs", None) or {}), task.task_id
    publish(built.values())
    client, token = airflow_api(None)
    found = ui.pipelines()  # the broken config's DAGs carry no pipeline
    assert sorted(found) == ["cnn", "ml"] and found["ml"].config.storage_root == str(roots["ml"])
    assert found["ml"].dag_ids == tuple(sorted(f"ml_{kind}" for kind in KINDS))
    bearer = {"Authorization": f"Bearer {token}"}
    listing = client.get("/stagewise/", headers=bearer).text
    assert "ml_run" in listing and "cnn_run" in listing and "0.81" in listing and "0.82" in listing
    for name in roots:
        page = client.get(f"/stagewise/runs/{name}_pipeline/{name}_run", headers=bearer)
        assert page.status_code == 200 and f"data-stagewise-run-id='{name}_run'" in page.text
    assert client.get("/stagewise/runs/cnn_pipeline/ml_run", headers=bearer).status_code == 404
    models = client.get("/stagewise/registry", headers=bearer).text
    for name in roots:
        assert f"data-stagewise-model='{name}_model'" in models and f"pipeline <b>{name}</b>" in models


def two_pipelines(tmp_path: Path, lake: dict) -> Path:
    """Pipeline ``ml`` on local storage with a finished run and a registered model, and pipeline ``lake`` with the
    ``lake`` config keys (an S3 storage); both published. Returns ml's storage root."""
    local = tmp_path / "ml_root"
    write_run(str(local), RUN_ID, test_accuracy=0.9123)
    model = tmp_path / "ml.pt"
    model.write_bytes(b"weights")
    registry.register(str(local), "ml_model", str(model), {"test_accuracy": 0.9, "objective": "accuracy",
                                                           "source_run": f"ml_pipeline/{RUN_ID}"})
    publish_pipelines(tmp_path / "pipelines", {
        "ml": {**base_config(local), "registry": {"model_name": "ml_model"}},
        "lake": {**base_config(tmp_path / "unused"), "registry": {"model_name": "lake_model"}, **lake}})
    return local


LAKE_ROOT = "s3://stagewise-ui-lake/team"


def assert_degraded_in_place(client, token, error: str, *hidden: str) -> None:
    """Both pages answer 200 with ml's rows and lake's named error in place of lake's; the lake's run page answers 503
    naming the error; no answer holds any of ``hidden`` (endpoints, keys), no error a storage path."""
    import html
    import re

    bearer = {"Authorization": f"Bearer {token}"}
    listing, models = client.get("/stagewise/", headers=bearer), client.get("/stagewise/registry", headers=bearer)
    lake_run = client.get("/stagewise/runs/lake_pipeline/some_run", headers=bearer)
    assert listing.status_code == 200 and RUN_ID in listing.text and "0.9123" in listing.text, listing.text
    assert models.status_code == 200 and "data-stagewise-model='ml_model'" in models.text, models.text
    shown = [lake_run.text]
    for answer in (listing, models):
        shown += [html.unescape(text) for text in
                  re.findall(r"data-stagewise-storage-error='lake'>storage error</span> ([^<]*)<", answer.text)]
        assert error in shown[-1], answer.text
    assert lake_run.status_code == 503 and error in lake_run.text, lake_run.text
    assert not [text for text in shown if "stagewise-ui-lake" in text or "/runs/" in text], shown
    for answer in (listing, models, lake_run):
        for value in hidden:
            assert value not in answer.text, value


def test_an_s3_pipeline_without_credentials_degrades_only_its_own_rows(airflow_api, tmp_path, no_aws_credentials):
    """No connection and no AWS credentials in the api-server (as docs/services.md sets S3 up, for the workers):
    the runs and registry pages show "pipeline lake: storage unreachable: NoCredentialsError" where lake's rows
    would be, and ml's rows as usual; a connection that does not exist is named the same way."""
    two_pipelines(tmp_path, {"storage_root": LAKE_ROOT})
    client, token = airflow_api(None)
    assert_degraded_in_place(client, token, "pipeline lake: storage unreachable: NoCredentialsError")
    two_pipelines(tmp_path, {"storage_root": LAKE_ROOT, "storage_conn_id": "lake_gone"})
    assert_degraded_in_place(client, token, "pipeline lake: storage connection 'lake_gone' does not exist")


class FakeS3:
    """An S3 endpoint on 127.0.0.1 that refuses every request (403 AccessDenied) and records who asked; ``stall``:
    one that accepts connections and never answers."""

    def __init__(self, stall: bool = False):
        import socket
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.authorizations: list[str] = []
        if stall:
            self.sock = socket.socket()
            self.sock.bind(("127.0.0.1", 0))
            self.sock.listen(16)  # the kernel accepts; nobody reads
            self.url, self.server = f"http://127.0.0.1:{self.sock.getsockname()[1]}", None
            return
        calls = self.authorizations

        class Refuse(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's name
                calls.append(self.headers.get("Authorization", ""))
                body = b"<Error><Code>AccessDenied</Code><Message>Access Denied</Message></Error>"
                self.send_response(403)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_HEAD = do_GET  # noqa: N815

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Refuse)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
        else:
            self.sock.close()


def test_each_pipeline_reads_its_storage_with_its_own_connection(airflow_api, tmp_path, monkeypatch):
    """Pipeline lake's storage_conn_id names an aws connection whose extra points at this test's endpoint: the pages'
    requests go there, signed with that connection's key, and the api-server's environment stays as it was (no AWS_*
    variable set); the endpoint refuses them, so lake's rows show its error while ml's render."""
    import os

    endpoint = FakeS3()
    key, secret = "AKIASTAGEWISEUITEST1", "ui-test-secret-" + "x" * 24
    monkeypatch.setenv("AIRFLOW_CONN_LAKE_S3", json.dumps({"conn_type": "aws", "login": key, "password": secret,
                                                           "extra": {"endpoint_url": endpoint.url,
                                                                     "region_name": "eu-west-1"}}))
    before = {name: value for name, value in os.environ.items() if name.startswith("AWS_")}
    try:
        two_pipelines(tmp_path, {"storage_root": LAKE_ROOT, "storage_conn_id": "lake_s3"})
        client, token = airflow_api(None)
        assert_degraded_in_place(client, token, "pipeline lake: storage unreachable: PermissionError",
                                 endpoint.url, key, secret)
    finally:
        endpoint.close()
    assert endpoint.authorizations and all(f"Credential={key}/" in auth and "/eu-west-1/s3/" in auth
                                           for auth in endpoint.authorizations), endpoint.authorizations
    assert {name: value for name, value in os.environ.items() if name.startswith("AWS_")} == before


def test_a_slow_storage_is_cut_at_the_deadline(airflow_api, tmp_path, monkeypatch):
    """An S3 endpoint that accepts and never answers: each page waits the deadline at most, once for all pipelines,
    then shows lake's "no answer" in place and ml's rows."""
    import threading
    import time

    from stagewise.airflow.ui import storage_access

    monkeypatch.setattr(storage_access, "STORAGE_DEADLINE_S", 0.5)
    endpoint = FakeS3(stall=True)
    monkeypatch.setenv("AIRFLOW_CONN_LAKE_S3", json.dumps({"conn_type": "aws", "login": "AKIASTALL", "password": "s",
                                                           "extra": {"endpoint_url": endpoint.url}}))
    try:
        two_pipelines(tmp_path, {"storage_root": LAKE_ROOT, "storage_conn_id": "lake_s3"})
        client, token = airflow_api(None)
        started = time.monotonic()
        assert_degraded_in_place(client, token, "pipeline lake: storage unreachable: no answer within 0.5 s",
                                 endpoint.url)
        assert time.monotonic() - started < 3 * 2.0  # three pages, each cut at 0.5 s (+ the page's own work)
    finally:
        endpoint.close()  # the reads left behind now fail at once: let them end inside this test
        for thread in threading.enumerate():
            if thread.name.startswith("stagewise-ui-storage-"):
                thread.join(10)


def test_the_ui_cookie_is_a_login_too(airflow_api, storage_root):
    """The UI's iframe sends no Authorization header, only Airflow's _token cookie: that must be enough."""
    write_run(str(storage_root), RUN_ID)
    client, token = airflow_api(str(storage_root))
    client.cookies.set("_token", token)
    assert client.get(f"/stagewise/runs/ml_pipeline/{RUN_ID}").status_code == 200


def test_a_run_with_report_html_serves_it_inside_the_run_page(airflow_api, storage_root):
    """When the report step wrote report.html, the run page frames it and /report.html serves its bytes unchanged."""
    html = "<!doctype html><html><body><div id='charts' data-stagewise-section='charts'>plots</div></body></html>"
    write_run(str(storage_root), RUN_ID, html=html)
    client, token = airflow_api(str(storage_root))
    bearer = {"Authorization": f"Bearer {token}"}
    page = client.get(f"/stagewise/runs/ml_pipeline/{RUN_ID}", headers=bearer)
    assert "data-stagewise-report='html'" in page.text
    assert f'src="/stagewise/runs/ml_pipeline/{storage.safe_name(RUN_ID)}/report.html"' in page.text
    served = client.get(f"/stagewise/runs/ml_pipeline/{RUN_ID}/report.html", headers=bearer)
    assert served.status_code == 200 and served.text == html
    assert served.headers["content-type"].startswith("text/html")


def test_registry_page_shows_versions_current_history_and_cards(airflow_api, storage_root, tmp_path):
    """Both versions with their cards, the promoted one marked current, the history in order, the source run linked."""
    first, second = register_two_versions(str(storage_root), tmp_path)
    client, token = airflow_api(str(storage_root))
    page = client.get("/stagewise/registry", headers={"Authorization": f"Bearer {token}"})
    assert page.status_code == 200, page.text
    text = page.text
    assert first in text and second in text
    assert f"<span class='badge cur mono'>{second}</span>" in text
    assert f"<span class='mono'>{first}</span> → <span class='mono'>{second}</span>" in text  # history, oldest first
    assert text.count("<summary>Card of") == 2 and "weights" not in text
    assert f'href="/stagewise/runs/ml_pipeline/{storage.safe_name(RUN_ID)}"' in text


def test_a_pipeline_on_the_mlflow_registry_is_linked_there_without_asking_the_server(airflow_api, storage_root):
    """Its versions live in MLflow: the registry page links the model's MLflow page and never waits on the server
    (nothing listens at this address)."""
    client, token = airflow_api(str(storage_root), tracking={"mlflow_uri": "http://127.0.0.1:9"},
                                registry={"backend": "mlflow", "model_name": "digits_mlflow"})
    page = client.get("/stagewise/registry", headers={"Authorization": f"Bearer {token}"})
    assert page.status_code == 200, page.text
    assert "data-stagewise-mlflow-model='digits_mlflow'" in page.text
    assert 'href="http://127.0.0.1:9/#/models/digits_mlflow"' in page.text


@pytest.mark.parametrize("torn", ["card.json", "current.json"])
def test_a_torn_registry_file_is_shown_with_its_error_and_hides_nothing_else(airflow_api, storage_root, tmp_path, torn):
    """A cut card.json or current.json answers 200, not 500: the error names the file, the other versions still show."""
    first, second = register_two_versions(str(storage_root), tmp_path)
    folder = storage_root / "models" / "digits"
    target = folder / second / "card.json" if torn == "card.json" else folder / "current.json"
    target.write_bytes(target.read_bytes()[:20])
    client, token = airflow_api(str(storage_root))
    page = client.get("/stagewise/registry", headers={"Authorization": f"Bearer {token}"})
    assert page.status_code == 200, page.text
    assert f"{target}: is not valid JSON" in page.text and first in page.text and second in page.text


def test_a_tracked_run_links_its_mlflow_run_and_model_version_and_names_its_gaps(airflow_api, storage_root):
    """With tracking on, the run page's header links to the MLflow run and model version (http(s) only) and names each
    task whose tracking had a gap; the report's own page carries the same links."""
    tracking = {"run_url": "http://mlflow.team:5000/#/experiments/1/runs/abc",
                "model_version_url": "http://mlflow.team:5000/#/models/digits/versions/3", "model_version_label": "digits v3",
                "gaps": [{"task": "train_s2", "error": "ConnectionError", "dropped_calls": 4}]}
    write_run(str(storage_root), RUN_ID, html=None, tracking=tracking)
    write_run(str(storage_root), "odd", html=None, tracking={"run_url": "javascript:alert(1)", "gaps": []})
    client, token = airflow_api(str(storage_root))
    bearer = {"Authorization": f"Bearer {token}"}
    page = client.get(f"/stagewise/runs/ml_pipeline/{RUN_ID}", headers=bearer).text
    assert 'data-stagewise-link="mlflow-run" href="http://mlflow.team:5000/#/experiments/1/runs/abc"' in page
    assert 'href="http://mlflow.team:5000/#/models/digits/versions/3"' in page and "MLflow model digits v3" in page
    assert "tracking gap in train_s2" in page
    assert "javascript:" not in client.get("/stagewise/runs/ml_pipeline/odd", headers=bearer).text
    out = storage.run_prefix(str(storage_root), "ml_pipeline", RUN_ID)
    report.write_html(report.read_report(storage.join(out, "report.json")), out)
    html = storage.read_bytes(storage.join(out, "report.html")).decode()
    assert 'href="http://mlflow.team:5000/#/models/digits/versions/3"' in html and "tracking gap in train_s2" in html


def test_values_from_storage_are_escaped(airflow_api, storage_root):
    """A run id carrying markup shows as text in the list and on its page; it never becomes an element."""
    write_run(str(storage_root), ODD_RUN_ID)
    client, token = airflow_api(str(storage_root))
    bearer = {"Authorization": f"Bearer {token}"}
    listing = client.get("/stagewise/", headers=bearer).text
    assert "<img src=x" not in listing and "&lt;img src=x onerror=alert(1)&gt;" in listing
    page = client.get(f"/stagewise/runs/ml_pipeline/{storage.safe_name(ODD_RUN_ID)}", headers=bearer)
    assert page.status_code == 200 and "<img src=x" not in page.text and "&lt;img" in page.text


@pytest.mark.parametrize("path", ["/stagewise/runs/%2E%2E/secret", "/stagewise/runs/ml_pipeline/%2E%2E",
                                  "/stagewise/runs/..%5C..%5Csecret/x", "/stagewise/runs/%2E%2E/secret/report.json",
                                  "/stagewise/runs/ml_pipeline/..%2F..%2Fsecret"])
def test_ids_cannot_walk_out_of_the_runs_folder(airflow_api, storage_root, path):
    """'..', '/' and '\\' in a DAG or run id are refused (400) or match no page (404); the file outside never shows."""
    write_run(str(storage_root), RUN_ID)
    storage.write_json(str(storage_root / "secret" / "report.json"), {"dag_id": "ml_pipeline", "run_id": "SECRET-RUN"})
    client, token = airflow_api(str(storage_root))
    answer = client.get(path, headers={"Authorization": f"Bearer {token}"})
    assert answer.status_code in (400, 404), answer.text
    assert "SECRET-RUN" not in answer.text


@pytest.mark.service
def test_reports_under_an_s3_root(airflow_api, s3_bucket, tmp_path):
    """The same pages read through stagewise.core.storage from an s3:// storage root (moto), registry included."""
    root = f"{s3_bucket}/stagewise"
    write_run(root, RUN_ID, test_accuracy=0.8642, html="<html><body>from s3</body></html>")
    first, second = register_two_versions(root, tmp_path)
    client, token = airflow_api(root)
    bearer = {"Authorization": f"Bearer {token}"}
    listing = client.get("/stagewise/", headers=bearer)
    assert listing.status_code == 200 and RUN_ID in listing.text and "0.8642" in listing.text
    assert "data-stagewise-report='html'" in client.get(f"/stagewise/runs/ml_pipeline/{RUN_ID}", headers=bearer).text
    assert client.get(f"/stagewise/runs/ml_pipeline/{RUN_ID}/report.html", headers=bearer).text == \
        "<html><body>from s3</body></html>"
    registry_page = client.get("/stagewise/registry", headers=bearer).text
    assert first in registry_page and f"<span class='badge cur mono'>{second}</span>" in registry_page


def test_the_list_rereads_a_report_only_when_it_changed(airflow_api, storage_root):
    """Reports are cached by their modification time: a rewritten report.json shows its new values at once."""
    import os

    out = write_run(str(storage_root), RUN_ID, test_accuracy=0.5111)
    client, token = airflow_api(str(storage_root))
    bearer = {"Authorization": f"Bearer {token}"}
    assert "0.5111" in client.get("/stagewise/", headers=bearer).text
    report_file = Path(out) / "report.json"
    rewritten = json.loads(report_file.read_text())
    rewritten["objective"]["test"] = 0.6222
    report_file.write_text(json.dumps(rewritten))
    later = report_file.stat().st_mtime + 5
    os.utime(report_file, (later, later))
    listing = client.get("/stagewise/", headers=bearer).text
    assert "0.6222" in listing and "0.5111" not in listing


def test_a_user_without_read_access_to_a_dag_sees_none_of_its_runs(airflow_api, storage_root, monkeypatch):
    """The auth manager decides per DAG: its runs leave the list and their pages answer 403, existing or not."""
    from airflow.api_fastapi.app import get_auth_manager

    write_run(str(storage_root), RUN_ID)
    client, token = airflow_api(str(storage_root))
    manager = get_auth_manager()
    monkeypatch.setattr(manager, "is_authorized_dag", lambda *, method, access_entity=None, details=None, user:
                        details is None or details.id != "ml_pipeline")
    bearer = {"Authorization": f"Bearer {token}"}
    assert RUN_ID not in client.get("/stagewise/", headers=bearer).text
    for path in (RUN_ID, f"{RUN_ID}/report.json", "no_such_run"):
        assert client.get(f"/stagewise/runs/ml_pipeline/{path}", headers=bearer).status_code == 403


def test_a_user_denied_a_pipelines_dags_sees_no_card_of_its_model(airflow_api, storage_root, tmp_path, monkeypatch):
    """The registry page shows a model only to users who may read a DAG that writes it: denied every DAG of pipeline
    ml, a user gets the page without digits' section, versions, cards or storage path; allowed one of them (its
    retrain DAG), the model is back."""
    from airflow.api_fastapi.app import get_auth_manager

    first, second = register_two_versions(str(storage_root), tmp_path)
    client, token = airflow_api(str(storage_root))
    manager = get_auth_manager()
    denied: set[str] = {f"ml_{kind}" for kind in KINDS}  # every DAG of pipeline ml
    monkeypatch.setattr(manager, "is_authorized_dag", lambda *, method, access_entity=None, details=None, user:
                        details is None or details.id not in denied)
    bearer = {"Authorization": f"Bearer {token}"}
    page = client.get("/stagewise/registry", headers=bearer)
    assert page.status_code == 200, page.text
    for hidden in ("data-stagewise-model", first, second, "Card of", str(storage_root)):
        assert hidden not in page.text
    denied.discard("ml_retrain")
    page = client.get("/stagewise/registry", headers=bearer)
    assert "data-stagewise-model='digits'" in page.text and first in page.text and second in page.text


def test_a_model_no_pipeline_registers_shows_only_to_readers_of_the_dags_its_versions_came_from(
        airflow_api, storage_root, tmp_path, monkeypatch):
    """A model left by a renamed pipeline has no pipeline's DAGs: its versions' source DAGs decide who sees it."""
    from airflow.api_fastapi.app import get_auth_manager

    register_two_versions(str(storage_root), tmp_path)
    client, token = airflow_api(str(storage_root), registry={"model_name": "renamed"})
    manager = get_auth_manager()
    bearer = {"Authorization": f"Bearer {token}"}
    assert "data-stagewise-model='digits'" in client.get("/stagewise/registry", headers=bearer).text
    monkeypatch.setattr(manager, "is_authorized_dag", lambda *, method, access_entity=None, details=None, user:
                        details is None or details.id != "ml_pipeline")
    assert "data-stagewise-model='digits'" not in client.get("/stagewise/registry", headers=bearer).text


@pytest.mark.parametrize(("path", "login", "status"), [
    ("/stagewise/", "admin", 200), (f"/stagewise/runs/ml_pipeline/{RUN_ID}", "admin", 200),
    (f"/stagewise/runs/ml_pipeline/{RUN_ID}/report.html", "admin", 200),
    (f"/stagewise/runs/ml_pipeline/{RUN_ID}/report.json", "admin", 200), ("/stagewise/registry", "admin", 200),
    ("/stagewise/runs/ml_pipeline/no_such_run", "admin", 404), ("/stagewise/no_such_page", "admin", 404),
    ("/stagewise/runs/ml_pipeline/%2E%2E", "admin", 400), (f"/stagewise/runs/ml_pipeline/{RUN_ID}", None, 401),
    (f"/stagewise/runs/ml_pipeline/{RUN_ID}/report.html", "forged", 403)])
def test_every_answer_carries_the_security_headers(airflow_api, storage_root, path, login, status):
    """Pages, report.html, report.json and the 400/401/403/404 errors alike: no MIME sniffing, no referrer outside the
    origin, and a CSP that fetches nothing by default and lets only Airflow's own pages frame the answer."""
    write_run(str(storage_root), RUN_ID, html=REPORT_PAGE)
    client, token = airflow_api(str(storage_root))
    headers = {"Authorization": f"Bearer {token if login == 'admin' else 'not.a.jwt'}"} if login else {}
    answer = client.get(path, headers=headers)
    assert answer.status_code == status, answer.text
    assert answer.headers["x-content-type-options"] == "nosniff"
    assert answer.headers["referrer-policy"] == "same-origin"
    policy = csp_directives(answer)
    assert policy["default-src"] == "'none'" and policy["frame-ancestors"] == "'self'", policy
    assert policy["base-uri"] == "'none'" and "unsafe-eval" not in answer.headers["content-security-policy"]


def test_pages_allow_no_script_and_only_their_own_style(airflow_api, storage_root, tmp_path):
    """The runs list, a run page and the registry run no script at all (none is allowed) and allow exactly their one
    inline <style>, by its hash: markup slipped into a page could neither run nor restyle it; the page's style applies."""
    import base64
    import hashlib
    import re

    write_run(str(storage_root), RUN_ID, html=REPORT_PAGE)
    register_two_versions(str(storage_root), tmp_path)
    client, token = airflow_api(str(storage_root))
    for path in ("/stagewise/", f"/stagewise/runs/ml_pipeline/{RUN_ID}", "/stagewise/registry"):
        answer = client.get(path, headers={"Authorization": f"Bearer {token}"})
        assert answer.status_code == 200, answer.text
        styles = re.findall(r"<style>(.*?)</style>", answer.text, re.S)
        assert len(styles) == 1 and "<script" not in answer.text and " style=" not in answer.text
        digest = base64.b64encode(hashlib.sha256(styles[0].encode()).digest()).decode()
        policy = csp_directives(answer)
        assert "script-src" not in policy and policy["style-src"] == f"'sha256-{digest}'", policy
        assert policy["frame-src"] == "'self'"


def test_report_html_runs_sandboxed_framed_or_opened_alone(airflow_api, storage_root):
    """report.html's inline scripts run in an opaque origin, never Airflow's: the run page frames it sandboxed without
    allow-same-origin, and report.html's own CSP sandboxes it when opened on its own; no request leaves it."""
    import re

    write_run(str(storage_root), RUN_ID, html=REPORT_PAGE)
    client, token = airflow_api(str(storage_root))
    bearer = {"Authorization": f"Bearer {token}"}
    frame = re.search(r'<iframe id="stagewise-report"[^>]*>', client.get(f"/stagewise/runs/ml_pipeline/{RUN_ID}",
                                                                         headers=bearer).text).group(0)
    assert 'sandbox="allow-scripts allow-downloads"' in frame, frame  # no allow-same-origin
    served = client.get(f"/stagewise/runs/ml_pipeline/{RUN_ID}/report.html", headers=bearer)
    assert served.status_code == 200 and served.text == REPORT_PAGE
    policy = csp_directives(served)
    assert policy["sandbox"].split() == ["allow-scripts", "allow-downloads"], policy
    assert policy["script-src"] == "'unsafe-inline'" and policy["default-src"] == "'none'" and "connect-src" not in policy


def test_errors_name_what_is_missing_not_where_storage_is(airflow_api, storage_root, tmp_path):
    """A 404 names the run and its DAG, or the missing report.html; no error body holds the storage root or a path
    under it (they go to the api-server's log)."""
    write_run(str(storage_root), RUN_ID)  # report.json only
    client, token = airflow_api(str(storage_root))
    bearer = {"Authorization": f"Bearer {token}"}
    missing = client.get("/stagewise/runs/ml_pipeline/no_such_run/report.json", headers=bearer)
    assert missing.status_code == 404 and "no_such_run" in missing.text and "ml_pipeline" in missing.text
    no_page = client.get(f"/stagewise/runs/ml_pipeline/{RUN_ID}/report.html", headers=bearer)
    assert no_page.status_code == 404 and "report.html" in no_page.text
    for answer in (missing, no_page):
        assert str(tmp_path) not in answer.text and "/runs/" not in answer.text, answer.text
