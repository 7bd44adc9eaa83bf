"""An inference shard or a sweep worker on a Slurm profile (steps.launch_subjob -> slurm_subjob): one one-node job
running ``python -m stagewise.infer shard ...`` (or ``stagewise.sweep worker``) ``--config <snapshot> --result-file
<shared file>`` through the backend's run_command, named by the run, the shard or worker and the try; a setting Slurm
refuses fails without retry. No cluster: the backend's run_command is a stand-in (the real one:
tests/dags/test_slurm_pipeline.py)."""

from __future__ import annotations

import datetime as dt
import types
from pathlib import Path

import pytest
import yaml
from airflow.sdk.exceptions import AirflowFailException

from stagewise.airflow import shard_steps, steps
from stagewise.airflow.backends import slurm
from stagewise.airflow.stage_job import job_name
from stagewise.core.errors import UserError
from tests.conftest import base_config

RUN = {"dag_id": "ml_batch_inference", "run_id": "manual__1", "overrides": {}}


@pytest.fixture
def shard_run(tmp_path, monkeypatch):
    raw = base_config(tmp_path / "storage")
    raw["profiles"]["cluster"] = {**raw["profiles"]["small"], "backend": "slurm",
                                  "slurm": {"slurm_conf": "/etc/slurm/test.conf"}}
    raw["inference"]["profile"] = raw["sweep"]["profile"] = "cluster"
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(raw))
    context = {"ti": types.SimpleNamespace(try_number=3, start_date=dt.datetime.now(dt.UTC))}
    monkeypatch.setattr("airflow.sdk.get_current_context", lambda: context)
    return {**RUN, "config": str(path), "out": str(tmp_path / "storage" / "runs" / "r")}


def test_a_slurm_shard_runs_stagewise_infer_as_one_job_of_its_own(shard_run, monkeypatch):
    calls = []

    def run_command(argv, profile, settings, **kwargs):
        calls.append((argv, profile, settings, kwargs))
        return {"index": 4, "rows": 10, "slurm": {"job_id": "5", "nodes": 1, "state": "COMPLETED"}}

    monkeypatch.setattr(slurm, "run_command", run_command)
    result = shard_steps.infer_shard(shard_run, {"model_uri": "/m/model.pt"}, {"index": 4, "uri": "/d/part.parquet",
                                                                              "fingerprint": "f"})
    [(argv, profile, settings, kwargs)] = calls
    name = job_name(RUN["dag_id"], RUN["run_id"], "infer-4", 3)
    assert argv[:3] == ["-m", "stagewise.infer", "shard"] and argv[argv.index("--config") + 1] == shard_run["config"]
    assert argv[argv.index("--result-file") + 1] == f"{shard_run['out']}/slurm/{name}.result.json"
    assert kwargs["name"] == name and kwargs["log_dir"] == f"{shard_run['out']}/slurm"
    assert profile.backend == "slurm" and settings.slurm_conf == "/etc/slurm/test.conf"
    assert (result["rows"], result["attempt"], result["fingerprint"], result["slurm"]["job_id"]) == (10, 3, "f", "5")


def test_a_setting_slurm_refuses_fails_the_shard_without_retry(shard_run, monkeypatch):
    def refused(*args, **kwargs):
        raise UserError("Slurm refused the job: invalid partition specified (check the profile's slurm.partition)")

    monkeypatch.setattr(slurm, "run_command", refused)
    with pytest.raises(AirflowFailException, match="slurm.partition"):
        shard_steps.infer_shard(shard_run, {"model_uri": "/m/model.pt"}, {"index": 0, "uri": "/d/p.parquet"})


def test_a_sweep_worker_on_a_slurm_profile_is_one_job_its_ddp_trials_under_torchrun_on_its_node(shard_run, monkeypatch):
    """The worker joins the shared study from its Slurm node; with processes_per_node > 1 its trials run DDP there."""
    calls = []

    def run_command(argv, profile, settings, **kwargs):
        calls.append((argv, kwargs))
        return {"trials": 2, "slurm": {"job_id": "6", "nodes": 1, "state": "COMPLETED"}}

    monkeypatch.setattr(slurm, "run_command", run_command)
    worker = {"study": "st", "worker": 1, "fingerprint": "f", "reused_from": None}
    result = steps.sweep_worker(shard_run, worker)
    [(argv, kwargs)] = calls
    assert argv[:4] == ["-m", "stagewise.sweep", "worker", "--study"] and argv[argv.index("--worker") + 1] == "1"
    assert kwargs["name"] == job_name(RUN["dag_id"], RUN["run_id"], "sweep-1", 3) and kwargs["distributed"] is False
    assert (result["trials"], result["study"], result["slurm"]["job_id"]) == (2, "st", "6")
    raw = yaml.safe_load(Path(shard_run["config"]).read_text())
    raw["profiles"]["trials"] = {**raw["profiles"]["cluster"], "processes_per_node": 2}
    raw["sweep"]["profile"] = "trials"
    ddp = Path(shard_run["config"]).with_name("ddp.yaml")  # a snapshot of its own: run_config caches by path
    ddp.write_text(yaml.safe_dump(raw))
    steps.sweep_worker({**shard_run, "config": str(ddp)}, worker)
    assert calls[-1][1]["distributed"] is True
