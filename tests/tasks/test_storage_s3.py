"""Storage on a real S3 endpoint (moto) behind a proxy that injects 5xx answers, resets, lost replies and cut bodies."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import pyarrow as pa
import pytest

from stagewise.core import storage
from stagewise.core.errors import UserError
from tests.conftest import REPO_ROOT, base_config, preprocess_digits
from tests.s3_faults import FAULT_KINDS, FaultPlan, FaultyS3


@pytest.fixture
def faulty_s3(s3_endpoint, monkeypatch):
    """A factory: start a fault proxy with a plan, point the AWS environment at it, return it and a fresh bucket."""
    import s3fs

    started = []

    def start(plan: FaultPlan) -> tuple[FaultyS3, str]:
        proxy = FaultyS3(s3_endpoint["AWS_ENDPOINT_URL"], plan).__enter__()
        started.append(proxy)
        for key, value in {**s3_endpoint, "AWS_ENDPOINT_URL": proxy.url}.items():
            monkeypatch.setenv(key, value)
        s3fs.S3FileSystem.clear_instance_cache()  # a cached client would still talk to the last endpoint
        bucket = f"faults-{uuid.uuid4().hex[:10]}"
        s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_endpoint["AWS_ENDPOINT_URL"]}, skip_instance_cache=True).mkdir(bucket)
        return proxy, bucket

    yield start
    for proxy in started:
        proxy.__exit__(None, None, None)
    s3fs.S3FileSystem.clear_instance_cache()


def test_retry_settings_come_from_the_aws_environment(monkeypatch):
    """Standard mode with 10 attempts by default; AWS_RETRY_MODE / AWS_MAX_ATTEMPTS win; bad values name the variable."""
    monkeypatch.delenv("AWS_RETRY_MODE", raising=False)
    monkeypatch.delenv("AWS_MAX_ATTEMPTS", raising=False)
    assert storage.s3_options()["config_kwargs"]["retries"] == {"mode": "standard", "max_attempts": 10}
    monkeypatch.setenv("AWS_RETRY_MODE", "adaptive")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "3")
    assert storage.s3_options()["config_kwargs"]["retries"] == {"mode": "adaptive", "max_attempts": 3}
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "three")
    with pytest.raises(UserError, match="AWS_MAX_ATTEMPTS"):
        storage.s3_options()
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "3")
    monkeypatch.setenv("AWS_RETRY_MODE", "eager")
    with pytest.raises(UserError, match="AWS_RETRY_MODE"):
        storage.s3_options()


@pytest.mark.service
def test_round_trips_are_whole_through_every_fault_kind(faulty_s3, caplog):
    """Every third request fails in one of five ways; each write lands once, each read returns exactly the bytes,
    and the failed attempts show in the log."""
    proxy, bucket = faulty_s3(FaultPlan(every=3))
    blobs = {f"s3://{bucket}/blobs/part-{i:02d}.bin": os.urandom(50_000 + 7919 * i) for i in range(12)}
    for uri, data in blobs.items():
        storage.write_bytes(uri, data)
    storage.write_json(f"s3://{bucket}/blobs/manifest.json", {"files": sorted(blobs)})
    for uri, data in blobs.items():
        fs, path = storage.filesystem(uri)
        assert fs.cat_file(path) == data, f"{uri} came back different"
    assert storage.read_json(f"s3://{bucket}/blobs/manifest.json") == {"files": sorted(blobs)}
    assert all(proxy.injected[kind] > 0 for kind in FAULT_KINDS), proxy.injected
    failed = [r.getMessage() for r in caplog.records if r.name == "stagewise.storage"]
    assert any("attempt 1 of 10 failed (503 SlowDown)" in m for m in failed), failed
    assert any("(500 InternalError)" in m for m in failed), failed


@pytest.mark.service
def test_preprocess_through_faults_commits_what_a_clean_local_run_commits(faulty_s3, tmp_path):
    """The whole preprocess stage on S3 with faults on every 4th request writes the same tables as on local files."""
    proxy, bucket = faulty_s3(FaultPlan(every=4))
    local_root = tmp_path / "local"
    local_root.mkdir()
    committed = {}
    for name, root in {"local": str(local_root), "s3": f"s3://{bucket}/root"}.items():
        config_path = tmp_path / f"{name}.yaml"
        config_path.write_text(json.dumps({**base_config(local_root), "storage_root": root}))
        out = storage.join(root, "runs", "test", "r1")
        preprocess_digits(config_path, out)
        manifest = storage.read_json(storage.join(out, "preprocess", "manifest.json"))
        committed[name] = {"mean": manifest["mean"], "std": manifest["std"], "rows": manifest["rows"]}
        for split, entries in manifest["splits"].items():
            tables = []
            for entry in entries:
                with storage.open_parquet(entry["uri"]) as parquet:
                    tables.append(parquet.read())
            committed[name][split] = pa.concat_tables(tables).sort_by("row_id").to_pydict()
    assert committed["s3"]["rows"] == committed["local"]["rows"]
    assert committed["s3"] == committed["local"], "the committed data differ from a fault-free run"
    assert sum(proxy.injected.values()) > 10, proxy.injected


@pytest.mark.service
def test_an_outage_beyond_the_retries_fails_as_retryable_and_the_retry_commits(faulty_s3, tmp_path, subprocess_env):
    """With S3 down past its retries the sub-job exits 1 (Airflow retries it), not 3 (user error), and writes
    nothing; once S3 is back, the same command (the retry) writes the shard's statistics and the key hashes they name."""
    from stagewise.datasets.demo import write_digits

    proxy, bucket = faulty_s3(FaultPlan())
    root = f"s3://{bucket}/root"
    shard = write_digits(storage.join(root, "raw", "digits"), num_shards=1)[0]
    config_path = tmp_path / "pipeline.yaml"
    config_path.write_text(json.dumps({**base_config(tmp_path), "storage_root": root}))
    env = {**subprocess_env, **{k: v for k, v in os.environ.items() if k.startswith("AWS_")}, "AWS_MAX_ATTEMPTS": "2"}
    command = [sys.executable, "-m", "stagewise.preprocess", "stats", "--config", str(config_path), "--shard", shard,
               "--index", "0", "--out", "runs/test/r1"]
    stats_prefix = storage.join(root, "runs", "test", "r1")

    proxy.plan = FaultPlan(outage_after=1, outage_s=3600)
    proxy.requests = 0
    down = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert down.returncode == 1, f"expected a retryable failure (1), got {down.returncode}:\n{down.stdout[-3000:]}\n{down.stderr[-3000:]}"
    assert proxy.injected["outage"] > 0

    proxy.plan = FaultPlan()
    up = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
    fs, path = storage.filesystem(stats_prefix)
    written = sorted(p for p in fs.find(path) if not p.endswith("/"))
    assert len(written) == 2 and written[0].endswith(".u64") and written[1].endswith("shard-00000.json"), written
    assert storage.read_json(fs.unstrip_protocol(written[1]))["key_hashes_uri"] == fs.unstrip_protocol(written[0])


@pytest.mark.service
def test_a_missing_bucket_is_a_user_error_naming_the_setting_and_the_bucket(s3_env):
    """A storage_root whose bucket does not exist fails with a UserError naming storage_root, the URI and the bucket;
    listing input in a missing bucket says the bucket is missing; an existing bucket passes."""
    bucket = f"missing-{uuid.uuid4().hex[:10]}"
    with pytest.raises(UserError) as caught:
        storage.require_bucket(f"s3://{bucket}/root", "storage_root")
    assert str(caught.value).startswith(f"storage_root s3://{bucket}/root: S3 bucket '{bucket}' does not exist")
    with pytest.raises(UserError, match=f"S3 bucket '{bucket}' does not exist"):
        storage.list_parquet(f"s3://{bucket}/raw/digits")
    existing = f"present-{uuid.uuid4().hex[:10]}"
    storage.filesystem(f"s3://{existing}")[0].mkdir(existing)
    storage.require_bucket(f"s3://{existing}/root", "storage_root")


@pytest.mark.service
def test_an_unreachable_endpoint_is_not_a_missing_bucket(s3_env, monkeypatch):
    """With S3 unreachable (connection refused) the bucket check raises a retryable fault, never a UserError."""
    import socket

    import s3fs

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed_port = sock.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{closed_port}")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    s3fs.S3FileSystem.clear_instance_cache()
    with pytest.raises(Exception) as caught:
        storage.require_bucket("s3://any-bucket/root", "storage_root")
    assert not isinstance(caught.value, UserError), caught.value


@pytest.mark.service
def test_preprocess_cli_with_a_missing_bucket_exits_as_user_error_naming_storage_root(s3_env, tmp_path, subprocess_env):
    """`python -m stagewise.preprocess plan` with storage_root in a bucket that does not exist exits USER_ERROR_EXIT and
    names storage_root and the bucket (not NoCredentialsError or a bare NoSuchBucket)."""
    from stagewise.core.errors import USER_ERROR_EXIT

    bucket = f"missing-{uuid.uuid4().hex[:10]}"
    config_path = tmp_path / "pipeline.yaml"
    config_path.write_text(json.dumps({**base_config(tmp_path), "storage_root": f"s3://{bucket}/root"}))
    env = {**subprocess_env, **s3_env, "AWS_MAX_ATTEMPTS": "2"}
    completed = subprocess.run([sys.executable, "-m", "stagewise.preprocess", "plan", "--config", str(config_path)],
                               cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert completed.returncode == USER_ERROR_EXIT, completed.stdout[-3000:] + completed.stderr[-3000:]
    assert f"storage_root s3://{bucket}/root: S3 bucket '{bucket}' does not exist" in completed.stdout


@pytest.mark.service
def test_a_broken_raw_shard_on_s3_is_a_data_error_naming_it(s3_env, tmp_path):
    """A truncated Parquet object on S3 fails the stats step with a DataError naming its s3:// URI."""
    from stagewise import preprocess
    from stagewise.core.errors import DataError
    from stagewise.definitions.loading import load_config
    from tests.bad_parquet import write_bad_file

    bucket = f"broken-{uuid.uuid4().hex[:10]}"
    fs, _ = storage.filesystem(f"s3://{bucket}")
    fs.mkdir(bucket)
    good = tmp_path / "good.parquet"
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"row_id": list(range(50)), "label": [i % 10 for i in range(50)],
                             **{f"px_{i:02d}": [0.5] * 50 for i in range(64)}}), good)
    bad_local = write_bad_file("truncated", tmp_path / "bad.parquet", good.read_bytes())
    shard = f"s3://{bucket}/raw/digits/part-00000.parquet"
    fs.put_file(str(bad_local), shard)
    config_path = tmp_path / "pipeline.yaml"
    config_path.write_text(json.dumps({**base_config(tmp_path), "storage_root": f"s3://{bucket}/root"}))
    with pytest.raises(DataError, match=f"{shard}: has no Parquet footer.*truncated"):
        preprocess.shard_stats(load_config(config_path), shard, 0, f"s3://{bucket}/root/runs/t/r1")


@pytest.mark.service
def test_ingest_onto_s3_adds_each_file_once_and_leaves_no_partial_object(s3_env, tmp_path):
    """Ingest from local files into an s3:// data set: every source file lands whole under its content name, no
    '.partial' object stays behind, and a second run (a retry) adds nothing."""
    import pyarrow.parquet as pq

    from stagewise.data import ingest
    from stagewise.datasets.demo import synthetic_table, write_synthetic
    from stagewise.definitions.loading import load_config

    bucket = f"ingest-{uuid.uuid4().hex[:10]}"
    fs, _ = storage.filesystem(f"s3://{bucket}")
    fs.mkdir(bucket)
    target = f"s3://{bucket}/root/raw/synth"
    write_synthetic(target, 400, num_features=4, num_shards=2, dirty_fraction=0.0)
    source = tmp_path / "new"
    source.mkdir()
    for index in range(2):
        pq.write_table(synthetic_table(50, num_features=4, seed=index, first_key=10_000 + 50 * index), source / f"p{index}.parquet")
    raw = {**base_config(tmp_path), "storage_root": f"s3://{bucket}/root"}
    raw["dataset"] = {"uri": "raw/synth", "key": "row_id", "label": "label", "features": "f_*", "num_classes": 10}
    config_path = tmp_path / "pipeline.yaml"
    config_path.write_text(json.dumps(raw))
    config = load_config(config_path)
    first = ingest(config, str(source), target)
    assert len(first["added"]) == 2 and first["rows"] == 100
    for uri in first["added"]:
        assert fs.cat_file(fs._strip_protocol(uri)) in {(source / f"p{i}.parquet").read_bytes() for i in range(2)}
    assert not [key for key in fs.find(f"{bucket}/root") if "partial" in key]
    again = ingest(config, str(source), target)
    assert again["added"] == [] and len(storage.list_parquet(target)) == 4


@pytest.mark.service
def test_a_report_another_process_writes_shows_in_this_processs_next_read(s3_bucket):
    """As the api-server sees a run on S3: a run folder is listed and its report.json looked for while the run is in
    flight; another process (its own S3 client) then writes the report; the next listing lists it, its row reads it
    (never "unreadable … does not exist") and the run page's existence check finds it, with no restart."""
    import s3fs

    from stagewise.reporting import listing

    bucket = s3_bucket.removeprefix("s3://")
    writer = s3fs.S3FileSystem(client_kwargs={"endpoint_url": os.environ["AWS_ENDPOINT_URL"]}, skip_instance_cache=True)
    writer.pipe_file(f"{bucket}/runs/ml_pipeline/done/report.json", json.dumps({"run_id": "done"}).encode())
    writer.pipe_file(f"{bucket}/runs/ml_pipeline/running/config.yaml", b"name: digits\n")
    report_uri = storage.join(s3_bucket, "runs", "ml_pipeline", "running", "report.json")
    assert [item.parts for item in listing.run_reports(s3_bucket)] == [("ml_pipeline", "done")]
    assert not storage.exists(report_uri)
    fs, _ = storage.filesystem(report_uri)
    fs.ls(f"{bucket}/runs/ml_pipeline/running")  # the run page's folder looked at while the run had no report

    writer.pipe_file(f"{bucket}/runs/ml_pipeline/running/report.json", json.dumps({"run_id": "running"}).encode())
    reports = listing.run_reports(s3_bucket)
    assert {item.parts for item in reports} == {("ml_pipeline", "done"), ("ml_pipeline", "running")}
    rows = {row.run_id: row for row in listing.run_rows(s3_bucket, reports, recheck_files=True)}
    assert rows["running"].state != "unreadable", rows["running"].error
    assert storage.exists(report_uri) and storage.read_json(report_uri) == {"run_id": "running"}
