"""A bring-your-own script launched by the Airflow glue sees exactly the documented STAGEWISE_* variables."""

from __future__ import annotations

import os

from stagewise.airflow import launch
from stagewise.core import contract
from stagewise.definitions.config import Profile
from stagewise.definitions.loading import load_config
from stagewise.scripting.stage_contract import byo_environment

DUMP_ENV = """
import json, os
seen = {name: value for name, value in os.environ.items() if name.startswith("STAGEWISE_")}
with open(os.environ["STAGEWISE_RESULT_FILE"], "w") as handle:
    json.dump({"seen": seen}, handle)
"""


def test_script_gets_exactly_the_documented_environment(write_config, storage_root, tmp_path, monkeypatch):
    """byo_environment plus the launcher give a script every contract variable and no undocumented STAGEWISE_* one."""
    for name in [name for name in os.environ if name.startswith("STAGEWISE_")]:
        monkeypatch.delenv(name)  # the test's own (STAGEWISE_HOME, ...) would blur what the launcher adds
    path = write_config()
    config = load_config(path)
    env = byo_environment(config, str(path), "s2", str(storage_root / "runs" / "x" / "r1"), {}, None, {})
    script = tmp_path / "dump_env.py"
    script.write_text(DUMP_ENV)
    seen = launch.run("", [], Profile(), script=str(script), extra_env=env)["seen"]
    assert set(seen) == set(contract.STAGE_ENV) | set(contract.LAUNCH_ENV)  # a trial's variables only in a trial
    assert {name: seen[name] for name in env} == env
    assert seen[contract.ERROR_FILE] and seen[contract.RESULT_FILE]
