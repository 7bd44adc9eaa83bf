"""``fsdp_handoff_memory``: the peak memory per rank of a 2-rank fsdp stage that starts from a ddp stage's hand-off
(``--init-from`` its final.pt) ÷ the same stage started from scratch.

The model is the built-in MLP at hidden 3072 (9.5M parameters) with AdamW, whose two moments (76 MiB) outweigh the
weights (38 MiB). Each rank runs the real stage (``stagewise.train`` under torchrun) inside this module's wrapper,
which records the process's peak resident memory (VmHWM) when the stage ends; the allocator is set as the tests'
memory cap sets it (one arena, a fixed mmap threshold, Arrow on malloc) so the peak counts what is used. The ratio is
the larger rank's peak of each side.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.sharding import _peak_resident_bytes, _rank_results, _write_rank_result
from bench.training import REPO_ROOT, _prepare

_TIMEOUT_S = 900
HIDDEN = 3072
PARAMS = json.dumps({"lr": 0.0005, "hidden": HIDDEN, "optimizer": "adamw", "dropout": 0.0})


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_THRESHOLD_": "65536",
            "ARROW_DEFAULT_MEMORY_POOL": "system",
            "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}


def peak(results: str, argv: list[str]) -> None:
    """One rank: the training stage given by ``argv``, then this process's peak resident bytes into ``results``."""
    from stagewise import train

    try:
        train.main(argv)
    finally:
        _write_rank_result(results, int(os.environ.get("RANK", "0")),
                           {"rank": int(os.environ.get("RANK", "0")), "peak_resident_bytes": _peak_resident_bytes()})


def _stage(config: Path, out: str, stage: str, processes: int, *extra: str) -> list[dict[str, Any]]:
    train_args = ["--config", str(config), "--out", out, "--stage", stage, "--params", PARAMS, *extra]
    with tempfile.TemporaryDirectory(prefix="bench-handoff-") as results:
        done = subprocess.run([sys.executable, "-m", "stagewise.training.local_torchrun",
                               f"--nproc-per-node={processes}", "-m", "bench.handoff", results, *train_args],
                              cwd=REPO_ROOT, env=_env(), capture_output=True, text=True, timeout=_TIMEOUT_S)
        ranks = _rank_results(results)
    if done.returncode != 0 or len(ranks) != processes:
        raise RuntimeError(f"stage {stage} x{processes} failed: {done.stdout[-2000:]}{done.stderr[-2000:]}")
    return ranks


def fsdp_handoff_memory(rows: int = 4000) -> dict[str, Any]:
    """Peak resident MiB per rank of a 2-rank fsdp stage from a ddp hand-off ÷ from scratch (goal <= 1.1)."""
    with tempfile.TemporaryDirectory(prefix="bench-handoff-") as tmp:
        _, out = _prepare(Path(tmp), rows, features=32, **{
            "model": {"spec": "stagewise.model:MLPClassifier", "args": {}},
            "train__checkpoint_every_steps": 100_000, "train__noise_scale": False,
            "train__stages": [
                {"name": "s1", "profile": "ddp1", "per_process_batch": 64, "epochs": 1},
                {"name": "s2", "profile": "ddp2", "per_process_batch": 64, "epochs": 1, "strategy": "fsdp",
                 "hand_on": "last"}]})
        config = Path(tmp) / "pipeline.yaml"
        scratch = _stage(config, out, "s2", 2)
        shutil.rmtree(Path(out, "train", "s2"))
        first = _stage(config, out, "s1", 1)
        handed = Path(out, "train", "s1", "final.pt")
        handed_bytes = handed.stat().st_size
        from_hand_off = _stage(config, out, "s2", 2, "--init-from", str(handed))
    mib = {side: [round(rank["peak_resident_bytes"] / 2**20, 1) for rank in ranks]
           for side, ranks in (("scratch", scratch), ("hand_off", from_hand_off), ("ddp_s1", first))}
    parameters = (32 + 1) * HIDDEN + (HIDDEN + 1) * HIDDEN + (HIDDEN + 1) * 10
    return {"ours": max(mib["hand_off"]), "baseline": max(mib["scratch"]), "unit": "peak resident MiB per rank",
            "details": {"per_rank_mib": mib, "parameters": parameters, "optimizer": "adamw", "processes": 2,
                        "hand_off_file_mib": round(handed_bytes / 2**20, 1),
                        "model_mib": round(parameters * 4 / 2**20, 1)}}


if __name__ == "__main__":
    if len(sys.argv) < 3:
        raise SystemExit("usage: python -m bench.handoff RESULTS_DIR STAGEWISE_TRAIN_ARGS... (under torchrun)")
    peak(sys.argv[1], sys.argv[2:])
