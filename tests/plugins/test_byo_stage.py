"""Bring your own script: a user's torchrun script runs as a stage with the profile and the STAGEWISE_* contract."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from stagewise.airflow import launch
from stagewise.definitions.config import Profile
from stagewise.definitions.loading import load_config
from stagewise.scripting.stage_contract import byo_args, byo_contract, byo_environment, check_byo_outputs
from tests.conftest import REPO_ROOT

SNAPSHOT_SCRIPT = str(REPO_ROOT / "tests" / "plugins" / "byo_snapshot_script.py")


@pytest.mark.torchrun
def test_user_script_runs_under_torchrun_with_the_stage_contract(digits_run):
    """The script gets torchrun's variables, its own args (placeholders filled), the data manifest, the output dirs; its result comes back."""
    config_path, out = digits_run
    raw = yaml.safe_load(config_path.read_text())
    raw["train"]["stages"][1]["entrypoint"] = {"script": str(REPO_ROOT / "examples" / "byo_train.py"),
                                                   "args": ["--hidden", "{hidden}"]}
    config_path.write_text(yaml.safe_dump(raw))
    config = load_config(config_path)
    stage = config.stage("s2")
    env = byo_environment(config, str(config_path), "s2", out, {"lr": 0.02, "hidden": 32}, init_from=None)
    assert env["STAGEWISE_GLOBAL_BATCH"] == "128" and float(env["STAGEWISE_LR"]) == pytest.approx(0.02 * 128 / 32)
    args = byo_args(config, "s2", byo_contract(config, str(config_path), "s2", out, {"lr": 0.02, "hidden": 32}, None))

    result = launch.run("", args, config.profile(stage.profile), distributed=True,
                        script=stage.entrypoint.script, extra_env=env)
    assert result["world_size"] == 2 and result["args"] == {"hidden": 32}
    seen = result["torchrun_env"]
    assert seen["RANK"] == "0" and seen["WORLD_SIZE"] == "2" and seen["MASTER_ADDR"] and seen["MASTER_PORT"]
    assert result["val_metric"] > 0.2, "two epochs should beat chance (0.1) clearly"
    stage_dir = Path(out) / "train" / "s2"
    assert (stage_dir / "final.pt").exists() and (stage_dir / "model.pt").exists()
    assert (stage_dir / "checkpoints" / "byo.pt").exists()
    assert check_byo_outputs(config, "s2", out) == {"final.pt": str(stage_dir / "final.pt"), "model.pt": str(stage_dir / "model.pt")}


def test_entrypoint_needs_exactly_one_target(write_config):
    """A stage entrypoint with both or neither of script and module is refused, naming the key."""
    from stagewise.definitions.config import ConfigError

    path = write_config()
    raw = yaml.safe_load(path.read_text())
    raw["train"]["stages"][0]["entrypoint"] = {"script": "a.py", "module": "b"}
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match=r"train\.stages\.0\.entrypoint"):
        load_config(path)


@pytest.mark.parametrize("entry", [{"script": SNAPSHOT_SCRIPT}, {"module": "tests.plugins.byo_snapshot_script"}])
@pytest.mark.torchrun  # a one-process torchrun job
def test_user_script_runs_in_a_scratch_cwd_that_no_later_run_sees(entry):
    """A script writing snapshot.pt relative to its cwd leaves nothing in the task's cwd, and a second run starts
    clean. A ``module:`` still imports although the cwd is elsewhere.
    """
    task_cwd = Path.cwd()
    leftover = task_cwd / "snapshot.pt"
    assert not leftover.exists(), "a snapshot.pt from an earlier run sits in the task's cwd"
    kwargs = {"script": entry.get("script"), "result_arg": False}
    try:
        first = launch.run(entry.get("module", ""), [], Profile(), distributed=True, **kwargs)
        second = launch.run(entry.get("module", ""), [], Profile(), distributed=True, **kwargs)
        assert not leftover.exists(), "the script's relative snapshot.pt landed in the task's cwd"
        assert not first["found_snapshot"] and not second["found_snapshot"], "the second run saw the first run's snapshot"
        assert Path(first["cwd"]) != task_cwd and not Path(first["cwd"]).exists(), "the scratch cwd is removed"
    finally:
        leftover.unlink(missing_ok=True)


def _set_entrypoint(config_path: Path, stage: int, entrypoint: dict) -> None:
    raw = yaml.safe_load(config_path.read_text())
    raw["train"]["stages"][stage]["entrypoint"] = entrypoint
    config_path.write_text(yaml.safe_dump(raw))


@pytest.mark.torchrun  # a one-process torchrun job
def test_stage_whose_script_wrote_no_model_fails_without_retry_naming_what_is_missing(write_config, storage_root):
    """A user stage that exits 0 without final.pt and model.pt fails at once (no retry), naming both files and the dir.

    Before, the stage passed and evaluate failed three times with FileNotFoundError.
    """
    from airflow.sdk.exceptions import AirflowFailException
    from airflow.sdk.execution_time.context import set_current_context

    from stagewise.airflow import steps

    config_path = write_config()
    _set_entrypoint(config_path, 0, {"script": SNAPSHOT_SCRIPT})
    out = str(storage_root / "runs" / "test" / "no-model")
    run = {"dag_id": "test", "run_id": "no-model", "config": str(config_path), "overrides": {}, "out": out}
    # The task's Airflow context: only the try number is read by the step.
    with set_current_context({"ti": SimpleNamespace(try_number=1)}):
        with pytest.raises(AirflowFailException) as failure:
            steps.train_stage(run, "s1", {"best_params": {"lr": 0.02}}, None)
    message = str(failure.value)
    assert f"stage s1: script {SNAPSHOT_SCRIPT} ended without writing final.pt and model.pt" in message
    assert str(Path(out) / "train" / "s1") in message and "save_bundle" in message


@pytest.mark.parametrize("reported, card_params", [
    (None, "not reported by the script"),
    ({"hidden": 16, "lr": 0.5}, {"hidden": 16, "lr": 0.5}),
])
@pytest.mark.torchrun  # a one-process torchrun job
def test_model_card_records_the_params_the_script_reported_not_the_sweeps(write_config, storage_root, reported, card_params):
    """A BYO stage's card holds its result JSON's params, or says they were not reported; never the sweep's best.

    Before, the card claimed the sweep's params although the script ignored them.
    """
    from airflow.sdk.execution_time.context import set_current_context

    from stagewise.airflow import steps

    config_path = write_config()
    args = ["--write-outputs"] + (["--params", json.dumps(reported).replace("{", "{{").replace("}", "}}")] if reported else [])
    _set_entrypoint(config_path, 0, {"script": SNAPSHOT_SCRIPT, "args": args})
    out = storage_root / "runs" / "test" / "card"
    (out / "preprocess").mkdir(parents=True)
    (out / "preprocess" / "manifest.json").write_text("{}")  # the card fingerprints it; its content does not matter here
    run = {"dag_id": "test", "run_id": "card", "config": str(config_path), "overrides": {}, "out": str(out), "study": "s"}
    swept = {"best_params": {"lr": 0.02, "hidden": 256}}
    with set_current_context({"ti": SimpleNamespace(try_number=1)}):
        trained = steps.train_stage(run, "s1", swept, None)
        card = steps.register_model(run, trained, {"test_accuracy": 0.5}, swept)
    assert trained["model_uri"] == str(out / "train" / "s1" / "model.pt") and trained["global_batch"] == 32
    assert card["params"] == card_params and card["params_source"] == "script"
    assert card["model_uri"].startswith(str(storage_root / "models" / "digits"))


@pytest.mark.torchrun  # a one-process torchrun job
def test_script_reporting_params_that_are_no_object_fails_without_retry(write_config, storage_root):
    """'params' in a script's result JSON must be an object: anything else fails the stage naming the key."""
    from airflow.sdk.exceptions import AirflowFailException
    from airflow.sdk.execution_time.context import set_current_context

    from stagewise.airflow import steps

    config_path = write_config()
    _set_entrypoint(config_path, 0, {"script": SNAPSHOT_SCRIPT,
                                     "args": ["--write-outputs", "--params", "[1, 2]"]})
    run = {"dag_id": "test", "run_id": "bad", "config": str(config_path), "overrides": {},
           "out": str(storage_root / "runs" / "test" / "bad")}
    with set_current_context({"ti": SimpleNamespace(try_number=1)}):
        with pytest.raises(AirflowFailException, match=r"stage s1: 'params' in the script's result JSON .* got list \[1, 2\]"):
            steps.train_stage(run, "s1", {"best_params": {"lr": 0.02}}, None)


@pytest.mark.torchrun
@pytest.mark.slow
def test_a_script_stage_runs_alone_from_the_command_line_as_its_airflow_task_would(digits_run, subprocess_env):
    """`python -m stagewise.train --stage s2` on a stage with its own script launches it under torchrun with the
    stage's contract and checks its outputs, so it can be debugged in a terminal (it used to run the built-in loop);
    started under torchrun itself, it refuses, naming how to run it."""
    import subprocess
    import sys

    config_path, out = digits_run
    raw = yaml.safe_load(config_path.read_text())
    raw["train"]["stages"][1]["entrypoint"] = {"script": str(REPO_ROOT / "examples" / "byo_train.py"),
                                               "args": ["--hidden", "{hidden}"]}
    config_path.write_text(yaml.safe_dump(raw))
    result_file = Path(out) / "alone.json"
    command = [sys.executable, "-m", "stagewise.train", "--config", str(config_path), "--stage", "s2", "--out", out,
               "--params", json.dumps({"lr": 0.02, "hidden": 32}), "--result-file", str(result_file)]
    done = subprocess.run(command, env=subprocess_env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(result_file.read_text())
    assert result["world_size"] == 2 and result["args"] == {"hidden": 32} and result["params_source"] == "script"
    assert Path(result["checkpoint_uri"]).name == "final.pt" and Path(result["model_uri"]).exists()
    refused = subprocess.run(command, env={**subprocess_env, "RANK": "0"}, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 3 and "run `python -m stagewise.train` plainly, not under torchrun" in refused.stdout
