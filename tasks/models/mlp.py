"""The built-in model spec; configs and bundles name it by its public path ``stagewise.model:MLPClassifier``."""

from __future__ import annotations

from typing import Any

from torch import nn

from stagewise.core.errors import UserError
from stagewise.definitions.hyperparams import BUILTIN_SPEC_PARAMS, defaults
from stagewise.definitions.spec import Classifier, DataInfo


class MLPClassifier(Classifier):
    """Two hidden ReLU layers over the feature vector; cross-entropy, accuracy, class and probabilities (Classifier)."""

    default_params = defaults(BUILTIN_SPEC_PARAMS)
    static_shapes = True  # a (batch, features) matrix in, (batch, classes) out: its step can be a CUDA graph

    def build(self, data: DataInfo, params: dict[str, Any]) -> nn.Module:
        if data.num_classes is None:
            raise UserError("MLPClassifier needs an integer class label (dataset.num_classes)")
        hidden, dropout = int(params["hidden"]), float(params["dropout"])
        return nn.Sequential(
            nn.Linear(data.num_features, hidden), nn.ReLU(), nn.Dropout(dropout),
            nn.Linear(hidden, hidden), nn.ReLU(), nn.Dropout(dropout),
            nn.Linear(hidden, data.num_classes),
        )


