"""The same DAG and config with the storage root on s3://, through s3fs against a real S3 HTTP endpoint."""

from __future__ import annotations

import json

import pytest

from tests.dags.conftest import airflow, make_airflow_env

pytestmark = [pytest.mark.airflow, pytest.mark.torchrun, pytest.mark.service]


def test_ml_pipeline_runs_on_s3_without_leaking_credentials(s3_endpoint, tmp_path):
    """Every stage reads and writes s3:// through s3fs; the report is on S3; the secret appears in no output."""
    import s3fs

    fs = s3fs.S3FileSystem(key=s3_endpoint["AWS_ACCESS_KEY_ID"], secret=s3_endpoint["AWS_SECRET_ACCESS_KEY"],
                           client_kwargs={"endpoint_url": s3_endpoint["AWS_ENDPOINT_URL"]})
    fs.mkdir("stagewise-test")
    home = tmp_path / "home"
    home.mkdir()
    env = make_airflow_env(home, "s3://stagewise-test/root", tmp_path, extra=s3_endpoint)
    result = airflow(env, "dags", "test", "ml_pipeline", "-c", json.dumps({"num_trials": 4, "stage_epochs": {"s1": 4, "s2": 3}}))
    reports = fs.glob("stagewise-test/root/runs/ml_pipeline/*/report.json")
    assert len(reports) == 1
    report = json.loads(fs.cat(reports[0]))
    assert report["model_uri"].startswith("s3://stagewise-test/root/") and report["test_accuracy"] > 0.9
    assert report["predictions"]["rows"] == 1797 and report["predictions"]["uri"].startswith("s3://")
    assert fs.exists("stagewise-test/root/models/digits/current.json")
    secret = s3_endpoint["AWS_SECRET_ACCESS_KEY"]
    assert secret not in result.stdout + result.stderr, "the secret key reached the logs"
    assert secret not in json.dumps(report)
    # report.html is beside report.json on S3, with every task attempt the timeline hooks recorded through s3fs.
    assert report["html_uri"] == "s3://" + reports[0].rsplit("/", 1)[0] + "/report.html"
    page = fs.cat(report["html_uri"]).decode()
    assert 'data-figure="fig-timeline"' in page and secret not in page
    assert {t["task_id"] for t in report["tasks"]} >= {"start_run", "sweep_worker", "train_s1", "train_s2", "report"}
