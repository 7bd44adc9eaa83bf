"""The training loop shared by sweep trials (one process) and DDP train stages (torchrun).

Batch arithmetic: global batch = per-process batch x world size x accumulation steps. The learning
rate is swept at ``base_batch`` and rescaled by a rule (Goyal et al. 2017: linear).
Sampling follows DistributedSampler: each epoch a permutation seeded by ``seed + epoch`` is padded
to a multiple of the world size and rank r takes every world_size-th index from r.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tasks.distributed import DistEnv
from tasks.errors import UserError

log = logging.getLogger("stagewise.train")


def scaled_lr(base_lr: float, global_batch: int, base_batch: int, rule: str) -> float:
    """The learning rate for ``global_batch`` given the one that holds at ``base_batch``."""
    ratio = global_batch / base_batch
    if rule == "linear":
        return base_lr * ratio
    if rule == "sqrt":
        return base_lr * math.sqrt(ratio)
    if rule == "none":
        return base_lr
    raise UserError(f"train.lr_rule '{rule}' is not one of linear, sqrt, none")


def warmup_factor(step: int, warmup_steps: int) -> float:
    """Gradual warmup: ramp linearly from 1/warmup_steps to 1 over the first ``warmup_steps`` steps."""
    if warmup_steps <= 0 or step >= warmup_steps:
        return 1.0
    return (step + 1) / warmup_steps


@dataclass(kw_only=True)
class EpochResult:
    """What one epoch did, reduced over ranks."""

    epoch: int
    """Zero-based epoch number."""
    train_loss: float
    """Mean training loss over the epoch's samples."""
    val_accuracy: float
    """Accuracy on the validation split."""
    samples_per_s: float
    """Training samples per second over all ranks."""
    lr: float
    """Learning rate at the epoch's last step."""
    steps: int
    """Optimizer steps taken so far in this stage."""


class Loop:
    """Runs epochs of one model over in-memory tensors; DDP-wrapped when the job has several ranks."""

    def __init__(self, *, model: nn.Module, optimizer: torch.optim.Optimizer, env: DistEnv,
                 train: tuple[torch.Tensor, torch.Tensor], validation: tuple[torch.Tensor, torch.Tensor],
                 per_process_batch: int, grad_accum_steps: int = 1, seed: int = 0) -> None:
        self.env = env
        self.module = model.to(env.device)
        self.model: nn.Module = self.module
        if env.distributed:
            from torch.nn.parallel import DistributedDataParallel

            self.model = DistributedDataParallel(self.module, device_ids=[env.local_rank] if env.device != "cpu" else None)
        self.optimizer = optimizer
        self.x_train, self.y_train = (t.to(env.device) for t in train)
        self.x_val, self.y_val = (t.to(env.device) for t in validation)
        self.per_process_batch = per_process_batch
        self.grad_accum_steps = grad_accum_steps
        self.seed = seed
        self.step = 0

    @property
    def global_batch(self) -> int:
        return self.per_process_batch * self.env.world_size * self.grad_accum_steps

    def rank_indices(self, epoch: int) -> torch.Tensor:
        """This rank's sample order for ``epoch`` (DistributedSampler semantics)."""
        num_samples = self.x_train.shape[0]
        generator = torch.Generator().manual_seed(self.seed + epoch)
        order = torch.randperm(num_samples, generator=generator)
        total = math.ceil(num_samples / self.env.world_size) * self.env.world_size
        if total > num_samples:
            order = torch.cat([order, order[: total - num_samples]])
        return order[self.env.rank : total : self.env.world_size]

    def _all_reduce(self, values: list[float]) -> list[float]:
        tensor = torch.tensor(values, dtype=torch.float64, device=self.env.device)
        if self.env.distributed:
            import torch.distributed as dist

            dist.all_reduce(tensor)
        return tensor.tolist()

    def train_epoch(self, epoch: int, lr_at: Callable[[int], float]) -> EpochResult:
        self.model.train()
        torch.manual_seed(self.seed * 1_000_003 + epoch * 1009 + self.env.rank)  # dropout masks
        indices = self.rank_indices(epoch).to(self.env.device)
        micro_batches = torch.split(indices, self.per_process_batch)
        started = time.perf_counter()
        loss_sum, seen, lr = 0.0, 0, lr_at(self.step)
        for index, batch in enumerate(micro_batches):
            boundary = (index + 1) % self.grad_accum_steps == 0 or index + 1 == len(micro_batches)
            inputs, targets = self.x_train[batch], self.y_train[batch]
            sync = self.model.no_sync() if (self.env.distributed and not boundary) else contextlib.nullcontext()
            with sync:
                logits = self.model(inputs)
                loss = F.cross_entropy(logits, targets)
                (loss / self.grad_accum_steps).backward()
            loss_sum += float(loss.detach()) * len(batch)
            seen += len(batch)
            if boundary:
                lr = lr_at(self.step)
                for group in self.optimizer.param_groups:
                    group["lr"] = lr
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
                self.step += 1
        elapsed = time.perf_counter() - started
        correct, count = self.evaluate_counts()
        total_loss, total_seen, total_correct, total_count = self._all_reduce([loss_sum, seen, correct, count])
        return EpochResult(epoch=epoch, train_loss=total_loss / max(total_seen, 1),
                           val_accuracy=total_correct / max(total_count, 1),
                           samples_per_s=total_seen / max(elapsed, 1e-9), lr=lr, steps=self.step)

    @torch.no_grad()
    def evaluate_counts(self) -> tuple[int, int]:
        """Correct predictions and count on this rank's slice of the validation split."""
        self.module.eval()
        x_val = self.x_val[self.env.rank :: self.env.world_size]
        y_val = self.y_val[self.env.rank :: self.env.world_size]
        correct = 0
        for start in range(0, x_val.shape[0], 4096):
            predicted = self.module(x_val[start : start + 4096]).argmax(dim=1)
            correct += int((predicted == y_val[start : start + 4096]).sum())
        return correct, int(x_val.shape[0])


def make_optimizer(model: nn.Module, *, lr: float, weight_decay: float, momentum: float) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=momentum > 0)


def eta_s(epochs_done: int, epochs_total: int, elapsed_s: float) -> float:
    return elapsed_s / max(epochs_done, 1) * (epochs_total - epochs_done)
