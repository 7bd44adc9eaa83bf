"""Every DAG file imports cleanly, fast, and without heavy ML libraries at module level."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
DAG_FILES = sorted((REPO_ROOT / "dags").glob("*.py"))
HEAVY = ("torch", "optuna", "pyarrow", "pandas", "sklearn")

# No sys.path edits: as in Airflow's dag-processor, tasks and stagewise.airflow import as the installed package.
PROBE = """
import json, runpy, sys
namespace = runpy.run_path({path!r})
from airflow.sdk import DAG
dags = [v.dag_id for v in namespace.values() if isinstance(v, DAG)]
print(json.dumps({{"heavy": [m for m in {heavy!r} if m in sys.modules], "dags": dags}}))
"""


@pytest.mark.parametrize("path", DAG_FILES, ids=[p.name for p in DAG_FILES])
def test_dag_file_imports_without_heavy_modules(path, tmp_path):
    """A fresh interpreter outside the checkout, with no PYTHONPATH, imports the file with no error and no
    torch/optuna/pyarrow/pandas loaded."""
    code = PROBE.format(path=str(path), heavy=HEAVY)
    env = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-4000:]
    probe = json.loads(result.stdout.strip().splitlines()[-1])
    assert probe["heavy"] == [], f"{path.name} imports {probe['heavy']} at module level"


def test_dagbag_holds_every_default_pipelines_family_without_import_errors(monkeypatch):
    """Airflow's own parser loads the checkout's pipelines (pipeline.yaml and examples/) side by side: five DAGs
    each (stagewise.definitions.pipelines.KINDS, maintenance the fifth), named <pipeline>_<kind>, each tagged with its pipeline's name, and no import error."""
    from airflow.dag_processing.dagbag import DagBag

    monkeypatch.delenv("STAGEWISE_PIPELINES", raising=False)
    monkeypatch.delenv("STAGEWISE_CONFIG", raising=False)
    bag = DagBag(dag_folder=str(REPO_ROOT / "dags"))
    assert bag.import_errors == {}
    names = ("ml", "digits_cnn", "diabetes", "ddp_tutorial", "token_transformer", "decoder")
    kinds = ("pipeline", "retrain", "batch_inference", "ingest", "maintenance")
    assert set(bag.dag_ids) == {f"{name}_{kind}" for name in names for kind in kinds}
    for name in names:
        for kind in kinds:
            assert {"stagewise", name} <= set(bag.get_dag(f"{name}_{kind}").tags)
