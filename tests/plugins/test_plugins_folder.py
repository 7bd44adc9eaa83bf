"""Airflow's plugin loader imports every .py file under its plugins folder as a top-level module named after the file.
Our setups point that folder at $AIRFLOW_HOME/plugins; for one still pointed at the checkout's plugins/,
plugins/.airflowignore keeps the loader away from the stagewise.airflow package (imported by its own name). The UI
plugin comes from the package's airflow.plugins entry point, as it does for a team that pip-installed Stagewise."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.conftest import REPO_ROOT

# Plugin loading as every Airflow process does it (the plugins folder, then the entry points), as a task process sees
# it: every warning recorded (Airflow's own filters would show some only once), with what it imported.
PROBE = """
import json, sys, warnings
from airflow import plugins_manager
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    plugins, errors = plugins_manager._get_plugins()
kubernetes = sys.modules.get("kubernetes")
print(json.dumps({"errors": errors, "plugins": sorted(p.name for p in plugins),
                  "warnings": [f"{w.category.__name__}: {w.message}" for w in caught],
                  "ui_imported": [m for m in ("stagewise.airflow.ui", "fastapi") if m in sys.modules],
                  "top_level": sorted(m for m in ("steps", "launch", "wiring", "sagemaker", "kubernetes")
                                      if m in sys.modules),
                  "kubernetes_file": getattr(kubernetes, "__file__", None)}))
"""


def _probe(home, plugins_folder: str | None = None) -> dict:
    """The probe run in `make up`'s environment (scripts/airflow_env.sh sourced, a fresh Airflow home), optionally with
    another plugins folder."""
    setting = f"export AIRFLOW__CORE__PLUGINS_FOLDER={plugins_folder} && " if plugins_folder else ""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
    env["AIRFLOW_HOME"] = str(home)
    done = subprocess.run(["bash", "-c", f'{setting}. scripts/airflow_env.sh && exec python -c "$0"', PROBE],
                          env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def checkout_folder(tmp_path_factory) -> dict:
    """The probe's findings in a process whose plugins folder is the checkout's plugins/ (one process for the
    tests below, each Airflow import costing seconds)."""
    return _probe(tmp_path_factory.mktemp("plugins") / "home", str(REPO_ROOT / "plugins"))


@pytest.mark.subprocess
def test_airflows_plugin_loader_imports_none_of_our_files_as_top_level_modules(checkout_folder):
    """Before the ignore file, loading plugins made backends/kubernetes.py sys.modules['kubernetes'], so the
    cncf.kubernetes provider and the kubernetes client broke in every Airflow process that loads plugins."""
    assert checkout_folder["errors"] == {} and checkout_folder["top_level"] == []
    assert checkout_folder["kubernetes_file"] is None or "site-packages" in checkout_folder["kubernetes_file"]


@pytest.mark.subprocess
def test_the_ui_plugin_loads_once_from_the_entry_point_without_importing_its_pages(checkout_folder):
    """Every process that loads plugins (the dag-processor too) gets the Stagewise UI plugin once, from the
    entry point (no file to copy into a plugins folder), but not FastAPI or its pages: those are built on the
    api-server's first request."""
    assert checkout_folder["errors"] == {} and checkout_folder["plugins"] == ["stagewise_ui"]
    assert checkout_folder["ui_imported"] == []


@pytest.mark.subprocess
def test_loading_plugins_puts_no_warning_into_a_task_log(tmp_path, checkout_folder):
    """Every task process loads plugins. With make up's settings the plugins folder is Airflow's default under its home,
    so no .airflowignore is compiled through pathspec's deprecated GitWildMatchPattern (the DeprecationWarning that
    every task log carried while the folder was the checkout's plugins/, which the second probe shows), and the UI
    plugin still comes from its entry point."""
    found = _probe(tmp_path / "home")
    assert found["errors"] == {} and found["plugins"] == ["stagewise_ui"]
    assert found["warnings"] == []
    assert any("GitWildMatchPattern" in warning for warning in checkout_folder["warnings"]), checkout_folder
