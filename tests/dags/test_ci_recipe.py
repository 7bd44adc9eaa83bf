"""docs/ci.md's recipe, run as written: `airflow dags test` of a pipeline under $STAGEWISE_SCRATCH_ROOT keeps the run,
its sweep journal and its registry in scratch, leaves production's storage root and registry as they were, and the
report says what the gate would have decided."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from stagewise import registry
from tests.conftest import base_config
from tests.dags.conftest import REPO_ROOT

pytestmark = [pytest.mark.airflow, pytest.mark.torchrun]

# The team's DAG file, naming its pipelines folder relative to itself as docs/ci.md asks.
DAG_FILE = '''"""The team's airflow dag file: one DAG family per pipeline config."""
from pathlib import Path

from stagewise.airflow.dags import build_pipelines

build_pipelines(globals(), str(Path(__file__).resolve().parent.parent / "pipelines"))
'''


def _recipe() -> str:
    """The one bash block of docs/ci.md."""
    blocks = re.findall(r"^```bash\n(.*?)^```$", (REPO_ROOT / "docs" / "ci.md").read_text(), re.MULTILINE | re.DOTALL)
    assert len(blocks) == 1, "docs/ci.md has exactly one recipe block"
    return blocks[0]


def _files(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` with a hash of its bytes: what a run could have added or changed there."""
    return {str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(folder.rglob("*")) if path.is_file()}


def test_the_ci_recipe_runs_in_scratch_and_promotes_nothing(tmp_path):
    """The recipe runs as written; the run's files are under the scratch root; nothing under the production storage
    root (whose registry has a current model) nor beside the config changed; the report names the gate's would-be
    decision and promoted nothing."""
    production = tmp_path / "prod-storage"
    repo = tmp_path / "team"
    (repo / "dags").mkdir(parents=True)
    (repo / "dags" / "team_pipelines.py").write_text(DAG_FILE)
    (repo / "pipelines").mkdir()
    raw = base_config(production)
    raw["name"] = "digits"
    raw["storage_conn_id"] = "prod_s3"  # a connection CI does not have: scratch storage must not need it
    del raw["sweep"]["storage"]  # the default journal, which must follow the storage root into scratch
    raw["sweep"]["epochs"] = 2
    raw["train"]["stages"] = [{**raw["train"]["stages"][0], "epochs": 1}]
    (repo / "pipelines" / "digits.yaml").write_text(yaml.safe_dump(raw))
    production.mkdir()
    model = tmp_path / "prod-model.pt"
    model.write_bytes(b"production model")
    live = registry.register(str(production), "digits", str(model), {"test_accuracy": 0.99})["version"]
    registry.promote(str(production), "digits", live)
    before, pipelines_before = _files(production), _files(repo / "pipelines")

    env = {key: value for key, value in os.environ.items() if not key.startswith(("AIRFLOW", "STAGEWISE"))}
    env.update(PATH=f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}", TMPDIR=str(tmp_path),
               DAGS="dags", PIPELINES="pipelines", PIPELINE="digits", OMP_NUM_THREADS="1")
    result = subprocess.run(["bash", "-c", _recipe()], cwd=repo, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, f"the recipe failed:\n{result.stdout[-6000:]}\n{result.stderr[-6000:]}"

    [home] = [path for path in tmp_path.glob("tmp.*") if (path / "airflow.db").exists()]
    scratch = home / "storage" / "digits"
    [report_file] = scratch.glob("runs/digits_pipeline/*/report.json")
    report = json.loads(report_file.read_text())
    assert report["run_prefix"].startswith(str(scratch)) and report["model_uri"].startswith(str(scratch))
    assert report["predictions"]["uri"].startswith(str(scratch))
    assert (scratch / "optuna" / "optuna.journal").is_file(), "the sweep's journal is in scratch"
    snapshot = yaml.safe_load(Path(report["config"]["config_uri"].removeprefix("file://")).read_text())
    assert snapshot["storage_root"] == str(scratch) and snapshot["registry"]["report_only"]

    assert _files(production) == before, "nothing under the production storage root changed"
    assert registry.current(str(production), "digits")["version"] == live
    assert _files(repo / "pipelines") == pipelines_before, "nothing was written beside the config"

    gate = report["registry"]
    assert gate["report_only"] and gate["would_promote"] and not gate["promoted"]
    assert gate["decision"] == f"would promote {gate['version']}: no current model"
    assert not (scratch / "models" / "digits" / "current.json").exists(), "no pointer moved, in scratch either"
    assert f"report only (registry.report_only: nothing promoted): {gate['decision']}" in result.stdout + result.stderr, \
        "the gate_model task's log says what it would do"
    assert f"registry (report only, nothing promoted): {gate['decision']}" in result.stdout
    assert result.stdout.rstrip().splitlines()[-1] == f"REPORT {report_file}"
