"""From (spec, data, hyperparameters) to a module: the one path shared by sweep trials, training stages,
evaluation, inference and bundle loading.

The built-in ``stagewise.model:MLPClassifier`` is one spec among any a user names in ``model.spec``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from stagewise.core.errors import UserError
from stagewise.definitions.config import PipelineConfig
from stagewise.definitions.hyperparams import FRAMEWORK_DEFAULTS, hyperparameter_problem, typed
from stagewise.definitions.rows import RowLayout
from stagewise.definitions.spec import DataInfo, ModelSpec, SpecRef, user_hook


def data_info(manifest: dict[str, Any]) -> DataInfo:
    """The data description a spec builds from, read off a preprocess manifest (or a bundle's preprocessing)."""
    target = manifest.get("target") or {}
    layout = RowLayout(**manifest["layout"]) if manifest.get("layout") else None
    return DataInfo(features=list(manifest["features"]), num_classes=manifest.get("num_classes"),
                    class_counts=manifest.get("class_counts"),
                    target_mean=target.get("mean"), target_std=target.get("std"),
                    shapes={name: list(shape) for name, shape in (manifest.get("feature_shapes") or {}).items()},
                    layout=layout if layout is not None and layout.typed else None)


def spec_params(spec: ModelSpec, params: dict[str, Any]) -> dict[str, Any]:
    """The spec's defaults overlaid with the values of ``params`` it declares."""
    return {**spec.default_params, **{k: v for k, v in params.items() if k in spec.default_params}}


def build(spec: ModelSpec, data: DataInfo, params: dict[str, Any]) -> nn.Module:
    """The one way a module comes to be: the spec is prepared for the data and builds it; a spec that returns no module is named."""
    with user_hook(spec, "prepare"):
        spec.prepare(data)
    spec._row_layout = data.layout if data.typed else None
    with user_hook(spec, "build"):
        module = spec.build(data, spec_params(spec, params))
    if not isinstance(module, nn.Module):
        raise UserError(f"{type(spec).__name__}.build returned {type(module).__name__}, not a torch.nn.Module")
    return module


def load_spec(config: PipelineConfig) -> ModelSpec:
    """The config's ``model.spec`` instantiated with ``model.args``."""
    return SpecRef(config.model.spec, dict(config.model.args)).load()


def resolve_params(config: PipelineConfig, swept: dict[str, Any], spec: Any = None) -> dict[str, Any]:
    """Hyperparameters: the framework's and the spec's defaults, then train.default_params, then the sweep's best
    (each checked by name: the framework's and those the spec declares)."""
    if not isinstance(swept or {}, dict):
        raise UserError(f"--params must be a JSON object of hyperparameters, got {type(swept).__name__}")
    spec = spec or load_spec(config)
    known = (*FRAMEWORK_DEFAULTS, *spec.default_params)
    params = {**FRAMEWORK_DEFAULTS, **spec.default_params, **config.train.default_params, **(swept or {})}
    problems = [problem for name, value in params.items() if (problem := hyperparameter_problem(name, value, known))]
    if problems:
        raise UserError(f"bad hyperparameter(s) in --params / sweep result / train.default_params for {config.model.spec}: "
                        f"{'; '.join(problems)}")
    return typed(params)


@dataclass(frozen=True)
class BuiltModel:
    """A fresh module for a run, with what built it."""

    module: nn.Module
    spec: ModelSpec
    ref: SpecRef
    data: DataInfo
    params: dict[str, Any]
    """Every hyperparameter, resolved: the framework's and the spec's."""


def model_for_run(config: PipelineConfig, manifest: dict[str, Any], swept: dict[str, Any]) -> BuiltModel:
    """Resolve the hyperparameters and build the config's model for a committed preprocess manifest.

    The one setup shared by sweep trials and training stages (seed the RNG before calling it).
    """
    ref = SpecRef(config.model.spec, dict(config.model.args))
    spec = ref.load()
    if hasattr(spec, "threshold_rule"):  # a binary Classifier's validation chooses its threshold by this rule
        spec.threshold_rule = (config.evaluate.threshold.rule, config.evaluate.threshold.target)
    params = resolve_params(config, swept, spec)
    data = data_info(manifest)
    return BuiltModel(module=build(spec, data, params), spec=spec, ref=ref, data=data, params=params)
