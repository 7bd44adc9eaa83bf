"""A real Airflow run whose sharded stage loses a rank on 2 processes; the profile edited to 3 and the run cleared, the
stage resumes its newest checkpoint on 3 (the torchrun-level matrix, ddp and fsdp both ways, with the weights of an
uninterrupted run: tests/tasks/test_resume_world_size.py)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests import run_cache
from tests.dags.conftest import REPO_ROOT, _with_path, make_airflow_env
from tests.dags.test_operations import WHEN, small_config

pytestmark = [pytest.mark.airflow, pytest.mark.torchrun, pytest.mark.timeout(1800)]

CHECKPOINT_EVERY = 10
# Past s2's first epoch (12 steps of global batch 96), before step 20's checkpoint: the retry resumes step 10.
KILL_AT = "1:15"


def clear_and_run(env: dict) -> tuple[int, str]:
    """The run of WHEN again, whole, in the same run folder (tests/dags/run_again.py): what a clear from its first task
    does. Its exit status and log."""
    command = f". scripts/airflow_env.sh && exec python -m tests.dags.run_again ml_pipeline '{WHEN}'"
    done = subprocess.run(["bash", "-c", command], cwd=REPO_ROOT, env=_with_path(env), capture_output=True, text=True,
                          timeout=900)
    return done.returncode, done.stdout + done.stderr


@pytest.mark.slow
def test_a_stage_killed_on_two_ranks_can_resume_at_another_world_size_after_its_profile_is_edited(tmp_path):
    """s2 (fsdp, global batch 96, profile `ranks` of 2 processes, no retry) loses rank 1 at step 15 and the run fails;
    `ranks` edited to 3 processes in the pipeline's file and the run cleared, s2 resumes from its step-10 checkpoint on
    3 (never starting over), finishes with its best epoch intact and the run succeeds."""
    from stagewise.training.checkpoint import ShardedCheckpointStore

    raw = yaml.safe_load((REPO_ROOT / "pipeline.yaml").read_text())
    profiles = {**raw["profiles"], "ranks": {**raw["profiles"]["ddp2"], "retries": 0}}
    config = small_config(profiles=profiles, retention={"drop_after_success": False})
    config["train"].update({"checkpoint_every_steps": CHECKPOINT_EVERY})
    config["train"]["stages"][1].update({"profile": "ranks", "strategy": "fsdp", "epochs": 2, "global_batch": 96,
                                         "per_process_batch": None, "hand_on": "best"})
    storage, home = tmp_path / "storage", tmp_path / "home"
    home.mkdir()
    env = make_airflow_env(home, str(storage), storage, config=config)
    # Six row groups in the train split, not the tests' two: every one of 3 ranks needs its own (2 each, 3 each on 2).
    shutil.rmtree(storage / "raw")
    run_cache.demo_data(env["STAGEWISE_CONFIG"], num_shards=6)

    failed, log = clear_and_run({**env, "STAGEWISE_FAULT_KILL_AT": KILL_AT})
    assert failed != 0, log[-4000:]
    (stage_dir,) = storage.glob("runs/ml_pipeline/*/train/s2")
    assert json.loads((stage_dir / "checkpoints" / "latest.json").read_text())["step"] == CHECKPOINT_EVERY

    pipeline = Path(env["STAGEWISE_CONFIG"])
    edited = yaml.safe_load(pipeline.read_text())
    edited["profiles"]["ranks"]["processes_per_node"] = 3
    pipeline.write_text(yaml.safe_dump(edited))
    succeeded, log = clear_and_run(env)
    assert succeeded == 0, log[-6000:]
    assert "stage s2 starts over" not in log
    assert "written by 2 process(es), on 3" in log
    report = json.loads(next(storage.glob("runs/ml_pipeline/*/report.json")).read_text())
    (s2,) = [entry for entry in report["training"] if entry["stage"] == "s2"]
    assert (s2["world_size"], s2["global_batch"]) == (3, 96)
    metrics = json.loads((stage_dir / "metrics.json").read_text())
    assert metrics["resumed_from_step"] == CHECKPOINT_EVERY and metrics["steps"] > CHECKPOINT_EVERY
    best = ShardedCheckpointStore(str(stage_dir), master=True, folder="best")
    kept = best._listed()
    assert kept and all(best.verify(uri) is None for uri in kept), [best.verify(uri) for uri in kept]
