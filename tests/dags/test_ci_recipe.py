"""docs/ci.md's recipe, run as written: `airflow dags test` of a pipeline under $STAGEWISE_SCRATCH_ROOT keeps the run,
its sweep journal and its registry in scratch, leaves production's storage root and registry as they were, and the
report says what the gate would have decided. Without the variable, a test run is in a scratch root of its own."""

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
from tests import run_cache
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


SCRATCH_LINE = 'export STAGEWISE_SCRATCH_ROOT="$AIRFLOW_HOME/storage"\n'


def _files(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` with a hash of its bytes: what a run could have added or changed there."""
    return {str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(folder.rglob("*")) if path.is_file()}


def _team(tmp_path: Path) -> tuple[Path, Path, str]:
    """The team's repository (dags/, pipelines/digits.yaml) and production's storage root, whose registry has a current
    model: (repository, production storage root, the live version)."""
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
    # production's newest run: the recipe's report must show the CI's own run, never this one
    old_run = production / "runs" / "digits_pipeline" / "scheduled__production" / "report.json"
    old_run.parent.mkdir(parents=True)
    old_run.write_text(json.dumps({"dag_id": "digits_pipeline", "run_id": "scheduled__production"}))
    os.utime(old_run, (1_700_000_000, 1_700_000_000))
    return repo, production, live


def _team_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """The CI's environment: none of the checkout's Airflow or Stagewise settings (no scratch root, no opt-in)."""
    env = {key: value for key, value in os.environ.items() if not key.startswith(("AIRFLOW", "STAGEWISE"))}
    env.update(PATH=f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}", TMPDIR=str(tmp_path), OMP_NUM_THREADS="1",
               **extra)
    return env


@pytest.mark.slow
def test_the_ci_recipe_runs_in_scratch_and_promotes_nothing(tmp_path):
    """The recipe runs as written (it names the extra its demo data needs); the run's files are under the scratch root;
    nothing under the production storage root (whose registry has a current model) nor beside the config changed; the
    report names the gate's would-be decision and promoted nothing."""
    assert '"stagewise[demo]"' in _recipe() and "scikit-learn" in (REPO_ROOT / "pyproject.toml").read_text()
    assert _recipe().count(SCRATCH_LINE) == 1, "the recipe names its scratch root in one line"
    repo, production, live = _team(tmp_path)
    before, pipelines_before = _files(production), _files(repo / "pipelines")

    env = _team_env(tmp_path, DAGS="dags", PIPELINES="pipelines", PIPELINE="digits")
    result = subprocess.run(["bash", "-c", _recipe()], cwd=repo, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, f"the recipe failed:\n{result.stdout[-6000:]}\n{result.stderr[-6000:]}"

    [home] = [path for path in tmp_path.glob("tmp.*") if (path / "airflow.db").exists()]
    scratch = home / "storage" / "digits"
    [report_file] = scratch.glob("runs/digits_pipeline/*/report.json")
    report = json.loads(report_file.read_text())
    assert report["run_prefix"].startswith(str(scratch)) and report["model_uri"].startswith(str(scratch))
    assert report["predictions"]["uri"].startswith(str(scratch))
    assert list((scratch / "optuna" / "studies").glob("*.journal")), "the sweep's journal is in scratch"
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


@pytest.mark.slow
def test_the_recipe_without_its_scratch_line_runs_and_reports_its_own_run(tmp_path):
    """The recipe as written less its STAGEWISE_SCRATCH_ROOT line, on a production pipeline whose input is there and
    which has runs of its own, no opt-in: the test run reads production's input and lands under
    $AIRFLOW_HOME/stagewise-scratch/<name> (report-only gate, scratch journal), its first start_run line says so,
    every file under the production storage root (data, registry, pointer, its runs) is byte for byte what it was,
    and the recipe's last step reports this run, saying it is a test run in scratch, not production's newest."""
    repo, production, live = _team(tmp_path)
    config = repo / "pipelines" / "digits.yaml"
    run_cache.demo_data(config, num_shards=1)  # production's input, one file: the recipe's demo step leaves it be
    before = _files(production)

    env = _team_env(tmp_path, DAGS="dags", PIPELINES="pipelines", PIPELINE="digits")
    recipe = _recipe().replace(SCRATCH_LINE, "")
    result = subprocess.run(["bash", "-c", recipe], cwd=repo, env=env, capture_output=True, text=True, timeout=900)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"the recipe failed:\n{result.stdout[-6000:]}\n{result.stderr[-6000:]}"

    assert _files(production) == before, "nothing under the production storage root changed"
    assert registry.current(str(production), "digits")["version"] == live
    [home] = [path for path in tmp_path.glob("tmp.*") if (path / "airflow.db").exists()]
    scratch = home / "stagewise-scratch" / "digits"
    [report_file] = scratch.glob("runs/digits_pipeline/*/report.json")
    report = json.loads(report_file.read_text())
    assert report["run_prefix"].startswith(str(scratch)) and report["model_uri"].startswith(str(scratch))
    assert list((scratch / "optuna" / "studies").glob("*.journal")), "the sweep's journal is in scratch"
    snapshot = yaml.safe_load(Path(report["config"]["config_uri"].removeprefix("file://")).read_text())
    assert snapshot["storage_root"] == str(scratch) and snapshot["dataset"]["uri"] == str(production / "raw" / "digits")
    gate = report["registry"]
    assert gate["report_only"] and not gate["promoted"]
    said = f"test run (airflow dags test): pipeline digits runs in scratch under {home / 'stagewise-scratch'}"
    assert said in output, output[-6000:]  # start_run's first line (tests/plugins/test_test_runs.py checks it is first)
    shown = result.stdout.rstrip().splitlines()
    [note] = [line for line in shown if line.startswith("a test run (airflow dags test) of this Airflow home")]
    assert f"in scratch under {home / 'stagewise-scratch'}, not in production's storage_root {production}" in note
    assert f"run digits_pipeline / {report['run_id']}" in shown and "scheduled__production" not in result.stdout
    assert shown[-1] == f"REPORT {report_file}"
