"""The record tells what ran (stagewise.training.recipe): the optimizer read off the live object (class, who built it,
each group's size and settings) and the schedule in force go into metrics.json, the stage result, report.json, the
model card and MLflow's params; a sweep trial runs the spec's schedule over its own steps, as a stage does."""

from __future__ import annotations

import json
import math

import optuna
import pytest

from stagewise import registry, train
from stagewise.core import storage
from stagewise.definitions.config import LRSchedule
from stagewise.definitions.hyperparams import FRAMEWORK_DEFAULTS, ran_params
from stagewise.definitions.loading import load_config
from stagewise.definitions.spec import DataInfo
from stagewise.models.building import build
from stagewise.models.mlp import MLPClassifier
from stagewise.report import build_report
from stagewise.study.studies import create, open_storage
from stagewise.sweep import run_worker
from stagewise.training.optimizers import make_optimizer
from stagewise.training.recipe import describe_optimizer, recipe_params, training_recipe
from tests.specs import AdamWCosine

PARAMS = {"lr": 0.05, "hidden": 16}
DATA = DataInfo(features=["a", "b", "c"], num_classes=3)


@pytest.fixture
def single_process(monkeypatch):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", train.FAULT_ENV,
                 "STAGEWISE_FAULT_KILL_TRIAL"):
        monkeypatch.delenv(name, raising=False)


def _optimizer(spec):
    params = {**FRAMEWORK_DEFAULTS, **PARAMS}
    model = build(spec, DATA, params)
    return model, make_optimizer(model, params, spec)


def test_the_live_optimizer_is_described_by_its_class_groups_and_settings():
    """A spec's AdamW: two groups with their parameter counts, weight decay, betas and lr_scale; JSON as it is (no
    tensors, no per-step lr). The framework's SGD is recorded as the framework's, with its momentum."""
    model, optimizer = _optimizer(AdamWCosine())
    described = describe_optimizer(optimizer)
    assert described["type"] == "AdamW" and described["source"] == "spec"
    weights, biases = described["groups"]
    assert weights["params"] + biases["params"] == sum(p.numel() for p in model.parameters())
    assert (weights["weight_decay"], biases["weight_decay"]) == (0.01, 0.0)
    assert (weights["lr_scale"], biases["lr_scale"]) == (1.0, 0.5)
    assert weights["betas"] == [0.9, 0.98] and "lr" not in weights and "foreach" not in weights
    assert json.loads(json.dumps(described)) == described

    _, framework = _optimizer(MLPClassifier())
    default = describe_optimizer(framework)
    assert default["type"] == "SGD" and default["source"] == "framework"
    assert all(group["momentum"] == 0.9 and group["nesterov"] for group in default["groups"])


def test_the_schedule_in_force_is_the_specs_else_the_configs_and_mlflow_gets_it_flat():
    """The spec's lr_schedule is named by class and method; without one the config's schedule is recorded; MLflow
    params say the optimizer's class (not the framework's unused 'sgd' and momentum) and each group's settings."""
    _, optimizer = _optimizer(AdamWCosine())
    recipe = training_recipe(optimizer, AdamWCosine(), LRSchedule(type="cosine"), warmup_steps=0, total_steps=40)
    assert recipe["lr_schedule"] == {"type": "spec", "source": "spec", "spec": "tests.specs:AdamWCosine",
                                     "method": "AdamWCosine.lr_schedule", "warmup_steps": 0, "total_steps": 40}
    flat = recipe_params(recipe)
    assert flat["optimizer"] == "AdamW" and flat["optimizer.groups"] == 2 and flat["optimizer.source"] == "spec"
    assert flat["optimizer.group1.lr_scale"] == 0.5 and flat["optimizer.group0.betas"] == "0.9, 0.98"
    assert flat["lr_schedule"] == "AdamWCosine.lr_schedule" and flat["lr_schedule.source"] == "spec"
    shown = ran_params({**FRAMEWORK_DEFAULTS, **PARAMS}, recipe)
    assert "optimizer" not in shown and "momentum" not in shown and shown["lr"] == 0.05

    _, framework = _optimizer(MLPClassifier())
    configured = training_recipe(framework, MLPClassifier(), LRSchedule(type="cosine", min_lr_ratio=0.1),
                                 warmup_steps=3, total_steps=40)["lr_schedule"]
    assert configured["source"] == "config" and configured["type"] == "cosine" and configured["min_lr_ratio"] == 0.1
    assert ran_params({"optimizer": "sgd", "momentum": 0.9}, {"optimizer": {"source": "framework"}}) == \
        {"optimizer": "sgd", "momentum": 0.9}


def test_a_stage_records_the_specs_adamw_and_schedule_everywhere(digits_run, single_process):
    """A stage with the spec's own AdamW (two groups) and warmup-plus-cosine: the stage result, metrics.json, the
    report's training entry and the model card record AdamW, its groups and "the spec's schedule" (not the config's
    constant and the framework's sgd/momentum); the per-epoch lr follows the spec's curve."""
    config_path, out = digits_run
    config = load_config(config_path, {"model.spec": "tests.specs:AdamWCosine", "train.stages.0.epochs": 2})
    result = train.run_stage(config, "s1", out, PARAMS, None)
    optimizer, schedule = result["optimizer"], result["lr_schedule"]
    assert optimizer["type"] == "AdamW" and optimizer["source"] == "spec" and len(optimizer["groups"]) == 2
    assert [g["weight_decay"] for g in optimizer["groups"]] == [0.01, 0.0]
    assert [g["lr_scale"] for g in optimizer["groups"]] == [1.0, 0.5]
    assert schedule["source"] == "spec" and schedule["method"] == "AdamWCosine.lr_schedule"
    assert schedule["total_steps"] == result["steps"]

    metrics = storage.read_json(storage.join(storage.stage_prefix(out, "s1"), "metrics.json"))
    assert metrics["optimizer"] == optimizer and metrics["lr_schedule"] == schedule
    per_epoch = len(metrics["history"]) and result["steps"] // len(metrics["history"])
    for index, entry in enumerate(metrics["history"]):  # lr at each epoch's last step: the spec's factor of it
        last_step = (index + 1) * per_epoch - 1
        assert entry["lr"] == pytest.approx(result["lr"] * AdamWCosine().lr_schedule(last_step, schedule["total_steps"]))

    card = registry.model_card(config, trained=result, evaluation={"test_accuracy": 0.9}, best_params=None, study="s",
                               source_run="r", manifest_uri=storage.join(out, "preprocess", "manifest.json"))
    assert card["optimizer"] == optimizer and card["lr_schedule"] == schedule
    assert "optimizer" not in card["params"] and "momentum" not in card["params"]

    report = build_report(dag_id="d", run_id="r", out=out, stage_results={}, preprocess={}, sweep={},
                          training=[result], evaluation={}, predictions={}, registry={})
    [entry] = storage.read_json(report["report_uri"])["training"]
    assert entry["optimizer"]["type"] == "AdamW" and entry["lr_schedule"]["source"] == "spec"


def test_a_sweep_trial_runs_the_specs_schedule_over_its_own_steps(digits_run, single_process):
    """A trial's per-epoch lr is the suggested lr times the spec's factor at that epoch's last step of the trial's own
    steps (not a constant); its record names the spec's AdamW and schedule."""
    config_path, out = digits_run
    config = load_config(config_path, {"model.spec": "tests.specs:AdamWCosine", "sweep.num_trials": 1,
                                       "sweep.num_workers": 1, "sweep.epochs": 3, "sweep.pruner.type": "none",
                                       "sweep.batch_size": 64})
    create(config, "scheduled")
    study = optuna.load_study(study_name="scheduled", storage=open_storage(config.sweep.storage))
    study.enqueue_trial({"lr": 0.05, "hidden": 64})
    run_worker(config, "scheduled", 0, out)
    [trial] = optuna.load_study(study_name="scheduled", storage=open_storage(config.sweep.storage)).trials
    assert trial.state.name == "COMPLETE", trial.user_attrs.get("error")
    steps, curve = trial.user_attrs["steps"], trial.user_attrs["lr_curve"]
    schedule = trial.user_attrs["lr_schedule"]
    assert schedule["source"] == "spec" and schedule["total_steps"] == steps
    assert trial.user_attrs["optimizer"]["type"] == "AdamW"
    per_epoch = steps // 3
    expected = [0.05 * AdamWCosine().lr_schedule((epoch + 1) * per_epoch - 1, steps) for epoch in range(3)]
    assert curve == pytest.approx(expected)
    assert curve[-1] < 0.05 * 0.1 and not math.isclose(curve[0], curve[-1])
