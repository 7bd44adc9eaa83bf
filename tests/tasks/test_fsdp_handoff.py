"""Hand-offs into sharded stages within fsdp's memory, under real torchrun on CPU (gloo); a stage resumed at another
world size: tests/tasks/test_resume_world_size.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import base_config, preprocess_digits
from tests.tasks.test_train_fsdp import FEW_TRAIN_ROWS, MEMORY_CAP_MB, capped, torchrun

pytestmark = pytest.mark.torchrun

# The memory-cap test's model (tests/tasks/test_train_fsdp.py): a 50M-parameter MLP whose AdamW state dominates.
BIG = {"spec": "tests.specs:DeepMLP", "args": {"extra": 48}}
BIG_PARAMS = ("--params", json.dumps({"lr": 0.0005, "hidden": 1024, "optimizer": "adamw"}))
# What the memory-cap test sets for the heap accounting to count what is used (see its comment).
CAPPED_ENV = {"MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_THRESHOLD_": "65536", "ARROW_DEFAULT_MEMORY_POOL": "system"}


@pytest.fixture
def big_chain(storage_root, write_config) -> tuple[Path, str]:
    """The digits with the big model in three stages: s1 ddp on 1 process (hands on its best epoch), s2 fsdp on 2,
    s3 fsdp on 3, over FEW_TRAIN_ROWS (an epoch is 8 steps in s1, 2 in s2, 1 in s3): what this checks is where each
    stage starts and what it holds, not what it learns."""
    raw = base_config(storage_root)
    raw["preprocess"]["split"] = dict(FEW_TRAIN_ROWS)
    raw["model"].update(BIG)
    raw["profiles"]["ddp3"] = {**raw["profiles"]["ddp2"], "processes_per_node": 3}
    raw["train"].update({"checkpoint_every_steps": 1000000, "noise_scale": False})
    raw["train"]["stages"] = [
        {"name": "s1", "profile": "ddp1", "per_process_batch": 32, "epochs": 1},
        {"name": "s2", "profile": "ddp2", "per_process_batch": 64, "epochs": 1, "strategy": "fsdp", "hand_on": "last"},
        {"name": "s3", "profile": "ddp3", "per_process_batch": 64, "epochs": 1, "strategy": "fsdp", "hand_on": "last"}]
    config = write_config(raw)
    out = str(storage_root / "runs" / "test" / "big")
    preprocess_digits(config, out)
    return config, out


@pytest.mark.slow
def test_fsdp_stages_start_from_a_ddp_hand_off_under_a_cap_only_fsdp_meets(big_chain, subprocess_env, tmp_path):
    """s1 (ddp, its best epoch handed on) runs uncapped; s2 (fsdp, 2 ranks) and s3 (fsdp, 3 ranks) each start with
    --init-from the stage before under the per-process cap that a ddp rank overflows: the hand-off holds the model
    alone (the optimizer state in a sharded checkpoint beside it, the best epoch in its own files), rank 0 reads it and
    the others receive their shards."""
    config, out = big_chain
    first = torchrun(1, config, out, subprocess_env, "--stage", "s1", *BIG_PARAMS, result="s1.json").result
    s1 = Path(out, "train", "s1")
    handed = torch.load(s1 / "final.pt", weights_only=True)
    assert "best_epoch_state" not in handed and set(handed["optimizer"]) == {"sharded_checkpoint"}
    model_bytes = sum(tensor.numel() * tensor.element_size() for tensor in handed["model"].values())
    assert (s1 / "final.pt").stat().st_size < 1.05 * model_bytes, "final.pt holds one copy of the model, nothing more"
    assert list((s1 / "best").glob("step-*.pt")), "the best epoch is kept in its own file"

    env = {**subprocess_env, **CAPPED_ENV, "STAGEWISE_ERROR_FILE": str(tmp_path / "errors.txt")}
    previous = first["checkpoint_uri"]
    for stage, ranks in (("s2", 2), ("s3", 3)):
        done = torchrun(ranks, config, out, env, "--stage", stage, *BIG_PARAMS, "--init-from", previous,
                        result=f"{stage}.json", check=False, preexec_fn=capped(MEMORY_CAP_MB * 2**20))
        assert done.returncode == 0, f"{stage} on {ranks} ranks under the cap:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
        result = json.loads(Path(out, f"{stage}.json").read_text())
        assert (result["strategy"], result["world_size"]) == ("fsdp", ranks) and result["steps"] > 0
        previous = result["checkpoint_uri"]
