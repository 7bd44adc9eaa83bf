"""Metrics as reducible state (tasks/definitions/metrics.py): every built-in metric, summed over any batching,
accumulation and ranks, equals scikit-learn's value on the same predictions (exact for the counting metrics, within
CURVE_TOLERANCE for the binned curves); thresholds, class weights and a user's own states."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch
from sklearn import metrics as sk
from sklearn.preprocessing import label_binarize

from stagewise.core.errors import UserError
from stagewise.definitions.metric_names import CLASSIFICATION, REGRESSION
from stagewise.definitions.metrics import (
    CURVE_TOLERANCE,
    MetricState,
    choose_threshold,
    classification_metrics,
    confusion_matrix,
    regression_metrics,
    score_histogram,
)
from stagewise.spec import Classifier, DataInfo, Regressor
from stagewise.training.validation import MetricTotals

COUNTING = ("accuracy", "balanced_accuracy", "f1_macro", "f1_micro", "f1_weighted", "precision_macro", "recall_macro")
SUMS = ("log_loss", "rmse", "mae", "r2")
ROWS = 1201  # odd: the last batch of every size below is uneven, and so are two ranks' shares
BATCH_SIZES = (1, 7, 4096, ROWS)  # the last: the whole split in one batch


def _classification_data(classes: int, seed: int = 0, rows: int = ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, classes, generator=generator) * 2
    logits[:, 0] += 1.5  # imbalanced: class 0 is the common one
    targets = torch.distributions.Categorical(logits=logits * 0.6).sample()
    return logits, targets


def _reference_classification(logits: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    classes = logits.shape[1]
    y, predicted = targets.numpy(), logits.argmax(dim=1).numpy()
    probabilities = torch.softmax(logits.double(), dim=1).numpy()
    reference = {"accuracy": sk.accuracy_score(y, predicted), "balanced_accuracy": sk.balanced_accuracy_score(y, predicted),
                 "f1_macro": sk.f1_score(y, predicted, average="macro"), "f1_micro": sk.f1_score(y, predicted, average="micro"),
                 "f1_weighted": sk.f1_score(y, predicted, average="weighted"),
                 "precision_macro": sk.precision_score(y, predicted, average="macro", zero_division=0),
                 "recall_macro": sk.recall_score(y, predicted, average="macro", zero_division=0),
                 "log_loss": sk.log_loss(y, probabilities, labels=list(range(classes)))}
    if classes == 2:
        reference["auroc"] = sk.roc_auc_score(y, probabilities[:, 1])
        reference["auprc"] = sk.average_precision_score(y, probabilities[:, 1])
    else:
        reference["auroc"] = sk.roc_auc_score(y, probabilities, multi_class="ovr", average="macro")
        reference["auprc"] = sk.average_precision_score(label_binarize(y, classes=range(classes)), probabilities,
                                                        average="macro")
    return reference


def _summed(metric_fn, outputs: torch.Tensor, targets: torch.Tensor, batch_size: int, ranks: int,
            accumulation: int) -> dict[str, float]:
    """What validation computes: each rank sums its batches' states (a batch in ``accumulation`` micro-batches), the
    ranks' vectors are summed (the all-reduce), and each metric is computed once."""
    shares = np.array_split(np.arange(len(targets)), ranks)
    vectors, totals = [], None
    for share in shares:
        totals = MetricTotals("spec")
        for start in range(0, len(share), batch_size):
            batch = share[start:start + batch_size]
            for micro in np.array_split(batch, min(accumulation, len(batch))):
                rows = torch.from_numpy(micro)
                totals.add(metric_fn(outputs[rows], targets[rows]), len(micro), torch.tensor(0.0), "cpu")
        vectors.append(totals.vector())
    return totals.values(torch.stack(vectors).sum(dim=0))


def _close(name: str, value: float, reference: float) -> None:
    bound = 1e-12 if name in COUNTING else 1e-9 * max(1.0, abs(reference)) if name in SUMS else CURVE_TOLERANCE
    assert abs(value - reference) <= bound, f"{name}: {value} vs scikit-learn's {reference} (bound {bound})"


@pytest.mark.parametrize("classes", [2, 4])
@pytest.mark.parametrize("batch_size", BATCH_SIZES)
@pytest.mark.parametrize("ranks, accumulation", [(1, 1), (2, 1), (2, 3)])
def test_classification_metrics_equal_scikit_learn_whatever_the_batching(classes, batch_size, ranks, accumulation):
    """Every built-in classification metric, at batch sizes 1, 7, 4096 and the whole split, on 1 and 2 ranks, with
    and without accumulation, is scikit-learn's value on the same predictions."""
    # One row a batch allocates every state per row: fewer rows keep it cheap (still uneven over two ranks).
    logits, targets = _classification_data(classes, rows=ROWS if batch_size > 1 else 401)
    values = _summed(lambda o, t: classification_metrics(o, t, CLASSIFICATION), logits, targets, batch_size, ranks,
                     accumulation)
    for name, reference in _reference_classification(logits, targets).items():
        _close(name, values[name], reference)


@pytest.mark.parametrize("batch_size", BATCH_SIZES)
@pytest.mark.parametrize("ranks, accumulation", [(1, 1), (2, 3)])
def test_regression_metrics_equal_scikit_learn_whatever_the_batching(batch_size, ranks, accumulation):
    """rmse, mae and r2 of a target far from zero (r2's sums of squares stay exact with the data's mean shift)."""
    generator = torch.Generator().manual_seed(1)
    targets = 5000.0 + torch.randn(ROWS, generator=generator, dtype=torch.float64) * 3
    predicted = targets + torch.randn(ROWS, generator=generator, dtype=torch.float64)
    values = _summed(lambda o, t: regression_metrics(o, t, REGRESSION, shift=5000.0), predicted, targets, batch_size,
                     ranks, accumulation)
    y, p = targets.numpy(), predicted.numpy()
    reference = {"rmse": math.sqrt(sk.mean_squared_error(y, p)), "mae": sk.mean_absolute_error(y, p), "r2": sk.r2_score(y, p)}
    for name, expected in reference.items():
        _close(name, values[name], expected)


def test_curves_of_confident_scores_stay_within_the_documented_bound():
    """A trained model's scores crowd near 0 and 1; the log-odds bins keep auroc and auprc within CURVE_TOLERANCE."""
    generator = torch.Generator().manual_seed(2)
    targets = (torch.rand(20_000, generator=generator) < 0.03).long()
    margin = torch.where(targets == 1, 6.0, -6.0) + torch.randn(20_000, generator=generator) * 3
    logits = torch.stack([torch.zeros_like(margin), margin], dim=1)
    values = _summed(lambda o, t: classification_metrics(o, t, ("auroc", "auprc")), logits, targets, 4096, 2, 1)
    scores = torch.softmax(logits.double(), dim=1)[:, 1].numpy()
    assert abs(values["auroc"] - sk.roc_auc_score(targets.numpy(), scores)) <= CURVE_TOLERANCE
    assert abs(values["auprc"] - sk.average_precision_score(targets.numpy(), scores)) <= CURVE_TOLERANCE


def test_shared_states_are_summed_once_and_the_vector_is_one_per_state():
    """Seven counting metrics share one confusion matrix: the vector holds it once (k*k), plus the loss pair."""
    logits, targets = _classification_data(4)
    totals = MetricTotals("spec")
    totals.add(classification_metrics(logits, targets, COUNTING), ROWS, torch.tensor(0.5), "cpu")
    assert totals.vector().numel() == 16 + 2
    assert totals.values()["loss"] == pytest.approx(0.5)


def test_a_state_that_changes_shape_or_names_between_batches_is_named():
    """A state is fixed-shape and a spec reports the same metrics every batch: otherwise a user error says which."""
    totals = MetricTotals("MySpec")
    totals.add({"m": MetricState(torch.ones(3), lambda s: float(s.sum()))}, 1, torch.tensor(0.0), "cpu")
    with pytest.raises(UserError, match=r"MySpec.metrics\(\)\['m'\]: its state has shape \(4,\)"):
        totals.add({"m": MetricState(torch.ones(4), lambda s: float(s.sum()))}, 1, torch.tensor(0.0), "cpu")
    with pytest.raises(UserError, match="must report the same metrics every batch"):
        totals.add({"n": MetricState(torch.ones(3), lambda s: float(s.sum()))}, 1, torch.tensor(0.0), "cpu")


def test_a_users_macro_f1_and_recall_at_precision_reduce_exactly():
    """The docs' own metrics: macro-F1 from a confusion matrix, recall at precision >= 0.9 from a score histogram."""
    logits, targets = _classification_data(2, seed=3)

    def macro_f1(counts: torch.Tensor) -> float:
        tp = counts.diagonal()
        return float((2 * tp / (counts.sum(0) + counts.sum(1))).nan_to_num().mean())

    def recall_at_precision(histogram: torch.Tensor) -> float:
        negatives, positives = histogram[0].flip(0).cumsum(0), histogram[1].flip(0).cumsum(0)
        precise = positives / (positives + negatives).clamp(min=1) >= 0.9
        return float(positives[precise].max() / positives[-1]) if bool(precise.any()) else 0.0

    def user_metrics(outputs: torch.Tensor, labels: torch.Tensor) -> dict[str, MetricState]:
        scores = torch.log_softmax(outputs, 1)[:, 1] - torch.log_softmax(outputs, 1)[:, 0]
        return {"my_f1": MetricState(confusion_matrix(outputs.argmax(1), labels, 2), macro_f1),
                "recall_at_p90": MetricState(score_histogram(scores, labels == 1), recall_at_precision)}

    values = _summed(user_metrics, logits, targets, 7, 2, 1)
    assert values["my_f1"] == pytest.approx(sk.f1_score(targets, logits.argmax(1), average="macro"), abs=1e-12)
    probabilities = torch.softmax(logits.double(), 1)[:, 1].numpy()
    precision, recall, _ = sk.precision_recall_curve(targets.numpy(), probabilities)
    assert values["recall_at_p90"] == pytest.approx(recall[precision >= 0.9].max(), abs=0.01)


@pytest.mark.parametrize("rule, target", [("f1", None), ("precision", 0.6), ("recall", 0.8)])
def test_the_threshold_reaches_its_rule_on_the_validation_scores(rule, target):
    """f1: the threshold of the best F1; precision/recall: the target reached, with the most of the other."""
    logits, targets = _classification_data(2, seed=4)
    histogram = score_histogram(logits[:, 1] - logits[:, 0], targets == 1)
    threshold = choose_threshold(histogram, rule, target)
    scores = torch.softmax(logits.double(), 1)[:, 1].numpy()
    labels = targets.numpy()
    predicted = scores >= threshold
    f1_at = sk.f1_score(labels, predicted)
    candidates = np.unique(scores)
    if rule == "f1":
        best = max(sk.f1_score(labels, scores >= t) for t in candidates[::7])
        assert f1_at >= best - 0.01
    elif rule == "precision":
        assert sk.precision_score(labels, predicted) >= target - 1e-3
    else:
        assert sk.recall_score(labels, predicted) >= target - 1e-3
        assert sk.recall_score(labels, scores >= threshold * 1.05) < target + 0.05


def test_a_binary_classifier_predicts_its_threshold_and_writes_the_score():
    """With a threshold, the label is the positive class where its probability reaches it; the score is written too."""
    spec = Classifier()
    outputs = torch.tensor([[0.0, -1.0], [0.0, 1.0], [0.0, -3.0]])
    assert spec.predict(outputs)["prediction"].tolist() == [0, 1, 0]
    spec.threshold = 0.2  # sigmoid(-1) = 0.27 reaches it, sigmoid(-3) = 0.05 does not
    predicted = spec.predict(outputs)
    assert predicted["prediction"].tolist() == [1, 1, 0]
    assert predicted["score"].tolist() == pytest.approx(torch.sigmoid(outputs[:, 1]).tolist())


def test_balanced_class_weights_follow_scikit_learns_rule():
    """balanced: rows / (classes * rows of the class); explicit weights are taken as given; a bad setting is named."""
    from sklearn.utils.class_weight import compute_class_weight

    counts = [970, 30]
    spec = Classifier(class_weights="balanced")
    spec.prepare(DataInfo(features=["x"], num_classes=2, class_counts=counts))
    labels = np.repeat([0, 1], counts)
    expected = compute_class_weight("balanced", classes=np.array([0, 1]), y=labels)
    assert spec._class_weights.tolist() == pytest.approx(expected.tolist())
    outputs, targets = torch.randn(8, 2), torch.tensor([0, 1] * 4)
    weighted = torch.nn.functional.cross_entropy(outputs, targets, weight=torch.tensor(expected, dtype=torch.float32))
    assert spec.loss(outputs, targets).item() == pytest.approx(weighted.item())
    with pytest.raises(UserError, match=r"model.args.class_weights of Classifier: \[1\] is neither 'balanced' nor a list of 2"):
        Classifier(class_weights=[1]).prepare(DataInfo(features=["x"], num_classes=2, class_counts=counts))
    with pytest.raises(UserError, match="balanced needs the data's class counts"):
        Classifier(class_weights="balanced").prepare(DataInfo(features=["x"], num_classes=2))


def test_the_metrics_argument_narrows_the_builtin_ones_and_names_a_typo():
    """model.args.metrics picks the built-in metrics a stage computes; an unknown one lists those that exist."""
    spec = Regressor(metrics=["r2"])
    spec.prepare(DataInfo(features=["x"], target_mean=0.0, target_std=1.0))
    assert set(spec.metrics(torch.randn(4, 1), torch.randn(4))) == {"r2"}
    with pytest.raises(UserError, match=r"unknown metric\(s\) \['f1'\]; the built-in ones are \['accuracy'"):
        Classifier(metrics=["f1"]).prepare(DataInfo(features=["x"], num_classes=2))


def _two_rank_totals(rank: int, world: int, port: int, logits: torch.Tensor, targets: torch.Tensor, out: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    share = np.array_split(np.arange(len(targets)), world)[rank]
    totals = MetricTotals("spec")
    for start in range(0, len(share), 7):
        rows = torch.from_numpy(share[start:start + 7])
        totals.add(classification_metrics(logits[rows], targets[rows], CLASSIFICATION), len(rows), torch.tensor(0.0), "cpu")
    vector = totals.vector()
    dist.all_reduce(vector)  # the one collective of a validation
    if rank == 0:
        torch.save(totals.values(vector), out)
    dist.destroy_process_group()


@pytest.mark.torchrun
def test_two_gloo_ranks_reduce_to_scikit_learns_values(tmp_path):
    """Real ranks: each sums its share of the rows, one all-reduce of the state vector, and the computed values are
    scikit-learn's on the whole split."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    logits, targets = _classification_data(4, seed=5)
    out = str(tmp_path / "values.pt")
    mp.spawn(_two_rank_totals, args=(2, port, logits, targets, out), nprocs=2, join=True)
    values = torch.load(out)
    for name, reference in _reference_classification(logits, targets).items():
        _close(name, values[name], reference)


def test_every_builtin_state_stays_on_the_device_of_the_batch():
    """A state is built where the batch is, its row count given as a plain number beside a device sum included (on
    CUDA a CPU count beside a device total broke every validation): shown on the CPU with PyTorch's meta device."""
    logits, labels = torch.empty(64, 3, device="meta"), torch.zeros(64, dtype=torch.long, device="meta")
    states = {**classification_metrics(logits, labels, CLASSIFICATION),
              **regression_metrics(torch.empty(64, device="meta"), torch.empty(64, device="meta"), REGRESSION)}
    assert {name: state.state.device.type for name, state in states.items()} == dict.fromkeys(states, "meta")
    totals = MetricTotals("spec")
    totals.add(states, 64, torch.empty((), device="meta"), None)
    assert {slot.device.type for slot in totals.slots} == {"meta"}
