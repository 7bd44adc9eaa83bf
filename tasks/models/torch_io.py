"""torch files on any storage: written atomically, read back with ``weights_only=True`` (no pickled code runs)."""

from __future__ import annotations

import io
import os
from typing import Any

import torch

from stagewise.core import storage
from stagewise.core.errors import DataError, UserError, out_of_memory
from stagewise.models.versions import check_registered, registered_file


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
    ``uri``: no retry reads them differently. Memory that runs out while loading is a user error of its own."""
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # the bytes are in memory: whatever fails here is the file's content, or memory
        raise _load_failure(uri, len(data), exc) from None


def _load_failure(uri: str, size: int, exc: BaseException) -> UserError:
    """Why a torch file did not load: out of memory (naming the file, its size, the rank and what to change), else cut
    or corrupt."""
    reason = " ".join(str(exc).split())[:300]
    if out_of_memory(exc):
        return UserError(
            f"{uri}: rank {os.environ.get('RANK', '0')} ran out of memory loading it ({size / 2**20:.1f} MiB; "
            f"{type(exc).__name__}: {reason}): the file is not damaged; give the process more memory, or hand on less "
            f"(train.stages[].hand_on_optimizer: false leaves the optimizer state out; a stage with strategy fsdp reads "
            f"a hand-off on rank 0 only and sends each rank its shard)")
    return DataError(f"{uri}: cannot be loaded as a torch file ({type(exc).__name__}: {reason}; {size} bytes): "
                     f"it is cut or corrupt; restore it or run the stage that writes it again")


def load_torch(uri: str, *, mapped: bool = False) -> dict[str, Any]:
    """Read and load a file written by :func:`save_torch` (:func:`read_checked`, then :func:`parse_torch`).

    ``mapped``: a local file that is no registered version (a stage's hand-off, a checkpoint) is memory-mapped instead of
    read into memory first, so loading it costs its tensors once, not twice."""
    path = uri.removeprefix("file://")
    if not (mapped and "://" not in path and not registered_file(path)):
        return parse_torch(uri, read_checked(uri)[0])
    size = os.path.getsize(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except (FileNotFoundError, PermissionError):
        raise
    except Exception as exc:
        raise _load_failure(uri, size, exc) from None
