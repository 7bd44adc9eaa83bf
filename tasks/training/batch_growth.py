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
    min_global_batch: int
    """This stage's own configured global batch (per_process_batch × world size × grad_accum_steps): the smallest it
    may take, and what it trains at without a measurement."""
    max_global_batch: int
    """train.max_global_batch: the largest."""
    target: int
    """The noise scale clamped between those two."""
    global_batch: int
    """What the stage trains at: per_process_batch × world size × grad_accum_steps: the target or just below it, never
    below min_global_batch (then just above the target where the target does not divide)."""
    per_process_batch: int
    """The micro-batch on each process, at most the stage's configured per-process batch (its memory bound)."""
    grad_accum_steps: int
    """Micro-batches accumulated per step, so the target is reached when memory bounds the per-process batch."""
    no_measurement: str | None = None
    """Why the stage before handed on no noise scale, so the batch stayed (None: it handed one on)."""


def previous_noise_scale(state: dict[str, Any]) -> float | None:
    """B_simple kept in a handed-on checkpoint (None when the stage before measured none: a script stage, or
    train.noise_scale off)."""
    return handed_noise_scale(state)[0]


def handed_noise_scale(state: dict[str, Any]) -> tuple[float | None, str | None]:
    """(B_simple kept in a handed-on checkpoint, None) or (None, why there is none)."""
    saved = state.get("noise_scale") or {}
    if not saved:
        return None, ("its checkpoint holds no noise-scale state (train.noise_scale was off for it, or it was a "
                      "stage with its own entrypoint)")
    estimator = NoiseScale("cpu")
    estimator.load_state_dict(saved)
    estimates = estimator.estimates()
    if estimates is None and estimator.updates:
        return None, (f"none of its {estimator.updates} measurements was finite (every measured step's gradients "
                      "overflowed in fp16)")
    if estimates is None:
        return None, "it took no measured step (0 measurements: its steps never split into two batch sizes)"
    if estimates["noise_scale"] is None:
        return None, (f"its smoothed estimates were not both positive after {estimator.updates} measurements "
                      f"(|G|² {estimates['grad_sq']:.3g}, tr(Σ) {estimates['trace_cov']:.3g}): the gradient's mean "
                      "was lost in its noise; a longer stage measures more steps")
    return estimates["noise_scale"], None


def adaptive_batch(noise_scale: float | None, min_global_batch: int, max_global_batch: int, world_size: int,
                   per_process_limit: int, no_measurement: str | None = None) -> BatchDecision:
    """The global batch the noise scale asks for, clamped to [this stage's configured global batch, max], reached with
    the fewest accumulation steps the per-process limit allows (a batch that does not divide lands just below the
    target, or just above it where below would undercut the configured batch). Without a noise scale the stage trains
    at its configured batch; ``no_measurement`` (why) is kept."""
    wanted = min_global_batch if noise_scale is None else round(noise_scale)
    target = max(min_global_batch, min(max_global_batch, wanted))
    accumulation = math.ceil(target / (world_size * per_process_limit))
    per_process = max(1, min(per_process_limit, target // (world_size * accumulation)))
    if per_process * world_size * accumulation < min_global_batch:  # rounding down fell below the floor: round up
        per_process = min(per_process_limit, math.ceil(min_global_batch / (world_size * accumulation)))
    return BatchDecision(noise_scale=noise_scale, min_global_batch=min_global_batch,
                         max_global_batch=max_global_batch, target=target,
                         global_batch=per_process * world_size * accumulation, per_process_batch=per_process,
                         grad_accum_steps=accumulation,
                         no_measurement=(no_measurement or "the stage before handed on none") if noise_scale is None else None)
