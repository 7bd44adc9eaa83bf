"""Models as specs, and their self-contained bundle (spec reference, weights, what inference needs).

The built-in :class:`MLPClassifier` is one :class:`tasks.spec.ModelSpec` among any a user names in
``model.spec``. :func:`build` is the one path from (spec, data, params) to a module, shared by sweep
trials, training stages, evaluation, inference and bundle loading.

A bundle is one ``torch.save`` file holding tensors and plain values only (the spec's import path and
arguments, the hyperparameters, the data description, the state dict and the preprocessing), so it
loads with ``torch.load(weights_only=True)``: no pickled code runs on load.
"""

from __future__ import annotations

import io
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from tasks import storage
from tasks.errors import UserError
from tasks.spec import Classifier, DataInfo, ModelSpec, SpecRef

BUILTIN_SPEC = "tasks.model:MLPClassifier"
BUNDLE_FORMAT = "stagewise-model/2"


class MLPClassifier(Classifier):
    """Two hidden ReLU layers over the feature vector; cross-entropy, accuracy, class and probabilities (Classifier)."""

    default_params = {"hidden": 128, "dropout": 0.0}

    def build(self, data: DataInfo, params: dict[str, Any]) -> nn.Module:
        if data.num_classes is None:
            raise UserError("MLPClassifier needs an integer class label (dataset.num_classes)")
        hidden, dropout = int(params["hidden"]), float(params["dropout"])
        return nn.Sequential(
            nn.Linear(data.num_features, hidden), nn.ReLU(), nn.Dropout(dropout),
            nn.Linear(hidden, hidden), nn.ReLU(), nn.Dropout(dropout),
            nn.Linear(hidden, data.num_classes),
        )


def data_info(manifest: dict[str, Any]) -> DataInfo:
    """The data description a spec builds from, read off a preprocess manifest (or a bundle's preprocessing)."""
    target = manifest.get("target") or {}
    return DataInfo(features=list(manifest["features"]), num_classes=manifest.get("num_classes"),
                    target_mean=target.get("mean"), target_std=target.get("std"),
                    shapes={name: list(shape) for name, shape in (manifest.get("feature_shapes") or {}).items()})


def spec_params(spec: ModelSpec, params: dict[str, Any]) -> dict[str, Any]:
    """The spec's defaults overlaid with the values of ``params`` it declares."""
    return {**spec.default_params, **{k: v for k, v in params.items() if k in spec.default_params}}


def build(spec: ModelSpec, data: DataInfo, params: dict[str, Any]) -> nn.Module:
    """The one way a module comes to be: the spec is prepared for the data and builds it; a spec that returns no module is named."""
    spec.prepare(data)
    module = spec.build(data, spec_params(spec, params))
    if not isinstance(module, nn.Module):
        raise UserError(f"{type(spec).__name__}.build returned {type(module).__name__}, not a torch.nn.Module")
    return module


def save_torch(uri: str, payload: dict[str, Any]) -> None:
    """Serialise and write atomically: a crash mid-write never leaves a torn file visible."""
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    storage.write_bytes(uri, buffer.getvalue())


def load_torch(uri: str) -> dict[str, Any]:
    """Read a file written by :func:`save_torch`; tensors land on the CPU (see :func:`restore_training_state`)."""
    fs, path = storage.filesystem(uri)
    with fs.open(path, "rb") as handle:
        data = handle.read()
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def restore_training_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any],
                           device: str | torch.device) -> None:
    """Load a checkpoint's model and optimizer state for training on ``device``.

    The model moves to ``device`` first: ``Optimizer.load_state_dict`` puts each state tensor (e.g.
    SGD momentum, Adam moments) on its parameter's device, so loading into a model still on the CPU
    would leave those buffers behind and the first GPU step would fail on mixed devices.
    """
    model.to(device)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])


def load_spec(config: Any) -> ModelSpec:
    """The config's ``model.spec`` instantiated with ``model.args``."""
    return SpecRef(config.model.spec, dict(config.model.args)).load()


@dataclass(frozen=True)
class BuiltModel:
    """A fresh module for a run, with what built it."""

    module: nn.Module
    spec: ModelSpec
    ref: SpecRef
    data: DataInfo
    params: dict[str, Any]
    """Every hyperparameter, resolved: the framework's and the spec's."""


def model_for_run(config: Any, manifest: dict[str, Any], swept: dict[str, Any]) -> BuiltModel:
    """Resolve the hyperparameters and build the config's model for a committed preprocess manifest.

    The one setup shared by sweep trials and training stages (seed the RNG before calling it).
    """
    from tasks.train import resolve_params

    ref = SpecRef(config.model.spec, dict(config.model.args))
    spec = ref.load()
    params = resolve_params(config, swept, spec)
    data = data_info(manifest)
    return BuiltModel(module=build(spec, data, params), spec=spec, ref=ref, data=data, params=params)


def preprocessing_of(manifest: dict[str, Any]) -> dict[str, Any]:
    """What inference needs to turn raw rows into the model's inputs: raw columns, tensor shapes and normalisation."""
    return {**{name: manifest[name] for name in ("features", "mean", "std", "key", "label")},
            "columns": manifest.get("columns") or manifest["features"], "feature_shapes": manifest.get("feature_shapes") or {}}


@dataclass(frozen=True)
class Bundle:
    """A loaded model bundle: the module in eval mode, its spec, and the stored metadata."""

    module: nn.Module
    spec: ModelSpec
    ref: SpecRef
    data: DataInfo
    params: dict[str, Any]
    preprocessing: dict[str, Any]
    extra: dict[str, Any]


def save_bundle(uri: str, model: nn.Module, ref: SpecRef, data: DataInfo, params: dict[str, Any],
                preprocessing: dict[str, Any], extra: dict[str, Any]) -> None:
    """Write the model as its spec reference, hyperparameters, data description, weights and normalisation."""
    save_torch(uri, {"format": BUNDLE_FORMAT, "spec": {"path": ref.path, "args": ref.args}, "params": params,
                     "data": asdict(data), "state_dict": model.state_dict(), "preprocessing": preprocessing,
                     "extra": extra})


def _upgrade(payload: dict[str, Any]) -> dict[str, Any]:
    # Bundles of the first format held the MLP's shape only; they load as the built-in spec.
    shape = payload["spec"]
    return {**payload, "spec": {"path": BUILTIN_SPEC, "args": {}},
            "params": {"hidden": shape["hidden"], "dropout": shape["dropout"]},
            "data": {"features": payload["preprocessing"]["features"], "num_classes": shape["num_classes"]}}


def load_bundle(uri: str) -> Bundle:
    """Import the bundle's spec, build its module and load the weights; a spec that is gone or no longer fits is named."""
    payload = load_torch(uri)
    if payload.get("format") == "stagewise-model/1":
        payload = _upgrade(payload)
    elif payload.get("format") != BUNDLE_FORMAT:
        raise UserError(f"{uri}: not a stagewise model bundle")
    ref = SpecRef(payload["spec"]["path"], dict(payload["spec"]["args"]))
    try:
        spec = ref.load()
    except UserError as exc:
        raise UserError(f"{uri}: {exc}") from None
    data = DataInfo(**payload["data"])
    module = build(spec, data, payload["params"])
    try:
        module.load_state_dict(payload["state_dict"])
    except RuntimeError as exc:
        raise UserError(f"{uri}: the weights do not fit what {ref.path} builds now (did the spec change since the model "
                        f"was trained?): {str(exc).splitlines()[0]}") from None
    module.eval()
    return Bundle(module=module, spec=spec, ref=ref, data=data, params=dict(payload["params"]),
                  preprocessing=payload["preprocessing"], extra=payload["extra"])
