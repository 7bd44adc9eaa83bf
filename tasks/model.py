"""The classifier and its self-contained bundle (weights + what inference needs to use them).

A bundle is one ``torch.save`` file holding tensors and plain values only, so it loads with
``torch.load(weights_only=True)``: no pickled code runs on load.
"""

from __future__ import annotations

import io
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from tasks import storage


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """Shape of the MLP classifier."""

    num_features: int
    """Input width."""
    num_classes: int
    """Output classes."""
    hidden: int = 128
    """Width of the two hidden layers."""
    dropout: float = 0.0
    """Dropout after each hidden layer."""


def build_model(spec: ModelSpec) -> nn.Module:
    return nn.Sequential(
        nn.Linear(spec.num_features, spec.hidden), nn.ReLU(), nn.Dropout(spec.dropout),
        nn.Linear(spec.hidden, spec.hidden), nn.ReLU(), nn.Dropout(spec.dropout),
        nn.Linear(spec.hidden, spec.num_classes),
    )


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


def save_bundle(uri: str, model: nn.Module, spec: ModelSpec, preprocessing: dict[str, Any], extra: dict[str, Any]) -> None:
    """Write the model with its spec and the normalisation it expects (features, mean, std)."""
    save_torch(uri, {"format": "stagewise-model/1", "spec": asdict(spec), "state_dict": model.state_dict(),
                     "preprocessing": preprocessing, "extra": extra})


def load_bundle(uri: str) -> tuple[nn.Module, dict[str, Any]]:
    """The model in eval mode and the bundle's metadata (spec, preprocessing, extra)."""
    payload = load_torch(uri)
    if payload.get("format") != "stagewise-model/1":
        from tasks.errors import UserError

        raise UserError(f"{uri}: not a stagewise model bundle")
    model = build_model(ModelSpec(**payload["spec"]))
    model.load_state_dict(payload["state_dict"])
    model.eval()
    return model, payload
