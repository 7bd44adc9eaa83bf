"""Adaptive batch growth: the next stage's global batch from the noise scale the stage before measured.

Run: ``python -m stagewise.train`` applies it to every stage after the first when ``train.batch_growth`` is adaptive.
The decision is a pure function of the previous stage's handed-on checkpoint (its noise-scale state and global
batch) and the config, so an Airflow retry, or a resume from a checkpoint, decides exactly the same again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from stagewise.training.noise_scale import NoiseScale


@dataclass(frozen=True, kw_only=True)
class BatchDecision:
    """How an adaptive stage chose its batch, with its inputs (logged, in the stage's result, report.json and chart)."""

    noise_scale: float | None
    """B_simple at the end of the stage before (None: it measured none, and the batch stays)."""
    previous_global_batch: int
    """The global batch of the stage before: the smallest this stage may take."""
    max_global_batch: int
    """train.max_global_batch: the largest."""
    target: int
    """The noise scale clamped between those two."""
    global_batch: int
    """What the stage trains at: per_process_batch × world size × grad_accum_steps, at most the target."""
    per_process_batch: int
    """The micro-batch on each process, at most the stage's configured per-process batch (its memory bound)."""
    grad_accum_steps: int
    """Micro-batches accumulated per step, so the target is reached when memory bounds the per-process batch."""


def previous_noise_scale(state: dict[str, Any]) -> float | None:
    """B_simple kept in a handed-on checkpoint (None when the stage before measured none: a script stage, or
    train.noise_scale off)."""
    saved = state.get("noise_scale") or {}
    if not saved:
        return None
    estimator = NoiseScale("cpu")
    estimator.load_state_dict(saved)
    return (estimator.estimates() or {}).get("noise_scale")


def adaptive_batch(noise_scale: float | None, previous_global_batch: int, max_global_batch: int, world_size: int,
                   per_process_limit: int) -> BatchDecision:
    """The global batch the noise scale asks for, clamped to [previous, max], reached with the fewest accumulation
    steps the per-process limit allows (a batch that does not divide lands just below the target)."""
    wanted = previous_global_batch if noise_scale is None else round(noise_scale)
    target = max(previous_global_batch, min(max_global_batch, wanted))
    accumulation = math.ceil(target / (world_size * per_process_limit))
    per_process = max(1, min(per_process_limit, target // (world_size * accumulation)))
    return BatchDecision(noise_scale=noise_scale, previous_global_batch=previous_global_batch,
                         max_global_batch=max_global_batch, target=target,
                         global_batch=per_process * world_size * accumulation, per_process_batch=per_process,
                         grad_accum_steps=accumulation)
