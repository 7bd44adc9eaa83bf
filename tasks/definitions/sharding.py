"""Which keys ``strategy: fsdp`` cannot be paired with, checked once where a config is validated.

Used by :mod:`stagewise.definitions.config` (a stage's and the sweep's refusals) and
:func:`stagewise.definitions.loading.load_config` (the warning); run ``python -m stagewise.config FILE`` to see both.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("stagewise.config")


def stage_strategy_problem(stage: Any) -> str | None:
    """Why a train stage's strategy cannot work with its other knobs (None: it can)."""
    if stage.strategy == "fsdp" and stage.precision == "fp16":
        return ("strategy fsdp with precision fp16: the fp16 gradient scaler would decide on each rank's shard alone; "
                "use precision bf16 (or fp32)")
    if stage.strategy == "fsdp" and stage.compile != "off":
        return f"strategy fsdp with compile '{stage.compile}': fsdp stages run eagerly; set compile: off"
    if stage.strategy == "fsdp" and stage.cuda_graph == "on":
        return ("strategy fsdp with cuda_graph 'on': each unit's all-gather and reduce-scatter run inside the step, so "
                "it is never captured; set cuda_graph: auto or off (or strategy: ddp)")
    if stage.activation_checkpointing and stage.strategy != "fsdp":
        return "activation_checkpointing checkpoints each fsdp unit: set strategy: fsdp, or drop it"
    return None


def sweep_strategy_problem(sweep: Any) -> str | None:
    """Why ``sweep.strategy`` cannot work with the rest of the sweep (None: it can)."""
    if sweep.strategy == "fsdp" and sweep.entrypoint is not None:
        # A trial of one's own script never builds through the trial loop, so nothing would shard it.
        return ("sweep.strategy fsdp with sweep.entrypoint: fsdp shards the built-in trial loop's model, but each trial "
                "runs your own script, which never sees it; drop sweep.strategy (your script spreads its model itself)")
    return None


def warn_unused_sharding_keys(train: Any, source: Any) -> None:
    """Log a WARNING for fsdp-only keys set where no stage of ``train`` runs fsdp (they change nothing there)."""
    if train.async_checkpoints and not any(stage.strategy == "fsdp" for stage in train.stages):
        log.warning("%s: train.async_checkpoints: true applies to fsdp stages only (strategy: fsdp), and no stage of "
                    "train.stages has one: every checkpoint is written in the step", source)
