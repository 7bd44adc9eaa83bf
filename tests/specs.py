"""Model specs for tests: each breaks one part of the stagewise.spec contract on purpose (or changes shape by its args)."""

from __future__ import annotations

import math
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


class AdamWCosine(MLPClassifier):
    """Its own AdamW in two groups (weights decayed; biases undecayed at half the lr) and its own schedule: a linear
    warmup over WARMUP steps, then cosine to zero over the rest of the stage (or trial)."""

    WARMUP = 5

    def optimizer(self, module: nn.Module, params: dict[str, Any]) -> torch.optim.Optimizer:
        weights = [p for p in module.parameters() if p.ndim >= 2]
        biases = [p for p in module.parameters() if p.ndim < 2]
        return torch.optim.AdamW([{"params": weights, "weight_decay": 0.01},
                                  {"params": biases, "weight_decay": 0.0, "lr_scale": 0.5}],
                                 lr=params["lr"], betas=(0.9, 0.98))

    def lr_schedule(self, step: int, total_steps: int) -> float | None:
        if step < self.WARMUP:
            return (step + 1) / self.WARMUP
        return 0.5 * (1 + math.cos(math.pi * min((step - self.WARMUP) / max(total_steps - self.WARMUP, 1), 1.0)))


class MissingBeta2(MLPClassifier):
    """Its optimizer reads a hyperparameter nobody set: a KeyError in the user's own code."""

    def optimizer(self, module: nn.Module, params: dict[str, Any]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(module.parameters(), lr=params["lr"], betas=(0.9, params["beta2"]))  # KeyError


class _OneWider(nn.Module):
    """Expects one feature more than the data has: its forward raises on a shape."""

    def __init__(self, features: int, classes: int) -> None:
        super().__init__()
        self.layer = nn.Linear(features + 1, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)  # raises: mat1 and mat2 shapes cannot be multiplied


class WrongWidth(MLPClassifier):
    """Its module's forward raises on the batch's shape."""

    def build(self, data: DataInfo, params: dict[str, Any]) -> nn.Module:
        return _OneWider(data.num_features, data.num_classes)


class _Summed(nn.Module):
    def __init__(self, features: int) -> None:
        super().__init__()
        self.layer = nn.Linear(features, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x).sum(dim=1, keepdim=True).expand(-1, 3).T  # (3, rows): rows and logits swapped


class TransposedOutputs(MLPClassifier):
    """Its forward returns (3, rows) where the loss wants (rows, classes): the loss raises, on the forward's shape."""

    def build(self, data: DataInfo, params: dict[str, Any]) -> nn.Module:
        return _Summed(data.num_features)


class _FailsLater(nn.Module):
    """Runs its first FINE calls, then raises in its forward (past the framework's first-batch check)."""

    FINE = 3

    def __init__(self, features: int, classes: int) -> None:
        super().__init__()
        self.layer = nn.Linear(features, classes)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls > self.FINE:
            raise ValueError(f"no more batches of shape {tuple(x.shape)}")
        return self.layer(x)


class FailsLater(MLPClassifier):
    """A forward that raises mid-epoch, inside the training step."""

    def build(self, data: DataInfo, params: dict[str, Any]) -> nn.Module:
        return _FailsLater(data.num_features, data.num_classes)


class PredictFailsOnBatches(MLPClassifier):
    """predict() that works on the one-row probe of inference's output columns and raises on every real batch."""

    def predict(self, outputs: torch.Tensor) -> dict[str, torch.Tensor]:
        if len(outputs) > 1:
            raise KeyError("calibration")
        return super().predict(outputs)
