"""Which epoch a stage hands on and when it stops early: read from the stage's history of the objective, so a
resumed stage (whose history comes back from its checkpoint) decides exactly as an uninterrupted one."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


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
