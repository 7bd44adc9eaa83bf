"""Launching a user's own script (a stage's or the sweep's ``entrypoint``): its STAGEWISE_* environment, its
arguments with placeholders filled, what its last ``report`` left in $STAGEWISE_METRICS_FILE, and the params a
model card then records.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from stagewise.core import contract as env_contract
from stagewise.core.errors import UserError
from stagewise.definitions.config import ARG_PLACEHOLDERS, EntryPoint, PipelineConfig, placeholders
from stagewise.training.torchrun_command import command


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


@dataclass(frozen=True)
class ScriptRun:
    """How one run of a user's entrypoint under torchrun ended."""

    code: int
    """torchrun's exit code."""
    error: str | None
    """The user error rank 0 left in $STAGEWISE_ERROR_FILE, prefixed with the script's name."""
    result: dict[str, Any]
    """What the script wrote to $STAGEWISE_RESULT_FILE (empty when nothing)."""
    last_report: dict[str, Any] | None
    """What its last ``stagewise.spec.report`` recorded."""


def run_script(config: PipelineConfig, entry: EntryPoint, args: list[str], env: dict[str, str], *, processes: int,
               threads: int, workdir: str) -> ScriptRun:
    """Run ``entry`` with ``args`` under torchrun (``processes`` per node) in a scratch cwd under ``workdir``, with
    ``env`` (its STAGE_ENV) and its own result, error and metrics files there; the config's model.import_paths are
    importable. Its output goes straight to this process's."""
    import subprocess

    files = {env_contract.RESULT_FILE: os.path.join(workdir, "result.json"),
             env_contract.ERROR_FILE: os.path.join(workdir, "user_error.txt"),
             env_contract.METRICS_FILE: os.path.join(workdir, "metrics.json")}
    cwd = os.path.join(workdir, "cwd")
    os.makedirs(cwd, exist_ok=True)
    paths = (*(config.model.import_paths or ()), os.environ.get("PYTHONPATH", ""))
    child = {**os.environ, **files, **env, "OMP_NUM_THREADS": str(threads),
             "PYTHONPATH": os.pathsep.join(path for path in paths if path)}
    target = [entry.script] if entry.script else ["-m", entry.module]  # a loaded config's script is absolute
    code = subprocess.run(command(target, args, processes), cwd=cwd, env=child).returncode
    error = None
    if os.path.exists(child[env_contract.ERROR_FILE]):
        with open(child[env_contract.ERROR_FILE]) as handle:
            error = f"{entry.script or entry.module}: {handle.read().strip()}"
    result = {}
    if os.path.exists(child[env_contract.RESULT_FILE]):
        with open(child[env_contract.RESULT_FILE]) as handle:
            result = json.load(handle)
    return ScriptRun(code, error, result, read_last_report(child[env_contract.METRICS_FILE]))


def read_last_report(path: str) -> dict[str, Any] | None:
    """What the script's last ``stagewise.spec.report`` recorded in ``path`` ($STAGEWISE_METRICS_FILE): epoch, metrics, pruned."""
    if not os.path.exists(path):
        return None
    with open(path) as handle:
        return json.load(handle)


