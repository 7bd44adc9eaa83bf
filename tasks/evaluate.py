"""Evaluate a trained model on the committed test split.

Run: ``python -m stagewise.evaluate --model storage/runs/x/y/train/s2/model.pt --out storage/runs/x/y``

The evaluate profile's ``device`` picks where the model runs, with inference's chunk prefetch onto a GPU.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

from stagewise.core.cli import common_parser, help_before_imports, parse_overrides, run_subjob


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Evaluate a model on the test split.", parents=[common_parser()])
    parser.add_argument("--model", required=True, help="model bundle URI (a train stage's model.pt)")
    parser.add_argument("--out", required=True, help="the run prefix")
    parser.add_argument("--inputs-fingerprint", default=None, help="the model's and data's fingerprint (stagewise.reuse) to record")
    return parser


# --help answers before the imports below, which load torch (seconds); they follow code on purpose
# ruff: noqa: E402
if __name__ == "__main__":
    help_before_imports(build_parser)

from stagewise.core import storage
from stagewise.core.errors import UserError
from stagewise.datasets.manifest import load_split, read_manifest
from stagewise.definitions.config import PipelineConfig
from stagewise.definitions.loading import load_config
from stagewise.definitions.metrics import THRESHOLD
from stagewise.models.bundle import load_bundle
from stagewise.models.curves import binary_curves, confusion_counts
from stagewise.models.scoring import exact_float32, prefetch, scoring_device
from stagewise.training.validation import accumulate_metrics

log = logging.getLogger("stagewise.evaluate")


def evaluate(config: PipelineConfig, model_uri: str, out: str, fingerprint: str | None = None) -> dict[str, Any]:
    """Every metric of the model's spec on the test split (``test_<name>``; per class too when it predicts classes;
    ``test_baseline_rmse`` of predicting the mean target for a float target); fails below
    ``evaluate.min_test_accuracy`` or when the objective is worse than ``evaluate.objective_limit``. ``fingerprint``:
    the model's and data's (stagewise.reuse), recorded with the metrics."""
    import numpy as np
    import torch

    profile = config.profile(config.evaluate.profile)
    torch.set_num_threads(profile.threads_per_process)
    device = scoring_device(profile.device)
    manifest = read_manifest(storage.join(out, "preprocess", "manifest.json"))
    features, labels = load_split(manifest, "test")
    if len(labels) == 0:
        raise UserError(f"{out}: the committed test split is empty; raise preprocess.split.test")
    bundle = load_bundle(model_uri)
    model = bundle.module.to(device)
    nonfinite = [name for name, tensor in model.state_dict().items() if tensor.is_floating_point() and not torch.isfinite(tensor).all()]
    if nonfinite:
        raise UserError(f"{model_uri}: the model's weights are NaN/inf ({', '.join(nonfinite)}): its training diverged, "
                        f"so it is neither evaluated nor registered")
    if bundle.preprocessing["features"] != manifest["features"]:
        raise UserError(f"{model_uri}: model features differ from the run's preprocess manifest")
    chunks = ((i, (torch.from_numpy(features[i : i + 8192]), torch.from_numpy(labels[i : i + 8192])))
              for i in range(0, len(labels), 8192))
    predicted: list[Any] = []
    scores: list[Any] = []

    def keep(outputs: Any, _: Any) -> None:
        columns = bundle.spec.predict(outputs)
        predicted.append(columns.get("prediction"))
        scores.append(columns.get("score"))

    with exact_float32(device), torch.inference_mode():
        totals = accumulate_metrics(bundle.spec, model, (pair for _, pair in prefetch(chunks, device)), str(device),
                                    on_outputs=keep)
    values = {name: value for name, value in totals.values().items() if name != THRESHOLD}
    metrics: dict[str, Any] = {f"test_{name}": float(value) for name, value in values.items()}
    metrics.update({"test_rows": int(len(labels)), "model_uri": model_uri, "spec": bundle.ref.path,
                    "objective": config.objective.metric, "fingerprint": fingerprint})
    if all(p is not None for p in predicted) and bundle.data.num_classes:
        classes = torch.cat(predicted).cpu().numpy()
        correct = classes == labels
        metrics["per_class_accuracy"] = {str(c): float(correct[labels == c].mean()) for c in np.unique(labels)}
        metrics["confusion_matrix"] = confusion_counts(labels, classes, bundle.data.num_classes)
        if bundle.data.num_classes == 2 and all(s is not None for s in scores):
            metrics["curves"] = binary_curves(labels, torch.cat(scores).double().cpu().numpy())
            threshold = getattr(bundle.spec, "threshold", None)
            metrics["decision_threshold"] = {"value": threshold, **(bundle.extra.get("threshold_rule") or {}),
                                             "chosen_on": "validation" if threshold is not None else None}
    target = manifest.get("target")
    if target is not None:  # what predicting the data set's mean target scores: the bar a regressor must clear
        metrics["test_baseline_rmse"] = float(np.sqrt(np.mean((labels.astype(np.float64) - target["mean"]) ** 2)))
    objective = f"test_{config.objective.metric}"
    if objective not in metrics:
        raise UserError(f"objective.metric '{config.objective.metric}' is not among the test metrics {bundle.ref.path} "
                        f"reports: {sorted(values)}")
    uri = storage.join(out, "evaluate", "metrics.json")
    storage.write_json(uri, metrics)
    log.info("test %s %.4f on %d rows (model %s); %s", config.objective.metric, metrics[objective], len(labels), model_uri,
             ", ".join(f"{k} {v:.4f}" for k, v in sorted(metrics.items()) if k.startswith("test_") and k != "test_rows"))
    minimum = config.evaluate.min_test_accuracy
    if minimum > 0 and "test_accuracy" not in metrics:
        raise UserError(f"evaluate.min_test_accuracy={minimum} needs an 'accuracy' metric, which {bundle.ref.path} does not report")
    if minimum > 0 and metrics["test_accuracy"] < minimum:
        raise UserError(f"test accuracy {metrics['test_accuracy']:.4f} is below evaluate.min_test_accuracy={minimum}")
    limit, direction = config.evaluate.objective_limit, config.objective.direction
    if limit is not None and (metrics[objective] > limit if direction == "minimize" else metrics[objective] < limit):
        raise UserError(f"{objective} {metrics[objective]:.4f} is worse than evaluate.objective_limit={limit} "
                        f"(objective.direction: {direction})")
    return {**{k: v for k, v in metrics.items() if k.startswith("test_")}, "test_objective": metrics[objective],
            "objective": config.objective.metric, "metrics_uri": uri, "fingerprint": fingerprint}



def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)

    def work() -> dict[str, Any]:
        config = load_config(args.config, parse_overrides(args.override))
        return evaluate(config, args.model, storage.resolve(config.storage_root, args.out), args.inputs_fingerprint)

    run_subjob("evaluate", work, args.result_file)


if __name__ == "__main__":
    main()
