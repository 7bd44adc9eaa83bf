"""Launching a user's own script (a stage's or the sweep's ``entrypoint``): its STAGEWISE_* environment, its
arguments with placeholders filled, what its last ``report`` left in $STAGEWISE_METRICS_FILE, and the params a
model card then records.
"""

from __future__ import annotations

import json
import os
from typing import Any

from stagewise.core import contract as env_contract
from stagewise.core.errors import UserError
from stagewise.definitions.config import ARG_PLACEHOLDERS, EntryPoint, PipelineConfig, placeholders


def contract_environment(config: PipelineConfig, values: dict[str, Any], overrides: dict[str, Any] | None) -> dict[str, str]:
    """stagewise.contract.STAGE_ENV from a stage's (or a sweep trial's) contract values, all as strings."""
    text = {"params": json.dumps(values["params"]), "lr": repr(values["lr"])}
    env = {f"STAGEWISE_{name.upper()}": text.get(name, str(value)) for name, value in values.items()}
    env[env_contract.OVERRIDES] = json.dumps(overrides or {})
    env[env_contract.OBJECTIVE] = config.objective.metric
    return env


def entrypoint_args(entry: EntryPoint | None, owner: str, contract: dict[str, Any]) -> list[str]:
    """An entrypoint's args with each ``{name}`` filled from the contract values, else from the hyperparameters."""
    values = {**contract["params"], **{name: contract[name] for name in ARG_PLACEHOLDERS}}
    args = []
    for position, arg in enumerate(entry.args if entry else []):
        where = f"{owner}: entrypoint.args[{position}] {arg!r}"
        try:
            missing = [name for name in placeholders(arg) if name not in values]
            if missing:
                raise ValueError(f"unknown placeholder {{{missing[0]}}}; known: {sorted(values)}")
            args.append(arg.format_map(values))
        except ValueError as exc:
            raise UserError(f"{where}: {exc}") from None
    return args


# The key under which the launcher hands a user script's last stagewise.spec.report ($STAGEWISE_METRICS_FILE) to byo_result.
LAST_REPORT = "last_report"


# What a model card says in place of params when a user's script did not report the ones it trained with.
PARAMS_NOT_REPORTED = "not reported by the script"


def card_params(trained: dict[str, Any], swept_params: dict[str, Any] | None) -> dict[str, Any]:
    """The params a model card records: every hyperparameter our own stage built and trained the model with (the
    sweep's best over the defaults), else a user script's own report (or that it gave none), never the sweep's in its
    place."""
    if trained.get("params_source") != "script":
        return {"params": trained.get("params") or swept_params, "params_source": "sweep"}
    reported = trained.get("params")
    return {"params": PARAMS_NOT_REPORTED if reported is None else reported, "params_source": "script"}


def read_last_report(path: str) -> dict[str, Any] | None:
    """What the script's last ``stagewise.spec.report`` recorded in ``path`` ($STAGEWISE_METRICS_FILE): epoch, metrics, pruned."""
    if not os.path.exists(path):
        return None
    with open(path) as handle:
        return json.load(handle)


