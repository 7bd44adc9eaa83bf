"""The one launch of a train stage: steps.train_stage builds a StageJob and the profile's backend runs it."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from stagewise.airflow.stage_job import TRAIN_MODULE, build
from stagewise.definitions.loading import load_config


def _run(config_path: Path, out: str) -> dict:
    return {"dag_id": "test", "run_id": Path(out).name, "config": str(config_path), "overrides": {}, "out": out,
            "study": "s"}


def test_a_built_in_stage_job_carries_train_args_the_fingerprints_and_the_credentials_once(digits_run):
    """stagewise.train's arguments (the fingerprints that key its checkpoints, the hand-off, the run's snapshot last),
    no entrypoint, and one environment with the storage variables in it."""
    config_path, out = digits_run
    config = load_config(config_path)
    job = build(config, _run(config_path, out), "s2", {"lr": 0.05}, "x/final.pt", 3,
                fingerprints={"inputs_fingerprint": "f1", "data_fingerprint": "d1"})
    assert job.entry is None and job.contract is None and job.attempt == 3 and job.backend == "local"
    assert list(job.args) == ["--stage", "s2", "--out", out, "--params", '{"lr": 0.05}', "--inputs-fingerprint", "f1",
                              "--data-fingerprint", "d1", "--init-from", "x/final.pt", "--config", str(config_path)]
    assert job.storage_env.items() <= job.env.items()
    assert TRAIN_MODULE == "stagewise.train"


@pytest.mark.torchrun
def test_train_stage_runs_a_built_in_stage_on_the_local_backend(digits_run):
    """The step's built-in path: one torchrun job of stagewise.train whose result (the stage's model, its attempt,
    the sub-job's own seconds and the task's) comes back to the DAG."""
    from airflow.sdk.execution_time.context import set_current_context

    from stagewise.airflow import steps

    config_path, out = digits_run
    steps._cached_config.cache_clear()
    with set_current_context({"ti": SimpleNamespace(try_number=1, start_date=None)}):
        result = steps.train_stage(_run(config_path, out), "s1", {"best_params": {"lr": 0.05}}, None)
    assert result["model_uri"] == str(Path(out) / "train" / "s1" / "model.pt") and Path(result["model_uri"]).exists()
    assert result["attempt"] == 1 and result["duration_s"] > 0 and "fingerprint" in result


def test_a_slurm_stage_job_is_built_as_a_local_one(digits_run, tmp_path):
    """Every Slurm node runs this install on a shared filesystem: the job carries stagewise.train's own arguments with
    the fingerprints and the environment, not the remote backends' node command."""
    import yaml

    config_path, out = digits_run
    raw = yaml.safe_load(config_path.read_text())
    raw["profiles"]["ddp2"].update({"backend": "slurm", "nodes": 2, "processes_per_node": 1, "slurm": {}})
    path = tmp_path / "slurm.yaml"
    path.write_text(yaml.safe_dump(raw))
    config = load_config(path)
    job = build(config, _run(path, out), "s2", {"lr": 0.05}, None, 1, fingerprints={"inputs_fingerprint": "f1"})
    assert job.backend == "slurm" and job.entry is None
    assert list(job.args) == ["--stage", "s2", "--out", out, "--params", '{"lr": 0.05}', "--inputs-fingerprint", "f1",
                              "--config", str(path)]
    assert job.storage_env.items() <= job.env.items()


def test_a_stage_job_is_resolved_once_and_no_backend_reaches_back_into_the_config_or_the_airflow_context():
    """The job carries the stage's profile and import paths, not the config: each backend module reads only the job
    (no config loading, no run snapshot, no task context), so the launch walks one way from the step."""
    import dataclasses

    from stagewise.airflow.stage_job import StageJob

    assert {"profile", "profile_name", "import_paths"} <= {item.name for item in dataclasses.fields(StageJob)}
    assert "config" not in {item.name for item in dataclasses.fields(StageJob)}
    folder = Path(__file__).parents[2] / "plugins" / "stagewise_airflow" / "backends"
    for module in sorted(folder.glob("*.py")):
        source = module.read_text()
        for reach in ("job.config", "load_config", "run_config", "get_current_context", "_context("):
            assert reach not in source, f"{module.name} reaches back through {reach}"


def test_an_own_script_stage_computes_its_contract_once(digits_run, monkeypatch):
    """The own-script contract is computed once per try: its environment and its arguments read the same values."""
    from stagewise.scripting import stage_contract

    config_path, out = digits_run
    config = load_config(config_path)
    raw = config.model_dump()
    raw["train"]["stages"][1]["entrypoint"] = {"script": str(Path(__file__).parents[2] / "examples" / "byo_train.py")}
    from stagewise.definitions.config import PipelineConfig

    own = PipelineConfig.model_validate(raw)
    calls = []
    real = stage_contract.byo_contract
    monkeypatch.setattr(stage_contract, "byo_contract", lambda *args: calls.append(args) or real(*args))
    job = build(own, _run(config_path, out), "s2", {"lr": 0.05}, None, 1)
    assert len(calls) == 1 and job.contract is not None and job.entry is not None
    assert job.env["STAGEWISE_STAGE"] == "s2" and job.profile_name == own.stage("s2").profile
