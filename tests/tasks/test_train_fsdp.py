"""Sharded (fsdp) stages under real torchrun on CPU (gloo): ddp 1 -> fsdp 2 -> fsdp 4 with growing batch and
full-state hand-offs, sharded checkpoints written by every rank, a killed rank resumed exactly, and a model that fits a
per-process memory cap only sharded."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests import run_cache
from tests.conftest import base_config, preprocess_digits

REPO_ROOT = Path(__file__).resolve().parents[2]
KILL_AT_STEP = 25

pytestmark = pytest.mark.torchrun


def torchrun(nproc: int, config: Path, out: str, env: dict, *args: str, result: str = "result.json",
             check: bool = True) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "-m",
               "stagewise.train", "--config", str(config), "--out", out, "--result-file", str(Path(out) / result), *args]
    completed = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    if check:
        assert completed.returncode == 0, completed.stdout[-4000:] + completed.stderr[-4000:]
        completed.result = json.loads((Path(out) / result).read_text())
    return completed


@pytest.fixture
def sharded_run(storage_root, write_config) -> tuple[Path, str]:
    """The digits with three stages: s1 ddp on 1 process, s2 fsdp on 2 (clipped), s3 fsdp on 4, batch 32 -> 128 -> 256."""
    raw = base_config(storage_root)
    raw["profiles"]["ddp4"] = {**raw["profiles"]["ddp2"], "processes_per_node": 4}
    raw["train"]["stages"][1].update({"strategy": "fsdp", "grad_clip_norm": 5.0})
    raw["train"]["stages"].append({"name": "s3", "profile": "ddp4", "per_process_batch": 64, "epochs": 1,
                                   "strategy": "fsdp", "warmup_steps": 5, "hand_on": "last"})
    config = write_config(raw)
    out = str(storage_root / "runs" / "test" / "sharded")
    preprocess_digits(config, out)
    return config, out


def test_ddp_then_fsdp_on_two_then_four_ranks_hands_on_full_states(sharded_run, subprocess_env):
    """s1 (ddp, 1 rank) hands its final.pt to s2 (fsdp, 2 ranks), which hands its own to s3 (fsdp, 4 ranks): each
    sharded stage starts from the stage before's weights at another world size and strategy, every rank writes its
    own checkpoint shard, and the final.pt and model.pt a sharded stage leaves are full states that a ddp stage,
    evaluation and the registry read as before."""
    from stagewise.models.bundle import load_bundle

    config, out = sharded_run
    params = ("--params", json.dumps({"lr": 0.05, "hidden": 64}))
    first = torchrun(1, config, out, subprocess_env, "--stage", "s1", *params, result="s1.json").result
    second_run = torchrun(2, config, out, subprocess_env, "--stage", "s2", *params, "--init-from",
                          first["checkpoint_uri"], result="s2.json")
    second = second_run.result
    assert second["strategy"] == "fsdp" and second["world_size"] == 2 and second["global_batch"] == 128
    assert second["val_metric"] > 0.9, "s2 starts from s1's trained model"
    assert "world size 2 (fsdp over 2 rank(s): 4 units)" in second_run.stdout + second_run.stderr
    history = json.loads(Path(out, "train", "s2", "metrics.json").read_text())["history"]
    assert all(entry["grad_norm"] is not None and entry["grad_norm"] > 0 for entry in history), "clipped on shards"
    assert history[-1]["noise_scale"] is not None and history[-1]["noise_scale"] > 0, "measured over the shards"

    stage_dir = Path(out, "train", "s2")
    pointer = json.loads((stage_dir / "checkpoints" / "latest.json").read_text())
    shards = sorted(path.name for path in Path(pointer["uri"]).iterdir())
    assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"], "each rank wrote its own shard"
    final = torch.load(stage_dir / "final.pt", weights_only=True)
    bundle = load_bundle(str(stage_dir / "model.pt"))
    plain = dict(bundle.module.state_dict())
    assert set(final["model"]) == set(plain) and all(torch.equal(final["model"][k], plain[k]) for k in plain)
    assert all(isinstance(tensor, torch.Tensor) and type(tensor) is torch.Tensor for tensor in final["model"].values())
    # The optimizer state is never gathered: final.pt names the sharded checkpoint holding it (one of its own).
    kept = Path(final["optimizer"]["sharded_checkpoint"])
    assert kept.parent == stage_dir and kept.name.startswith("final-optimizer-")
    assert {"__0_0.distcp", "__1_0.distcp"} <= {path.name for path in kept.iterdir()}
    assert len(list(stage_dir.glob("final-optimizer-*"))) == 1
    assert final["global_batch"] == 128

    third = torchrun(4, config, out, subprocess_env, "--stage", "s3", *params, "--init-from", second["checkpoint_uri"],
                     result="s3.json").result
    assert (third["world_size"], third["global_batch"], third["strategy"]) == (4, 256, "fsdp")
    assert third["val_metric"] > 0.9, "s3 starts from s2's weights, resharded from 2 ranks to 4"
    last = torch.load(Path(out, "train", "s3", "final.pt"), weights_only=True)
    assert last["previous_global_batch"] == 128

    # A ddp stage after a sharded one loads its full state (model by name, optimizer numbered).
    again = torchrun(1, config, out, subprocess_env, "--stage", "s1", *params, "--init-from",
                     str(Path(out, "train", "s3", "final.pt")), "--override=train.stages.0.epochs=1", result="again.json")
    assert again.result["val_metric"] > 0.9


def test_killed_fsdp_rank_resumes_from_its_sharded_checkpoint_exactly(digits_run, subprocess_env, tmp_path):
    """SIGKILL of rank 1 at step 25 of an fsdp stage: the retry loads every rank's shard of the newest sharded
    checkpoint and ends on the weights, noise scale and metric of an uninterrupted fsdp stage."""
    config, out = digits_run
    stage_args = (*run_cache.REFERENCE_STAGE_ARGS, "--override=train.stages.1.strategy=fsdp")
    crashed = torchrun(2, config, out, {**subprocess_env, "STAGEWISE_FAULT_KILL_AT": f"1:{KILL_AT_STEP}"}, *stage_args,
                       result="crashed.json", check=False)
    assert crashed.returncode != 0, "a killed rank must fail the stage"
    every = run_cache.REFERENCE_CHECKPOINT_EVERY
    pointer = json.loads(Path(out, "train", "s2", "checkpoints", "latest.json").read_text())
    assert pointer["step"] == (KILL_AT_STEP // every) * every and pointer["uri"].endswith(".dcp")

    resumed = torchrun(2, config, out, {**subprocess_env, "STAGEWISE_FAULT_KILL_AT": f"1:{KILL_AT_STEP}"}, *stage_args,
                       result="resumed.json").result
    assert 0 <= KILL_AT_STEP - resumed["resumed_from_step"] <= every

    reference_out = str(tmp_path / "reference")
    os.makedirs(f"{reference_out}/preprocess")
    shutil.copy(f"{out}/preprocess/manifest.json", f"{reference_out}/preprocess/manifest.json")
    clean = torchrun(2, config, reference_out, subprocess_env, *stage_args, result="clean.json").result
    assert resumed["steps"] == clean["steps"] and resumed["handed_epoch"] == clean["handed_epoch"]
    assert resumed["val_metric"] == pytest.approx(clean["val_metric"], abs=1e-9)
    assert resumed["noise_scale"] > 0 and resumed["noise_scale"] == pytest.approx(clean["noise_scale"], rel=1e-6)
    resumed_model = torch.load(Path(out, "train", "s2", "final.pt"), weights_only=True)["model"]
    clean_model = torch.load(Path(reference_out, "train", "s2", "final.pt"), weights_only=True)["model"]
    for name, tensor in clean_model.items():
        torch.testing.assert_close(resumed_model[name], tensor, rtol=1e-5, atol=1e-6)
