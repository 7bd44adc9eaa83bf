"""What a scoped viewer learns from the runs page's header: the pipelines whose DAGs it may read and the storage roots
that hold them (or runs it may read), never the others' names or roots. The app and fixtures are test_ui_plugin's."""

from __future__ import annotations

from stagewise.definitions.pipelines import KINDS
from tests.conftest import base_config
from tests.plugins import test_ui_plugin
from tests.plugins.test_ui_plugin import publish_pipelines, write_run

airflow_db = test_ui_plugin.airflow_db
airflow_api = test_ui_plugin.airflow_api


def test_the_runs_page_header_names_only_the_pipelines_and_roots_a_scoped_viewer_may_read(airflow_api, tmp_path,
                                                                                        monkeypatch):
    """Pipelines fraud and churn on roots of their own, each with a run: a viewer allowed fraud's DAGs only is told of
    fraud and its root, not of churn nor churn's root; allowed none, it is told it may read no pipeline's runs; an
    admin is told of both."""
    from airflow.api_fastapi.app import get_auth_manager

    roots = {name: tmp_path / f"{name}_root" for name in ("fraud", "churn")}
    for name, root in roots.items():
        write_run(str(root), f"{name}_run", dag_id=f"{name}_pipeline")
    publish_pipelines(tmp_path / "pipelines", {name: {**base_config(root), "registry": {"model_name": f"{name}_model"}}
                                               for name, root in roots.items()})
    client, token = airflow_api(None)
    bearer = {"Authorization": f"Bearer {token}"}
    header = client.get("/stagewise/", headers=bearer).text.split("</p>")[0]
    assert all(str(root) in header and f"({name})" in header for name, root in roots.items()), header

    allowed = {f"fraud_{kind}" for kind in KINDS}
    monkeypatch.setattr(get_auth_manager(), "is_authorized_dag", lambda *, method, access_entity=None, details=None,
                        user: details is None or details.id in allowed)
    text = client.get("/stagewise/", headers=bearer).text
    assert f"<code>{roots['fraud']}/runs/</code> (fraud)" in text and "fraud_run" in text
    assert "churn" not in text and str(roots["churn"]) not in text, text

    allowed.clear()
    text = client.get("/stagewise/", headers=bearer).text
    assert "You may read no Stagewise pipeline's runs." in text
    assert not any(str(root) in text or name in text for name, root in roots.items()), text
