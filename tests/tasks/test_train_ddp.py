"""A real 2-process torchrun DDP stage on CPU (gloo): growing batch, checkpoint hand-off, rank-0 writes."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.torchrun


def torchrun(nproc: int, config: Path, stage: str, out: str, env: dict, *extra: str) -> subprocess.CompletedProcess:
    result_file = Path(out) / f"result-{stage}.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "-m",
               "stagewise.train", "--config", str(config), "--stage", stage, "--out", out,
               "--params", json.dumps({"lr": 0.05, "hidden": 64}), "--result-file", str(result_file), *extra]
    completed = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stdout[-4000:] + completed.stderr[-4000:]
    completed.result = json.loads(result_file.read_text())
    return completed


@pytest.mark.slow
def test_two_stages_grow_the_batch_and_hand_off_the_checkpoint(digits_run, subprocess_env):
    """s1 (1 process) hands its model to s2 (2 processes, bigger batch); s2 keeps learning from there."""
    config, out = digits_run
    first = torchrun(1, config, "s1", out, subprocess_env).result
    second_run = torchrun(2, config, "s2", out, subprocess_env, "--init-from", first["checkpoint_uri"])
    second = second_run.result
    assert (first["world_size"], second["world_size"]) == (1, 2)
    assert second["global_batch"] == 2 * 64 and first["global_batch"] == 32
    assert second["lr"] == pytest.approx(0.05 * 128 / 32)  # linear rule against base_batch 32
    assert second["val_metric"] > 0.9, "stage 2 should start from stage 1's trained model"
    # Only rank 0 logs epochs: each epoch line appears once, not once per rank.
    epoch_lines = [line for line in second_run.stdout.splitlines() if "stage s2 epoch" in line]
    assert len(epoch_lines) == 2
    # The gradient noise scale is measured in both stages (each rank's batch in two halves, each half's gradient
    # averaged over the ranks, against the whole) and logged with each epoch line.
    for stage in ("s1", "s2"):
        history = json.loads((Path(out) / "train" / stage / "metrics.json").read_text())["history"]
        values = [entry["noise_scale"] for entry in history]  # None while the smoothed estimates are not positive yet
        assert all(value is None or 0 < value < 1e7 for value in values) and values[-1] is not None, history
    assert "noise scale" in epoch_lines[-1]
    # A measured step's halves are each all-reduced and added up: the same average DDP makes of the whole batch, so
    # s2 measuring ends on the weights of s2 never measuring.
    measuring = torch.load(second["checkpoint_uri"], weights_only=True)["model"]
    shutil.rmtree(Path(out) / "train" / "s2")
    torchrun(2, config, "s2", out, subprocess_env, "--init-from", first["checkpoint_uri"], "--override=train.noise_scale=false")
    plain = torch.load(second["checkpoint_uri"], weights_only=True)["model"]
    for name, tensor in plain.items():
        torch.testing.assert_close(measuring[name], tensor, rtol=1e-6, atol=1e-7)
    checkpoint = torch.load(second["checkpoint_uri"], weights_only=True)
    assert checkpoint["global_batch"] == 128 and checkpoint["previous_global_batch"] == 32
    files = sorted(p.name for p in (Path(out) / "train" / "s2").iterdir())
    handed = [name for name in files if name.startswith("final-optimizer-")]  # the optimizer, beside final.pt
    assert len(handed) == 1 and checkpoint["optimizer"]["sharded_checkpoint"].endswith(handed[0])
    assert set(files) - {"checkpoints", "best", *handed} == {"final.pt", "metrics.json", "model.pt"}


def test_diverging_ddp_stage_fails_on_every_rank_as_a_user_error(digits_run, subprocess_env, tmp_path):
    """A 2-process stage whose loss turns NaN (lr 1e6) ends on both ranks with the user-error exit (3) and one
    message naming stage, epoch, step and lr; no rank hangs waiting for the other, and no model is written."""
    config, out = digits_run
    error_file = tmp_path / "errors.txt"
    env = {**subprocess_env, "STAGEWISE_ERROR_FILE": str(error_file)}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "stagewise.train",
               "--config", str(config), "--stage", "s2", "--out", out, "--params", json.dumps({"lr": 1e6, "hidden": 64})]
    completed = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert completed.returncode != 0
    messages = error_file.read_text().splitlines()
    assert len(messages) == 2, "both ranks reached the same verdict and failed as a user error"
    # The lr named is the one applied at that step: 1e6 scaled to the 128 batch (x4), times the warmup factor.
    assert all(m.startswith("stage s2: training diverged") and "epoch 1, step " in m and "(lr " in m
               for m in messages), messages
    assert len(set(messages)) == 1, "every rank names the same epoch and step"
    assert not (Path(out) / "train" / "s2" / "final.pt").exists()
    assert not (Path(out) / "train" / "s2" / "model.pt").exists()
