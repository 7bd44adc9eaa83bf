"""The bring-your-own contract: tasks/contract.py names every STAGEWISE_* variable, and the code sets just those."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

from stagewise.core import contract
from stagewise.definitions.loading import load_config
from stagewise.scripting.stage_contract import byo_environment

REPO_ROOT = Path(__file__).resolve().parents[2]
# STAGEWISE_* variables that are not part of a script's contract, each with why.
INTERNAL = {
    "STAGEWISE_HOME": "the checkout, for scripts/airflow_env.sh and the Airflow glue",
    "STAGEWISE_PIPELINES": "the deployment's pipeline configs (stagewise.definitions.pipelines), for the DAG file and the UI",
    "STAGEWISE_FAULT_KILL_AT": "test-only fault injection in stagewise.train",
    "STAGEWISE_FAULT_KILL_TRIAL": "test-only fault injection in stagewise.sweep",
    "STAGEWISE_STATE_DIR": "where the DAG file keeps each pipeline's last valid version (stagewise.definitions.last_valid)",
    "STAGEWISE_SCRATCH_ROOT": "CI mode: every loaded pipeline on scratch storage (stagewise.definitions.loading, docs/ci.md)",
    "STAGEWISE_TEST_RUNS_WRITE": "the pipelines whose `airflow dags test` runs may write production (docs/ci.md)",
}


def test_byo_environment_sets_exactly_the_stage_contract(write_config, storage_root):
    """byo_environment returns every documented stage variable and nothing else, all strings, overrides as JSON."""
    path = write_config()
    config = load_config(path)
    out = str(storage_root / "runs" / "byo" / "r1")
    overrides = {"sweep.num_trials": 4}
    env = byo_environment(config, str(path), "s2", out, {"lr": 0.02}, None, overrides)
    assert set(env) == set(contract.STAGE_ENV)
    assert all(isinstance(value, str) for value in env.values())
    assert json.loads(env[contract.OVERRIDES]) == overrides and env[contract.INIT_FROM] == ""
    assert json.loads(byo_environment(config, str(path), "s2", out, {}, None)[contract.OVERRIDES]) == {}


def test_every_variable_is_named_stagewise_and_documented():
    """Each variable is STAGEWISE_-prefixed with a one-line doc, and stage, launch and trial variables do not overlap."""
    assert len(contract.ENVIRONMENT) == len(contract.STAGE_ENV) + len(contract.LAUNCH_ENV) + len(contract.TRIAL_ENV)
    for name, doc in contract.ENVIRONMENT.items():
        assert re.fullmatch(r"STAGEWISE_[A-Z_]+", name), name
        assert doc.strip() and "\n" not in doc and doc.endswith("."), f"{name}: {doc!r}"


def test_no_stagewise_variable_outside_the_contract():
    """Every STAGEWISE_* name in tasks/ and the Airflow glue is in the contract (a script's, or the node launcher's)
    or a listed internal one."""
    found: dict[str, str] = {}
    for path in sorted([*(REPO_ROOT / "tasks").rglob("*.py"), *(REPO_ROOT / "plugins").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                for name in re.findall(r"\bSTAGEWISE_[A-Z][A-Z_]*\b", node.value):
                    found.setdefault(name, f"{path.relative_to(REPO_ROOT)}:{node.lineno}")
    declared = {**contract.ENVIRONMENT, **contract.NODE_ENV, **INTERNAL}
    unknown = {name: where for name, where in found.items() if name not in declared}
    assert unknown == {}, f"declare these in tasks/contract.py (or list them in INTERNAL with a reason): {unknown}"
