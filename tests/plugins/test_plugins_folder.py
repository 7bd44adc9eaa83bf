"""Airflow's plugin loader imports every .py file under plugins/ as a top-level module named after the file;
plugins/.airflowignore keeps it away from the stagewise_airflow package (imported by its own name)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import REPO_ROOT

PROBE = """
import json, sys
from airflow import plugins_manager
plugins, errors = plugins_manager._load_plugins_from_plugin_directory(sys.argv[1])
kubernetes = sys.modules.get("kubernetes")
print(json.dumps({"errors": errors, "plugins": sorted(p.name for p in plugins),
                  "ui_imported": [m for m in ("stagewise_airflow.ui", "fastapi") if m in sys.modules],
                  "top_level": sorted(m for m in ("steps", "launch", "wiring", "sagemaker", "kubernetes")
                                                        if m in sys.modules),
                  "kubernetes_file": getattr(kubernetes, "__file__", None)}))
"""


def test_airflows_plugin_loader_imports_none_of_our_files_as_top_level_modules(subprocess_env):
    """Before the ignore file, loading plugins made backends/kubernetes.py sys.modules['kubernetes'], so the
    cncf.kubernetes provider and the kubernetes client broke in every Airflow process that loads plugins."""
    done = subprocess.run([sys.executable, "-c", PROBE, str(REPO_ROOT / "plugins")], env=subprocess_env, cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["errors"] == {} and found["top_level"] == []
    assert found["kubernetes_file"] is None or "site-packages" in found["kubernetes_file"]


def test_the_ui_plugin_loads_without_importing_its_pages(subprocess_env):
    """Every process that loads plugins (the dag-processor too) gets the Stagewise UI plugin, but not FastAPI or
    its pages: those are built on the api-server's first request."""
    done = subprocess.run([sys.executable, "-c", PROBE, str(REPO_ROOT / "plugins")], env=subprocess_env, cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["errors"] == {} and found["plugins"] == ["stagewise_ui"]
    assert found["ui_imported"] == []
