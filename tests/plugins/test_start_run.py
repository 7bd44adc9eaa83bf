"""start_run fixes a run's config: the snapshot it writes is what every later step and sub-job of the run reads."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import yaml
from airflow.sdk.execution_time.context import set_current_context

from stagewise.airflow import steps
from stagewise.airflow.params import pipeline_params
from stagewise.core import storage
from stagewise.definitions.loading import load_config, snapshot
from tests.conftest import REPO_ROOT


def _start(config_path, conf: dict, config_file: str | None = None) -> dict:
    config = load_config(config_file or config_path)
    params = {name: param.resolve() for name, param in pipeline_params(config).items()} | conf
    context = {"ti": SimpleNamespace(try_number=1), "run_id": "manual__1", "params": params,
               "dag": SimpleNamespace(dag_id="ml_pipeline", params=params), "dag_run": SimpleNamespace(conf=conf)}
    with set_current_context(context):
        return steps.start_run(config_file=config_file)


def test_a_run_reads_its_snapshot_not_the_file_edited_after_it_started(write_config, storage_root, monkeypatch,
                                                                       subprocess_env):
    """The file edited after start_run (s2's batch and warmup, no Param) changes nothing for the run: in-process steps
    and a sub-job process both read <run>/config.yaml, with the form's values in it and the hash start_run gave."""
    path = write_config()
    monkeypatch.setenv("STAGEWISE_CONFIG", str(path))
    run = _start(path, {"num_trials": 3})
    assert run["config"] == storage.join(run["out"], "config.yaml") and run["config_source"] == str(path)
    edited = yaml.safe_load(path.read_text())
    edited["train"]["stages"][1].update({"per_process_batch": 16, "warmup_steps": 0})
    path.write_text(yaml.safe_dump(edited))
    steps._cached_config.cache_clear()

    seen = steps.run_config(run)
    assert (seen.stage("s2").per_process_batch, seen.stage("s2").warmup_steps, seen.sweep.num_trials) == (64, 20, 3)
    assert snapshot(seen)[1] == run["config_hash"] and steps._config_args(run) == ["--config", run["config"]]
    probe = ("import sys; from stagewise.definitions.loading import load_config; s2 = load_config(sys.argv[1]).stage('s2'); "
             "print(s2.per_process_batch, s2.warmup_steps)")
    printed = subprocess.run([sys.executable, "-c", probe, run["config"]], cwd=REPO_ROOT, env=subprocess_env,
                             capture_output=True, text=True, check=True).stdout.split()
    assert printed == ["64", "20"]


def test_a_run_starts_from_its_dags_config_not_the_processs_default(write_config, storage_root, monkeypatch):
    """A DAG built from another file (another pipeline of the deployment, with a diabetes-like config) runs that file, whatever
    $STAGEWISE_CONFIG says in the worker: its label, not the default config's with its Params laid on top."""
    from tests.conftest import base_config

    monkeypatch.setenv("STAGEWISE_CONFIG", str(write_config()))
    raw = base_config(storage_root)
    raw["dataset"].update({"label": "target", "uri": "raw/other"})
    own = write_config(raw, "other.yaml")
    run = _start(own, {}, config_file=str(own))
    assert run["config_source"] == str(own)
    assert (steps.run_config(run).dataset.label, steps.run_config(run).registry.model_name) == ("target", "other")


@pytest.mark.service
def test_an_s3_snapshot_is_read_with_the_runs_connection_when_the_worker_has_no_keys(write_config, storage_root, s3_bucket,
                                                                                    monkeypatch):
    """A later task (a fresh process: no cached config, no s3fs client) reads the run's s3:// snapshot with the keys of
    storage_conn_id, as it writes and reads the run's data; the worker's environment has none."""
    import json

    import s3fs

    from tests.conftest import base_config

    endpoint = {key: os.environ[key] for key in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    monkeypatch.setenv("AIRFLOW_CONN_STAGEWISE_RUN_S3", json.dumps({
        "conn_type": "aws", "login": endpoint["AWS_ACCESS_KEY_ID"], "password": endpoint["AWS_SECRET_ACCESS_KEY"],
        "extra": {"endpoint_url": endpoint["AWS_ENDPOINT_URL"], "region_name": "us-east-1"}}))
    for key in endpoint:
        monkeypatch.delenv(key)
    raw = {**base_config(storage_root), "storage_root": f"{s3_bucket}/root", "storage_conn_id": "stagewise_run_s3"}
    path = write_config(raw)
    monkeypatch.setenv("STAGEWISE_CONFIG", str(path))
    run = _start(path, {})
    assert run["config"].startswith(f"{s3_bucket}/root/runs/")
    steps._cached_config.cache_clear()
    s3fs.S3FileSystem.clear_instance_cache()
    assert steps.run_config(run).storage_conn_id == "stagewise_run_s3"


def test_a_stage_added_after_the_run_started_hands_the_stage_before_through(write_config, storage_root, caplog):
    """The file gains a stage s3 mid-run (the next parse gives the running run a train_s3 task): that task trains
    nothing, says why, and passes s2's result on, marked, so evaluate tests s2's model and the report leaves s3 out."""
    path = write_config()
    run = _start(path, {})
    edited = yaml.safe_load(path.read_text())
    edited["train"]["stages"].append({"name": "s3", "profile": "ddp1", "per_process_batch": 32, "epochs": 1})
    path.write_text(yaml.safe_dump(edited))
    steps._cached_config.cache_clear()
    s2 = {"stage": "s2", "checkpoint_uri": "x/final.pt", "model_uri": "x/model.pt", "fingerprint": "f2"}
    with caplog.at_level("WARNING", logger="stagewise.train"):
        handed = steps.train_stage(run, "s3", {"best_params": {"lr": 0.1}}, s2)
    assert handed == {**s2, "handed_through": "s3"}
    assert "train stage 's3' was added to the config after this run started" in caplog.text


@pytest.mark.service
def test_a_model_name_another_team_holds_in_mlflow_fails_the_first_task(write_config, storage_root, mlflow_server):
    """registry.backend mlflow, registry.model_name a model another team made in MLflow: start_run fails without retry
    naming the model name, its version's source and the setting, before any stage runs."""
    from airflow.sdk.exceptions import AirflowFailException

    from tests.conftest import base_config

    mlflow_server.client("""
        client.create_registered_model("fraud_model", tags={"team": "fraud"})
        client.create_model_version("fraud_model", "s3://fraud/models/3")
    """)
    raw = base_config(storage_root)
    raw["tracking"] = {"mlflow_uri": mlflow_server.uri, "experiment": "start_run_owner"}
    raw["registry"] = {"backend": "mlflow", "model_name": "fraud_model"}
    path = write_config(raw)
    with pytest.raises(AirflowFailException) as refused:
        _start(path, {}, config_file=str(path))
    said = str(refused.value)
    assert "registry.model_name 'fraud_model'" in said and "not pipeline 'ml''s" in said, said
    assert "version 1 not made by Stagewise, run (none), source s3://fraud/models/3" in said, said
