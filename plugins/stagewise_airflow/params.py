"""The DAG's Params (the UI trigger form) and their mapping onto pipeline-config overrides."""

from __future__ import annotations

from typing import Any

from stagewise.definitions.config import MAX_STUDY_NAME, PipelineConfig
from stagewise.models.versions import VERSION_PATTERN

# A string Param that may be left empty: the UI treats a non-null type with an empty value as a missing field.
OPTIONAL_STRING = ["null", "string"]
# Longest URI a form takes: S3's longest key, 1,024 bytes. Every string Param is bounded, so a run's conf stays small.
MAX_URI = 1024
# Most rows a sweep trial may be budgeted: a trillion, far beyond any split, so the bound only refuses typos.
MAX_SWEEP_ROWS = 10**12


# Python's JSON (the REST API's) reads NaN and Infinity; every comparison with NaN is false, so NaN passes minimum
# and maximum, and Airflow then stores it as null, which reads as "not set" (e.g. no objective limit). The schema
# under "not" is valid for NaN and +-Infinity alone, so they are refused, and the answer quotes its description.
MAX_FINITE = 1.7976931348623157e308
FINITE = {"not": {"description": "NaN and Infinity are refused: give a finite number", "type": "number",
                  "anyOf": [{"exclusiveMinimum": MAX_FINITE}, {"exclusiveMaximum": -MAX_FINITE}]}}


def bounded(default: Any, description: str, *, minimum: float, maximum: float, **schema: Any) -> Any:
    """A number Param whose description states the bounds it is validated against (the form clamps silently);
    NaN and +-Infinity are refused."""
    from airflow.sdk import Param

    return Param(default, minimum=minimum, maximum=maximum, description=f"{description} {minimum} to {maximum}.",
                 **schema, **FINITE)


def optional_text(value: str | None) -> str:
    """The config's value for an optional string Param: the form sends None (or "") for 'not set'."""
    return value or ""


def pipeline_params(config: PipelineConfig) -> dict[str, Any]:
    """Params with JSON-schema bounds; defaults come from the config so the form shows what will run."""
    from airflow.sdk import Param

    stage_epochs = {stage.name: stage.epochs for stage in config.train.stages}
    epochs_min, epochs_max = 1, 1000
    return {
        "input_uri": Param(config.dataset.uri, type="string", minLength=1, maxLength=MAX_URI,
                           description="Raw Parquet file or folder to train on (relative to the storage root, or a URI)."),
        "num_trials": bounded(config.sweep.num_trials, "Trial budget of the Optuna sweep:", type="integer",
                              minimum=1, maximum=500),
        "num_sweep_workers": bounded(config.sweep.num_workers, "Parallel sweep worker tasks sharing the study:",
                                     type="integer", minimum=1, maximum=32),
        "sweep_epochs": bounded(config.sweep.epochs, "Max epochs of one trial (Hyperband's max resource):",
                                type="integer", minimum=1, maximum=200),
        "sweep_budget": Param(config.sweep.budget, type="string", enum=["epochs", "rows"],
                              description="Hyperband's resource: the epochs a trial trained, or the training rows it "
                                          "has seen (nested key-hashed subsets of the data; flat cost as data grows)."),
        "sweep_max_rows": bounded(config.sweep.max_rows, "Row budget: rows a trial that is never pruned sees (empty: "
                                  "sweep epochs x the train split; ignored with the epoch budget):",
                                  type=["null", "integer"], minimum=1, maximum=MAX_SWEEP_ROWS),
        "stage_epochs": Param(stage_epochs, type="object",
                              properties={name: {"type": "integer", "minimum": epochs_min, "maximum": epochs_max}
                                          for name in stage_epochs},
                              additionalProperties=False,
                              description=f"Epochs of each training stage ({', '.join(stage_epochs)}): each "
                                          f"{epochs_min} to {epochs_max}."),
        "warm_start_study": Param(config.sweep.warm_start_from or None, type=OPTIONAL_STRING, maxLength=MAX_STUDY_NAME,
                                  description="Optuna study of an earlier run whose best params are tried first "
                                              "(empty: cold start)."),
        "seed": bounded(config.train.seed, "Seed of the sweep sampler and of training:", type="integer",
                        minimum=0, maximum=2**31 - 1),
        "min_test_accuracy": bounded(config.evaluate.min_test_accuracy, "Fail the run when the test accuracy is lower:",
                                     type="number", minimum=0, maximum=1),
        "objective_limit": Param(config.evaluate.objective_limit, type=["null", "number"], **FINITE,
                                 description="Fail the run when the test objective is worse than this, in the "
                                             "objective's direction (e.g. a test rmse above it), a finite number; "
                                             "empty: no limit."),
    }


def inference_params(config: PipelineConfig) -> dict[str, Any]:
    """batch_inference's form: what to score and with which registered model (empty: the current one)."""
    from airflow.sdk import Param

    return {
        "input_uri": Param(config.inference.input_uri or config.dataset.uri, type="string", minLength=1, maxLength=MAX_URI,
                           description="Parquet file or folder to score (relative to the storage root, or a URI)."),
        "model_version": Param(None, type=OPTIONAL_STRING, pattern=f"^({VERSION_PATTERN}|[0-9]+)$",
                               description="Registered model version (python -m stagewise.registry list): its m-... id, "
                                           "or its number in MLflow's registry; empty means the current one "
                                           "(@champion in MLflow)."),
    }


def unknown_trigger_keys(conf: dict[str, Any] | None, known: Any) -> list[str]:
    """Keys of a run's conf that name no Param of the DAG (a typo such as ``num_trails``), sorted."""
    return sorted(set(conf or {}) - set(known))


def _budget_overrides(config: PipelineConfig, params: dict[str, Any]) -> dict[str, Any]:
    """The sweep's budget from the form: the row budget's sizes stay only while the budget is rows."""
    budget = params.get("sweep_budget", config.sweep.budget)
    if budget == "epochs":
        return {"sweep.budget": "epochs", "sweep.max_rows": None, "sweep.min_rows": None}
    return {"sweep.budget": "rows", "sweep.max_rows": params.get("sweep_max_rows")}


def overrides_from_params(config: PipelineConfig, params: dict[str, Any]) -> dict[str, Any]:
    """Dotted config overrides for the values a person set in the trigger form."""
    overrides: dict[str, Any] = {
        "dataset.uri": params["input_uri"],
        "sweep.num_trials": params["num_trials"],
        "sweep.num_workers": params["num_sweep_workers"],
        "sweep.epochs": params["sweep_epochs"],
        **_budget_overrides(config, params),
        "sweep.seed": params["seed"],
        "sweep.warm_start_from": optional_text(params["warm_start_study"]),
        "train.seed": params["seed"],
        "evaluate.min_test_accuracy": params["min_test_accuracy"],
        "evaluate.objective_limit": params.get("objective_limit"),
    }
    names = [stage.name for stage in config.train.stages]
    for name, epochs in (params.get("stage_epochs") or {}).items():
        overrides[f"train.stages.{names.index(name)}.epochs"] = epochs
    return overrides
