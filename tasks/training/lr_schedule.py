"""A stage's learning rate: rescaled with the global batch, warmed up from the stage before, and scheduled.

Used by :mod:`stagewise.train` and :mod:`stagewise.sweep` through :func:`stage_lr`; the rules alone:
``python -c "from stagewise.training.lr_schedule import scaled_lr; print(scaled_lr(0.1, 256, 32, 'linear'))"``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from stagewise.core.errors import UserError
from stagewise.definitions.spec import ModelSpec, hook_error


def scaled_lr(base_lr: float, global_batch: int, base_batch: int, rule: str) -> float:
    """The learning rate for ``global_batch`` given the one that holds at ``base_batch``."""
    ratio = global_batch / base_batch
    if rule == "linear":
        return base_lr * ratio
    if rule == "sqrt":
        return base_lr * math.sqrt(ratio)
    if rule == "none":
        return base_lr
    raise UserError(f"train.lr_rule '{rule}' is not one of linear, sqrt, none")


def schedule_factor(schedule: Any, step: int, *, warmup_steps: int, total_steps: int, steps_per_epoch: int) -> float:
    """The factor of a stage's lr from its ``lr_schedule`` (stagewise.definitions.config.LRSchedule) at optimizer
    step ``step``: 1 through warmup, then decaying to ``min_lr_ratio`` by the stage's last step (cosine, linear) or by
    ``gamma`` every ``step_epochs`` epochs (step). The step is the stage's own, so a resume continues the curve."""
    if schedule.type == "constant":
        return 1.0
    floor = schedule.min_lr_ratio
    if schedule.type == "step":
        return max(schedule.gamma ** (step // (schedule.step_epochs * max(steps_per_epoch, 1))), floor)
    if step < warmup_steps:
        return 1.0
    progress = min((step - warmup_steps) / max(total_steps - warmup_steps, 1), 1.0)
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if schedule.type == "cosine" else 1 - progress
    return floor + (1 - floor) * shape


def stage_lr(lr: float, *, warmup_steps: int, schedule: Any, spec: ModelSpec, total_steps: int,
             steps_per_epoch: int, warmup_from: float | None = None) -> Callable[[int], float]:
    """A stage's lr at each optimizer step: the rescaled ``lr`` x warmup (from ``warmup_from``, the stage before's
    last lr, where there is one) x the spec's own ``lr_schedule`` (when it gives one) else the config's schedule."""
    start = None if warmup_from is None or lr <= 0 else min(1.0, max(0.0, warmup_from / lr))

    def lr_at(step: int) -> float:
        try:  # costs nothing per step until the user's schedule raises
            own = spec.lr_schedule(step, total_steps)
        except Exception as exc:
            if isinstance(exc, UserError):
                raise
            raise hook_error(spec, exc, "lr_schedule", context=f"at step {step} of {total_steps}") from exc
        factor = schedule_factor(schedule, step, warmup_steps=warmup_steps, total_steps=total_steps,
                                 steps_per_epoch=steps_per_epoch) if own is None else float(own)
        if not math.isfinite(factor) or factor < 0:
            raise UserError(f"{type(spec).__name__}.lr_schedule({step}, {total_steps}) gave {factor}: a factor >= 0")
        return lr * warmup_factor(step, warmup_steps, start) * factor

    return lr_at


def warmup_factor(step: int, warmup_steps: int, start: float | None = None) -> float:
    """Gradual warmup (Goyal et al. 2017): ramp linearly over the first ``warmup_steps`` steps from ``start`` (the
    stage before's lr as a fraction of this one's: no drop at the hand-off) to 1; from scratch, from 1/warmup_steps."""
    if warmup_steps <= 0 or step >= warmup_steps:
        return 1.0
    if start is None:
        return (step + 1) / warmup_steps
    return start + (1.0 - start) * (step + 1) / warmup_steps


MAX_WARMUP_FRACTION = 0.25
"""The most of a stage's steps its warmup may take: a short stage still trains mostly at its own lr."""
