"""Multi-node overhead: one stage on 2 emulated nodes x 1 process vs 1 node x 2 processes (needs root and ``ip netns``).

Each function returns ``{"ours", "baseline", "unit", "details"}``; the harness turns that into a ratio.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.training import REPO_ROOT, _prepare

_TIMEOUT_S = 600
_ROUNDS = 3


def _training_ms_per_1000(out: str) -> list[float]:
    """ms per 1000 training samples of each epoch after the first, from the stage's metrics.json (rank 0's
    samples/s over all ranks: the training steps only, no validation, process start or rendezvous)."""
    history = json.loads(Path(out, "train", "s1", "metrics.json").read_text())["history"]
    return [1e6 / epoch["samples_per_s"] for epoch in history[1:]]


def multinode_overhead(rows: int = 60_000) -> dict[str, Any]:
    """Training time of stage s1 (built-in MLP, hidden 256, 128 rows per process, 4 epochs, 1 thread per process)
    on 2 emulated nodes x 1 process (stagewise.training.node_launch sagemaker in two network namespaces joined by a veth
    pair, gloo over it) vs 1 node x 2 processes (stagewise.training.local_torchrun, gloo over loopback).

    ours / baseline = median ms per 1000 training samples over the epochs after the first (three runs of each side,
    alternated): the cost of the veth and the multi-node launch on the steps themselves. Both "nodes" share this
    machine's CPUs, so it measures the network path, not a real cluster's. Raises when netns is unavailable.
    """
    from tests import netns

    netns.check_available()
    load_before = os.getloadavg()[0]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    with tempfile.TemporaryDirectory(prefix="bench-multinode-") as tmp:
        config, out = _prepare(Path(tmp), rows, features=32, **{
            "model": {"spec": "stagewise.model:MLPClassifier", "args": {}},
            "profiles__ddp2__threads_per_process": 1, "train__checkpoint_every_steps": 100_000,
            "train__stages": [{"name": "s1", "profile": "ddp2", "per_process_batch": 128, "epochs": 4}]})
        stage = ["-m", "stagewise.train", "--config", str(Path(tmp) / "pipeline.yaml"), "--stage", "s1", "--out", out,
                 "--params", json.dumps({"lr": 0.01, "hidden": 256, "dropout": 0.0})]
        multi, single, results = [], [], {}
        with netns.two_hosts() as hosts:
            for _ in range(_ROUNDS):  # alternated, so both sides meet the same machine
                shutil.rmtree(Path(out, "train"), ignore_errors=True)  # a fresh stage each time, never a resume
                nodes = [netns.popen(host, [sys.executable, "-m", "stagewise.training.node_launch", "sagemaker",
                                            "--nproc-per-node=1", *stage],
                                     netns.sagemaker_environment(host, hosts, Path(tmp), env), cwd=REPO_ROOT,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for host in hosts]
                for node in nodes:
                    output, _ = node.communicate(timeout=_TIMEOUT_S)
                    if node.returncode != 0:
                        raise RuntimeError(f"2-node stage failed (exit {node.returncode}): {output[-2000:]}")
                multi += _training_ms_per_1000(out)
                results["multi_val"] = json.loads(Path(out, "train", "s1", "metrics.json").read_text())["val_metric"]

                shutil.rmtree(Path(out, "train"), ignore_errors=True)
                done = subprocess.run([sys.executable, "-m", "stagewise.training.local_torchrun", "--nproc-per-node=2", *stage],
                                      cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=_TIMEOUT_S)
                if done.returncode != 0:
                    raise RuntimeError(f"1-node stage failed (exit {done.returncode}): {done.stderr[-2000:]}")
                single += _training_ms_per_1000(out)
                results["single_val"] = json.loads(Path(out, "train", "s1", "metrics.json").read_text())["val_metric"]
    return {"ours": statistics.median(multi), "baseline": statistics.median(single), "unit": "ms per 1000 samples",
            "details": {"rows": rows, "world_size": 2, "per_process_batch": 128, "hidden": 256, "epochs_measured": len(multi),
                        "multi_ms_per_1000": [round(v, 2) for v in multi], "single_ms_per_1000": [round(v, 2) for v in single],
                        "multi_val_accuracy": results["multi_val"], "single_val_accuracy": results["single_val"],
                        "load_average_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)]}}


def noise_scale_overhead(rows: int = 60_000, rounds: int = 6) -> dict[str, Any]:
    """Step time of a 2-process DDP stage (built-in MLP, hidden 256, 128 rows per process, 4 epochs, 1 thread per
    process, stagewise.training.local_torchrun) with the gradient noise scale measured (train.noise_scale: a measured
    step runs each rank's batch as two halves, each all-reduced, as fsdp and one process do; spaced out to one step in
    8 x noise_scale_every_steps after the first 10, stagewise.training.noise_scale) ÷ without it.

    ours / baseline = median ms per 1000 training samples over the epochs after the first, the sides alternated over
    ``rounds`` runs; details add the same ratio for one process (the consecutive-steps estimator)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    sides: dict[tuple[int, bool], list[float]] = {}
    per_round: list[float] = []  # each run's median ms per 1000 samples, 2 processes, measured
    per_round_off: list[float] = []
    noise = None  # the last measured one-process run's noise scale at its end
    with tempfile.TemporaryDirectory(prefix="bench-noise-") as tmp:
        _, out = _prepare(Path(tmp), rows, features=32, **{
            "model": {"spec": "stagewise.model:MLPClassifier", "args": {}},
            "profiles__ddp2__threads_per_process": 1, "profiles__ddp1__threads_per_process": 1,
            "train__checkpoint_every_steps": 100_000,
            "train__stages": [{"name": "s1", "profile": "ddp2", "per_process_batch": 128, "epochs": 4}]})
        for number in range(rounds):
            for processes in (2, 1):
                for measured in ((True, False) if number % 2 else (False, True)):
                    shutil.rmtree(Path(out, "train"), ignore_errors=True)  # a fresh stage each time, never a resume
                    profile = "ddp2" if processes == 2 else "ddp1"
                    done = subprocess.run(
                        [sys.executable, "-m", "stagewise.training.local_torchrun", f"--nproc-per-node={processes}",
                         "-m", "stagewise.train", "--config", str(Path(tmp) / "pipeline.yaml"), "--stage", "s1",
                         "--out", out, "--params", json.dumps({"lr": 0.01, "hidden": 256, "dropout": 0.0}),
                         f"--override=train.noise_scale={str(measured).lower()}",
                         f"--override=train.stages.0.profile={profile}"],
                        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=_TIMEOUT_S)
                    if done.returncode != 0:
                        raise RuntimeError(f"stage failed: {done.stdout[-2000:]}{done.stderr[-2000:]}")
                    sides.setdefault((processes, measured), []).extend(_training_ms_per_1000(out))
                    if measured and processes == 1:  # read now: the next run (maybe unmeasured) replaces the history
                        noise = json.loads(Path(out, "train", "s1", "metrics.json").read_text())["history"][-1].get(
                            "noise_scale")
                    if measured and processes == 2:
                        per_round.append(round(statistics.median(sides[(2, True)][-3:]), 3))
                    elif processes == 2:
                        per_round_off.append(round(statistics.median(sides[(2, False)][-3:]), 3))
    median = {key: statistics.median(values) for key, values in sides.items()}
    return {"ours": median[(2, True)], "baseline": median[(2, False)], "unit": "ms per 1000 samples",
            "details": {"rows": rows, "processes": 2, "per_process_batch": 128, "rounds": rounds,
                        "one_process_ratio": round(median[(1, True)] / median[(1, False)], 4),
                        "one_process_ms": {"on": round(median[(1, True)], 3), "off": round(median[(1, False)], 3)},
                        "last_noise_scale_one_process": noise,
                        "ratio_per_round": [round(on / off, 4) for on, off in zip(per_round, per_round_off)]}}
