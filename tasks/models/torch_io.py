"""torch files on any storage: written atomically, read back with ``weights_only=True`` (no pickled code runs)."""

from __future__ import annotations

import io
from typing import Any

import torch

from stagewise.core import storage
from stagewise.core.errors import DataError
from stagewise.models.versions import check_registered


def save_torch(uri: str, payload: dict[str, Any]) -> None:
    """Serialise and write atomically: a crash mid-write never leaves a torn file visible (a local file is written
    as it is serialised, never whole in memory twice)."""
    storage.write_with(uri, lambda handle: torch.save(payload, handle))


def read_checked(uri: str) -> tuple[bytes, str]:
    """A torch file's bytes and their version id (stagewise.models.versions), read once; a registered model whose bytes
    no longer match its version is a DataError naming it. Read faults pass and are retried."""
    data = storage.read_bytes(uri)
    return data, check_registered(uri, data)


def parse_torch(uri: str, data: bytes) -> dict[str, Any]:
    """``data`` read from ``uri`` loaded with ``weights_only=True``, tensors on the CPU (see
    :func:`restore_training_state`); bytes that do not load (cut, corrupt, not a torch file) are a DataError naming
    ``uri``: no retry reads them differently."""
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except MemoryError:
        raise
    except Exception as exc:  # the bytes are in memory: whatever fails here is the file's content
        reason = " ".join(str(exc).split())[:300]
        raise DataError(f"{uri}: cannot be loaded as a torch file ({type(exc).__name__}: {reason}; {len(data)} bytes): "
                        f"it is cut or corrupt; restore it or run the stage that writes it again") from None


def load_torch(uri: str) -> dict[str, Any]:
    """Read and load a file written by :func:`save_torch` (:func:`read_checked`, then :func:`parse_torch`)."""
    return parse_torch(uri, read_checked(uri)[0])
