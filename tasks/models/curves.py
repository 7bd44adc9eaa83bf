"""What a classification report draws: the confusion matrix and a binary model's ROC and precision-recall curves.

Exact curves of the test split's written scores (numpy, no scikit-learn), thinned to at most :data:`CURVE_POINTS`
points each for the report; the metrics themselves (auroc, auprc) come from the reduced states
(stagewise.definitions.metrics).
"""

from __future__ import annotations

from typing import Any

import numpy as np

CURVE_POINTS = 200
"""Points kept of each curve in report.json (the first and last always)."""


def confusion_counts(labels: Any, predicted: Any, num_classes: int) -> dict[str, Any]:
    """Rows: true class; columns: predicted class."""
    index = np.asarray(labels, dtype=np.int64) * num_classes + np.asarray(predicted, dtype=np.int64)
    counts = np.bincount(index, minlength=num_classes * num_classes).reshape(num_classes, num_classes)
    return {"labels": list(range(num_classes)), "counts": counts.tolist(), "rows": "true class", "columns": "predicted"}


def _thin(length: int) -> np.ndarray:
    if length <= CURVE_POINTS:
        return np.arange(length)
    return np.unique(np.linspace(0, length - 1, CURVE_POINTS).round().astype(np.int64))


def binary_curves(labels: Any, scores: Any) -> dict[str, Any]:
    """ROC (fpr, tpr) and precision-recall points at every distinct score, highest first, thinned; empty when the
    split lacks positives or negatives."""
    labels, scores = np.asarray(labels) == 1, np.asarray(scores, dtype=np.float64)
    positives, negatives = int(labels.sum()), int((~labels).sum())
    if positives == 0 or negatives == 0:
        return {}
    order = np.argsort(-scores, kind="stable")
    ranked, hits = scores[order], labels[order]
    last = np.r_[np.flatnonzero(np.diff(ranked)), len(ranked) - 1]  # the last row of each distinct score
    true_positive = np.cumsum(hits)[last]
    false_positive = (last + 1) - true_positive
    keep = _thin(len(last))
    tpr, fpr = true_positive / positives, false_positive / negatives
    precision = true_positive / (true_positive + false_positive)
    rounded = lambda values: [round(float(v), 6) for v in values]  # noqa: E731 - a report's numbers, not a metric
    return {"positive_class": 1, "positives": positives, "negatives": negatives,
            "roc": {"fpr": rounded(np.r_[0.0, fpr[keep]]), "tpr": rounded(np.r_[0.0, tpr[keep]]),
                    "thresholds": rounded(np.r_[1.0, ranked[last][keep]])},
            "pr": {"recall": rounded(tpr[keep]), "precision": rounded(precision[keep]),
                   "thresholds": rounded(ranked[last][keep])}}
