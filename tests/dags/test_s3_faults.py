"""ml_pipeline on an S3 endpoint that throttles, errs and drops connections, reached through an Airflow connection."""

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


def test_ml_pipeline_rides_out_s3_faults_with_credentials_from_a_connection(s3_endpoint, tmp_path):
    """The run succeeds through every fault kind and an outage; each row is predicted exactly once; no secret leaks."""
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
    assert report["test_accuracy"] > 0.9
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
    assert secret not in json.dumps(report)
