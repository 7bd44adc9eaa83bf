"""Model specs for tests: each breaks one part of the stagewise.spec contract on purpose (or changes shape by its args)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from stagewise.models.mlp import MLPClassifier
from stagewise.spec import Average, DataInfo


class MeanAccuracy(MLPClassifier):
    """Reports a per-batch mean as a plain float: it cannot be reduced across batches and ranks."""

    def metrics(self, outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, Any]:
        return {"accuracy": float((outputs.argmax(dim=1) == targets).float().mean())}


class CubePredictions(MLPClassifier):
    """Predicts a (rows, 2, 5) block, which no Parquet prediction column can hold."""

    def predict(self, outputs: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"scores": outputs.view(-1, 2, 5)}


class NoModule(MLPClassifier):
    """build() returns something that is not a torch module."""

    def build(self, data: DataInfo, params: dict[str, Any]) -> Any:
        return {"weights": torch.zeros(3)}


class DeepMLP(MLPClassifier):
    """The MLP with ``extra`` more hidden layers: another state dict for the same hyperparameters."""

    def __init__(self, extra: int = 0) -> None:
        super().__init__(extra=extra)
        self.extra = extra

    def build(self, data: DataInfo, params: dict[str, Any]) -> nn.Module:
        base = super().build(data, params)
        hidden = int(params["hidden"])
        layers = [module for _ in range(self.extra) for module in (nn.Linear(hidden, hidden), nn.ReLU())]
        return nn.Sequential(*list(base)[:-1], *layers, list(base)[-1])


class LogLoss(MLPClassifier):
    """Reports its negative log-likelihood as 'nll' too, for an objective to minimise."""

    def metrics(self, outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, Average]:
        nll = torch.nn.functional.cross_entropy(outputs, targets, reduction="sum")
        return {**super().metrics(outputs, targets), "nll": Average(nll, len(targets))}


class TooFewClasses(MLPClassifier):
    """Builds three logits for the ten digit classes: its outputs do not fit the targets."""

    def build(self, data: DataInfo, params: dict[str, Any]) -> nn.Module:
        return nn.Linear(data.num_features, 3)


class SummedLoss(MLPClassifier):
    """Returns the per-row losses, not their mean: no scalar to call backward on."""

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(outputs, targets, reduction="none")
