"""Evaluate a trained model on the committed test split.

Run: ``python -m tasks.evaluate --model storage/runs/x/y/train/s2/model.pt --out storage/runs/x/y``
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

from tasks import storage
from tasks.cli import common_parser, parse_overrides, run_subjob
from tasks.config import PipelineConfig, load_config
from tasks.errors import UserError

log = logging.getLogger("stagewise.evaluate")


def evaluate(config: PipelineConfig, model_uri: str, out: str) -> dict[str, Any]:
    """Test accuracy (overall and per class); fails when below ``evaluate.min_test_accuracy``."""
    import numpy as np
    import torch

    from tasks.model import load_bundle
    from tasks.preprocess import load_split, read_manifest

    torch.set_num_threads(config.profile(config.evaluate.profile).threads_per_process)
    manifest = read_manifest(storage.join(out, "preprocess", "manifest.json"))
    features, labels = load_split(manifest, "test")
    if len(labels) == 0:
        raise UserError(f"{out}: the committed test split is empty; raise preprocess.split.test")
    model, bundle = load_bundle(model_uri)
    nonfinite = [name for name, tensor in model.state_dict().items() if tensor.is_floating_point() and not torch.isfinite(tensor).all()]
    if nonfinite:
        raise UserError(f"{model_uri}: the model's weights are NaN/inf ({', '.join(nonfinite)}): its training diverged, "
                        f"so it is neither evaluated nor registered")
    if bundle["preprocessing"]["features"] != manifest["features"]:
        raise UserError(f"{model_uri}: model features differ from the run's preprocess manifest")
    with torch.no_grad():
        predicted = torch.cat([model(torch.from_numpy(features[i : i + 8192])).argmax(dim=1)
                               for i in range(0, len(labels), 8192)]).numpy()
    correct = predicted == labels
    per_class = {str(c): float(correct[labels == c].mean()) for c in np.unique(labels)}
    metrics = {"test_accuracy": float(correct.mean()), "test_rows": int(len(labels)), "per_class_accuracy": per_class,
               "model_uri": model_uri}
    uri = storage.join(out, "evaluate", "metrics.json")
    storage.write_json(uri, metrics)
    log.info("test accuracy %.4f on %d rows (model %s)", metrics["test_accuracy"], len(labels), model_uri)
    if metrics["test_accuracy"] < config.evaluate.min_test_accuracy:
        raise UserError(f"test accuracy {metrics['test_accuracy']:.4f} is below evaluate.min_test_accuracy="
                        f"{config.evaluate.min_test_accuracy}")
    return {"test_accuracy": metrics["test_accuracy"], "test_rows": metrics["test_rows"], "metrics_uri": uri}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Evaluate a model on the test split.", parents=[common_parser()])
    parser.add_argument("--model", required=True, help="model bundle URI (a train stage's model.pt)")
    parser.add_argument("--out", required=True, help="the run prefix")
    args = parser.parse_args(argv)

    def work() -> dict[str, Any]:
        config = load_config(args.config, parse_overrides(args.override))
        return evaluate(config, args.model, storage.resolve(config.storage_root, args.out))

    run_subjob("evaluate", work, args.result_file)


if __name__ == "__main__":
    main()
