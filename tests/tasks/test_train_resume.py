"""Kill a DDP rank mid-stage: the stage fails cleanly, and the retry resumes and matches an uninterrupted run."""

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

REPO_ROOT = Path(__file__).resolve().parents[2]
CHECKPOINT_EVERY = run_cache.REFERENCE_CHECKPOINT_EVERY
KILL_AT_STEP = 25
MLP = "stagewise.model:MLPClassifier"

pytestmark = pytest.mark.torchrun

# What an epoch's history entry measures of the wall clock: the only fields a resumed stage may record otherwise.
TIMING_FIELDS = ("samples_per_s", "validation_s")


def recorded_history(stage_dir: str | Path) -> list[dict]:
    """A stage's metrics.json history (what report.json and report.html draw) without its wall-clock fields."""
    history = json.loads(Path(stage_dir, "metrics.json").read_text())["history"]
    return [{key: value for key, value in entry.items() if key not in TIMING_FIELDS} for entry in history]


def run_stage(config: Path, out: str, env: dict, result_name: str, spec: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "stagewise.train",
               "--config", str(config), "--out", out, *run_cache.REFERENCE_STAGE_ARGS, f"--override=model.spec={spec}",
               "--result-file", str(Path(out) / result_name)]
    return subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)


def processes_mentioning(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and entry.name != str(os.getpid()):
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in cmdline:
                found.append(int(entry.name))
    return found


def clean_run(config: Path, out: str, spec: str, env: dict, tmp_path: Path) -> tuple[str, dict]:
    """The same stage run uninterrupted over the same data: the MLP's is the run's shared reference (run_cache), the
    CNN's is run here in a run prefix of its own."""
    if spec == MLP:
        return run_cache.reference_stage(env)
    reference_out = str(tmp_path / "reference")
    os.makedirs(f"{reference_out}/preprocess")
    shutil.copy(f"{out}/preprocess/manifest.json", f"{reference_out}/preprocess/manifest.json")
    clean = run_stage(config, reference_out, env, "clean.json", spec)
    assert clean.returncode == 0, clean.stderr[-3000:]
    return reference_out, json.loads(Path(reference_out, "clean.json").read_text())


@pytest.mark.parametrize("spec, data", [(MLP, "digits_run"),
                                        ("stagewise.examples.digits_cnn:DigitsCNN", "digits_images_run")])
@pytest.mark.slow
def test_killed_rank_fails_the_stage_and_the_retry_resumes_exactly(request, subprocess_env, tmp_path, spec, data):
    """SIGKILL of rank 1 at step 25 ends every process; the retry redoes at most K steps and ends where a clean run
    does, weights and metrics.json's history (every field but the wall clock's) alike, for the built-in MLP and for a
    user's spec (the example CNN)."""
    config, out = request.getfixturevalue(data)

    faulty_env = {**subprocess_env, "STAGEWISE_FAULT_KILL_AT": f"1:{KILL_AT_STEP}"}
    crashed = run_stage(config, out, faulty_env, "crashed.json", spec)
    assert crashed.returncode != 0, "a killed rank must fail the stage"
    assert processes_mentioning(out) == [], "no rank or agent may outlive the failed stage"
    pointer = json.loads(Path(out, "train", "s2", "checkpoints", "latest.json").read_text())
    assert pointer["step"] == (KILL_AT_STEP // CHECKPOINT_EVERY) * CHECKPOINT_EVERY

    # The Airflow retry: same command, same environment (the fault fires only on a fresh start).
    resumed = run_stage(config, out, faulty_env, "resumed.json", spec)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    result = json.loads(Path(out, "resumed.json").read_text())
    steps_redone = KILL_AT_STEP - result["resumed_from_step"]
    assert 0 <= steps_redone <= CHECKPOINT_EVERY, f"redid {steps_redone} steps"

    reference_out, reference = clean_run(config, out, spec, subprocess_env, tmp_path)
    assert result["steps"] == reference["steps"] and result["handed_epoch"] == reference["handed_epoch"]
    # Tolerance: identical data order and dropout masks; only float summation order may differ.
    assert result["val_metric"] == pytest.approx(reference["val_metric"], abs=1e-9)
    # The noise scale's estimator state is in the checkpoint: the resumed stage's curve ends where the clean one does.
    assert result["noise_scale"] > 0 and result["noise_scale"] == pytest.approx(reference["noise_scale"], rel=1e-6)
    # Its record too: the epoch it resumed in sums every rank's loss and samples, as the clean run's does (it recorded
    # rank 0's alone on every rank once: train loss 1.6828 against 1.7094), and so does every later field.
    assert recorded_history(Path(out, "train", "s2")) == recorded_history(Path(reference_out, "train", "s2"))
    resumed_model = torch.load(Path(out, "train", "s2", "final.pt"), weights_only=True)["model"]
    clean_model = torch.load(Path(reference_out, "train", "s2", "final.pt"), weights_only=True)["model"]
    assert any(t.dim() == 4 for t in clean_model.values()) == spec.endswith("DigitsCNN"), "the stage trained another model"
    for name, tensor in clean_model.items():
        torch.testing.assert_close(resumed_model[name], tensor, rtol=1e-5, atol=1e-6)
