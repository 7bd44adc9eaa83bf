"""Checkpoints of a training stage: atomic files, a pointer written last, the last N kept.

Layout under a stage prefix: ``checkpoints/step-000000123.pt`` files and ``checkpoints/latest.json``
naming the newest complete one. A file is fully written (temp + rename locally, one PUT on S3)
before the pointer moves to it, so a crash while writing leaves the previous checkpoint in force.
Files hold tensors and plain values only and load with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from stagewise.core import storage
from stagewise.core.errors import DataError
from stagewise.models.torch_io import load_torch, save_torch

log = logging.getLogger("stagewise.checkpoint")


class CheckpointStore:
    """Save, find and prune the checkpoints of one stage."""

    def __init__(self, stage_prefix: str, keep_last: int = 2) -> None:
        self.prefix = storage.join(stage_prefix, "checkpoints")
        self.pointer = storage.join(self.prefix, "latest.json")
        self.keep_last = max(1, keep_last)

    def path_for(self, step: int) -> str:
        return storage.join(self.prefix, f"step-{step:09d}.pt")

    def save(self, step: int, state: dict[str, Any]) -> str:
        uri = self.path_for(step)
        save_torch(uri, state)
        storage.write_json(self.pointer, {"uri": uri, "step": step})
        self._prune()
        return uri

    def _listed(self) -> list[str]:
        fs, path = storage.filesystem(self.prefix)
        if not fs.isdir(path):
            return []
        found = sorted(p for p in fs.glob(path + "/step-*.pt"))
        return [fs.unstrip_protocol(p) if "://" in self.prefix else p for p in found]

    def _prune(self) -> None:
        fs, _ = storage.filesystem(self.prefix)
        for uri in self._listed()[: -self.keep_last]:
            fs.rm_file(storage.filesystem(uri)[1])

    def latest(self) -> tuple[str, dict[str, Any]] | None:
        """The newest checkpoint that loads: the pointer's, else the newest readable file."""
        candidates = []
        if storage.exists(self.pointer):
            try:
                candidates.append(storage.read_json(self.pointer)["uri"])
            except (DataError, KeyError, TypeError) as exc:  # a torn or foreign pointer: the step files still say
                log.warning("ignoring unreadable checkpoint pointer %s: %s", self.pointer, exc)
        candidates += [uri for uri in reversed(self._listed()) if uri not in candidates]
        for uri in candidates:
            try:
                return uri, load_torch(uri)
            except Exception as exc:  # a torn or foreign file: fall back to an older one
                log.warning("skipping unreadable checkpoint %s: %s", uri, exc)
        return None


def restore_training_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any],
                           device: str | torch.device) -> None:
    """Load a checkpoint's model and optimizer state for training on ``device``.

    The model moves to ``device`` first: ``Optimizer.load_state_dict`` puts each state tensor (e.g.
    SGD momentum, Adam moments) on its parameter's device, so loading into a model still on the CPU
    would leave those buffers behind and the first GPU step would fail on mixed devices.
    """
    model.to(device)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
