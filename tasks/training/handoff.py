"""What a stage hands to the next and how the next reads it, and what a checkpoint written at another world size
resumes as.

``final.pt`` holds the model whole (evaluation, the bundle, a ddp stage and a user's script read it) and the plain
values a next stage needs (global batch, position, noise scale, ...). The optimizer state goes beside it as a sharded
(DCP) checkpoint that ``final.pt`` names, so each rank of the next stage reads only its part; a stage with
``hand_on_optimizer: false`` leaves it out. The best epoch lives in its own files (``best/``), never in ``final.pt``.

A sharded stage on several ranks reads a hand-off on rank 0 only: its plain values go to the other ranks as one small
object and the model one tensor at a time (the strategy's broadcast from rank 0), so the model is materialised whole
once, on one rank, and no rank ever holds the whole optimizer state.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from stagewise.core.dropped import refuse_dropped
from stagewise.core.errors import UserError
from stagewise.models.torch_io import load_torch
from stagewise.training.distributed import DistEnv

log = logging.getLogger("stagewise.train")

CHECKPOINT_ONLY = ("best_epoch_state",)
"""Plain values a checkpoint keeps for a resume that a hand-off never carries."""

ON_RANK_ZERO = "on_rank_zero"
"""A rank's ``optimizer`` in a hand-off read on rank 0 only, when final.pt holds it inline (a script's, an older
stage's): rank 0 sends each rank its part."""


def handed_values(plain: dict[str, Any]) -> dict[str, Any]:
    """The plain values of a stage's final state as final.pt carries them."""
    return {key: value for key, value in plain.items() if key not in CHECKPOINT_ONLY}


def handed_lr(state: dict[str, Any]) -> float | None:
    """The lr a hand-off's stage ended at (its last epoch's), where its final.pt records a history (a script's has
    none): the next stage's warmup starts there."""
    try:
        history = json.loads(state.get("history") or "[]")
        return float(history[-1]["lr"]) if history and history[-1].get("lr") is not None else None
    except (TypeError, ValueError, KeyError, AttributeError):
        return None


def _plain_part(state: dict[str, Any]) -> dict[str, Any]:
    """What the ranks that do not read a hand-off get of it: everything but the model and an inline optimizer."""
    plain = {key: value for key, value in state.items() if key not in ("model", "optimizer")}
    optimizer = state.get("optimizer")
    if isinstance(optimizer, dict) and "state" in optimizer:
        plain["optimizer"] = {ON_RANK_ZERO: True}
    elif optimizer is not None:
        plain["optimizer"] = optimizer  # a reference to a sharded checkpoint: every rank reads its own part
    return plain


def read_hand_off(uri: str, env: DistEnv, *, rank_zero_reads: bool) -> dict[str, Any]:
    """The stage before's final.pt as this rank needs it. ``rank_zero_reads`` (a sharded stage): rank 0 reads the file,
    every other rank gets its plain values and an empty model (the strategy sends it its shard); otherwise every rank
    reads it (a replica needs the model whole). Every rank calls it. One dropped after its run succeeded (a stage
    cleared alone then) is a DataError saying what to clear instead."""
    refuse_dropped(uri, "the stage before's hand-off")
    if not (rank_zero_reads and env.distributed):
        return load_torch(uri, mapped=True)
    import torch.distributed as dist

    state = load_torch(uri, mapped=True) if env.master else {}
    holder = [_plain_part(state) if env.master else None]
    dist.broadcast_object_list(holder, src=0)
    return state if env.master else {**holder[0], "model": {}}


def resumed_position(stage: str, uri: str, meta: dict[str, Any], world_size: int, global_batch: int,
                     accumulation: int) -> dict[str, Any]:
    """The position to resume a checkpoint at on ``world_size`` ranks. Written at another world size, it carries over
    when the global batch is the same (the steps of the epoch done stay done; each rank's part is resharded); a
    global batch that changed with the world size cannot continue the epoch's position, and is a user error."""
    position = json.loads(meta["position"])
    written = meta.get("world_size", world_size)
    if written == world_size:
        return position
    if meta["global_batch"] != global_batch:
        raise UserError(
            f"stage {stage}: checkpoint {uri} was written by {written} process(es) at global batch "
            f"{meta['global_batch']}; this attempt runs {world_size}, whose global batch is {global_batch}, so its "
            f"position in the epoch cannot carry over. Run the stage on {written} process(es) again, give it a "
            f"global_batch (instead of per_process_batch) that {written} and {world_size} processes both divide, or "
            f"remove {uri.rsplit('/', 1)[0]} to train it again from its start")
    steps_done = position["micro_step"] // max(1, meta.get("grad_accum_steps", accumulation))
    log.info("stage %s resumes %s, written by %d process(es), on %d: global batch %d either way, its state resharded",
             stage, uri, written, world_size, global_batch)
    return {**position, "micro_step": steps_done * accumulation}
