"""A stage killed on one number of processes and retried on another, the count changed through its config (the stage
moved to another profile, or its profile's processes_per_node edited), under real torchrun on CPU (gloo): it resumes
its newest checkpoint resharded where its global batch is the same, and refuses, keeping its checkpoints, where the
global batch changed with the count. (The Airflow retry of the same: tests/dags/test_resume_world_size.py.)"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.conftest import base_config, preprocess_digits
from tests.tasks.test_train_fsdp import torchrun

pytestmark = pytest.mark.torchrun

CHECKPOINT_EVERY = 10
# Past the first epoch's end (12 steps of global batch 96 over the digits' train split), before step 20's checkpoint:
# the retry resumes step 10 and saves the first epoch's best again, at its own world size.
KILL_AT = "1:15"
STAGE = ("--stage", "s2", "--params", json.dumps({"lr": 0.02, "hidden": 16}))


@pytest.fixture
def resumable(storage_root, write_config) -> tuple[Path, str]:
    """The digits; profiles ddp2 and ddp3 (2 and 3 processes); s2 at global batch 96 (48 a rank on 2, 32 on 3), two
    epochs, hand_on best, a checkpoint every 10 steps."""
    raw = base_config(storage_root)
    raw["profiles"]["ddp3"] = {**raw["profiles"]["ddp2"], "processes_per_node": 3}
    raw["train"]["checkpoint_every_steps"] = CHECKPOINT_EVERY
    raw["train"]["stages"][1] = {"name": "s2", "profile": "ddp2", "global_batch": 96, "epochs": 2, "warmup_steps": 5,
                                 "grad_clip_norm": 1.0, "hand_on": "best"}
    config = write_config(raw)
    out = str(storage_root / "runs" / "test" / "resumable")
    preprocess_digits(config, out)
    return config, out


def placed(ranks: int, first: int, how: str) -> tuple[str, ...]:
    """The overrides that run s2 on ``ranks`` processes where its first attempt ran on ``first``: ``moved`` to the
    profile of that count, or ``edited``: its first profile's processes_per_node changed."""
    if how == "edited":
        return (f"--override=train.stages.1.profile=ddp{first}", f"--override=profiles.ddp{first}.processes_per_node={ranks}")
    return (f"--override=train.stages.1.profile=ddp{ranks}",)


@pytest.mark.parametrize(("strategy", "killed_at", "resumed_at", "how"), [
    ("fsdp", 2, 3, "edited"), ("fsdp", 3, 2, "moved"), ("ddp", 2, 3, "moved"), ("ddp", 3, 2, "edited")],
    ids=["fsdp-2-to-3-edited", "fsdp-3-to-2-moved", "ddp-2-to-3-moved", "ddp-3-to-2-edited"])
@pytest.mark.slow
def test_a_killed_stage_can_resume_at_another_world_size_through_its_profile(resumable, subprocess_env, tmp_path,
                                                                             strategy, killed_at, resumed_at, how):
    """A rank killed at step 15 on ``killed_at`` processes; the retry, its count changed in the config, resumes from
    the step-10 checkpoint resharded (no start over), saves the best epoch again at its own world size, ends with every
    kept best epoch intact, and ends on the weights and record of a run on ``resumed_at`` processes from a copy of
    that same checkpoint."""
    from stagewise.training.checkpoint import CheckpointStore, ShardedCheckpointStore

    config, out = resumable
    common = (*STAGE, f"--override=train.stages.1.strategy={strategy}")
    crashed = torchrun(killed_at, config, out, {**subprocess_env, "STAGEWISE_FAULT_KILL_AT": KILL_AT}, *common,
                       *placed(killed_at, killed_at, "moved"), result="crashed.json", check=False)
    assert crashed.returncode != 0
    stage_dir = Path(out, "train", "s2")
    assert json.loads((stage_dir / "checkpoints" / "latest.json").read_text())["step"] == CHECKPOINT_EVERY
    assert list((stage_dir / "best").glob("step-000000000.*")), "the first epoch's best was kept before the kill"
    reference_out = tmp_path / "reference"
    shutil.copytree(out, reference_out)

    retry = (*common, *placed(resumed_at, killed_at, how))
    # First, while the killed attempt's checkpoint (which the copy's latest.json names) is there as it was left.
    clean = torchrun(resumed_at, config, str(reference_out), subprocess_env, *retry, result="clean.json").result
    resumed_run = torchrun(resumed_at, config, out, subprocess_env, *retry, result="resumed.json")
    resumed, log = resumed_run.result, resumed_run.stdout + resumed_run.stderr
    assert "starts over" not in log, log[-3000:]
    assert resumed["resumed_from_step"] == clean["resumed_from_step"] == CHECKPOINT_EVERY
    assert resumed["world_size"] == resumed_at
    assert f"written by {killed_at} process(es), on {resumed_at}" in log
    best = (ShardedCheckpointStore(str(stage_dir), master=True, folder="best") if strategy == "fsdp"
            else CheckpointStore(str(stage_dir), folder="best"))
    kept = best._listed()
    assert kept and all(best.verify(uri) is None for uri in kept), [best.verify(uri) for uri in kept]
    assert (resumed["steps"], resumed["val_metric"], resumed["handed_epoch"]) == (
        clean["steps"], clean["val_metric"], clean["handed_epoch"])
    resumed_model = torch.load(stage_dir / "final.pt", weights_only=True)["model"]
    clean_model = torch.load(reference_out / "train" / "s2" / "final.pt", weights_only=True)["model"]
    for name, tensor in clean_model.items():
        assert torch.equal(resumed_model[name], tensor), name


@pytest.mark.slow
def test_a_stage_whose_global_batch_changes_with_the_world_size_refuses_to_resume_and_keeps_its_checkpoints(
        digits_run, subprocess_env, tmp_path):
    """A ddp stage with per_process_batch killed on 2 ranks and retried on 3 through its profile (global batch
    128 -> 192) fails as a user error naming both world sizes and batches and what to do; its checkpoints stay (it
    once started over and overwrote them)."""
    config, out = digits_run
    args = ("--stage", "s2", "--params", json.dumps({"lr": 0.02, "hidden": 16}), "--override=train.checkpoint_every_steps=5")
    crashed = torchrun(2, config, out, {**subprocess_env, "STAGEWISE_FAULT_KILL_AT": "1:7"}, *args,
                       result="crashed.json", check=False)
    assert crashed.returncode != 0
    checkpoints = sorted(path.name for path in Path(out, "train", "s2", "checkpoints").iterdir())
    error_file = tmp_path / "errors.txt"
    refused = torchrun(3, config, out, {**subprocess_env, "STAGEWISE_ERROR_FILE": str(error_file)}, *args,
                       "--override=profiles.ddp2.processes_per_node=3", result="refused.json", check=False)
    assert refused.returncode != 0
    message = error_file.read_text()
    assert "written by 2 process(es) at global batch 128" in message and "runs 3, whose global batch is 192" in message
    assert "global_batch" in message and "checkpoints" in message
    assert sorted(path.name for path in Path(out, "train", "s2", "checkpoints").iterdir()) == checkpoints
