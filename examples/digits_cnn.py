"""A small CNN on the digits as 1x8x8 images: a user's own model, named in the config, in every stage.

Use it with ``model: {spec: "stagewise.examples.digits_cnn:DigitsCNN", args: {channels: 16}}`` and the data set's
``features: [{column: image, shape: [1, 8, 8]}]`` (see examples/digits_cnn.yaml): the sweep, the
growing-batch stages, evaluation, the registry and batch inference all run it. The image's shape
comes from the declared column (``DataInfo.shapes``), not from the code. It imports only the public
interface, ``stagewise.spec``.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from stagewise.spec import Classifier, DataInfo, UserError


class DigitsCNN(Classifier):
    """Two 3x3 convolutions over a (channels, height, width) image column, then a linear classifier
    (loss, accuracy and predictions: Classifier)."""

    default_params = {"dropout": 0.0}
    static_shapes = True  # fixed-size rows in, one output per row: a GPU stage may capture its step as a CUDA graph

    def __init__(self, channels: int = 16, column: str = "image") -> None:
        super().__init__(channels=channels, column=column)
        self.channels, self.column = channels, column

    def build(self, data: DataInfo, params: dict[str, Any]) -> nn.Module:
        shape = data.shapes.get(self.column)
        if shape is None or len(shape) != 3:
            raise UserError(f"DigitsCNN needs dataset.features to declare {{column: {self.column}, shape: [channels, "
                            f"height, width]}}; the declared shapes are {data.shapes}")
        if data.num_features != shape[0] * shape[1] * shape[2]:
            raise UserError(f"DigitsCNN reads only the image column '{self.column}' {shape}, but the data has "
                            f"{data.num_features} features")
        c, (depth, height, width) = self.channels, shape
        return nn.Sequential(
            nn.Unflatten(1, (depth, height, width)),  # the row's flattened elements back into the declared shape
            nn.Conv2d(depth, c, 3, padding=1), nn.ReLU(),
            nn.Conv2d(c, 2 * c, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Dropout(float(params["dropout"])),
            nn.Linear(2 * c * (height // 2) * (width // 2), data.num_classes),
        )
