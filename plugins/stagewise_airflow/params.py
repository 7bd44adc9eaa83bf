"""The DAG's Params (the UI trigger form) and their mapping onto pipeline-config overrides."""

from __future__ import annotations

from typing import Any

from tasks.config import PipelineConfig


def pipeline_params(config: PipelineConfig) -> dict[str, Any]:
    """Params with JSON-schema bounds; defaults come from the config so the form shows what will run."""
    from airflow.sdk import Param

    stage_epochs = {stage.name: stage.epochs for stage in config.train.stages}
    return {
        "input_uri": Param(config.dataset.uri, type="string", minLength=1,
                           description="Raw Parquet file or folder to train on (relative to the storage root, or a URI)."),
        "num_trials": Param(config.sweep.num_trials, type="integer", minimum=1, maximum=500,
                            description="Trial budget of the Optuna sweep."),
        "num_sweep_workers": Param(config.sweep.num_workers, type="integer", minimum=1, maximum=32,
                                   description="Parallel sweep worker tasks sharing the study."),
        "sweep_epochs": Param(config.sweep.epochs, type="integer", minimum=1, maximum=200,
                              description="Max epochs of one trial (Hyperband's max resource)."),
        "stage_epochs": Param(stage_epochs, type="object",
                              properties={name: {"type": "integer", "minimum": 1, "maximum": 1000} for name in stage_epochs},
                              additionalProperties=False, description="Epochs of each training stage."),
        "warm_start_study": Param(config.sweep.warm_start_from, type="string",
                                  description="Optuna study of an earlier run whose best params are tried first (empty: cold start)."),
        "seed": Param(config.train.seed, type="integer", minimum=0, maximum=2**31 - 1,
                      description="Seed of the sweep sampler and of training."),
        "min_test_accuracy": Param(config.evaluate.min_test_accuracy, type="number", minimum=0, maximum=1,
                                   description="Fail the run when the test accuracy is lower."),
    }


def overrides_from_params(config: PipelineConfig, params: dict[str, Any]) -> dict[str, Any]:
    """Dotted config overrides for the values a person set in the trigger form."""
    overrides: dict[str, Any] = {
        "dataset.uri": params["input_uri"],
        "sweep.num_trials": params["num_trials"],
        "sweep.num_workers": params["num_sweep_workers"],
        "sweep.epochs": params["sweep_epochs"],
        "sweep.seed": params["seed"],
        "sweep.warm_start_from": params["warm_start_study"],
        "train.seed": params["seed"],
        "evaluate.min_test_accuracy": params["min_test_accuracy"],
    }
    names = [stage.name for stage in config.train.stages]
    for name, epochs in (params.get("stage_epochs") or {}).items():
        overrides[f"train.stages.{names.index(name)}.epochs"] = epochs
    return overrides
