"""Sharded (fsdp) stages against replicated (ddp) ones: memory per rank and throughput.

``fsdp_memory_per_rank``: the bytes one rank holds of the parameters, the gradients and the optimizer state (AdamW) of
a 21M-parameter model after a training step, under fsdp ÷ under ddp, 2 ranks (``_4``: 4 ranks). Each rank is a
process of its own under torchrun running this module's worker, which spreads the model with the stage's own strategy
(stagewise.training.strategy) and optimizer (stagewise.training.optimizers.make_optimizer); on CUDA the allocator's peak
(torch.cuda.max_memory_allocated) is recorded beside it, on the CPU each process's peak resident memory (VmHWM).

``fsdp_throughput``: training samples/s of the same 2-process stage (the built-in MLP, hidden 1024, 128 rows per
process, stagewise.training.local_torchrun) under fsdp ÷ under ddp, the sides alternated over rounds.
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

from bench.multinode import _training_ms_per_1000
from bench.training import REPO_ROOT, _prepare

_TIMEOUT_S = 900
WIDTH, DEPTH = 1024, 20  # 20 x (1024 x 1024 + 1024) = 21.0M parameters


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}


def _peak_resident_bytes() -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _write_rank_result(folder: str, rank: int, result: dict[str, Any]) -> None:
    """This rank's result as a file of its own in ``folder``, moved into place whole: the ranks share one stdout, where
    their lines can run together."""
    path = Path(folder, f"rank-{rank}.json")
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, path)


def _rank_results(folder: str) -> list[dict[str, Any]]:
    """What each rank wrote with :func:`_write_rank_result`, by rank."""
    ranks = [json.loads(path.read_text()) for path in Path(folder).glob("rank-*.json")]
    return sorted(ranks, key=lambda rank: rank["rank"])


def worker(strategy_name: str, results: str) -> None:
    """One rank: build, spread, one AdamW step; write this rank's state bytes (and peaks) into ``results``."""
    import torch
    from torch import nn

    from stagewise.definitions.spec import ModelSpec
    from stagewise.training.distributed import distributed_job
    from stagewise.training.optimizers import make_optimizer
    from stagewise.training.strategy import make_strategy, state_bytes

    # A GPU a rank where there are enough (one-GPU machines measure on the CPU: the bytes held are the same).
    device = "cuda" if torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", "1")) else "cpu"
    with distributed_job(device, threads=1) as env:
        torch.manual_seed(0)
        module = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)]).to(env.device)
        strategy = make_strategy(strategy_name, env, spec=ModelSpec())
        strategy.prepare(module)
        optimizer = make_optimizer(module, {"lr": 1e-3, "optimizer": "adamw", "weight_decay": 0.0})
        model = strategy.wrap(module)
        inputs = torch.randn(32, WIDTH, device=env.device)
        for _ in range(2):  # the second step runs with the optimizer state made by the first
            model(inputs).square().mean().backward()
            optimizer.step()
            held = state_bytes(module, optimizer, strategy)  # before zero_grad: the gradients are held too
            optimizer.zero_grad(set_to_none=True)
        parameters = sum(p.numel() for p in module.parameters()) if strategy_name == "ddp" else None
        peak_device = torch.cuda.max_memory_allocated(env.device) if env.device.startswith("cuda") else None
        _write_rank_result(results, env.rank, {
            "rank": env.rank, "held": held, "total": sum(held.values()), "parameters": parameters,
            "peak_device_bytes": peak_device, "peak_resident_bytes": _peak_resident_bytes()})
        strategy.close()


def collectives(elements: int, results: str, repeats: int = 20) -> None:
    """One rank: ms per call of the collectives each strategy's step runs over ``elements`` float32 values (DDP: one
    all-reduce; fsdp: an all-gather of the shards and a reduce-scatter of the gradients), on this machine's backend;
    rank 0 writes them into ``results``."""
    import time

    import torch
    import torch.distributed as dist

    from stagewise.training.distributed import distributed_job

    with distributed_job("cpu", threads=1) as env:
        world = env.world_size
        full, shard = torch.randn(elements - elements % world), torch.randn(elements // world)
        gathered, scattered = torch.empty_like(full), torch.empty_like(shard)
        calls = {"all_reduce": lambda: dist.all_reduce(full),
                 "all_gather": lambda: dist.all_gather_into_tensor(gathered, shard),
                 "reduce_scatter": lambda: dist.reduce_scatter_tensor(scattered, full)}
        timed = {}
        for name, call in calls.items():
            for _ in range(3):
                call()
            dist.barrier()
            started = time.perf_counter()
            for _ in range(repeats):
                call()
            dist.barrier()
            timed[f"{name}_ms"] = round((time.perf_counter() - started) / repeats * 1000, 2)
        if env.master:
            _write_rank_result(results, env.rank, {"rank": env.rank, "collectives": timed,
                                                   "backend": dist.get_backend(), "elements": elements})


def _collectives(elements: int, processes: int = 2) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-collectives-") as results:
        done = subprocess.run([sys.executable, "-W", "ignore::FutureWarning", "-m", "stagewise.training.local_torchrun",
                               f"--nproc-per-node={processes}", "-m", "bench.sharding", "collectives", str(elements),
                               results], cwd=REPO_ROOT, env=_env(), capture_output=True, text=True, timeout=_TIMEOUT_S)
        found = _rank_results(results)
    if done.returncode != 0 or not found:
        raise RuntimeError(f"the collectives timing failed: {done.stdout[-2000:]}{done.stderr[-2000:]}")
    return found[0]


def _memory(strategy: str, processes: int) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="bench-fsdp-ranks-") as results:
        done = subprocess.run([sys.executable, "-m", "stagewise.training.local_torchrun",
                               f"--nproc-per-node={processes}", "-m", "bench.sharding", "worker", strategy, results],
                              cwd=REPO_ROOT, env=_env(), capture_output=True, text=True, timeout=_TIMEOUT_S)
        if done.returncode != 0:
            raise RuntimeError(f"{strategy} x{processes} failed: {done.stdout[-2000:]}{done.stderr[-2000:]}")
        ranks = _rank_results(results)
    if [rank["rank"] for rank in ranks] != list(range(processes)):
        raise RuntimeError(f"{strategy} x{processes}: ranks {[rank['rank'] for rank in ranks]} reported: "
                           f"{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return ranks


def _memory_ratio(processes: int) -> dict[str, Any]:
    replicated, sharded = _memory("ddp", processes), _memory("fsdp", processes)
    most = {side: max(rank["total"] for rank in ranks) for side, ranks in (("ddp", replicated), ("fsdp", sharded))}

    def peaks(ranks: list[dict[str, Any]], key: str) -> list[float] | None:
        values = [rank[key] for rank in ranks]
        return None if any(value is None for value in values) else [round(value / 2**20, 1) for value in values]

    return {"ours": most["fsdp"] / 2**20, "baseline": most["ddp"] / 2**20, "unit": "MiB per rank (params+grads+AdamW)",
            "details": {"processes": processes, "parameters": replicated[0]["parameters"],
                        "fsdp_held_mib": {key: round(value / 2**20, 2) for key, value in sharded[0]["held"].items()},
                        "ddp_held_mib": {key: round(value / 2**20, 2) for key, value in replicated[0]["held"].items()},
                        "peak_device_mib": {"fsdp": peaks(sharded, "peak_device_bytes"),
                                            "ddp": peaks(replicated, "peak_device_bytes")},
                        "peak_resident_mib": {"fsdp": peaks(sharded, "peak_resident_bytes"),
                                              "ddp": peaks(replicated, "peak_resident_bytes")}}}


def fsdp_memory_per_rank() -> dict[str, Any]:
    """fsdp ÷ ddp bytes per rank of parameters, gradients and AdamW state, 21M parameters, 2 ranks (goal <= 0.6)."""
    return _memory_ratio(2)


def fsdp_memory_per_rank_4() -> dict[str, Any]:
    """As fsdp_memory_per_rank with 4 ranks (goal <= 0.35)."""
    return _memory_ratio(4)


def fsdp_throughput(rows: int = 60_000, rounds: int = 3) -> dict[str, Any]:
    """Samples/s of a 2-process stage under fsdp ÷ under ddp (ours = ddp's ms per 1000 samples, baseline = fsdp's:
    the ratio is fsdp's rate over ddp's), median over the epochs after the first, sides alternated over ``rounds``."""
    sides: dict[str, list[float]] = {"ddp": [], "fsdp": []}
    with tempfile.TemporaryDirectory(prefix="bench-fsdp-") as tmp:
        _, out = _prepare(Path(tmp), rows, features=32, **{
            "model": {"spec": "stagewise.model:MLPClassifier", "args": {}},
            "profiles__ddp2__threads_per_process": 1, "train__checkpoint_every_steps": 100_000,
            "train__noise_scale": False,
            "train__stages": [{"name": "s1", "profile": "ddp2", "per_process_batch": 128, "epochs": 4}]})
        for number in range(rounds):
            for strategy in (("fsdp", "ddp") if number % 2 else ("ddp", "fsdp")):
                shutil.rmtree(Path(out, "train"), ignore_errors=True)  # a fresh stage each time, never a resume
                done = subprocess.run(
                    [sys.executable, "-m", "stagewise.training.local_torchrun", "--nproc-per-node=2", "-m",
                     "stagewise.train", "--config", str(Path(tmp) / "pipeline.yaml"), "--stage", "s1", "--out", out,
                     "--params", json.dumps({"lr": 0.01, "hidden": 1024, "dropout": 0.0}),
                     f"--override=train.stages.0.strategy={strategy}"],
                    cwd=REPO_ROOT, env=_env(), capture_output=True, text=True, timeout=_TIMEOUT_S)
                if done.returncode != 0:
                    raise RuntimeError(f"{strategy} stage failed: {done.stdout[-2000:]}{done.stderr[-2000:]}")
                sides[strategy].extend(_training_ms_per_1000(out))
    median = {side: statistics.median(values) for side, values in sides.items()}
    parameters = (32 + 1) * 1024 + (1024 + 1) * 1024 + (1024 + 1) * 10  # the MLP at hidden 1024: 32 features, 10 classes
    timed = _collectives(parameters)
    return {"ours": median["ddp"], "baseline": median["fsdp"], "unit": "ms per 1000 samples (ddp / fsdp)",
            "details": {"rows": rows, "processes": 2, "per_process_batch": 128, "hidden": 1024, "rounds": rounds,
                        "fsdp_samples_per_s": round(1000_000 / median["fsdp"], 1),
                        "ddp_samples_per_s": round(1000_000 / median["ddp"], 1),
                        "collectives_ms": {**timed["collectives"], "backend": timed["backend"],
                                           "float32_values": timed["elements"]},
                        "why": "per step ddp runs one all-reduce, bucketed and overlapped with the backward; fsdp runs "
                               "an all-gather per unit in the forward and again in the backward where a unit reshards, "
                               "and a reduce-scatter per unit, each in turn with the computation on the CPU (FSDP2 "
                               "overlaps them on CUDA streams): collectives_ms holds this machine's cost of each"}}


if __name__ == "__main__":
    if sys.argv[1:2] == ["worker"] and len(sys.argv) == 4:
        worker(sys.argv[2], sys.argv[3])
    elif sys.argv[1:2] == ["collectives"] and len(sys.argv) == 4:
        collectives(int(sys.argv[2]), sys.argv[3])
    else:
        raise SystemExit("usage: python -m bench.sharding worker ddp|fsdp RESULTS_DIR | collectives ELEMENTS "
                         "RESULTS_DIR (under torchrun)")
