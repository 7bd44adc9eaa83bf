"""Which epoch a stage hands on and when it stops early: read from the stage's history of the objective, so a
resumed stage (whose history comes back from its checkpoint) decides exactly as an uninterrupted one."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from stagewise.models.torch_io import load_torch
from stagewise.training.checkpoint import CheckpointStore, ShardedCheckpointStore


@dataclass(frozen=True)
class EpochSelection:
    """The objective's direction and, for early stopping, how much better counts and for how long to wait."""

    direction: str
    """maximize or minimize: the objective's."""
    min_delta: float = 0.0
    """Early stopping: the least change that counts as an improvement."""
    patience: int | None = None
    """Early stopping: epochs without improvement before the stage stops (None: never stops early)."""

    def better(self, value: float, best: float | None, margin: float = 0.0) -> bool:
        """Whether ``value`` beats ``best`` by more than ``margin``; a NaN never does, anything beats no best."""
        if math.isnan(value):
            return False
        if best is None:
            return True
        return value > best + margin if self.direction == "maximize" else value < best - margin

    def best_index(self, values: Sequence[float]) -> int | None:
        """The first epoch holding the best value (None: no epoch, or only NaN)."""
        best, index = None, None
        for position, value in enumerate(values):
            if self.better(value, best):
                best, index = value, position
        return index

    def epochs_without_improvement(self, values: Sequence[float]) -> int:
        """Epochs since the last one that beat every earlier epoch by more than ``min_delta``."""
        best, since = None, 0
        for value in values:
            if self.better(value, best, self.min_delta):
                best, since = value, 0
            else:
                since += 1
        return since

    def should_stop(self, values: Sequence[float]) -> bool:
        return self.patience is not None and self.epochs_without_improvement(values) >= self.patience


def cpu_copy(state: Any) -> Any:
    """A copy of a (nested) state dict with every tensor cloned to the CPU: later steps cannot change it."""
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return {key: cpu_copy(value) for key, value in state.items()}
    if isinstance(state, list | tuple):
        return type(state)(cpu_copy(value) for value in state)
    return state


class BestEpoch:
    """The best epoch's model and optimizer, kept for ``hand_on: best`` in files of their own under ``best/`` (never in
    memory, never inside final.pt): a whole file from rank 0 where each rank holds the whole state (ddp), a sharded
    checkpoint where each holds a shard (fsdp). Its :meth:`record` (the file's URI) goes into each checkpoint, so a
    resume hands on the same epoch."""

    def __init__(self, strategy: Any, stage_prefix: str, *, master: bool, trust_unrecorded: bool = False) -> None:
        self.strategy, self.master = strategy, master
        self.state: dict[str, Any] | None = None
        # Two kept: a resume from a checkpoint older than the newest best still finds the best it recorded.
        self.store = (ShardedCheckpointStore(stage_prefix, keep_last=2, master=master, folder="best",
                                             trust_unrecorded=trust_unrecorded)
                      if strategy.shards_state else
                      CheckpointStore(stage_prefix, keep_last=2, folder="best", trust_unrecorded=trust_unrecorded))

    @property
    def available(self) -> bool:
        """Whether a best epoch is kept here (False on ranks that keep none, and after a resume from an older format)."""
        return self.state is not None

    def keep(self, epoch: int, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """This epoch is the best so far: keep its state (every rank calls it)."""
        if self.strategy.shards_state:
            self.state = {"uri": self.store.save(epoch, self.strategy.training_state(module, optimizer))}
        elif self.master:
            self.state = {"uri": self.store.save(epoch, {"model": module.state_dict(), "optimizer": optimizer.state_dict()})}

    def record(self) -> dict[str, Any]:
        return self.state or {}

    def restore(self, recorded: dict[str, Any] | None) -> None:
        """Take a checkpoint's record back (the best epoch's file; a CPU copy from an older checkpoint)."""
        self.state = recorded or None
        if self.state is not None and not self.strategy.shards_state and not self.master:
            self.state = None

    def load_into(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Put the best epoch's weights and optimizer state into the live ones (every rank calls it)."""
        if self.state is None:
            return
        if "uri" in self.state:
            self.store.require_intact(self.state["uri"])
        if self.strategy.shards_state:
            shards = ShardedCheckpointStore.load_shards(self.state["uri"], self.strategy.training_state(module, optimizer))
            self.strategy.load_training_state(module, optimizer, shards)
            return
        state = load_torch(self.state["uri"]) if "uri" in self.state else self.state  # older checkpoints: inline
        module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
