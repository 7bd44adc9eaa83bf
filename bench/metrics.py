"""Metric benchmarks: how exact the reduced metric states are, and what the richer metrics cost a stage.

Each function returns ``{"ours", "baseline", "unit", "details"}``; the harness turns that into a ratio.
"""

from __future__ import annotations

import json
import shutil
import statistics
import tempfile
from pathlib import Path
from typing import Any

from bench.training import _prepare

BATCH_SIZES = (1, 7, 4096, None)  # None: the whole split in one batch


def metric_exactness(rows: int = 2001) -> dict[str, Any]:
    """The largest absolute difference from scikit-learn over every counting metric, batch size (1, 7, 4096, the
    whole split) and rank count (1, 2), binary and 4 classes; ratio = that difference / 1 (goal <= 1e-6). Details keep
    the curve metrics' and the sums' (log_loss, rmse, mae, r2) largest differences too."""
    import math

    import numpy as np
    import torch
    from sklearn import metrics as sk
    from sklearn.preprocessing import label_binarize

    from stagewise.definitions.metric_names import CLASSIFICATION, REGRESSION
    from stagewise.definitions.metrics import classification_metrics, regression_metrics
    from stagewise.training.validation import MetricTotals

    def summed(metric_fn: Any, outputs: Any, targets: Any, batch: int, ranks: int) -> dict[str, float]:
        vectors, totals = [], None
        for share in np.array_split(np.arange(len(targets)), ranks):
            totals = MetricTotals("bench")
            for start in range(0, len(share), batch):
                index = torch.from_numpy(share[start:start + batch])
                totals.add(metric_fn(outputs[index], targets[index]), len(index), torch.tensor(0.0), "cpu")
            vectors.append(totals.vector())
        return totals.values(torch.stack(vectors).sum(dim=0))

    counting = {"accuracy", "balanced_accuracy", "f1_macro", "f1_micro", "f1_weighted", "precision_macro", "recall_macro"}
    worst = {"counting": 0.0, "curves": 0.0, "sums": 0.0}
    worst_at: dict[str, Any] = {}
    generator = torch.Generator().manual_seed(0)
    for classes in (2, 4):
        logits = torch.randn(rows, classes, generator=generator) * 2
        logits[:, 0] += 1.5
        targets = torch.distributions.Categorical(logits=logits * 0.6).sample()
        y, predicted = targets.numpy(), logits.argmax(1).numpy()
        probabilities = torch.softmax(logits.double(), 1).numpy()
        reference = {"accuracy": sk.accuracy_score(y, predicted), "balanced_accuracy": sk.balanced_accuracy_score(y, predicted),
                     **{f"f1_{avg}": sk.f1_score(y, predicted, average=avg) for avg in ("macro", "micro", "weighted")},
                     "precision_macro": sk.precision_score(y, predicted, average="macro", zero_division=0),
                     "recall_macro": sk.recall_score(y, predicted, average="macro", zero_division=0),
                     "log_loss": sk.log_loss(y, probabilities, labels=list(range(classes)))}
        if classes == 2:
            reference.update(auroc=sk.roc_auc_score(y, probabilities[:, 1]),
                             auprc=sk.average_precision_score(y, probabilities[:, 1]))
        else:
            reference.update(auroc=sk.roc_auc_score(y, probabilities, multi_class="ovr"),
                             auprc=sk.average_precision_score(label_binarize(y, classes=range(classes)), probabilities))
        for batch in BATCH_SIZES:
            for ranks in (1, 2):
                values = summed(lambda o, t: classification_metrics(o, t, CLASSIFICATION), logits, targets,
                                batch or rows, ranks)
                for name, expected in reference.items():
                    group = "counting" if name in counting else "sums" if name == "log_loss" else "curves"
                    difference = abs(values[name] - expected)
                    if difference > worst[group] or math.isnan(difference):
                        worst[group], worst_at[group] = difference, {"metric": name, "classes": classes,
                                                                     "batch": batch or "whole", "ranks": ranks}
    target = 300.0 + torch.randn(rows, generator=generator, dtype=torch.float64) * 20
    guess = target + torch.randn(rows, generator=generator, dtype=torch.float64) * 5
    reference = {"rmse": math.sqrt(sk.mean_squared_error(target, guess)), "mae": sk.mean_absolute_error(target, guess),
                 "r2": sk.r2_score(target, guess)}
    for batch in BATCH_SIZES:
        for ranks in (1, 2):
            values = summed(lambda o, t: regression_metrics(o, t, REGRESSION, shift=300.0), guess, target, batch or rows, ranks)
            for name, expected in reference.items():
                difference = abs(values[name] - expected) / max(1.0, abs(expected))
                if difference > worst["sums"]:
                    worst["sums"], worst_at["sums"] = difference, {"metric": name, "batch": batch or "whole", "ranks": ranks}
    return {"ours": worst["counting"], "baseline": 1.0, "unit": "largest |ours - scikit-learn| (counting metrics)",
            "details": {"rows": rows, "largest_difference": worst, "where": worst_at,
                        "sums_difference_is": "relative to max(1, |value|)"}}


def metric_overhead(rows: int = 60_000, rounds: int = 10, epochs: int = 3) -> dict[str, Any]:
    """Samples/s of a stage (the built-in MLP, hidden 256, batch 256, one thread: the other core's bursts of load
    reach it least) whose validation computes f1_macro, auroc and log_loss, over the same stage computing accuracy
    alone. Unlike the training benchmarks, an epoch's rate counts its validation too (that is where metrics cost):
    its trained rows over its training time plus ``validation_s``. The sides alternate (which goes first too) in
    ``rounds`` pairs of runs; ours and baseline are each side's median epoch (after the first of every run), the
    ratio the median of the pairs' ratios: run to run this machine's speed drifts by more than the metrics cost."""
    from stagewise.definitions.loading import load_config
    from stagewise.train import run_stage

    params = {"lr": 0.01, "hidden": 256, "dropout": 0.0}
    sides = {"rich": ["f1_macro", "auroc", "log_loss"], "accuracy": ["accuracy"]}
    with tempfile.TemporaryDirectory(prefix="bench-metrics-") as tmp:
        workdir = Path(tmp)
        _, out = _prepare(workdir, rows, **{
            "profiles__ddp1__threads_per_process": 1, "train__checkpoint_every_steps": 10_000,
            "train__stages": [{"name": "s1", "profile": "ddp1", "per_process_batch": 256, "epochs": epochs}]})
        configs = {}
        for side, names in sides.items():
            metric = "f1_macro" if side == "rich" else "accuracy"
            configs[side] = load_config(workdir / "pipeline.yaml", {
                "model.args": {"metrics": names}, "objective.metric": metric, "registry.gate_metric": f"test_{metric}"})
        rates: dict[str, list[float]] = {side: [] for side in sides}
        validation: dict[str, list[float]] = {side: [] for side in sides}
        trained = 0
        pairs: list[float] = []
        for number in range(rounds):
            before = {side: len(rates[side]) for side in sides}
            for side in (list(sides) if number % 2 == 0 else list(reversed(sides))):
                shutil.rmtree(Path(out, "train"), ignore_errors=True)
                run_stage(configs[side], "s1", out, params, None)
                record = json.loads(Path(out, "train", "s1", "metrics.json").read_text())
                trained = record["rows_per_epoch"]["trained"]
                for entry in record["history"][1:]:  # the first epoch warms up the allocator and first-use kernels
                    rates[side].append(trained / (trained / entry["samples_per_s"] + entry["validation_s"]))
                    validation[side].append(entry["validation_s"])
            rich, plain = (statistics.median(rates[side][before[side]:]) for side in sides)
            pairs.append(rich / plain)  # one round's two runs, back to back: the machine's drift cancels
    ours, baseline = statistics.median(rates["rich"]), statistics.median(rates["accuracy"])
    return {"ours": ours, "baseline": baseline, "ratio": statistics.median(pairs), "unit": "samples/s (validation included)",
            "details": {"rows": rows, "epochs": epochs, "trained_rows_per_epoch": trained, "metrics": sides,
                        "validation_s_median": {side: statistics.median(values) for side, values in validation.items()},
                        "epoch_rates": rates, "pair_ratios": pairs}}
