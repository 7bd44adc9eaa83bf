"""Slurm overhead: one small stage through the Slurm backend on the suite's test cluster vs launched locally.

Needs root, ``ip netns`` and Slurm's daemons (slurm-wlm, munge): tests/slurm_cluster.py starts the cluster.
Each function returns ``{"ours", "baseline", "unit", "details"}``; the harness turns that into a ratio.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from bench.training import _prepare

_STAGE = {"name": "s1", "profile": "ddp2", "per_process_batch": 128, "epochs": 3}
_PARAMS = {"lr": 0.01, "hidden": 128, "dropout": 0.0}


def _job(config_path: Path, out: str, profile: dict[str, Any]) -> Any:
    """Stage s1 of the prepared run on ``profile`` (the ddp2 profile's fields replaced), as the step builds it."""
    from stagewise.airflow.stage_job import stage_job
    from stagewise.definitions.loading import load_config

    raw = yaml.safe_load(config_path.read_text())
    raw["profiles"]["ddp2"].update(profile)
    path = config_path.with_name(f"pipeline-{profile.get('backend', 'local')}.yaml")
    path.write_text(yaml.safe_dump(raw))
    args = ("--stage", "s1", "--out", out, "--params", json.dumps(_PARAMS), "--config", str(path))
    return stage_job(load_config(path), dag_id="bench", run_id=Path(out).name, stage="s1", out=out, attempt=1,
                     params=_PARAMS, init_from=None, config_file=str(path), args=args)


def slurm_stage_overhead(rows: int = 20_000, rounds: int = 3) -> dict[str, Any]:
    """Wall time of one small stage (s1: built-in MLP, hidden 128, 2 processes x 128 rows, 3 epochs, 1 thread each)
    through the Slurm backend (sbatch, one node of the test cluster, srun starting node_launch slurm with 2 processes,
    the task polling the job and reading its result back) ÷ the same stage launched locally at the same world size
    (backends.local: torchrun on this machine). Both through ``stagewise.airflow.backends.run_job``, the step's own
    call, from its call to its return; the sides alternate over ``rounds`` and each side's median counts.

    What the ratio holds above 1 is submission, scheduling, srun's step launch and the polling (slurm.poll_s 1 s).
    The cluster's nodes are network namespaces of this machine: the same CPUs and files, so the training itself costs
    the same on both sides.
    """
    from stagewise.airflow import backends
    from tests import slurm_cluster

    if reason := slurm_cluster.unavailable_reason():
        raise RuntimeError(f"slurm_stage_overhead needs a Slurm test cluster: {reason}")

    walls: dict[str, list[float]] = {"slurm": [], "local": []}
    costs, steps = [], set()
    with tempfile.TemporaryDirectory(prefix="bench-slurm-") as tmp, slurm_cluster.cluster(nodes=2) as cluster:
        _, out = _prepare(Path(tmp), rows, features=32, **{
            "model": {"spec": "stagewise.model:MLPClassifier", "args": {}},
            "profiles__ddp2__threads_per_process": 1, "train__checkpoint_every_steps": 100_000,
            "train__stages": [_STAGE]})
        config_path = Path(tmp) / "pipeline.yaml"
        jobs = {"local": _job(config_path, out, {"backend": "local"}),
                "slurm": _job(config_path, out, {"backend": "slurm", "nodes": 1, "slurm": {
                    "slurm_conf": str(cluster.conf), "poll_s": 1.0, "cpus_per_task": 2}})}
        for number in range(rounds):
            for side in (("slurm", "local") if number % 2 else ("local", "slurm")):
                shutil.rmtree(Path(out, "train"), ignore_errors=True)  # a fresh stage each time, never a resume
                started = time.monotonic()
                result = backends.run_job(jobs[side])
                walls[side].append(time.monotonic() - started)
                steps.add(result["steps"])
                if side == "slurm":
                    costs.append(result["slurm"])
    return {"ours": statistics.median(walls["slurm"]), "baseline": statistics.median(walls["local"]), "unit": "s",
            "details": {"rows": rows, "world_size": 2, "nodes": 1, "stage": _STAGE, "steps": sorted(steps),
                        "slurm_s": [round(v, 3) for v in walls["slurm"]],
                        "local_s": [round(v, 3) for v in walls["local"]],
                        "slurm_cost_last": costs[-1] if costs else None,
                        "load_average_1m": round(os.getloadavg()[0], 2)}}
