"""The device a scoring sub-job (evaluation, batch inference) runs on, exact float32 there, and overlapped copies to it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

from stagewise.core.errors import UserError


def scoring_device(requested: str) -> Any:
    """The torch device a scoring sub-job uses for a profile's ``device``: cpu, cuda, or auto (cuda when present)."""
    import torch

    if requested == "cuda" and not torch.cuda.is_available():
        raise UserError("profile asks for device 'cuda' but no CUDA device is visible")
    return torch.device("cuda" if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()) else "cpu")


@contextlib.contextmanager
def exact_float32(device: Any) -> Iterator[None]:
    """TF32 off on ``device`` for the block: GPU scores then agree with the CPU's to float32 rounding, not TF32's 1e-3."""
    import torch

    if device.type != "cuda":
        yield
        return
    # torch >= 2.9 refuses a mix of its legacy (allow_tf32) and new (fp32_precision) switches: use the new ones there.
    backends = [torch.backends.cuda.matmul, getattr(torch.backends.cudnn, "conv", None), getattr(torch.backends.cudnn, "rnn", None)]
    backends = [b for b in backends if b is not None and hasattr(b, "fp32_precision")]
    if backends:
        saved = [b.fp32_precision for b in backends]
        for backend in backends:
            backend.fp32_precision = "ieee"
    else:
        saved = [torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32]
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        if backends:
            for backend, value in zip(backends, saved):
                backend.fp32_precision = value
        else:
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def prefetch(chunks: Iterable[tuple[Any, Any]], device: Any) -> Iterator[tuple[Any, Any]]:
    """Each ``(meta, tensors)`` of ``chunks`` (a tensor or a tuple of them) as ``(meta, the same on device)``, in order.

    On CUDA the next chunk is read (pulling ``chunks``), pinned unless it already is, and copied on a side
    stream when the caller asks for it, i.e. after it queued the current chunk's work: the copy overlaps that
    work, and the consumer's stream waits for the copy before it reads the tensors (no host sync). Elsewhere
    the tensors pass through ``.to(device)``, so the CPU path runs the same caller code.
    """
    import torch

    def each(tensors: Any, move: Any) -> Any:
        return tuple(move(t) for t in tensors) if isinstance(tensors, tuple) else move(tensors)

    if device.type != "cuda":
        for meta, tensors in chunks:
            yield meta, each(tensors, lambda t: t.to(device))
        return
    side = torch.cuda.Stream(device=device)

    def copy(tensor: Any) -> Any:
        pinned = tensor if tensor.is_pinned() else tensor.pin_memory()
        with torch.cuda.stream(side):
            return pinned.to(device, non_blocking=True)

    def hand_over(moved: Any) -> Any:
        moved.record_stream(current)  # allocated on the side stream: not reused before the consumer's work is done
        return moved

    for meta, tensors in chunks:
        moved = each(tensors, copy)
        current = torch.cuda.current_stream(device)
        current.wait_stream(side)  # the model reads the chunk only once its copy has landed
        yield meta, each(moved, hand_over)


