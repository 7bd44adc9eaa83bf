"""The own-script contract of a training stage: the values a user's stage script gets (as STAGEWISE_* variables and
``{name}`` placeholders in its args), and the checks and result of its outputs once it ended.

The Airflow step and ``python -m stagewise.train`` (a stage with an ``entrypoint`` run alone) both launch a script
through these; :mod:`stagewise.scripting.runtime` is the side that reads them inside the script.
"""

from __future__ import annotations

from typing import Any

from stagewise.core import contract as env_contract
from stagewise.core import storage
from stagewise.core.errors import UserError
from stagewise.definitions.config import PipelineConfig
from stagewise.models.building import resolve_params
from stagewise.scripting.entrypoint import LAST_REPORT, contract_environment, entrypoint_args
from stagewise.training.lr_schedule import scaled_lr


def byo_contract(config: PipelineConfig, config_file: str, stage_name: str, out: str, swept: dict[str, Any],
                 init_from: str | None) -> dict[str, Any]:
    """The stage's values a user's own script gets, by name (stagewise.contract.STAGE_VALUES), typed."""
    stage = config.stage(stage_name)
    world = config.profile(stage.profile).world_size
    micro, global_batch = stage.micro_batch(world), stage.global_batch_for(world)
    params = resolve_params(config, swept)
    prefix = storage.stage_prefix(out, stage.name)
    values = {
        "config": config_file, "stage": stage.name, "run_prefix": out, "output_dir": prefix,
        "checkpoint_dir": storage.join(prefix, "checkpoints"),
        "data_manifest": storage.join(out, "preprocess", "manifest.json"), "init_from": init_from or "",
        "params": params, "per_process_batch": micro, "grad_accum_steps": stage.grad_accum_steps,
        "global_batch": global_batch, "lr": scaled_lr_for(config, params["lr"], global_batch), "epochs": stage.epochs,
        "warmup_steps": stage.warmup_steps if global_batch > previous_global_batch(config, stage_name) else 0,
        "seed": config.train.seed,
    }
    assert set(values) == set(env_contract.STAGE_VALUES), "stagewise.contract declares the stage values; fill each of them here"
    return values


def byo_environment(config: PipelineConfig, config_file: str, stage_name: str, out: str, swept: dict[str, Any],
                    init_from: str | None, overrides: dict[str, Any] | None = None) -> dict[str, str]:
    """What a user's own stage script gets besides torchrun's RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT.

    Exactly stagewise.contract.STAGE_ENV (the names and their docs live there); the launcher adds LAUNCH_ENV.

    The script reads data through the manifest, keeps its checkpoints in STAGEWISE_CHECKPOINT_DIR
    (a retry finds them there), and for a later stage or evaluation writes ``final.pt`` (model and
    optimizer state, global_batch) and ``model.pt`` (stagewise.models.bundle.save_bundle) in STAGEWISE_OUTPUT_DIR
    (stagewise.spec.save_model writes both).
    """
    return contract_environment(config, byo_contract(config, config_file, stage_name, out, swept, init_from), overrides)


def byo_args(config: PipelineConfig, stage_name: str, contract: dict[str, Any]) -> list[str]:
    """The stage entrypoint's args with each ``{name}`` filled from the contract, else from the hyperparameters.

    ``{lr}`` is the stage's rescaled lr (as $STAGEWISE_LR); the swept base lr is in $STAGEWISE_PARAMS.
    """
    stage = config.stage(stage_name)
    return entrypoint_args(stage.entrypoint, f"train.stages ({stage.name})", contract)


# What a user's stage must leave in STAGEWISE_OUTPUT_DIR: the next stage starts from final.pt, evaluation loads model.pt.
BYO_OUTPUTS = {"final.pt": "model and optimizer state plus global_batch, which the next stage starts from",
               "model.pt": "the model bundle (stagewise.models.bundle.save_bundle), which evaluation, the registry and inference load"}


def check_byo_outputs(config: PipelineConfig, stage_name: str, out: str) -> dict[str, str]:
    """The URIs of a finished user stage's outputs; a UserError naming each missing file and where it was expected."""
    stage = config.stage(stage_name)
    prefix = storage.stage_prefix(out, stage.name)
    uris = {name: storage.join(prefix, name) for name in BYO_OUTPUTS}
    missing = [name for name, uri in uris.items() if not storage.exists(uri)]
    if missing:
        entry = stage.entrypoint
        what = f"script {entry.script}" if entry and entry.script else f"module {entry.module}" if entry else "stagewise.train"
        needs = "; ".join(f"{name}: {BYO_OUTPUTS[name]}" for name in missing)
        raise UserError(f"stage {stage.name}: {what} ended without writing {' and '.join(missing)} in "
                        f"STAGEWISE_OUTPUT_DIR ({prefix}); rank 0 must write them there ({needs})")
    return uris


def byo_result(config: PipelineConfig, stage_name: str, out: str, contract: dict[str, Any],
               reported: dict[str, Any]) -> dict[str, Any]:
    """A finished user stage's result: outputs checked, the contract's numbers, and params only as the script reported them.

    ``reported`` is the script's own result JSON ($STAGEWISE_RESULT_FILE; empty when it wrote none) plus, under
    ``last_report``, what its last stagewise.spec.report recorded: the objective there is the val_metric unless the
    result JSON gives one.
    """
    outputs = check_byo_outputs(config, stage_name, out)
    reported = dict(reported)
    last = reported.pop(LAST_REPORT, None) or {}
    stage = config.stage(stage_name)
    params = reported.get("params")
    if params is not None and not isinstance(params, dict):
        raise UserError(f"stage {stage.name}: 'params' in the script's result JSON ($STAGEWISE_RESULT_FILE) must be an "
                        f"object of the hyperparameters it trained with, got {type(params).__name__} {params!r}")
    result = {"stage": stage.name, "world_size": config.profile(stage.profile).world_size,
              "global_batch": contract["global_batch"], "lr": contract["lr"], "epochs": stage.epochs,
              "val_metric": last.get("metrics", {}).get(config.objective.metric),
              "checkpoint_uri": outputs["final.pt"], "model_uri": outputs["model.pt"], **reported}
    return {**result, "params": params, "params_source": "script"}


def previous_global_batch(config: PipelineConfig, stage_name: str) -> int:
    """The global batch of the stage before ``stage_name`` (0 for the first): a script stage warms up when it grew,
    as the built-in loop does."""
    index = config.train.stages.index(config.stage(stage_name))
    if index == 0:
        return 0
    previous = config.train.stages[index - 1]
    return previous.global_batch_for(config.profile(previous.profile).world_size)


def scaled_lr_for(config: PipelineConfig, base_lr: float, global_batch: int) -> float:
    return scaled_lr(base_lr, global_batch, config.train.base_batch, config.train.lr_rule)
