"""The libraries the Airflow task process calls in-process (steps.py's inline steps: plan, reduce, commit, the study,
the registry, the report) load without torch: each such task stays a fraction of a second and a few MB, and only
the sub-jobs it launches pay for torch."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# What steps.py imports inside its inline steps (a launched sub-job imports its job module in its own process).
INLINE_MODULES = ("stagewise.core.storage", "stagewise.definitions.loading", "stagewise.study.studies", "stagewise.study.summary",
                  "stagewise.datasets.predictions", "stagewise.preprocess", "stagewise.registry", "stagewise.report",
                  "stagewise.reporting.timeline", "stagewise.airflow.steps", "stagewise.airflow.backends",
                  "stagewise.airflow.shard_steps", "stagewise.reuse.cache", "stagewise.reuse.fingerprints",
                  "stagewise.reuse.planning", "stagewise.reuse.leftovers", "stagewise.core.assets")


@pytest.mark.subprocess
def test_inline_step_modules_import_without_torch():
    """A fresh interpreter imports every inline step's module and has neither torch nor optuna loaded."""
    code = (f"import importlib, json, sys\nfor name in {INLINE_MODULES!r}: importlib.import_module(name)\n"
            "print(json.dumps([m for m in ('torch', 'optuna', 'plotly') if m in sys.modules]))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-4000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == []
