"""The built-in metrics by name, with their directions and ranges: what the config check knows without torch.

The states and computations behind each name are in ``stagewise.definitions.metrics``.
"""

from __future__ import annotations

import math

CLASSIFICATION = ("accuracy", "balanced_accuracy", "f1_macro", "f1_micro", "f1_weighted", "precision_macro",
                  "recall_macro", "log_loss", "auroc", "auprc")
"""The built-in metrics of an integer class label (stagewise.spec.Classifier)."""
REGRESSION = ("rmse", "mae", "r2")
"""The built-in metrics of a float target (stagewise.spec.Regressor)."""
CURVE_METRICS = ("auroc", "auprc")
"""Metrics kept as score histograms: binary, or one-vs-rest macro averages over classes."""
MINIMIZED = frozenset({"log_loss", "rmse", "mae", "loss"})
DIRECTIONS = {name: "minimize" if name in MINIMIZED else "maximize" for name in (*CLASSIFICATION, *REGRESSION, "loss")}
"""Each built-in metric's direction (``loss``, the spec's own loss, is minimised)."""
RANGES = {**{name: (0.0, 1.0) for name in CLASSIFICATION if name != "log_loss"}, "log_loss": (0.0, math.inf),
          "rmse": (0.0, math.inf), "mae": (0.0, math.inf), "r2": (-math.inf, 1.0), "loss": (-math.inf, math.inf)}
"""What each built-in metric can be: a limit outside can never be met nor missed."""
THRESHOLD = "threshold"
"""Not a metric: a binary classifier's decision threshold chosen on the validation split (evaluate.threshold)."""
MAX_CURVE_CLASSES = 100
"""Above this many classes the built-in classifier leaves auroc and auprc out (their histograms grow with classes)."""


def kind_of(metric: str) -> str | None:
    """``classification`` or ``regression`` for a built-in metric's name; None for ``loss`` and a user's own."""
    if metric in CLASSIFICATION:
        return "classification"
    if metric in REGRESSION:
        return "regression"
    return None
