"""``resume_redo_fraction``: the optimizer steps a 2 → 3 fsdp retry trains again ÷ the steps trained before the kill.

A stage (built-in MLP, strategy fsdp, global batch 96, a checkpoint every 10 steps) on 2 processes loses rank 1 after
step 65 (``STAGEWISE_FAULT_KILL_AT``); the retry runs on 3 with its profile's ``processes_per_node`` edited to 3, as a
pipeline changes it. The retry's redone steps are the kill's step less the step it resumed from (all 65 when it
starts over). Each attempt is the real ``stagewise.train`` under ``stagewise.training.local_torchrun``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.training import REPO_ROOT, _prepare

_TIMEOUT_S = 900
KILL_AFTER_STEP = 65
CHECKPOINT_EVERY = 10
STAGE_ARGS = ("--stage", "s2", "--params", json.dumps({"lr": 0.05, "hidden": 64}))


def _attempt(config: Path, out: str, processes: int, result: str, *extra: str,
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "stagewise.training.local_torchrun", f"--nproc-per-node={processes}", "-m",
               "stagewise.train", "--config", str(config), "--out", out, *STAGE_ARGS, "--result-file",
               str(Path(out, result)), *extra]
    base = {**os.environ, "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(command, cwd=REPO_ROOT, env={**base, **(env or {})}, capture_output=True, text=True,
                          timeout=_TIMEOUT_S)


def resume_redo_fraction(rows: int = 12_000) -> dict[str, Any]:
    """Steps a 2 → 3 fsdp retry (through the profile) trains again ÷ steps trained before the kill (goal <= 0.1)."""
    with tempfile.TemporaryDirectory(prefix="bench-resume-") as tmp:
        _, out = _prepare(Path(tmp), rows, features=32, **{
            "train__checkpoint_every_steps": CHECKPOINT_EVERY, "train__noise_scale": False,
            "train__stages": [
                {"name": "s1", "profile": "ddp1", "per_process_batch": 32, "epochs": 1},
                {"name": "s2", "profile": "ddp2", "global_batch": 96, "epochs": 2, "strategy": "fsdp"}]})
        config = Path(tmp) / "pipeline.yaml"
        started = time.monotonic()
        killed = _attempt(config, out, 2, "killed.json", env={"STAGEWISE_FAULT_KILL_AT": f"1:{KILL_AFTER_STEP}"})
        killed_s = time.monotonic() - started
        if killed.returncode == 0:
            raise RuntimeError(f"the rank was not killed at step {KILL_AFTER_STEP}: the stage is shorter")
        committed = json.loads(Path(out, "train", "s2", "checkpoints", "latest.json").read_text())["step"]
        started = time.monotonic()
        retried = _attempt(config, out, 3, "retried.json", "--override=profiles.ddp2.processes_per_node=3")
        retry_s = time.monotonic() - started
        if retried.returncode != 0:
            raise RuntimeError(f"the retry on 3 processes failed: {retried.stdout[-2000:]}{retried.stderr[-2000:]}")
        result = json.loads(Path(out, "retried.json").read_text())
        log = retried.stdout + retried.stderr
    resumed_at = result["resumed_from_step"]
    redone = KILL_AFTER_STEP - (resumed_at or 0)
    return {"ours": float(redone), "baseline": float(KILL_AFTER_STEP), "unit": "optimizer steps",
            "details": {"killed_after_step": KILL_AFTER_STEP, "newest_checkpoint_step": committed,
                        "resumed_from_step": resumed_at, "started_over": "starts over" in log,
                        "world_sizes": [2, result["world_size"]], "global_batch": result["global_batch"],
                        "steps": result["steps"], "checkpoint_every_steps": CHECKPOINT_EVERY,
                        "killed_attempt_s": round(killed_s, 1), "retry_s": round(retry_s, 1)}}
