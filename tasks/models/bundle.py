"""A model's self-contained bundle: spec reference, hyperparameters, data description, weights, preprocessing.

A bundle is one ``torch.save`` file holding tensors and plain values only, so it loads with
``torch.load(weights_only=True)``: no pickled code runs on load; loading imports the spec and builds the module. A
registered version whose spec module is not importable here imports it from the source it carries (``code/``,
stagewise.models.shipping).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from torch import nn

from stagewise.core.errors import UserError
from stagewise.definitions.hyperparams import BUILTIN_SPEC
from stagewise.definitions.spec import DataInfo, ModelSpec, SpecRef
from stagewise.models.building import build
from stagewise.models.shipping import make_importable
from stagewise.models.torch_io import parse_torch, read_checked, save_torch
from stagewise.models.versions import registered_file

BUNDLE_FORMAT = "stagewise-model/2"


def preprocessing_of(manifest: dict[str, Any]) -> dict[str, Any]:
    """What inference needs to turn raw rows into the model's inputs: raw columns, tensor shapes, normalisation, the record
    layout and categorical vocabularies."""
    return {**{name: manifest[name] for name in ("features", "mean", "std", "key", "label")},
            "columns": manifest.get("columns") or manifest["features"], "feature_shapes": manifest.get("feature_shapes") or {},
            **({"layout": manifest["layout"], "vocabularies": manifest.get("vocabularies") or {}} if manifest.get("layout") else {})}


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
    version: str
    """The version id of the bytes it was loaded from (a registered model's is checked against its folder's)."""


def save_bundle(uri: str, model: nn.Module | dict[str, Any], ref: SpecRef, data: DataInfo, params: dict[str, Any],
                preprocessing: dict[str, Any], extra: dict[str, Any]) -> None:
    """Write the model (a module, or its full state dict) as its spec reference, hyperparameters, data description,
    weights and normalisation."""
    weights = model if isinstance(model, dict) else model.state_dict()
    save_torch(uri, {"format": BUNDLE_FORMAT, "spec": {"path": ref.path, "args": ref.args}, "params": params,
                     "data": asdict(data), "state_dict": weights, "preprocessing": preprocessing,
                     "extra": extra})


def _upgrade(payload: dict[str, Any]) -> dict[str, Any]:
    # Bundles of the first format held the MLP's shape only; they load as the built-in spec.
    shape = payload["spec"]
    return {**payload, "spec": {"path": BUILTIN_SPEC, "args": {}},
            "params": {"hidden": shape["hidden"], "dropout": shape["dropout"]},
            "data": {"features": payload["preprocessing"]["features"], "num_classes": shape["num_classes"]}}


def load_bundle(uri: str) -> Bundle:
    """Import the bundle's spec, build its module and load the weights; a spec that is gone or no longer fits is named."""
    data, version = read_checked(uri)
    payload = parse_torch(uri, data)
    if payload.get("format") == "stagewise-model/1":
        payload = _upgrade(payload)
    elif payload.get("format") != BUNDLE_FORMAT:
        raise UserError(f"{uri}: not a stagewise model bundle")
    ref = SpecRef(payload["spec"]["path"], dict(payload["spec"]["args"]))
    if registered_file(uri):
        make_importable(uri, ref.path)
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
    if hasattr(spec, "threshold"):  # a binary Classifier predicts at the threshold its validation chose
        spec.threshold = payload["extra"].get("decision_threshold")
    return Bundle(module=module, spec=spec, ref=ref, data=data, params=dict(payload["params"]),
                  preprocessing=payload["preprocessing"], extra=payload["extra"], version=version)


