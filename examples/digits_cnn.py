"""A small CNN on the digits as 1x8x8 images: a user's own model, named in the config, in every stage.

Use it with ``model: {spec: "examples.digits_cnn:DigitsCNN", args: {channels: 16}}`` (see
examples/digits_cnn.yaml): the sweep, the growing-batch stages, evaluation, the registry and batch
inference all run it. It imports only the public interface, ``tasks.spec``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tasks.spec import Classifier, DataInfo, UserError


class DigitsCNN(Classifier):
    """Two 3x3 convolutions over the 8x8 image, then a linear classifier (loss, accuracy and predictions: Classifier)."""

    default_params = {"dropout": 0.0}

    def __init__(self, channels: int = 16, side: int = 8) -> None:
        super().__init__(channels=channels, side=side)
        self.channels, self.side = channels, side

    def build(self, data: DataInfo, params: dict[str, Any]) -> nn.Module:
        if data.num_features != self.side * self.side:
            raise UserError(f"DigitsCNN(side={self.side}) needs {self.side * self.side} pixel features, got {data.num_features}")
        c = self.channels
        return nn.Sequential(
            nn.Conv2d(1, c, 3, padding=1), nn.ReLU(),
            nn.Conv2d(c, 2 * c, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Dropout(float(params["dropout"])),
            nn.Linear(2 * c * (self.side // 2) ** 2, data.num_classes),
        )

    def batch(self, features: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return features.view(-1, 1, self.side, self.side), labels
