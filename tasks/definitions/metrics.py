"""Metrics as reducible state: what a spec's ``metrics(outputs, targets)`` returns for each batch.

A metric is a :class:`MetricState`: a fixed-shape tensor that one batch contributes (counts, sums, a confusion matrix,
score histograms) and a ``compute`` function of the state summed over every batch and rank. The framework adds the
states up (one all-reduce for all of a validation's metrics) and computes each metric once, so its value does not
depend on the batch size, the number of ranks or an uneven last batch. :class:`Average` (a total and a count) is the
simplest case. This mirrors torchmetrics' ``update``/``compute`` contract with sum-reduced states only
(docs/your-own-model.md says why Stagewise keeps its own).

Use::

    from stagewise.spec import MetricState, confusion_matrix

    def metrics(self, outputs, targets):
        counts = confusion_matrix(outputs.argmax(dim=1), targets, outputs.shape[1])
        return {"my_f1": MetricState(counts, compute=macro_f1)}   # macro_f1(summed counts) -> float

The built-in metrics (stagewise.definitions.metric_names: their names, directions and ranges) are written the
same way. The curve metrics (``auroc``, ``auprc``) keep histograms of the log-odds of each class's probability in
:data:`CURVE_BINS` bins over ±:data:`LOGIT_RANGE`: scores that fall in one bin count as tied, which moves the
value from the exact one by less than :data:`CURVE_TOLERANCE` on the suite's data (tests/tasks/test_metrics.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from stagewise.core.errors import UserError
from stagewise.definitions.metric_names import CLASSIFICATION, CURVE_METRICS, MAX_CURVE_CLASSES, REGRESSION, THRESHOLD

CURVE_BINS = 8192
"""Histogram bins of each class's log-odds for auroc and auprc."""
LOGIT_RANGE = 16.0
"""The log-odds the bins span (±16: probabilities from 1.1e-7 to 1 - 1.1e-7; beyond, the end bins): bins 0.0039 wide."""
CURVE_TOLERANCE = 1e-3
"""The largest difference from the exact (scikit-learn's) auroc and auprc the tests allow."""


@dataclass(frozen=True, eq=False)
class MetricState:
    """One batch's part of a metric: ``state`` is summed elementwise over batches and ranks, then ``compute(summed)``
    gives the value. Metrics may share one state tensor (the same object): it is summed and reduced once."""

    state: torch.Tensor
    """This batch's contribution: any fixed shape, the same in every batch (it is summed as float64)."""
    compute: Callable[[torch.Tensor], float]
    """The metric from the summed state (a float64 tensor on the CPU)."""


@dataclass(frozen=True)
class Average:
    """A metric as ``total / count`` (square-rooted when ``root``), summed over batches and ranks before dividing."""

    total: torch.Tensor | float
    """Sum of the per-row values of this batch."""
    count: torch.Tensor | float
    """Rows (or items) the total covers."""
    root: bool = False
    """Report the square root of the mean (e.g. RMSE from squared errors)."""


def _ratio(state: torch.Tensor) -> float:
    return float(state[0] / state[1]) if float(state[1]) > 0 else math.nan


def _root_ratio(state: torch.Tensor) -> float:
    return math.sqrt(_ratio(state))


def as_state(value: Any, device: torch.device | str | None = None) -> MetricState:
    """An :class:`Average` as the state it is (total, count); a :class:`MetricState` as it is."""
    if isinstance(value, MetricState):
        return value
    if device is None:  # a count given as a number goes where the total is (a CUDA sum and a plain row count)
        device = next((part.device for part in (value.total, value.count) if isinstance(part, torch.Tensor)), None)
    pair = torch.stack([torch.as_tensor(value.total, dtype=torch.float64, device=device).reshape(()),
                        torch.as_tensor(value.count, dtype=torch.float64, device=device).reshape(())])
    return MetricState(pair, _root_ratio if value.root else _ratio)


# --- states the built-in metrics (and a user's own) are made of ------------------------------------------------------


def _counts(index: torch.Tensor, size: int) -> torch.Tensor:
    """How often each of ``size`` values occurs in ``index``, as float64: a fixed-size add, where torch.bincount on a
    GPU reads the largest index back to the host to size its output (a sync per batch). Counts add exactly."""
    flat = index.reshape(-1)
    return torch.zeros(size, dtype=torch.float64, device=flat.device).index_add_(
        0, flat, torch.ones(flat.shape, dtype=torch.float64, device=flat.device))


def confusion_matrix(predicted: torch.Tensor, targets: torch.Tensor, num_classes: int) -> torch.Tensor:
    """(num_classes, num_classes) counts as float64: row = true class, column = predicted class."""
    index = targets.reshape(-1).long() * num_classes + predicted.reshape(-1).long()
    return _counts(index, num_classes * num_classes).reshape(num_classes, num_classes)


def log_odds(logits: torch.Tensor, logp: torch.Tensor | None = None) -> torch.Tensor:
    """(rows, classes) log-odds of each class's softmax probability, log p - log(1 - p), in float64 (``logp``: the
    logits' float64 log_softmax, when the caller has it already)."""
    logp = torch.log_softmax(logits.double(), dim=1) if logp is None else logp
    if logits.shape[1] == 2:  # exact for two classes: the other class's log-probability is log(1 - p)
        return logp - logp.flip(1)
    return logp - torch.log(-torch.expm1(logp).clamp(max=-1e-300))


def score_histogram(scores: torch.Tensor, positive: torch.Tensor) -> torch.Tensor:
    """(2, CURVE_BINS) counts of negatives (row 0) and positives (row 1) by log-odds ``scores`` (rows,); for
    (rows, classes) scores and (rows, classes) ``positive``, one such histogram per class: (classes, 2, CURVE_BINS)."""
    columns = scores.reshape(len(scores), -1)
    flags = positive.reshape(len(scores), -1).long()
    width = 2 * LOGIT_RANGE / CURVE_BINS
    bins = ((columns.clamp(-LOGIT_RANGE, LOGIT_RANGE) + LOGIT_RANGE) / width).long().clamp(max=CURVE_BINS - 1)
    classes = columns.shape[1]
    offset = torch.arange(classes, device=scores.device) * (2 * CURVE_BINS)
    index = offset + flags * CURVE_BINS + bins
    counts = _counts(index, classes * 2 * CURVE_BINS)
    return counts.reshape(classes, 2, CURVE_BINS) if scores.dim() == 2 else counts.reshape(2, CURVE_BINS)


def bin_probability(index: int) -> float:
    """The probability at the lower edge of histogram bin ``index``."""
    z = -LOGIT_RANGE + index * 2 * LOGIT_RANGE / CURVE_BINS
    return 1.0 / (1.0 + math.exp(-z))


# --- computing metrics from summed states ----------------------------------------------------------------------------


def _present(counts: torch.Tensor) -> torch.Tensor:
    # scikit-learn averages over the labels present in the true or the predicted classes.
    return (counts.sum(0) + counts.sum(1)) > 0


def _safe(numerator: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
    return torch.where(denominator > 0, numerator / denominator.clamp(min=1e-300), torch.zeros_like(numerator))


def accuracy(counts: torch.Tensor) -> float:
    return float(counts.diagonal().sum() / counts.sum()) if float(counts.sum()) > 0 else math.nan


def balanced_accuracy(counts: torch.Tensor) -> float:
    support = counts.sum(1)
    recall = counts.diagonal()[support > 0] / support[support > 0]
    return float(recall.mean()) if len(recall) else math.nan


def _per_class(counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    true_positive = counts.diagonal()
    predicted, actual = counts.sum(0), counts.sum(1)
    precision, recall = _safe(true_positive, predicted), _safe(true_positive, actual)
    f1 = _safe(2 * true_positive, predicted + actual)
    return precision, recall, f1, actual


def _macro(values: torch.Tensor, counts: torch.Tensor) -> float:
    present = _present(counts)
    return float(values[present].mean()) if bool(present.any()) else math.nan


def f1_macro(counts: torch.Tensor) -> float:
    return _macro(_per_class(counts)[2], counts)


def precision_macro(counts: torch.Tensor) -> float:
    return _macro(_per_class(counts)[0], counts)


def recall_macro(counts: torch.Tensor) -> float:
    return _macro(_per_class(counts)[1], counts)


def f1_micro(counts: torch.Tensor) -> float:
    true_positive, total = counts.diagonal().sum(), counts.sum()
    return float(2 * true_positive / (2 * total)) if float(total) > 0 else math.nan  # fp and fn both total - tp


def f1_weighted(counts: torch.Tensor) -> float:
    _, _, f1, actual = _per_class(counts)
    return float((f1 * actual).sum() / actual.sum()) if float(actual.sum()) > 0 else math.nan


def _curve_points(histogram: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """True and false positives at each bin's lower edge, from the highest bin down: (bins,) each."""
    negatives, positives = histogram[0].flip(0), histogram[1].flip(0)
    return positives.cumsum(0), negatives.cumsum(0)


def _auroc(histogram: torch.Tensor) -> torch.Tensor:
    """Area under the ROC curve of each (2, bins) histogram in ``histogram`` (..., 2, bins); scores in one bin count as
    ties (trapezoids); nan where a class has no positives or no negatives."""
    negatives, positives = histogram[..., 0, :], histogram[..., 1, :]
    above = positives.flip(-1).cumsum(-1).flip(-1) - positives  # positives in higher bins
    pairs = positives.sum(-1) * negatives.sum(-1)
    area = (negatives * (above + positives / 2)).sum(-1)
    return torch.where(pairs > 0, area / pairs.clamp(min=1), torch.full_like(area, math.nan))


def _auprc(histogram: torch.Tensor) -> torch.Tensor:
    """Average precision (scikit-learn's step-wise area, one step per non-empty bin) of each (2, bins) histogram in
    ``histogram`` (..., 2, bins); nan where a class has no positives."""
    positives = histogram[..., 1, :].flip(-1)
    true_positive, false_positive = positives.cumsum(-1), histogram[..., 0, :].flip(-1).cumsum(-1)
    total = positives.sum(-1)
    precision = _safe(true_positive, true_positive + false_positive)
    area = (positives * precision).sum(-1)
    return torch.where(total > 0, area / total.clamp(min=1), torch.full_like(area, math.nan))


def _macro_mean(values: torch.Tensor) -> float:
    """The mean over classes that have a value (one-vs-rest: a class absent from the split has none)."""
    kept = values[~torch.isnan(values)]
    return float(kept.mean()) if kept.numel() else math.nan


def binary_auroc(histogram: torch.Tensor) -> float:
    """Area under the ROC curve from a (2, bins) histogram, or the one-vs-rest macro mean over (classes, 2, bins)."""
    return _macro_mean(_auroc(histogram).reshape(-1))


def binary_auprc(histogram: torch.Tensor) -> float:
    """Average precision from a (2, bins) histogram, or the one-vs-rest macro mean over (classes, 2, bins)."""
    return _macro_mean(_auprc(histogram).reshape(-1))


def choose_threshold(histogram: torch.Tensor, rule: str = "f1", target: float | None = None) -> float:
    """A binary classifier's decision threshold (a probability of the positive class) from the (2, bins) validation
    histogram: the one that maximises F1 (``rule`` f1), or the lowest whose precision reaches ``target`` (``precision``,
    the most recall at that precision), or the highest whose recall does (``recall``). Nan when no bin qualifies."""
    true_positive, false_positive = _curve_points(histogram)
    total_pos = float(histogram[1].sum())
    if total_pos == 0:
        return math.nan
    edges = torch.arange(CURVE_BINS - 1, -1, -1)  # bin index at each point, highest first
    occupied = (histogram[0] + histogram[1]).flip(0) > 0
    precision = _safe(true_positive, true_positive + false_positive)
    recall = true_positive / total_pos
    if rule == "f1":
        score = torch.where(occupied, _safe(2 * precision * recall, precision + recall), torch.full_like(recall, -1.0))
        best = int(torch.argmax(score))  # the first maximum: the highest such threshold
    else:
        met = occupied & ((precision >= target) if rule == "precision" else (recall >= target))
        if not bool(met.any()):
            return math.nan
        chosen = torch.nonzero(met).reshape(-1)
        best = int(chosen[-1] if rule == "precision" else chosen[0])
    return bin_probability(int(edges[best]))


def _threshold_of(rule: str, target: float | None) -> Callable[[torch.Tensor], float]:
    def compute(histogram: torch.Tensor) -> float:
        return choose_threshold(histogram, rule, target)

    return compute


def classification_metrics(outputs: torch.Tensor, targets: torch.Tensor, names: Iterable[str],
                           threshold: float | None = None, threshold_rule: tuple[str, float | None] = ("f1", None),
                           ) -> dict[str, MetricState]:
    """The built-in classification metrics ``names`` of one batch of logits (rows, classes) and integer targets; a
    binary classifier predicts the positive class at ``threshold`` (else the larger logit) and also reports the
    validation threshold that ``threshold_rule`` (rule, target) chooses."""
    wanted = set(names)
    unknown = sorted(wanted - set(CLASSIFICATION))
    if unknown:
        raise UserError(f"unknown classification metric(s) {unknown}: the built-in ones are {list(CLASSIFICATION)}")
    num_classes = outputs.shape[1]
    targets = targets.reshape(-1).long()
    states: dict[str, MetricState] = {}
    counted = wanted & {"accuracy", "balanced_accuracy", "f1_macro", "f1_micro", "f1_weighted", "precision_macro",
                        "recall_macro"}
    if counted:
        counts = confusion_matrix(predicted_classes(outputs, threshold), targets, num_classes)
        functions = {"accuracy": accuracy, "balanced_accuracy": balanced_accuracy, "f1_macro": f1_macro,
                     "f1_micro": f1_micro, "f1_weighted": f1_weighted, "precision_macro": precision_macro,
                     "recall_macro": recall_macro}
        states.update({name: MetricState(counts, functions[name]) for name in sorted(counted)})
    curves = bool(wanted & set(CURVE_METRICS)) and num_classes <= MAX_CURVE_CLASSES
    logp = torch.log_softmax(outputs.double(), dim=1) if curves or "log_loss" in wanted else None
    if "log_loss" in wanted:
        states["log_loss"] = as_state(Average(-logp.gather(1, targets.unsqueeze(1)).sum(), len(targets)))
    if curves:
        scores = log_odds(outputs, logp)
        if num_classes == 2:
            histogram = score_histogram(scores[:, 1], targets == 1)
            states[THRESHOLD] = MetricState(histogram, _threshold_of(*threshold_rule))
        else:
            histogram = score_histogram(scores, torch.nn.functional.one_hot(targets, num_classes))
        for name, metric in (("auroc", binary_auroc), ("auprc", binary_auprc)):
            if name in wanted:
                states[name] = MetricState(histogram, metric)
    return states


def predicted_classes(outputs: torch.Tensor, threshold: float | None = None) -> torch.Tensor:
    """The predicted class of each row: the positive class where its probability reaches ``threshold`` (two classes
    only), else the largest logit."""
    if threshold is None or outputs.shape[1] != 2 or math.isnan(threshold):
        return outputs.argmax(dim=1)
    return (torch.softmax(outputs.float(), dim=1)[:, 1] >= threshold).long()


def regression_metrics(predicted: torch.Tensor, targets: torch.Tensor, names: Iterable[str],
                       shift: float = 0.0) -> dict[str, MetricState]:
    """The built-in regression metrics ``names`` of one batch; ``shift`` (the data set's mean target) keeps r2's sums
    of squares exact in float64 whatever the target's offset."""
    wanted = set(names)
    unknown = sorted(wanted - set(REGRESSION))
    if unknown:
        raise UserError(f"unknown regression metric(s) {unknown}: the built-in ones are {list(REGRESSION)}")
    error = predicted.double().reshape(-1) - targets.double().reshape(-1)
    rows = len(error)
    states: dict[str, MetricState] = {}
    if "rmse" in wanted:
        states["rmse"] = as_state(Average((error**2).sum(), rows, root=True))
    if "mae" in wanted:
        states["mae"] = as_state(Average(error.abs().sum(), rows))
    if "r2" in wanted:
        centred = targets.double().reshape(-1) - shift
        states["r2"] = MetricState(torch.stack([torch.tensor(float(rows), dtype=torch.float64, device=error.device),
                                                centred.sum(), (centred**2).sum(), (error**2).sum()]), r2)
    return states


def r2(state: torch.Tensor) -> float:
    rows, total, squares, residual = (float(value) for value in state)
    spread = squares - total * total / rows if rows > 0 else 0.0
    if rows == 0:
        return math.nan
    if spread <= 0:  # a constant target: scikit-learn's convention
        return 1.0 if residual == 0 else 0.0
    return 1.0 - residual / spread
