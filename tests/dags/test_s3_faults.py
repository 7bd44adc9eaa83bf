"""ml_pipeline with its storage root on s3://, through s3fs against a real S3 HTTP endpoint that throttles, errs and
drops connections, reached through an Airflow connection.

One run guards both the plain S3 path (every stage reads and writes s3://, the report, its page and the registry land
there) and riding out the faults; credentials from the environment instead of a connection are covered by
tests/plugins/test_credentials.py and the sub-job tests of tests/tasks/test_storage_s3.py.
"""

from __future__ import annotations

import json
import os
import re

import pytest

from tests.dags.conftest import airflow, make_airflow_env
from tests.s3_faults import FAULT_KINDS, FaultPlan, FaultyS3

pytestmark = [pytest.mark.airflow, pytest.mark.torchrun, pytest.mark.service]

BUCKET = "stagewise-faults"
# A fault on every 6th request, cycling through all kinds, plus a 10 s outage once the run is under way
# (about a third of a clean run's requests): longer than botocore's default 5 attempts ride out.
FAULTS = FaultPlan(every=6, outage_after=400, outage_s=10.0)


@pytest.mark.slow
def test_ml_pipeline_runs_on_s3_through_faults_with_credentials_from_a_connection(s3_endpoint, tmp_path):
    """The run succeeds through every fault kind and an outage with every output on S3; each row is predicted exactly
    once; no secret leaks into logs, report or page."""
    import pyarrow.parquet as pq
    import s3fs

    direct = s3fs.S3FileSystem(key=s3_endpoint["AWS_ACCESS_KEY_ID"], secret=s3_endpoint["AWS_SECRET_ACCESS_KEY"],
                               client_kwargs={"endpoint_url": s3_endpoint["AWS_ENDPOINT_URL"]}, skip_instance_cache=True)
    direct.mkdir(BUCKET)
    with FaultyS3(s3_endpoint["AWS_ENDPOINT_URL"], FAULTS) as proxy:
        connection = {"conn_type": "aws", "login": s3_endpoint["AWS_ACCESS_KEY_ID"],
                      "password": s3_endpoint["AWS_SECRET_ACCESS_KEY"],
                      "extra": {"endpoint_url": proxy.url, "region_name": s3_endpoint["AWS_DEFAULT_REGION"]}}
        home = tmp_path / "home"
        home.mkdir()
        # Only the demo-data writer gets AWS variables: Airflow and the sub-jobs must use the connection.
        env = make_airflow_env(home, f"s3://{BUCKET}/root", tmp_path, config={"storage_conn_id": "stagewise_s3"},
                               extra={"AIRFLOW_CONN_STAGEWISE_S3": json.dumps(connection)}, data_env=s3_endpoint)
        env = {k: v for k, v in env.items() if not k.startswith("AWS_")}
        proxy.requests = 0  # the outage counts from the pipeline's first request
        result = airflow(env, "dags", "test", "ml_pipeline", "-c", json.dumps({"num_trials": 4, "stage_epochs": {"s1": 4, "s2": 3}}))
        injected = dict(proxy.injected)
        requests = proxy.requests

    print(f"{requests} S3 requests through the proxy; faults injected: {injected}")
    assert all(injected.get(kind, 0) > 0 for kind in FAULT_KINDS), f"not every fault kind happened: {injected}"
    assert injected.get("outage", 0) > 0, f"the outage never started ({requests} requests): {injected}"

    reports = direct.glob(f"{BUCKET}/root/runs/ml_pipeline/*/report.json")
    assert len(reports) == 1
    report = json.loads(direct.cat(reports[0]))
    assert report["model_uri"].startswith(f"s3://{BUCKET}/root/") and report["test_accuracy"] > 0.9
    assert report["predictions"]["rows"] == 1797 and report["predictions"]["uri"].startswith("s3://")
    assert direct.exists(f"{BUCKET}/root/models/digits/current.json")
    # report.html is beside report.json on S3, with every task attempt the timeline hooks recorded through s3fs.
    assert report["html_uri"] == "s3://" + reports[0].rsplit("/", 1)[0] + "/report.html"
    page = direct.cat(report["html_uri"]).decode()
    assert 'data-figure="fig-timeline"' in page
    assert {t["task_id"] for t in report["tasks"]} >= {"start_run", "sweep_worker", "train_s1", "train_s2", "report"}
    manifest = json.loads(direct.cat(report["predictions"]["uri"]))
    keys = []
    for entry in manifest["files"]:
        with direct.open(entry["uri"], "rb") as handle:
            table = pq.read_table(handle)
        assert table.num_rows == entry["rows"], f"{entry['uri']} does not hold the rows its manifest lists"
        keys += table.column("row_id").to_pylist()
    assert len(keys) == len(set(keys)) == 1797, "every row predicted exactly once"
    prefix = os.path.dirname(report["predictions"]["uri"].removeprefix("s3://"))
    stored = {f"s3://{p}" for p in direct.glob(f"{prefix}/*.parquet")}
    assert stored == {entry["uri"] for entry in manifest["files"]}, "no stray or duplicate prediction objects"

    assert re.search(r"S3 \w+ attempt \d+ of 10 failed \(50[03]", result.stdout + result.stderr), \
        "failed S3 attempts are not visible in the task log"
    secret = s3_endpoint["AWS_SECRET_ACCESS_KEY"]
    assert secret not in result.stdout + result.stderr, "the secret key reached the logs"
    assert secret not in json.dumps(report) and secret not in page
