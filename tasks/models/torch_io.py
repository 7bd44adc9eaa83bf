"""torch files on any storage: written atomically, read back with ``weights_only=True`` (no pickled code runs)."""

from __future__ import annotations

import io
from typing import Any

import torch

from tasks.core import storage


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


