"""One DDP training stage, launched by torchrun (gloo on CPU, NCCL on GPU).

Run: ``torchrun --standalone --nproc-per-node 2 -m tasks.train --stage s2 --out storage/runs/x/y \
        --params '{"lr": 0.05}' --init-from storage/runs/x/y/train/s1/checkpoint.pt``

The stage reads the committed preprocess manifest under ``--out``, starts from the previous stage's
checkpoint (model and optimizer carry over; the LR schedule is re-derived for this stage's global
batch), and resumes from its own checkpoint when an Airflow retry finds one. Only rank 0 logs and
writes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import time
from dataclasses import asdict
from typing import Any

from tasks import storage
from tasks.cli import common_parser, json_arg, parse_overrides, run_subjob
from tasks.config import PipelineConfig, load_config
from tasks.errors import UserError

log = logging.getLogger("stagewise.train")

HYPER_DEFAULTS = {"lr": 0.05, "weight_decay": 0.0, "momentum": 0.9, "hidden": 128, "dropout": 0.0}


def stage_prefix(out: str, stage: str) -> str:
    return storage.join(out, "train", stage)


def resolve_params(config: PipelineConfig, swept: dict[str, Any]) -> dict[str, Any]:
    """Hyperparameters: built-in defaults, then train.default_params, then the sweep's best."""
    params = {**HYPER_DEFAULTS, **config.train.default_params, **(swept or {})}
    unknown = sorted(set(params) - set(HYPER_DEFAULTS))
    if unknown:
        raise UserError(f"unknown hyperparameter(s) {unknown} in --params / train.default_params; known: {sorted(HYPER_DEFAULTS)}")
    params["hidden"] = int(params["hidden"])
    return params


def config_hash(stage: dict[str, Any], params: dict[str, Any], world_size: int) -> str:
    text = json.dumps({"stage": stage, "params": params, "world_size": world_size}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def run_stage(config: PipelineConfig, stage_name: str, out: str, swept: dict[str, Any], init_from: str | None) -> dict[str, Any]:
    import torch

    from tasks.distributed import destroy_process_group, init_process_group, read_env
    from tasks.model import ModelSpec, build_model, load_torch, save_bundle, save_torch
    from tasks.preprocess import load_split, read_manifest
    from tasks.training import Loop, eta_s, make_optimizer, scaled_lr, warmup_factor

    stage = config.stage(stage_name)
    profile = config.profile(stage.profile)
    env = read_env(profile.device)
    torch.set_num_threads(profile.threads_per_process)
    if not env.master:
        logging.getLogger().setLevel(logging.WARNING)
    init_process_group(env)
    try:
        manifest = read_manifest(storage.join(out, "preprocess", "manifest.json"))
        params = resolve_params(config, swept)
        x_train, y_train = (torch.from_numpy(a) for a in load_split(manifest, "train"))
        x_val, y_val = (torch.from_numpy(a) for a in load_split(manifest, "validation"))
        if x_train.shape[0] == 0:
            raise UserError(f"{out}: the committed train split is empty")
        spec = ModelSpec(num_features=len(manifest["features"]), num_classes=manifest["num_classes"],
                         hidden=params["hidden"], dropout=float(params["dropout"]))
        torch.manual_seed(config.train.seed)
        model = build_model(spec)
        optimizer = make_optimizer(model, lr=params["lr"], weight_decay=params["weight_decay"], momentum=params["momentum"])
        global_batch = stage.per_process_batch * env.world_size * stage.grad_accum_steps
        digest = config_hash(stage.model_dump(), params, env.world_size)
        prefix = stage_prefix(out, stage.name)
        checkpoint_uri = storage.join(prefix, "checkpoint.pt")

        start_epoch, step, history, previous_batch = 0, 0, [], None
        if storage.exists(checkpoint_uri):
            state = load_torch(checkpoint_uri)
            if state["config_hash"] == digest:
                model.load_state_dict(state["model"])
                optimizer.load_state_dict(state["optimizer"])
                start_epoch, step, history = state["epoch"] + 1, state["step"], json.loads(state["history"])
                previous_batch = state.get("previous_global_batch")
                log.info("resuming stage %s from its checkpoint after epoch %d (step %d)", stage.name, state["epoch"], step)
            else:
                log.warning("ignoring checkpoint %s: written under another config", checkpoint_uri)
        if start_epoch == 0 and init_from:
            state = load_torch(init_from)
            try:
                model.load_state_dict(state["model"])
            except RuntimeError as exc:
                raise UserError(f"{init_from}: previous stage's model does not fit this stage's: {exc}") from None
            optimizer.load_state_dict(state["optimizer"])
            previous_batch = state["global_batch"]
            log.info("stage %s starts from %s (global batch %d -> %d)", stage.name, init_from, previous_batch, global_batch)

        lr = scaled_lr(params["lr"], global_batch, config.train.base_batch, config.train.lr_rule)
        warmup = stage.warmup_steps if (previous_batch is None or global_batch > previous_batch) else 0
        loop = Loop(model=model, optimizer=optimizer, env=env, train=(x_train, y_train), validation=(x_val, y_val),
                    per_process_batch=stage.per_process_batch, grad_accum_steps=stage.grad_accum_steps,
                    seed=config.train.seed + 7919 * (config.train.stages.index(stage) + 1))
        loop.step = step
        log.info("stage %s: world size %d, global batch %d (%d x %d x %d), lr %.4g (%s rule, base batch %d), warmup %d steps, %d epochs",
                 stage.name, env.world_size, global_batch, stage.per_process_batch, env.world_size,
                 stage.grad_accum_steps, lr, config.train.lr_rule, config.train.base_batch, warmup, stage.epochs)
        started = time.monotonic()
        for epoch in range(start_epoch, stage.epochs):
            result = loop.train_epoch(epoch, lambda s: lr * warmup_factor(s, warmup))
            history.append(asdict(result))
            if env.master:
                log.info("stage %s epoch %d/%d: loss %.4f, val_accuracy %.4f, %.0f samples/s, lr %.4g, ETA %.0fs",
                         stage.name, epoch + 1, stage.epochs, result.train_loss, result.val_accuracy,
                         result.samples_per_s, result.lr, eta_s(epoch + 1 - start_epoch, stage.epochs - start_epoch, time.monotonic() - started))
                save_torch(checkpoint_uri, {
                    "model": loop.module.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch,
                    "step": loop.step, "global_batch": global_batch, "previous_global_batch": previous_batch,
                    "config_hash": digest, "history": json.dumps(history), "params": json.dumps(params),
                    "rng_cpu": torch.get_rng_state(),
                })
        final = history[-1] if history else {"val_accuracy": float("nan")}
        result_info = {"stage": stage.name, "world_size": env.world_size, "global_batch": global_batch, "lr": lr,
                       "epochs": stage.epochs, "val_metric": final["val_accuracy"], "steps": loop.step,
                       "checkpoint_uri": checkpoint_uri}
        if env.master:
            model_uri = storage.join(prefix, "model.pt")
            save_bundle(model_uri, loop.module.cpu(), spec,
                        {"features": manifest["features"], "mean": manifest["mean"], "std": manifest["std"],
                         "key": manifest["key"], "label": manifest["label"]},
                        {"stage": stage.name, "params": json.dumps(params), "val_accuracy": final["val_accuracy"]})
            storage.write_json(storage.join(prefix, "metrics.json"), {**result_info, "params": params, "history": history})
            result_info["model_uri"] = model_uri
        return result_info
    finally:
        destroy_process_group(env)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="One DDP training stage (run under torchrun).", parents=[common_parser()])
    parser.add_argument("--stage", required=True, help="name of a stage in train.stages")
    parser.add_argument("--out", required=True, help="the run prefix (holds preprocess/manifest.json)")
    parser.add_argument("--params", type=json_arg, default={}, help="hyperparameters (JSON or @file), e.g. the sweep's best")
    parser.add_argument("--init-from", default=None, help="checkpoint of the previous stage")
    args = parser.parse_args(argv)
    import os

    rank = int(os.environ.get("RANK", "0"))

    def work() -> dict[str, Any]:
        config = load_config(args.config, parse_overrides(args.override))
        return run_stage(config, args.stage, storage.resolve(config.storage_root, args.out), args.params, args.init_from)

    run_subjob(f"train stage {args.stage}", work, args.result_file if rank == 0 else None, quiet=rank != 0)


if __name__ == "__main__":
    main()
