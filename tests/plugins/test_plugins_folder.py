"""Airflow's plugin loader imports every .py file under its plugins folder as a top-level module named after the file.
Our setups point that folder at $AIRFLOW_HOME/plugins; for one still pointed at the checkout's plugins/,
plugins/.airflowignore keeps the loader away from the stagewise.airflow package (imported by its own name). The UI
plugin comes from the package's airflow.plugins entry point, as it does for a team that pip-installed Stagewise."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import REPO_ROOT

# What every Airflow process that loads plugins does: the plugins folder, then the entry points.
PROBE = """
import json, sys
from airflow import plugins_manager
plugins, errors = plugins_manager._get_plugins()
kubernetes = sys.modules.get("kubernetes")
print(json.dumps({"errors": errors, "plugins": sorted(p.name for p in plugins),
                  "ui_imported": [m for m in ("stagewise.airflow.ui", "fastapi") if m in sys.modules],
                  "top_level": sorted(m for m in ("steps", "launch", "wiring", "sagemaker", "kubernetes")
                                                        if m in sys.modules),
                  "kubernetes_file": getattr(kubernetes, "__file__", None)}))
"""


def _load_plugins(subprocess_env: dict) -> dict:
    """The probe's findings, in a process whose plugins folder is the repo's plugins/."""
    env = {**subprocess_env, "AIRFLOW__CORE__PLUGINS_FOLDER": str(REPO_ROOT / "plugins")}
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_airflows_plugin_loader_imports_none_of_our_files_as_top_level_modules(subprocess_env):
    """Before the ignore file, loading plugins made backends/kubernetes.py sys.modules['kubernetes'], so the
    cncf.kubernetes provider and the kubernetes client broke in every Airflow process that loads plugins."""
    found = _load_plugins(subprocess_env)
    assert found["errors"] == {} and found["top_level"] == []
    assert found["kubernetes_file"] is None or "site-packages" in found["kubernetes_file"]


def test_the_ui_plugin_loads_once_from_the_entry_point_without_importing_its_pages(subprocess_env):
    """Every process that loads plugins (the dag-processor too) gets the Stagewise UI plugin once, from the
    entry point (no file to copy into a plugins folder), but not FastAPI or its pages: those are built on the
    api-server's first request."""
    found = _load_plugins(subprocess_env)
    assert found["errors"] == {} and found["plugins"] == ["stagewise_ui"]
    assert found["ui_imported"] == []


# Plugin loading as a task process does it, every warning recorded (Airflow's own filters would show some only once).
WARNINGS_PROBE = """
import json, warnings
from airflow import plugins_manager
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    plugins, errors = plugins_manager._get_plugins()
print(json.dumps({"plugins": sorted(p.name for p in plugins), "errors": errors,
                  "warnings": [f"{w.category.__name__}: {w.message}" for w in caught]}))
"""


def _probe_warnings(tmp_path, plugins_folder: str | None = None) -> dict:
    """The probe run in `make up`'s environment (scripts/airflow_env.sh sourced, a fresh Airflow home), optionally with
    another plugins folder."""
    setting = f"export AIRFLOW__CORE__PLUGINS_FOLDER={plugins_folder} && " if plugins_folder else ""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
    env["AIRFLOW_HOME"] = str(tmp_path / "home")
    done = subprocess.run(["bash", "-c", f'{setting}. scripts/airflow_env.sh && exec python -c "$0"', WARNINGS_PROBE],
                          env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_loading_plugins_puts_no_warning_into_a_task_log(tmp_path):
    """Every task process loads plugins. With make up's settings the plugins folder is Airflow's default under its home,
    so no .airflowignore is compiled through pathspec's deprecated GitWildMatchPattern (the DeprecationWarning that
    every task log carried while the folder was the checkout's plugins/, which the second probe shows), and the UI
    plugin still comes from its entry point."""
    found = _probe_warnings(tmp_path)
    assert found["errors"] == {} and found["plugins"] == ["stagewise_ui"]
    assert found["warnings"] == []
    old = _probe_warnings(tmp_path, str(REPO_ROOT / "plugins"))
    assert any("GitWildMatchPattern" in warning for warning in old["warnings"]), old
