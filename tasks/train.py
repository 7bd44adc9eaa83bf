"""One DDP training stage, launched by torchrun (gloo on CPU, NCCL on GPU).

Run: ``torchrun --standalone --nproc-per-node 2 -m tasks.train --stage s2 --out storage/runs/x/y \
        --params '{"lr": 0.05}' --init-from storage/runs/x/y/train/s1/final.pt``

The stage reads the committed preprocess manifest under ``--out``; each rank streams its own part
of the train split (tasks.loader). It starts from the previous stage's final checkpoint (model and
optimizer carry over; the LR schedule is re-derived for this stage's global batch, with warmup when
the batch grew). Rank 0 checkpoints every ``train.checkpoint_every_steps`` optimizer steps; an
Airflow retry resumes from the newest checkpoint at the same batch, redoing at most that many steps.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import signal
import time
from dataclasses import asdict
from typing import Any

from tasks import contract, storage
from tasks.cli import common_parser, json_arg, parse_overrides, run_subjob
from tasks.config import PipelineConfig, hyperparameter_problem, load_config
from tasks.errors import UserError

log = logging.getLogger("stagewise.train")

HYPER_DEFAULTS = {"lr": 0.05, "weight_decay": 0.0, "momentum": 0.9, "hidden": 128, "dropout": 0.0, "optimizer": "sgd"}
# Fault injection for tests: rank R SIGKILLs itself after optimizer step S of a fresh (not resumed) run.
FAULT_ENV = "STAGEWISE_FAULT_KILL_AT"


def stage_prefix(out: str, stage: str) -> str:
    return storage.join(out, "train", stage)


def resolve_params(config: PipelineConfig, swept: dict[str, Any]) -> dict[str, Any]:
    """Hyperparameters: built-in defaults, then train.default_params, then the sweep's best (each checked by name)."""
    if not isinstance(swept or {}, dict):
        raise UserError(f"--params must be a JSON object of hyperparameters, got {type(swept).__name__}")
    params = {**HYPER_DEFAULTS, **config.train.default_params, **(swept or {})}
    problems = [problem for name, value in params.items() if (problem := hyperparameter_problem(name, value))]
    if problems:
        raise UserError(f"bad hyperparameter(s) in --params / sweep result / train.default_params: {'; '.join(problems)}")
    params["hidden"] = int(params["hidden"])
    return params


def config_hash(stage: dict[str, Any], params: dict[str, Any], world_size: int, seed: int) -> str:
    """Identifies what a checkpoint was trained under; a retry resumes only a matching one."""
    text = json.dumps({"stage": stage, "params": params, "world_size": world_size, "seed": seed}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def byo_environment(config: PipelineConfig, config_file: str, stage_name: str, out: str, swept: dict[str, Any],
                    init_from: str | None, overrides: dict[str, Any] | None = None) -> dict[str, str]:
    """What a user's own stage script gets besides torchrun's RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT.

    Exactly tasks.contract.STAGE_ENV (the names and their docs live there); the launcher adds LAUNCH_ENV.

    The script reads data through the manifest, keeps its checkpoints in STAGEWISE_CHECKPOINT_DIR
    (a retry finds them there), and for a later stage or evaluation writes ``final.pt`` (model and
    optimizer state, global_batch) and ``model.pt`` (tasks.model.save_bundle) in STAGEWISE_OUTPUT_DIR.
    """
    stage = config.stage(stage_name)
    world = config.profile(stage.profile).processes_per_node
    micro = stage.micro_batch(world)
    global_batch = micro * world * stage.grad_accum_steps
    params = resolve_params(config, swept)
    prefix = stage_prefix(out, stage.name)
    return {
        contract.CONFIG: config_file,
        contract.OVERRIDES: json.dumps(overrides or {}),
        contract.STAGE: stage.name,
        contract.RUN_PREFIX: out,
        contract.OUTPUT_DIR: prefix,
        contract.CHECKPOINT_DIR: storage.join(prefix, "checkpoints"),
        contract.DATA_MANIFEST: storage.join(out, "preprocess", "manifest.json"),
        contract.INIT_FROM: init_from or "",
        contract.PARAMS: json.dumps(params),
        contract.PER_PROCESS_BATCH: str(micro),
        contract.GRAD_ACCUM_STEPS: str(stage.grad_accum_steps),
        contract.GLOBAL_BATCH: str(global_batch),
        contract.LR: repr(scaled_lr_for(config, params["lr"], global_batch)),
        contract.EPOCHS: str(stage.epochs),
        contract.SEED: str(config.train.seed),
    }


def scaled_lr_for(config: PipelineConfig, base_lr: float, global_batch: int) -> float:
    from tasks.training import scaled_lr

    return scaled_lr(base_lr, global_batch, config.train.base_batch, config.train.lr_rule)


def _fault_step(rank: int) -> int | None:
    spec = os.environ.get(FAULT_ENV, "")
    if not spec:
        return None
    fault_rank, fault_step = (int(part) for part in spec.split(":"))
    return fault_step if fault_rank == rank else None


def run_stage(config: PipelineConfig, stage_name: str, out: str, swept: dict[str, Any], init_from: str | None) -> dict[str, Any]:
    import torch

    from tasks.checkpoint import CheckpointStore
    from tasks.distributed import distributed_job
    from tasks.loader import split_batches
    from tasks.model import ModelSpec, build_model, load_torch, restore_training_state, save_bundle, save_torch
    from tasks.preprocess import read_manifest
    from tasks.training import Diverged, Loop, Position, eta_s, make_optimizer, scaled_lr, warmup_factor

    stage = config.stage(stage_name)
    profile = config.profile(stage.profile)
    with distributed_job(profile.device, profile.threads_per_process) as env:
        manifest = read_manifest(storage.join(out, "preprocess", "manifest.json"))
        params = resolve_params(config, swept)
        micro_batch = stage.micro_batch(env.world_size)
        global_batch = micro_batch * env.world_size * stage.grad_accum_steps
        data_seed = config.train.seed + 7919 * (config.train.stages.index(stage) + 1)
        train = split_batches(manifest, "train", rank=env.rank, world_size=env.world_size, batch_size=micro_batch, seed=data_seed)
        validation = split_batches(manifest, "validation", rank=env.rank, world_size=env.world_size, batch_size=4096,
                                   seed=0, shuffle=False)
        if train.steps_per_epoch(0) == 0:
            raise UserError(f"stage {stage.name}: per-process batch {micro_batch} exceeds the ~{train.num_rows // env.world_size} "
                            f"train rows each of {env.world_size} rank(s) gets; lower the batch or the process count")
        spec = ModelSpec(num_features=len(manifest["features"]), num_classes=manifest["num_classes"],
                         hidden=params["hidden"], dropout=float(params["dropout"]))
        torch.manual_seed(config.train.seed)
        model = build_model(spec).to(env.device)  # before the optimizer exists or loads state: its buffers follow the params
        optimizer = make_optimizer(model, params)
        digest = config_hash(stage.model_dump(), params, env.world_size, config.train.seed)
        prefix = stage_prefix(out, stage.name)
        checkpoints = CheckpointStore(prefix, keep_last=config.train.keep_checkpoints)

        position, history, previous_batch, resumed_from = Position(), [], None, None
        found = checkpoints.latest()
        if found and found[1]["config_hash"] == digest:
            uri, state = found
            restore_training_state(model, optimizer, state, env.device)
            position = Position(**json.loads(state["position"]))
            history, previous_batch = json.loads(state["history"]), state["previous_global_batch"]
            resumed_from = position.step
            log.info("stage %s resumes from %s: epoch %d, batch %d, step %d", stage.name, uri, position.epoch + 1,
                     position.micro_step, position.step)
        elif found:
            log.warning("ignoring checkpoint %s: written under another config or world size", found[0])
        if resumed_from is None and init_from:
            state = load_torch(init_from)
            try:
                restore_training_state(model, optimizer, state, env.device)
            except (RuntimeError, ValueError) as exc:
                raise UserError(f"{init_from}: the previous stage's model does not fit this stage's: {exc}") from None
            previous_batch = state["global_batch"]
            log.info("stage %s starts from %s (global batch %d -> %d)", stage.name, init_from, previous_batch, global_batch)

        lr = scaled_lr(params["lr"], global_batch, config.train.base_batch, config.train.lr_rule)
        warmup = stage.warmup_steps if (previous_batch is None or global_batch > previous_batch) else 0
        # Checked at each checkpoint step too, so no checkpoint is ever written from NaN weights.
        loop = Loop(model=model, optimizer=optimizer, env=env, train=train, validation=validation,
                    grad_accum_steps=stage.grad_accum_steps, seed=data_seed,
                    check_every_steps=config.train.checkpoint_every_steps)
        loop.position = position
        fault_step = _fault_step(env.rank) if resumed_from is None else None

        def state_now() -> dict[str, Any]:
            return {"model": loop.module.state_dict(), "optimizer": optimizer.state_dict(),
                    "position": json.dumps(asdict(loop.position)), "history": json.dumps(history),
                    "global_batch": global_batch, "previous_global_batch": previous_batch, "config_hash": digest,
                    "params": json.dumps(params), "rng_cpu": torch.get_rng_state()}

        def on_step(current: Loop) -> None:
            if fault_step is not None and current.position.step == fault_step:
                os.kill(os.getpid(), signal.SIGKILL)
            if env.master and current.position.step % config.train.checkpoint_every_steps == 0:
                checkpoints.save(current.position.step, state_now())

        log.info("stage %s: world size %d, global batch %d (%d per process x %d x %d accumulation), lr %.4g "
                 "(%s rule, base batch %d), warmup %d steps, %d epochs of %d steps, %d train rows",
                 stage.name, env.world_size, global_batch, micro_batch, env.world_size, stage.grad_accum_steps, lr,
                 config.train.lr_rule, config.train.base_batch, warmup, stage.epochs, loop.steps_per_epoch(0), train.num_rows)
        started, first_epoch = time.monotonic(), loop.position.epoch
        while loop.position.epoch < stage.epochs:
            try:
                result = loop.train_epoch(lambda s: lr * warmup_factor(s, warmup), on_step=on_step)
            except Diverged as exc:
                raise UserError(f"stage {stage.name}: {exc}") from None
            history.append(asdict(result))
            if env.master:
                done = result.epoch + 1
                log.info("stage %s epoch %d/%d: loss %.4f, val_accuracy %.4f, %.0f samples/s, lr %.4g, step %d, ETA %.0fs",
                         stage.name, done, stage.epochs, result.train_loss, result.val_accuracy, result.samples_per_s,
                         result.lr, result.steps, eta_s(done - first_epoch, stage.epochs - first_epoch, time.monotonic() - started))
                storage.write_json(storage.join(prefix, "metrics.json"), {"stage": stage.name, "history": history, "complete": False})
        final = history[-1] if history else {"val_accuracy": float("nan")}
        final_uri = storage.join(prefix, "final.pt")
        result_info = {"stage": stage.name, "world_size": env.world_size, "global_batch": global_batch,
                       "per_process_batch": micro_batch, "grad_accum_steps": stage.grad_accum_steps, "lr": lr,
                       "warmup_steps": warmup, "epochs": stage.epochs, "val_metric": final["val_accuracy"],
                       "steps": loop.position.step, "resumed_from_step": resumed_from, "checkpoint_uri": final_uri}
        if env.master:
            if loop.position.step != resumed_from:
                checkpoints.save(loop.position.step, state_now())  # a re-run of a finished stage retrains nothing
            save_torch(final_uri, state_now())
            model_uri = storage.join(prefix, "model.pt")
            save_bundle(model_uri, loop.module.cpu(), spec,
                        {"features": manifest["features"], "mean": manifest["mean"], "std": manifest["std"],
                         "key": manifest["key"], "label": manifest["label"]},
                        {"stage": stage.name, "params": json.dumps(params), "val_accuracy": final["val_accuracy"]})
            storage.write_json(storage.join(prefix, "metrics.json"),
                               {**result_info, "params": params, "history": history, "complete": True})
            result_info["model_uri"] = model_uri
        return result_info


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="One DDP training stage (run under torchrun).", parents=[common_parser()])
    parser.add_argument("--stage", required=True, help="name of a stage in train.stages")
    parser.add_argument("--out", required=True, help="the run prefix (holds preprocess/manifest.json)")
    parser.add_argument("--params", type=json_arg, default={}, help="hyperparameters (JSON or @file), e.g. the sweep's best")
    parser.add_argument("--init-from", default=None, help="final checkpoint of the previous stage")
    args = parser.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))

    def work() -> dict[str, Any]:
        config = load_config(args.config, parse_overrides(args.override))
        return run_stage(config, args.stage, storage.resolve(config.storage_root, args.out), args.params, args.init_from)

    run_subjob(f"train stage {args.stage}", work, args.result_file if rank == 0 else None, quiet=rank != 0)


if __name__ == "__main__":
    main()
