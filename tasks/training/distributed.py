"""The distributed environment, read once per process (torchrun sets RANK, LOCAL_RANK, WORLD_SIZE).

Only rank 0 (``master``) logs progress and writes to storage.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass

from stagewise.core.errors import UserError


@dataclass(frozen=True, kw_only=True)
class DistEnv:
    """Where this process sits in the job."""

    rank: int
    """Global rank."""
    local_rank: int
    """Rank on this node; picks the GPU."""
    world_size: int
    """Number of processes in the job."""
    device: str
    """torch device string, e.g. 'cpu' or 'cuda:1'."""

    @property
    def master(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def read_env(device: str = "cpu") -> DistEnv:
    """Read torchrun's variables; ``device`` is cpu, cuda or auto (cuda when present)."""
    import torch

    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        raise UserError("profile asks for device 'cuda' but no CUDA device is visible")
    if use_cuda and local_rank >= torch.cuda.device_count():
        raise UserError(f"local rank {local_rank} needs a GPU, but only {torch.cuda.device_count()} are visible; "
                        f"lower processes_per_node")
    return DistEnv(rank=rank, local_rank=local_rank, world_size=world_size,
                   device=f"cuda:{local_rank}" if use_cuda else "cpu")


def init_process_group(env: DistEnv) -> None:
    """Join the job's process group: NCCL on GPUs, gloo on CPU. A no-op for one process."""
    if not env.distributed:
        return
    import torch
    import torch.distributed as dist

    if env.device.startswith("cuda"):
        torch.cuda.set_device(env.local_rank)
        dist.init_process_group("nccl", device_id=torch.device(env.device))
    else:
        dist.init_process_group("gloo")


@contextlib.contextmanager
def distributed_job(device: str, threads: int) -> Iterator[DistEnv]:
    """Read the environment, pin threads, quiet every rank but 0, and hold the process group for the block."""
    import torch

    env = read_env(device)
    torch.set_num_threads(threads)
    if not env.master:
        logging.getLogger().setLevel(logging.WARNING)
    init_process_group(env)
    try:
        yield env
    finally:
        destroy_process_group(env)


def any_rank(env: DistEnv, flag: bool) -> bool:
    """Whether ``flag`` holds on any rank; every rank must call it (one all-reduce). A check that fails every rank
    then fails them together: a rank that raised alone would have torchrun stop the others before they said why."""
    if not env.distributed:
        return flag
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        return flag
    value = torch.tensor([int(flag)], device=env.device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def destroy_process_group(env: DistEnv) -> None:
    """Leave the job's process group, or the group of one a sharded stage on one process made (even if it failed)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
