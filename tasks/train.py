"""One DDP training stage, launched by torchrun (gloo on CPU, NCCL on GPU).

Run: ``torchrun --standalone --nproc-per-node 2 -m stagewise.train --stage s2 --out storage/runs/x/y \
        --params '{"lr": 0.05}' --init-from storage/runs/x/y/train/s1/final.pt``

The stage reads the committed preprocess manifest under ``--out``; each rank streams its own part
of the train split (stagewise.datasets.loader). It starts from the previous stage's final checkpoint (model and
optimizer carry over; the LR schedule is re-derived for this stage's global batch, with warmup when
the batch grew, and the stage's ``lr_schedule`` after it). Rank 0 checkpoints every
``train.checkpoint_every_steps`` optimizer steps; an Airflow retry resumes from the newest checkpoint at the same
batch, redoing at most that many steps. The stage hands on its best epoch on the objective (``hand_on``) and may
stop early (``early_stopping``); both are decided from the checkpointed history, so a resume decides alike.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import os
import signal
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from stagewise.core.cli import common_parser, help_before_imports, json_arg, parse_overrides, run_subjob


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="One training stage: the built-in loop (run this under torchrun), or a stage with its own "
                    "entrypoint, which this launches under torchrun itself (run it plainly).", parents=[common_parser()])
    parser.add_argument("--stage", required=True, help="name of a stage in train.stages")
    parser.add_argument("--out", required=True, help="the run prefix (holds preprocess/manifest.json)")
    parser.add_argument("--params", type=json_arg, default={}, help="hyperparameters (JSON or @file), e.g. the sweep's best")
    parser.add_argument("--init-from", default=None, help="final checkpoint of the previous stage")
    parser.add_argument("--inputs-fingerprint", default=None, help="the stage's inputs' fingerprint (default: derived)")
    parser.add_argument("--resume-fingerprint", default=None,
                        help="its inputs' fingerprint but the process count, which keys its checkpoints (default: derived)")
    parser.add_argument("--data-fingerprint", default=None, help="the committed data's fingerprint (default: derived)")
    return parser


# --help answers before the imports below, which load torch (seconds); they follow code on purpose
# ruff: noqa: E402
if __name__ == "__main__":
    help_before_imports(build_parser)

from stagewise.core import storage
from stagewise.core.errors import UserError, out_of_memory
from stagewise.datasets.manifest import read_manifest
from stagewise.definitions.config import PipelineConfig
from stagewise.definitions.hyperparams import ran_params
from stagewise.definitions.loading import config_path, load_config
from stagewise.definitions.metric_names import THRESHOLD
from stagewise.definitions.spec import user_hook
from stagewise.models.bundle import preprocessing_of, save_bundle
from stagewise.models.torch_io import save_torch
from stagewise.reuse.fingerprints import code_identity, manifest_fingerprint, stage_inputs, stage_resume_inputs
from stagewise.scripting.entrypoint import LAST_REPORT, contract_environment, run_script
from stagewise.scripting.stage_contract import byo_args, byo_contract, byo_result
from stagewise.tracking.runs import Tracker
from stagewise.training.batch_growth import adaptive_batch, handed_noise_scale
from stagewise.training.checkpoint import checkpoint_store
from stagewise.training.distributed import distributed_job
from stagewise.training.handoff import handed_lr, handed_values, read_hand_off, resumed_position
from stagewise.training.loop import Diverged, Loop, Position, eta_s, rank_batches, start_loop
from stagewise.training.lr_schedule import MAX_WARMUP_FRACTION, scaled_lr, stage_lr
from stagewise.training.recipe import recipe_params, schedule_label, training_recipe
from stagewise.training.selection import BestEpoch, EpochSelection
from stagewise.training.strategy import out_of_memory_named, sharded_optimizer_uri

log = logging.getLogger("stagewise.train")

# Fault injection for tests: rank R SIGKILLs itself after optimizer step S of a fresh (not resumed) run.
FAULT_ENV = "STAGEWISE_FAULT_KILL_AT"


def config_hash(stage: dict[str, Any], params: dict[str, Any], world_size: int | None, seed: int) -> str:
    """Identifies what a checkpoint was trained under; a retry resumes only a matching one (at any world size: None;
    checkpoints written before that named theirs)."""
    text = json.dumps({"stage": stage, "params": params, "world_size": world_size, "seed": seed}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _step_range(loop: Any, epochs: int) -> str:
    """The optimizer steps per epoch as the epochs will run them: ranks take whole row groups, so an epoch's count
    follows its shuffle of them (e.g. ``332-351``)."""
    counts = [loop.steps_per_epoch(epoch) for epoch in range(epochs)]
    return f"{min(counts)}" if min(counts) == max(counts) else f"{min(counts)}-{max(counts)}"


def _fault_step(rank: int) -> int | None:
    spec = os.environ.get(FAULT_ENV, "")
    if not spec:
        return None
    fault_rank, fault_step = (int(part) for part in spec.split(":"))
    return fault_step if fault_rank == rank else None


# Stage keys added after checkpoints already recorded a stage's identity: left out at their defaults, so an upgrade
# still resumes the checkpoints of a stage that does not use them.
_LATER_KEYS = {"strategy": "ddp", "activation_checkpointing": False, "hand_on_optimizer": True}


def stage_identity(stage: Any) -> dict[str, Any]:
    """The stage's settings as its checkpoints' config hash covers them: not its profile's name (another profile with
    another process count resumes them; stagewise.training.handoff)."""
    return {key: value for key, value in stage.model_dump().items()
            if key != "profile" and _LATER_KEYS.get(key, object()) != value}


# What a checkpoint records as its stage's start when no --init-from was given.
SCRATCH = "scratch"


def init_source(init_from: str | None) -> str:
    """Where a stage starts, as its checkpoints record it: the --init-from URI (a local path made absolute) or "scratch"."""
    if not init_from:
        return SCRATCH
    return init_from if "://" in init_from else os.path.abspath(init_from)


def warn_if_scratch(config: PipelineConfig, stage_name: str, out: str, init_from: str | None) -> None:
    """A stage after the first run without --init-from starts from a random init: say so where an operator looks,
    naming the stage before and where its final checkpoint is (or would be)."""
    index = config.train.stages.index(config.stage(stage_name))
    if init_from or index == 0:
        return
    previous = config.train.stages[index - 1]
    final = storage.join(storage.stage_prefix(out, previous.name), "final.pt")
    there = "is there" if storage.exists(final) else "is not there yet"
    log.warning("stage %s STARTS FROM SCRATCH (a random init, not stage %s's model): no --init-from was given though "
                "stage %s comes before it in train.stages; its final checkpoint %s %s; pass --init-from %s to continue "
                "from it", stage_name, previous.name, previous.name, final, there, final)


def refuse_other_start(stage_name: str, uri: str, state: dict[str, Any], source: str) -> None:
    """A checkpoint resumes only the start it was made from: one trained from scratch never continues as a stage that
    starts from --init-from (or from another checkpoint), nor the other way round."""
    recorded = state.get("init_source")
    if recorded is None or recorded == source:  # older checkpoints recorded no start
        return

    def named(start: str) -> str:
        return "scratch (no --init-from)" if start == SCRATCH else f"--init-from {start}"

    raise UserError(f"stage {stage_name}: checkpoint {uri} was trained starting from {named(recorded)}, but this attempt "
                    f"starts from {named(source)}; resuming it would continue another run. Run the stage as it was "
                    f"started ({named(recorded)}) to resume it, or remove {uri.rsplit('/', 1)[0]} to train this stage "
                    f"again from {named(source)}")


def _batch_plan(config: PipelineConfig, stage: Any, env: Any, init_from: str | None) -> tuple[Any, Any, int, int, int]:
    """(adaptive decision or None, the handed-on state it read or None, per-process batch, accumulation, global batch)."""
    micro_batch, accumulation = stage.micro_batch(env.world_size), stage.grad_accum_steps
    global_batch = stage.global_batch_for(env.world_size)
    if not (init_from and config.train.batch_growth == "adaptive"):
        return None, None, micro_batch, accumulation, global_batch
    handed = read_hand_off(init_from, env, rank_zero_reads=stage.strategy == "fsdp")  # the stage before's
    assert config.train.max_global_batch is not None
    noise_scale, why = handed_noise_scale(handed)
    decision = adaptive_batch(noise_scale, global_batch, config.train.max_global_batch, env.world_size, micro_batch,
                              no_measurement=why)
    micro_batch, accumulation, global_batch = decision.per_process_batch, decision.grad_accum_steps, decision.global_batch
    if env.master and decision.no_measurement is not None:
        # Nothing grows: say so where an operator looks, not only in an INFO line.
        log.warning("stage %s: batch_growth adaptive received no noise scale from the stage before, so it "
                    "trains at its configured global batch %d (%d per process x %d x %d accumulation): %s",
                    stage.name, global_batch, micro_batch, env.world_size, accumulation, decision.no_measurement)
    elif env.master:
        log.info("stage %s: adaptive global batch %d = %d per process x %d x %d accumulation (noise scale %.4g at the "
                 "end of the stage before, clamped to [%d, %d])", stage.name, global_batch, micro_batch,
                 env.world_size, accumulation, decision.noise_scale, decision.min_global_batch, decision.max_global_batch)
    return decision, handed, micro_batch, accumulation, global_batch


@dataclass
class StageStart:
    """Where a stage's training starts: fresh, resumed from its own checkpoint, or from the stage before's."""

    position: Position = field(default_factory=Position)
    history: list[dict[str, Any]] = field(default_factory=list)
    previous_batch: int | None = None
    """The global batch of the stage before (None: from scratch): warmup when this one is larger."""
    previous_lr: float | None = None
    """The lr the stage before ended at (None: from scratch, or it recorded none): where the warmup starts."""
    resumed_from: int | None = None
    """The step this attempt resumed at (None: not resumed)."""
    step_offset: int = 0
    """Optimizer steps of the stages before this one: the tracked curve's x axis runs across stages."""
    resumes: list[dict[str, Any]] = field(default_factory=list)
    """Every resume of this stage, for the report's curve (rank 0 writes it)."""


def _start(stage: Any, loop: Loop, checkpoints: Any, best: BestEpoch, digests: tuple[str, str], source: str,
           init_from: str | None, handed: dict[str, Any] | None, global_batch: int) -> StageStart:
    """Resume from the stage's newest matching checkpoint (written at any world size: ``digests`` holds this stage's
    and the one checkpoints of the same world size recorded before), else load the stage before's final state, else
    start fresh."""
    strategy, model, optimizer, env = loop.strategy, loop.module, loop.optimizer, loop.env
    found = checkpoints.latest(into=lambda: strategy.training_state(model, optimizer),
                               accept=lambda meta: meta.get("config_hash") in digests)
    if found and found[1]["config_hash"] in digests:
        uri, state = found
        position = Position(**resumed_position(stage.name, uri, state, env.world_size, global_batch,
                                               loop.grad_accum_steps))
        if state.get("inputs_fingerprint") is None:  # written before checkpoints were keyed by their inputs
            refuse_other_start(stage.name, uri, state, source)
        strategy.load_training_state(model, optimizer, state)
        best.restore(state.get("best_epoch_state"))
        loop.load_scaler_state(state.get("grad_scaler") or {})
        loop.load_noise_state(state.get("noise_scale") or {})  # the noise scale's curve goes on where it left off
        log.info("stage %s resumes from %s (made from the same inputs): epoch %d, batch %d, step %d", stage.name, uri,
                 position.epoch + 1, position.micro_step, position.step)
        return StageStart(position=position, history=json.loads(state["history"]),
                          previous_batch=state["previous_global_batch"], resumed_from=position.step,
                          previous_lr=state.get("previous_lr"),
                          step_offset=state.get("global_step_offset", 0),
                          resumes=[*json.loads(state.get("resumes", "[]")),
                                   {"step": position.step, "epoch": position.epoch, "at": time.time()}])
    if found:
        log.warning("stage %s starts over: its checkpoint %s was written from other inputs (data, params, the stage "
                    "before, code) or another config", stage.name, found[0])
    if not init_from:
        return StageStart()
    state = handed if handed is not None else read_hand_off(init_from, env, rank_zero_reads=strategy.shards_state)
    try:  # a full state, whatever strategy and world size wrote it: this stage's strategy takes its part
        strategy.load_full_state(model, optimizer, state)
    except (RuntimeError, ValueError, KeyError) as exc:
        if out_of_memory(exc):
            raise  # out_of_memory_named names memory and what to change: the model does fit, the rank's memory does not
        raise UserError(f"{init_from}: the previous stage's model does not fit this stage's: {exc}") from None
    log.info("stage %s starts from %s (global batch %d -> %d)", stage.name, init_from, state["global_batch"], global_batch)
    return StageStart(previous_batch=state["global_batch"], previous_lr=handed_lr(state),
                      step_offset=state.get("global_step_offset", 0) + json.loads(state.get("position", "{}")).get("step", 0))


def _stage_params(params: dict[str, Any], recipe: dict[str, Any], env: Any, config: PipelineConfig, stage: Any,
                  decision: Any, sizes: dict[str, Any], begun: StageStart, source: str) -> dict[str, Any]:
    """The stage's params as MLflow records them."""
    return {**ran_params(params, recipe), "world_size": env.world_size, **sizes, "epochs": stage.epochs,
            "lr_rule": config.train.lr_rule, "global_step_offset": begun.step_offset,
            "batch_growth": config.train.batch_growth, "strategy": stage.strategy,
            **({"noise_scale_before": decision.noise_scale} if decision else {}),
            **({"adaptive_no_measurement": decision.no_measurement} if decision and decision.no_measurement else {}),
            "init_from": source, **recipe_params(recipe)}


def run_stage(config: PipelineConfig, stage_name: str, out: str, swept: dict[str, Any], init_from: str | None,
              inputs: str | None = None, data: str | None = None, resume: str | None = None) -> dict[str, Any]:
    """Train one stage; ``inputs``, ``data`` and ``resume`` are its inputs', its data's and its checkpoints'
    fingerprints (stagewise.reuse), derived here from what it reads when not given."""
    stage = config.stage(stage_name)
    profile = config.profile(stage.profile)
    with distributed_job(profile.device, profile.threads_per_process) as env, out_of_memory_named(stage, env):
        return _train_stage(config, stage, env, out, swept, init_from, (inputs, data, resume))


def stage_fingerprints(config: PipelineConfig, stage: str, manifest_uri: str, swept: dict[str, Any],
                       init_from: str | None) -> tuple[str, str, str]:
    """(inputs, data, resume) fingerprints of a stage run alone: the manifest's, and the hand-off's bytes for the stage
    before."""
    data = manifest_fingerprint(storage.read_json(manifest_uri)) or storage.sha256_of(manifest_uri)[:24]
    upstream = f"sha256:{storage.sha256_of(init_from)}" if init_from else None
    code = code_identity(config)
    return (stage_inputs(config, stage, data, swept, upstream, code), data,
            stage_resume_inputs(config, stage, data, swept, upstream, code))


def _train_stage(config: PipelineConfig, stage: Any, env: Any, out: str, swept: dict[str, Any],
                 init_from: str | None, fingerprints: tuple[str | None, str | None, str | None]) -> dict[str, Any]:
    import torch

    source = init_source(init_from)
    if env.master:
        warn_if_scratch(config, stage.name, out, init_from)
    manifest_uri = storage.join(out, "preprocess", "manifest.json")
    manifest = read_manifest(manifest_uri)
    inputs, data, resume = fingerprints
    if inputs is None or data is None:
        inputs, data, resume = stage_fingerprints(config, stage.name, manifest_uri, swept, init_from)
    resume = resume or inputs  # given the inputs' alone (an older caller): its checkpoints keyed by them, as before
    decision, handed, micro_batch, accumulation, global_batch = _batch_plan(config, stage, env, init_from)
    data_seed = config.train.seed + 7919 * (config.train.stages.index(stage) + 1)
    train, validation = rank_batches(
        manifest, env, batch_size=micro_batch, seed=data_seed,
        too_few_rows=lambda rows: (f"stage {stage.name}: per-process batch {micro_batch} exceeds the ~{rows} train rows "
                                   f"each of {env.world_size} rank(s) gets; lower the batch or the process count"),
        placement=stage.data_placement, memory_fraction=stage.resident_memory_fraction,
        shuffle_block_rows=stage.shuffle_block_rows)
    torch.manual_seed(config.train.seed)
    # Checked at each checkpoint step too, so no checkpoint is ever written from NaN weights.
    built, loop = start_loop(config, manifest, env, swept, train, validation, seed=data_seed,
                             grad_accum_steps=accumulation, check_every_steps=config.train.checkpoint_every_steps,
                             precision=stage.precision, compile_mode=stage.compile,
                             grad_clip_norm=stage.grad_clip_norm, tf32=stage.tf32, cuda_graph=stage.cuda_graph,
                             noise_scale_every=config.train.noise_scale_every_steps if config.train.noise_scale else 0,
                             strategy=stage.strategy, activation_checkpointing=stage.activation_checkpointing)
    params, model, optimizer, strategy = built.params, loop.module, loop.optimizer, loop.strategy
    # The inputs' fingerprint too: a try resumes only checkpoints made from the same data, params and stage before.
    # Without the world size: a retry on more or fewer processes, through the launcher or the profile, resumes
    # (stagewise.training.handoff), and one whose global batch changed with it is refused there, keeping its checkpoints.
    digest = config_hash({**stage_identity(stage), "inputs": resume, **({"adaptive": {
        "noise_scale": decision.noise_scale, "max_global_batch": decision.max_global_batch}} if decision else {})},
        params, None, config.train.seed)
    same_world = config_hash({**stage_identity(stage), **({"adaptive": asdict(decision)} if decision else {}),
                              "inputs": inputs}, params, env.world_size, config.train.seed)
    prefix = storage.stage_prefix(out, stage.name)
    trusted = config.train.trust_unrecorded_checkpoints
    strategy.trust_unrecorded = trusted  # the stage before's sharded optimizer state is verified as a checkpoint is
    checkpoints = checkpoint_store(prefix, config.train.keep_checkpoints, sharded=strategy.shards_state,
                                   master=env.master, background=config.train.async_checkpoints,
                                   trust_unrecorded=trusted)
    # The best epoch's model and optimizer (hand_on best)
    best = BestEpoch(strategy, prefix, master=env.master, trust_unrecorded=trusted)
    begun = _start(stage, loop, checkpoints, best, (digest, same_world), source, init_from, handed, global_batch)
    handed = None  # loaded into the model: its tensors (rank 0's whole model under fsdp) go now, not at the stage's end
    history, resumes, step_offset = begun.history, begun.resumes, begun.step_offset
    lr = scaled_lr(params["lr"], global_batch, config.train.base_batch, config.train.lr_rule)
    total_steps = sum(loop.steps_per_epoch(epoch) for epoch in range(stage.epochs))
    warmup = min(stage.warmup_steps, int(MAX_WARMUP_FRACTION * total_steps)) if (
        begun.previous_batch is None or global_batch > begun.previous_batch) else 0
    lr_at = stage_lr(lr, warmup_steps=warmup, schedule=stage.lr_schedule, spec=built.spec, total_steps=total_steps,
                     steps_per_epoch=loop.steps_per_epoch(0), warmup_from=begun.previous_lr)
    # What trains, read off the live optimizer (after any restore) and the schedule lr_at follows: every record keeps it.
    recipe = training_recipe(optimizer, built.spec, stage.lr_schedule, warmup_steps=warmup, total_steps=total_steps)
    stopping = stage.early_stopping
    selection = EpochSelection(config.objective.direction, stopping.min_delta if stopping else 0.0,
                               stopping.patience if stopping else None)
    loop.position = begun.position
    fault_step = _fault_step(env.rank) if begun.resumed_from is None else None
    writes_checkpoints = env.master or strategy.shards_state  # sharded: every rank saves its own part

    def plain_state() -> dict[str, Any]:  # what a checkpoint and final.pt hold besides the model and optimizer
        return {"position": json.dumps(asdict(loop.position)), "history": json.dumps(history),
                "global_batch": global_batch, "previous_global_batch": begun.previous_batch, "config_hash": digest,
                "previous_lr": begun.previous_lr,
                "params": json.dumps(params), "rng_cpu": torch.get_rng_state(), "resumes": json.dumps(resumes),
                "best_epoch_state": best.record(), "grad_scaler": loop.scaler_state(),
                "global_step_offset": step_offset, "noise_scale": loop.noise_state(), "init_source": source,
                "inputs_fingerprint": inputs, "resume_fingerprint": resume, "world_size": env.world_size,
                "grad_accum_steps": accumulation}

    def state_now() -> dict[str, Any]:
        return {**strategy.training_state(model, optimizer), **plain_state()}

    def on_step(current: Loop) -> None:
        if fault_step is not None and current.position.step == fault_step:
            os.kill(os.getpid(), signal.SIGKILL)
        if writes_checkpoints and current.position.step % config.train.checkpoint_every_steps == 0:
            checkpoints.save(current.position.step, state_now())
        else:
            checkpoints.poll()  # a background save that has finished commits

    log.info("stage %s: world size %d (%s), global batch %d (%d per process x %d x %d accumulation), lr %.4g "
             "(%s rule, base batch %d), warmup %d steps, schedule %s, optimizer %s (%s, %d group(s)), %d epochs of "
             "%s steps (%d in all), %d train rows", stage.name, env.world_size, strategy.describe(), global_batch,
             micro_batch, env.world_size, accumulation, lr, config.train.lr_rule, config.train.base_batch, warmup,
             schedule_label(recipe["lr_schedule"]), recipe["optimizer"]["type"], recipe["optimizer"]["source"],
             len(recipe["optimizer"]["groups"]), stage.epochs, _step_range(loop, stage.epochs), total_steps,
             train.num_rows)
    sizes = {"global_batch": global_batch, "per_process_batch": micro_batch, "grad_accum_steps": accumulation,
             "warmup_steps": warmup, "warmup_from_lr": begun.previous_lr if warmup else None}
    tracker = Tracker.for_run(config, out, f"train_{stage.name}") if env.master else None
    if tracker is not None:
        tracked = tracker.nested(f"stage-{stage.name}", f"train {stage.name}",
                                 {"stagewise.kind": "stage", "stagewise.stage": stage.name},
                                 _stage_params(params, recipe, env, config, stage, decision, {**sizes, "stage_lr": lr},
                                               begun, source))
    started, first_epoch, stopped_early = time.monotonic(), loop.position.epoch, False
    guard = user_hook(built.spec, module=loop.module)
    while loop.position.epoch < stage.epochs:
        if selection.should_stop([entry["val_metric"] for entry in history]):
            stopped_early = True
            break
        try:
            with guard:  # a user's hook that raises is named (spec, hook, file:line) as a user error: no retry
                result = loop.train_epoch(lr_at, on_step=on_step)
        except UserError as exc:
            if tracker is not None:
                tracker.end(tracked, "FAILED")
                tracker.close()
            if isinstance(exc, Diverged):
                raise UserError(f"stage {stage.name}: {exc}") from None
            raise
        history.append(asdict(result))
        improved = selection.best_index([entry["val_metric"] for entry in history]) == len(history) - 1
        if stage.hand_on == "best" and improved:
            best.keep(result.epoch, model, optimizer)
        if env.master:
            done = result.epoch + 1
            clipped = "" if result.grad_norm is None else f", grad norm {result.grad_norm:.3g} (clip {stage.grad_clip_norm:g})"
            noise = "" if result.noise_scale is None else f", noise scale {result.noise_scale:.4g}"
            log.info("stage %s epoch %d/%d: loss %.4f, val_%s %.4f%s, %.0f samples/s, lr %.4g%s%s, step %d, ETA %.0fs",
                     stage.name, done, stage.epochs, result.train_loss, config.objective.metric, result.val_metric,
                     " (best so far)" if improved else "", result.samples_per_s, result.lr, clipped, noise,
                     result.steps, eta_s(done - first_epoch, stage.epochs - first_epoch, time.monotonic() - started))
            storage.write_json(storage.join(prefix, "metrics.json"), {"stage": stage.name, "history": history, "resumes": resumes,
                                                                      **recipe, "complete": False})
            if tracker is not None:  # queued: the next epoch starts while a background thread sends it
                tracker.log(tracked, step=step_offset + result.steps, metrics={
                    "loss": result.train_loss, f"val_{config.objective.metric}": result.val_metric,
                    "samples_per_s": result.samples_per_s, "lr": result.lr, "epoch": done,
                    **({"grad_norm": result.grad_norm} if result.grad_norm is not None else {}),
                    **({"noise_scale": result.noise_scale} if result.noise_scale is not None else {})})
    values = [entry["val_metric"] for entry in history]
    best_index = selection.best_index(values)
    handed_index = best_index if stage.hand_on == "best" and best_index is not None else len(history) - 1
    if not best.available:  # resumed from a checkpoint older than the best-epoch copy
        handed_index = len(history) - 1
    if env.master and stopped_early:
        log.info("stage %s stops early after epoch %d: val_%s has not improved by more than %g for %d epochs",
                 stage.name, len(history), config.objective.metric, selection.min_delta, selection.patience)
    if env.master and handed_index != len(history) - 1:
        log.info("stage %s hands on epoch %d (val_%s %.4f), its best; the last, epoch %d, had %.4f", stage.name,
                 handed_index + 1, config.objective.metric, values[handed_index], len(history), values[-1])
    final = history[handed_index] if history else {"val_metric": float("nan"), "val_metrics": {}}
    final_uri = storage.join(prefix, "final.pt")
    result_info = {"stage": stage.name, "world_size": env.world_size, "strategy": stage.strategy, **sizes,
                   "lr": lr, "epochs": stage.epochs, "val_metric": final["val_metric"],
                   "val_metrics": final["val_metrics"], "objective": config.objective.metric,
                   "steps": loop.position.step, "resumed_from_step": begun.resumed_from, "checkpoint_uri": final_uri,
                   "hand_on": stage.hand_on, "handed_epoch": handed_index + 1 if history else None,
                   "epochs_run": len(history), "stopped_early": stopped_early,
                   "rows_per_epoch": {"trained": train.steps_per_epoch(0) * micro_batch * env.world_size,
                                      "train": train.num_rows},
                   **recipe, "init_from": source, "grad_clip_norm": stage.grad_clip_norm,
                   "noise_scale": history[-1].get("noise_scale") if history else None,
                   "batch_decision": asdict(decision) if decision else None, "params": params,
                   "fingerprint": inputs, "data_fingerprint": data,
                   "step_graph": {"captured": bool(loop.step_graph and loop.step_graph.captured),
                                  "replays": loop.step_graph.replays if loop.step_graph else 0,
                                  "why": loop.graph_reason}}
    if writes_checkpoints and loop.position.step != begun.resumed_from:
        checkpoints.save(loop.position.step, state_now())  # a re-run of a finished stage retrains nothing
    checkpoints.wait()
    plain = handed_values(plain_state())
    if handed_index != len(history) - 1:  # the best epoch's weights and optimizer go on
        best.load_into(model, optimizer)
    # Every rank takes part; rank 0 holds it.
    handed_state = {**plain, **strategy.full_state(model, optimizer, prefix, stage.hand_on_optimizer)}
    if env.master:
        save_torch(final_uri, handed_state)
        strategy.committed(prefix, handed_state)
        model_uri = storage.join(prefix, "model.pt")
        save_bundle(model_uri, handed_state["model"], built.ref, built.data, params, preprocessing_of(manifest),
                    {"stage": stage.name, "objective": config.objective.metric, "val_metric": final["val_metric"],
                     "val_metrics": final["val_metrics"], **decision_threshold(config, final["val_metrics"])})
        storage.write_json(storage.join(prefix, "metrics.json"),
                           {**result_info, "params": params, "history": history, "resumes": resumes, "complete": True})
        result_info["model_uri"] = model_uri
        if optimizer_uri := sharded_optimizer_uri(handed_state):  # the cache checks it is still there
            result_info["optimizer_uri"] = optimizer_uri
    if tracker is not None:
        tracker.log(tracked, tags={"stagewise.handed_epoch": result_info["handed_epoch"],
                                   "stagewise.stopped_early": stopped_early, "stagewise.steps": loop.position.step})
        tracker.end(tracked, "FINISHED")
        tracker.close()
    strategy.close()
    return result_info


def run_script_stage(config: PipelineConfig, config_file: str, stage_name: str, out: str, swept: dict[str, Any],
                     init_from: str | None, overrides: dict[str, Any]) -> dict[str, Any]:
    """A stage with its own entrypoint, run alone as Airflow's task runs it: the same STAGEWISE_* contract, args and
    torchrun process count, in a scratch cwd; the same checks of its outputs and the same result."""
    import tempfile

    stage = config.stage(stage_name)
    entry = stage.entrypoint
    assert entry is not None
    warn_if_scratch(config, stage_name, out, init_from)
    values = byo_contract(config, config_file, stage_name, out, swept, init_from)
    env = contract_environment(config, values, overrides)
    profile = config.profile(stage.profile)
    log.info("stage %s: running %s under torchrun (%d processes), as its Airflow task does", stage.name,
             entry.script or entry.module, profile.processes_per_node)
    with tempfile.TemporaryDirectory(prefix=f"stagewise-{stage.name}-") as workdir:
        ran = run_script(config, entry, byo_args(config, stage_name, values), env,
                         processes=profile.processes_per_node, threads=profile.threads_per_process, workdir=workdir)
    if ran.error:
        raise UserError(ran.error)
    if ran.code != 0:
        raise RuntimeError(f"stage {stage.name}: {entry.script or entry.module} exited with code {ran.code}")
    return byo_result(config, stage_name, out, values, {**ran.result, LAST_REPORT: ran.last_report})


def decision_threshold(config: PipelineConfig, val_metrics: dict[str, Any]) -> dict[str, Any]:
    """A binary classifier's threshold, as the handed epoch's validation chose it, for the bundle (inference's label)."""
    value = val_metrics.get(THRESHOLD)
    if value is None or not math.isfinite(value):
        return {}
    rule = config.evaluate.threshold
    return {"decision_threshold": value, "threshold_rule": {"rule": rule.rule, "target": rule.target}}


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))

    def work() -> dict[str, Any]:
        overrides = parse_overrides(args.override)
        config = load_config(args.config, overrides)
        out = storage.resolve(config.storage_root, args.out)
        if config.stage(args.stage).entrypoint is None:
            return run_stage(config, args.stage, out, args.params, args.init_from, args.inputs_fingerprint,
                             args.data_fingerprint, args.resume_fingerprint)
        if "RANK" in os.environ:
            raise UserError(f"stage {args.stage} runs its own entrypoint, which this launches under torchrun: run "
                            "`python -m stagewise.train` plainly, not under torchrun")
        return run_script_stage(config, str(config_path(args.config)), args.stage, out, args.params, args.init_from,
                                overrides)

    run_subjob(f"train stage {args.stage}", work, args.result_file if rank == 0 else None, quiet=rank != 0)


if __name__ == "__main__":
    main()
