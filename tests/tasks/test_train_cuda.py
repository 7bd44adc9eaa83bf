"""Stages on a GPU: the growing-batch hand-off and kill-and-resume both load optimizer state onto CUDA.

These run only where CUDA is present (skipped with the reason elsewhere, CI included: its machine has
no GPU). The CPU tests in training/test_loop.py pin the order that makes them pass: the model is on its
device before the optimizer loads a checkpoint's state.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tasks import train
from tasks.config import load_config

REPO_ROOT = Path(__file__).resolve().parents[2]
CUDA = {f"profiles.{name}.device": "cuda" for name in ("ddp1", "ddp2")}
ONE_GPU = {**CUDA, "profiles.ddp2.processes_per_node": 1}  # s2 still grows the batch: 64 per process vs s1's 32
PARAMS = {"lr": 0.05, "hidden": 64, "momentum": 0.9}

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: GPU stage tests need one")


@pytest.fixture
def single_process(monkeypatch):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", train.FAULT_ENV):
        monkeypatch.delenv(name, raising=False)


def test_second_stage_starts_from_the_first_on_the_gpu(digits_run, single_process):
    """s1 trains on cuda and hands final.pt (SGD momentum included) to s2, which keeps training on cuda."""
    config_path, out = digits_run
    config = load_config(config_path, ONE_GPU)
    first = train.run_stage(config, "s1", out, PARAMS, None)
    second = train.run_stage(config, "s2", out, PARAMS, first["checkpoint_uri"])
    assert second["global_batch"] > first["global_batch"] and second["steps"] > 0
    assert second["val_metric"] > 0.9, "s2 should keep learning from s1's model"
    state = torch.load(second["checkpoint_uri"], weights_only=True)
    assert state["previous_global_batch"] == first["global_batch"]
    momentum = [buffer["momentum_buffer"] for buffer in state["optimizer"]["state"].values()]
    assert momentum and all(torch.isfinite(m).all() for m in momentum)


def _torchrun(config: Path, out: str, env: dict, result_name: str) -> subprocess.CompletedProcess:
    overrides = [f"--override={key}={json.dumps(value)}" for key, value in ONE_GPU.items()]
    command = [sys.executable, "-m", "tasks.training.local_torchrun", "--nproc-per-node=1", "-m", "tasks.train",  # as the launcher runs it
               "--config", str(config), "--stage", "s1", "--out", out, "--params", json.dumps(PARAMS),
               "--override=train.checkpoint_every_steps=10", "--override=train.stages.0.epochs=3", *overrides,
               "--result-file", str(Path(out) / result_name)]
    return subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_killed_gpu_stage_resumes_from_its_checkpoint(digits_run, subprocess_env, tmp_path):
    """A rank SIGKILLed at step 25 on cuda; the retry loads the step-20 checkpoint onto the GPU and ends like a clean run."""
    config, out = digits_run
    reference_out = str(tmp_path / "reference")
    os.makedirs(f"{reference_out}/preprocess")
    shutil.copy(f"{out}/preprocess/manifest.json", f"{reference_out}/preprocess/manifest.json")
    faulty = {**subprocess_env, train.FAULT_ENV: "0:25"}
    crashed = _torchrun(config, out, faulty, "crashed.json")
    assert crashed.returncode != 0
    resumed = _torchrun(config, out, faulty, "resumed.json")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    result = json.loads(Path(out, "resumed.json").read_text())
    assert result["resumed_from_step"] == 20
    clean = _torchrun(config, reference_out, subprocess_env, "clean.json")
    assert clean.returncode == 0, clean.stdout[-3000:] + clean.stderr[-3000:]
    reference = json.loads(Path(reference_out, "clean.json").read_text())
    assert result["steps"] == reference["steps"]
    # Same batches and dropout masks; cuBLAS may sum in another order than the uninterrupted run.
    assert result["val_metric"] == pytest.approx(reference["val_metric"], abs=0.01)
    resumed_model = torch.load(Path(out, "train", "s1", "final.pt"), weights_only=True)["model"]
    clean_model = torch.load(Path(reference_out, "train", "s1", "final.pt"), weights_only=True)["model"]
    for name, tensor in clean_model.items():
        torch.testing.assert_close(resumed_model[name], tensor, rtol=1e-3, atol=1e-4)


def test_sweep_trials_train_on_the_gpu(digits_run, single_process):
    """A sweep worker on a cuda profile runs its trials on the device and the study gets real values."""
    pytest.importorskip("optuna")
    from tasks.sweep import create, run_worker, summarize

    config_path, out = digits_run
    config = load_config(config_path, {"profiles.small.device": "cuda", "sweep.num_trials": 2, "sweep.num_workers": 1})
    create(config, "gpu")
    result = run_worker(config, "gpu", 0, out)
    summary = summarize(config, "gpu", out)
    assert result["trials_run"] == 2 and result["epochs_run"] > 0
    assert summary["n_complete"] >= 1 and summary["best_value"] > 0.5
