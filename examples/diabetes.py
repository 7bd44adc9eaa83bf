"""A small MLP regressor on scikit-learn's diabetes data: a float target through every stage.

Use it with ``model: {spec: "stagewise.examples.diabetes:DiabetesMLP", args: {}}``, no ``dataset.num_classes``
(the label is a float target) and ``objective: {metric: rmse, direction: minimize}`` (see
examples/diabetes.yaml). :class:`stagewise.spec.Regressor` trains the module on the standardised target
and reports ``rmse``/``mae`` and predictions in the target's own units. It imports only the public
interface, ``stagewise.spec``.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from stagewise.spec import DataInfo, Regressor


class DiabetesMLP(Regressor):
    """One hidden ReLU layer over the (standardised) features, one output: the standardised target (Regressor)."""

    default_params = {"hidden": 32, "dropout": 0.0}
    static_shapes = True  # fixed-size rows in, one output per row: a GPU stage may capture its step as a CUDA graph

    def build(self, data: DataInfo, params: dict[str, Any]) -> nn.Module:
        hidden = int(params["hidden"])
        return nn.Sequential(nn.Linear(data.num_features, hidden), nn.ReLU(), nn.Dropout(float(params["dropout"])),
                             nn.Linear(hidden, 1))
