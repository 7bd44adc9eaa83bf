"""`airflow dags test` of the diabetes regressor (a user's own spec, minimizing rmse) tracked in a real MLflow server
with MLflow's Model Registry as the registry, then batch inference from `models:/<name>@champion`; MLflow's official
client reads everything back. The server's credentials come from an Airflow connection and appear nowhere in MLflow."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.dags.conftest import REPO_ROOT, airflow, make_airflow_env

pytestmark = [pytest.mark.airflow, pytest.mark.torchrun, pytest.mark.service]

EXPERIMENT, MODEL = "diabetes-e2e", "diabetes_e2e"
SECRET = "s3cr3t-mlflow-pw-7Qx"  # distinctive, so any leak into MLflow is found


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory, mlflow_server) -> dict:
    """One diabetes pipeline run (3 trials, one worker) and one batch inference run, both against the server."""
    base = REPO_ROOT / "examples" / "diabetes.yaml"
    registry = {**yaml.safe_load(base.read_text()).get("registry", {}), "backend": "mlflow", "model_name": MODEL}
    storage_root = tmp_path_factory.mktemp("mlflow_storage")
    connection = json.dumps({"conn_type": "http", "login": "stagewise", "password": SECRET})
    env = make_airflow_env(tmp_path_factory.mktemp("mlflow_home"), str(storage_root), storage_root, base_config=base,
                           extra={"AIRFLOW_CONN_MLFLOW_TEAM": connection},
                           config={"registry": registry, "tracking": {"mlflow_uri": mlflow_server.uri,
                                                                      "experiment": EXPERIMENT, "conn_id": "mlflow_team"}})
    pipeline = airflow(env, "dags", "test", "diabetes_pipeline", "-c", json.dumps({"num_trials": 3, "num_sweep_workers": 1}))
    inference = airflow(env, "dags", "test", "diabetes_batch_inference")
    reports = {path.parent.parent.name: json.loads(path.read_text())
               for path in storage_root.glob("runs/diabetes_*/*/report.json")}
    return {"report": reports["diabetes_pipeline"], "inference": reports["diabetes_batch_inference"],
            "logs": pipeline.stdout + pipeline.stderr + inference.stdout + inference.stderr}


@pytest.fixture(scope="module")
def mlflow_view(tracked_run, mlflow_server) -> dict:
    """Everything MLflow's own client reads back: the runs with their tags, params and metric histories, the artifacts,
    the model version and its aliases."""
    return mlflow_server.client(f"""
        exp = client.get_experiment_by_name({EXPERIMENT!r}).experiment_id
        runs = client.search_runs([exp], max_results=1000)
        def history(run):
            return {{key: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]
                    for key in run.data.metrics}}
        def files(run_id, path=None):
            found = []
            for item in client.list_artifacts(run_id, path):
                found += files(run_id, item.path) if item.is_dir else [item.path]
            return found
        champion = client.get_model_version_by_alias({MODEL!r}, "champion")
        challenger = client.get_model_version_by_alias({MODEL!r}, "challenger")
        emit({{"runs": [{{"id": r.info.run_id, "status": r.info.status, "tags": r.data.tags, "params": r.data.params,
                        "history": history(r), "files": files(r.info.run_id)}} for r in runs],
              "champion": {{"version": champion.version, "run_id": champion.run_id, "tags": champion.tags}},
              "challenger": challenger.version,
              "texts": [open(client.download_artifacts(r.info.run_id, path)).read()
                        for r in runs for path in files(r.info.run_id) if path.endswith((".yaml", ".json", ".txt", "MLmodel"))]}})
    """)


def _kind(view: dict, kind: str) -> list[dict]:
    return [run for run in view["runs"] if run["tags"].get("stagewise.kind") == kind]


def test_one_parent_run_holds_the_config_the_report_the_test_metrics_and_the_gate(tracked_run, mlflow_view):
    """The DAG run's parent run is tagged (pipeline, dag, run, config hash, code version), holds config.yaml and the
    report, the test metrics and the gate's decision, and ended FINISHED."""
    report = tracked_run["report"]
    (parent,) = [run for run in _kind(mlflow_view, "pipeline") if run["tags"]["stagewise.dag_id"] == "diabetes_pipeline"]
    tags = parent["tags"]
    assert (tags["stagewise.pipeline"], tags["stagewise.run_id"]) == ("diabetes", report["run_id"])
    assert tags["stagewise.config_hash"] == report["config"]["config_hash"] and tags["stagewise.code_version"]
    assert {"config.yaml", "report.html", "report.json"} <= set(parent["files"])
    assert parent["history"]["test_rmse"][0][1] == pytest.approx(report["test_metrics"]["test_rmse"])
    assert tags["stagewise.gate"] == "promoted" and parent["status"] == "FINISHED"
    assert report["tracking"]["run_id"] == parent["id"] and report["tracking"]["gaps"] == []
    assert report["tracking"]["run_url"].endswith(parent["id"]) and "/versions/" in report["tracking"]["model_version_url"]


def test_trials_and_stages_are_nested_runs_with_their_curves(tracked_run, mlflow_view):
    """Each trial: params, the objective per epoch, its final state; each stage: world size, global batch, lr and per
    epoch loss, val_rmse, samples/s and lr on one step axis across stages."""
    report = tracked_run["report"]
    parent_id = report["tracking"]["run_id"]
    trials, stages = _kind(mlflow_view, "trial"), _kind(mlflow_view, "stage")
    assert len(trials) == report["sweep"]["n_trials"] == 3
    assert all(run["tags"]["mlflow.parentRunId"] == parent_id for run in trials + stages)
    for run in trials:
        assert run["tags"]["stagewise.state"] in ("COMPLETE", "PRUNED") and "lr" in run["params"]
        assert [step for step, _ in run["history"]["val_rmse"]] == list(range(1, len(run["history"]["val_rmse"]) + 1))
    by_stage = {run["tags"]["stagewise.stage"]: run for run in stages}
    last_step = 0
    for trained in report["training"]:
        run = by_stage[trained["stage"]]
        assert int(run["params"]["world_size"]) == trained["world_size"]
        assert int(run["params"]["global_batch"]) == trained["global_batch"]
        assert float(run["params"]["stage_lr"]) == pytest.approx(trained["lr"])
        steps = [step for step, _ in run["history"]["loss"]]
        assert steps[0] > last_step and steps[-1] == last_step + trained["steps"]
        assert {"val_rmse", "samples_per_s", "lr"} <= set(run["history"])
        last_step = steps[-1]


def test_the_version_is_champion_and_batch_inference_scored_with_it(tracked_run, mlflow_view):
    """register_model made a version linked to the parent run; the gate (no champion before) moved champion and
    challenger to it; batch_inference resolved models:/<name>@champion and scored every row with those bytes."""
    report, inference = tracked_run["report"], tracked_run["inference"]
    champion = mlflow_view["champion"]
    assert champion["run_id"] == report["tracking"]["run_id"] and mlflow_view["challenger"] == champion["version"]
    assert champion["tags"]["stagewise.version"] == report["registry"]["version"] == inference["model_version"]
    assert champion["tags"]["stagewise.gate"] == "promoted" and float(champion["tags"]["test_rmse"]) > 0
    assert inference["predictions"]["rows"] > 0 and "/versions/" in inference["tracking"]["model_version_url"]
    (served,) = [run for run in _kind(mlflow_view, "pipeline") if run["tags"]["stagewise.dag_id"] == "diabetes_batch_inference"]
    assert served["status"] == "FINISHED" and {"config.yaml", "report.json"} <= set(served["files"])
    assert "models:/" not in inference["model_uri"] and inference["model_uri"].endswith(f"{inference['model_version']}.pt")


def test_no_credential_reaches_a_param_tag_artifact_or_log(tracked_run, mlflow_view):
    """The connection's password went to the sub-jobs as MLFLOW_TRACKING_PASSWORD only: no MLflow param, tag or text
    artifact holds it, and Airflow masked it in the task logs."""
    values = [value for run in mlflow_view["runs"] for value in [*run["params"].values(), *run["tags"].values()]]
    assert values and not [value for value in values if SECRET in value]
    assert mlflow_view["texts"] and not [text for text in mlflow_view["texts"] if SECRET in text]
    assert SECRET not in tracked_run["logs"]
    assert SECRET not in Path(tracked_run["report"]["run_prefix"], "config.yaml").read_text()
