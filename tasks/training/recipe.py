"""What actually trained a stage or a trial: the live optimizer (class, groups, their settings) and the lr schedule in
force, as JSON for metrics.json, the stage result, report.json and the model card, and flat for MLflow params.

Use::

    recipe = training_recipe(loop.optimizer, spec, stage.lr_schedule, warmup_steps=warmup, total_steps=total)
    # {"optimizer": {"type": "AdamW", "source": "spec", "groups": [{"params": 1234, "lr_scale": 1.0, ...}]},
    #  "lr_schedule": {"type": "spec", "source": "spec", "spec": "pkg.mod:MySpec", "method": "MySpec.lr_schedule", ...}}

Read off the objects that ran, never off the hyperparameters that might have built them: a spec's own AdamW is
recorded as AdamW even while ``params["optimizer"]`` still says ``sgd``.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from stagewise.definitions.spec import ModelSpec, user_hook

# Group keys that are no setting of the run: the tensors themselves, the lr the schedule moves each step (lr_scale
# records the group's share of it) and torch's implementation switches.
_NOT_SETTINGS = frozenset({"params", "param_names", "lr", "initial_lr", "foreach", "capturable", "differentiable", "fused"})
# The group settings MLflow gets one param each for (the rest stay in the JSON record).
_FLAT_SETTINGS = ("lr_scale", "weight_decay", "betas", "momentum", "nesterov", "dampening", "eps", "amsgrad",
                  "maximize", "name")
_FLAT_GROUPS = 16  # groups beyond these are in the JSON record only: a run's params stay few
_SOURCE_ATTRIBUTE = "_stagewise_source"


def mark_source(optimizer: torch.optim.Optimizer, source: str) -> None:
    """Remember who built ``optimizer`` ("spec": ModelSpec.optimizer; unmarked: the framework's)."""
    try:
        setattr(optimizer, _SOURCE_ATTRIBUTE, source)
    except AttributeError:  # an optimizer class with __slots__: recorded as unknown
        pass


def _plain(value: Any) -> Any:
    """A JSON-safe copy of a group setting: numbers, strings, lists; a one-element tensor as its number."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, torch.Tensor):
        return _plain(value.item()) if value.numel() == 1 else f"tensor of shape {tuple(value.shape)}"
    if isinstance(value, (tuple, list)):
        return [_plain(item) for item in value]
    return type(value).__name__


def describe_optimizer(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The live optimizer: its class, who built it, and per parameter group its size (parameters and tensors) and
    settings (lr_scale, weight_decay, betas or momentum, ...)."""
    groups = []
    for group in optimizer.param_groups:
        tensors = group.get("params", [])
        entry: dict[str, Any] = {"params": sum(p.numel() for p in tensors), "tensors": len(tensors)}
        entry.update({key: _plain(value) for key, value in group.items() if key not in _NOT_SETTINGS})
        groups.append(entry)
    kind = type(optimizer)
    return {"type": kind.__name__, "class": f"{kind.__module__}.{kind.__qualname__}",
            "source": getattr(optimizer, _SOURCE_ATTRIBUTE, "framework"), "groups": groups}


def describe_schedule(spec: ModelSpec, schedule: Any, *, warmup_steps: int, total_steps: int) -> dict[str, Any]:
    """The schedule in force: the spec's own ``lr_schedule`` when it gives a factor (named by class and method), else
    ``schedule`` (the config's, stagewise.definitions.config.LRSchedule), with the warmup and the steps it spans."""
    with user_hook(spec, "lr_schedule"):
        own = spec.lr_schedule(0, max(total_steps, 1))
    span = {"warmup_steps": warmup_steps, "total_steps": total_steps}
    if own is not None:
        kind = type(spec)
        return {"type": "spec", "source": "spec", "spec": f"{kind.__module__}:{kind.__qualname__}",
                "method": f"{kind.__name__}.lr_schedule", **span}
    return {**schedule.model_dump(), "source": "config", **span}


def training_recipe(optimizer: torch.optim.Optimizer, spec: ModelSpec, schedule: Any, *, warmup_steps: int,
                    total_steps: int) -> dict[str, Any]:
    """``{"optimizer": describe_optimizer(...), "lr_schedule": describe_schedule(...)}``: what a record keeps."""
    return {"optimizer": describe_optimizer(optimizer),
            "lr_schedule": describe_schedule(spec, schedule, warmup_steps=warmup_steps, total_steps=total_steps)}


def schedule_label(described: dict[str, Any]) -> str:
    """One phrase for a log line: "the spec's own (MySpec.lr_schedule)", "constant", "cosine to 0.1 x lr"."""
    if described.get("source") == "spec":
        return f"the spec's own ({described['method']})"
    if described["type"] in ("constant", "step"):
        return described["type"]
    return f"{described['type']} to {described.get('min_lr_ratio', 0.0):g} x lr"


def recipe_params(recipe: dict[str, Any]) -> dict[str, Any]:
    """The recipe as flat MLflow params: ``optimizer`` (the class), ``optimizer.source``, ``optimizer.groups`` and
    ``optimizer.group<i>.<setting>`` with the group's size, ``lr_schedule`` and its settings."""
    optimizer, schedule = recipe["optimizer"], recipe["lr_schedule"]
    flat: dict[str, Any] = {"optimizer": optimizer["type"], "optimizer.source": optimizer["source"],
                            "optimizer.groups": len(optimizer["groups"])}
    for index, group in enumerate(optimizer["groups"][:_FLAT_GROUPS]):
        flat[f"optimizer.group{index}.params"] = group["params"]
        for key in _FLAT_SETTINGS:
            if key in group:
                value = group[key]
                flat[f"optimizer.group{index}.{key}"] = ", ".join(map(str, value)) if isinstance(value, list) else value
    flat["lr_schedule"] = schedule["method"] if schedule.get("source") == "spec" else schedule["type"]
    flat["lr_schedule.source"] = schedule["source"]
    for key in ("min_lr_ratio", "gamma", "step_epochs", "total_steps"):
        if schedule.get(key) is not None and (key == "total_steps" or schedule.get("source") == "config"):
            flat[f"lr_schedule.{key}"] = schedule[key]
    return flat
