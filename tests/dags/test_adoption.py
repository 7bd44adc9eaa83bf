"""Stagewise as a team adopts it: the wheel pip-installed into their Airflow environment as the README says (the
deployment's own versions as constraints), one line in their dags folder beside their own DAG and its helper module
``tasks.py``, and their pipelines in a folder of their own outside any checkout, each config beside the spec or script it names. The pipelines are the
shipped examples copied out as a team starts from them, so each example runs end to end through the installed
package with config changes only."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml

from stagewise.definitions.pipelines import KINDS
from tests import airflow_versions, run_cache
from tests.conftest import TEST_ROWS_PER_SHARD
from tests.dags.conftest import REPO_ROOT

pytestmark = [pytest.mark.airflow, pytest.mark.torchrun]

# What a wheel is built from: the project's files, as `pip wheel .` of a fresh clone sees them.
SOURCES = ("pyproject.toml", "README.md", "tasks", "plugins/stagewise_airflow", "examples")
EXAMPLES = ("digits_cnn", "diabetes", "ddp_tutorial")
# Parallel sweep workers are ml_pipeline's tests' to guard; one worker saves a process per run, and the seeded sweep
# no longer depends on how two workers race.
ONE_SWEEP_WORKER = {"num_sweep_workers": 1}

# The team's own top-level `tasks` module beside their DAGs, the name that clashed with ours (it is no DAG file: a DAG
# defined here would be registered again by every DAG file importing it).
TEAM_TASKS = '''"""The team's shared task helpers."""

GREETING = "from the team's own tasks module"


def greet() -> str:
    return GREETING
'''
TEAM_REPORT = '''"""A DAG of the team that imports their own top-level tasks module."""
from airflow.sdk import dag, task

from tasks import greet


@dag(dag_id="team_report", schedule=None)
def team_report():
    @task
    def report():
        return greet()

    report()


team_report()
'''


@dataclass
class Deployment:
    """A team's Airflow with Stagewise installed: its venv's interpreter, home, dags and pipelines folders."""

    python: Path
    home: Path
    pipelines: Path
    storage_root: Path
    site_packages: Path

    @property
    def env(self) -> dict[str, str]:
        """The team's environment: none of the checkout's paths or settings, the venv first on PATH."""
        env = {key: value for key, value in os.environ.items()
               if not key.startswith(("AIRFLOW", "STAGEWISE")) and key != "PYTHONPATH"}
        env.update({
            "PATH": os.pathsep.join([str(self.python.parent), env.get("PATH", "")]),
            "AIRFLOW_HOME": str(self.home),
            "AIRFLOW__CORE__DAGS_FOLDER": str(self.home / "dags"),
            "AIRFLOW__CORE__PLUGINS_FOLDER": str(self.home / "plugins"),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{self.home}/airflow.db",
            "STAGEWISE_TEST_RUNS_WRITE": ",".join(EXAMPLES),  # their `airflow dags test` runs write the storage root
        })
        return env

    def run(self, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
        """``python <args>`` in the team's venv, from a folder that holds nothing of ours; fails with its output."""
        done = subprocess.run([str(self.python), *args], env=self.env, cwd=self.home, capture_output=True, text=True,
                              timeout=timeout)
        assert done.returncode == 0, f"{args} failed ({done.returncode}):\n{done.stdout[-6000:]}\n{done.stderr[-6000:]}"
        return done

    def airflow(self, *args: str) -> subprocess.CompletedProcess:
        return self.run("-m", "airflow", *args)

    def airflow_json(self, *args: str) -> object:
        """An ``airflow ... --output json`` command's answer (its last line: warnings come before it)."""
        return json.loads(self.airflow(*args, "--output", "json").stdout.strip().splitlines()[-1])


def _image_of_this_environment(target: Path) -> Path:
    """The team's image before Stagewise: a folder of links to every package installed here (Airflow, torch, ...)
    but Stagewise itself, so pip sees them as installed and must resolve the wheel's requirements against them."""
    here = Path(sysconfig.get_paths()["purelib"])
    target.mkdir()
    for entry in here.iterdir():
        if entry.name.startswith(("stagewise", "__editable__")) or entry.suffix == ".pth":
            continue
        (target / entry.name).symlink_to(entry)
    return target


def _team_pipelines(folder: Path, storage_root: Path, journal: Path) -> None:
    """Each example's config, spec and script copied into the team's folder; the config names its spec by the module
    beside it (``digits_cnn:DigitsCNN``, not ``stagewise.examples.digits_cnn``) and its storage on scratch."""
    folder.mkdir()
    for name in EXAMPLES:
        raw = yaml.safe_load((REPO_ROOT / "examples" / f"{name}.yaml").read_text())
        raw["model"]["spec"] = raw["model"]["spec"].removeprefix("stagewise.examples.")
        raw["storage_root"] = str(storage_root)
        raw["sweep"]["storage"] = f"journal://{journal}/{name}.journal"
        raw["inference"]["rows_per_shard"] = TEST_ROWS_PER_SHARD
        (folder / f"{name}.yaml").write_text(yaml.safe_dump(raw))
        shutil.copy(REPO_ROOT / "examples" / f"{name}.py", folder / f"{name}.py")


@pytest.fixture(scope="module")
def deployment(tmp_path_factory) -> Deployment:
    """Build the wheel from the project's files, install it with the README's command into a fresh venv over the
    team's packages (no index: nothing may be fetched or replaced), and lay out their Airflow home."""
    root = tmp_path_factory.mktemp("adoption")
    source = root / "source"
    for name in SOURCES:
        copy = shutil.copytree if (REPO_ROOT / name).is_dir() else shutil.copy
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        kwargs = {"ignore": shutil.ignore_patterns("__pycache__")} if copy is shutil.copytree else {}
        copy(REPO_ROOT / name, source / name, **kwargs)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "--no-index",
                    "--wheel-dir", str(root / "wheels"), str(source)], check=True, capture_output=True, timeout=300)
    (wheel,) = (root / "wheels").glob("stagewise-*.whl")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root / "venv")], check=True, timeout=120)
    python = root / "venv" / "bin" / "python"
    site_packages = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                        check=True, capture_output=True, text=True).stdout.strip())
    (site_packages / "team_image.pth").write_text(f"{_image_of_this_environment(root / 'image')}\n")
    airflow_versions.install_as_readme_says(python, wheel, root)

    home, storage_root = root / "airflow", root / "storage"
    deployment = Deployment(python, home, root / "pipelines", storage_root, site_packages)
    _team_pipelines(deployment.pipelines, storage_root, root)
    (home / "dags").mkdir(parents=True)
    (home / "plugins").mkdir()
    # The two files, as docs/pipelines.md and the README give them.
    (home / "dags" / "stagewise_dags.py").write_text(
        f"from stagewise.airflow.dags import build_pipelines\nbuild_pipelines(globals(), {str(deployment.pipelines)!r})\n")
    (home / "dags" / "stagewise_dags_check.py").write_text(
        f"from stagewise.airflow.dags import check_pipelines\ncheck_pipelines({str(deployment.pipelines)!r})\n")
    (home / "dags" / "tasks.py").write_text(TEAM_TASKS)
    (home / "dags" / "team_report.py").write_text(TEAM_REPORT)
    run_cache.migrated_sqlite_db(home / "airflow.db", pools_of=deployment.pipelines / "diabetes.yaml")
    for name in EXAMPLES:
        run_cache.demo_data(deployment.pipelines / f"{name}.yaml")
    return deployment


def test_installing_adds_one_package_named_stagewise_and_no_generic_module(deployment):
    """Every file the wheel installed is under stagewise/ (or its metadata); `tasks` and `examples` are not
    importable, the public module is, and pip changed nothing else (no index: nothing to fetch)."""
    (record,) = deployment.site_packages.glob("stagewise-*.dist-info/RECORD")
    tops = {line.split(",")[0].split("/")[0] for line in record.read_text().splitlines() if line}
    assert {top for top in tops if not top.startswith("stagewise-")} == {"stagewise"}, tops
    probe = ("import importlib.util as u, json, stagewise.spec; "
             "print(json.dumps([u.find_spec(n) is not None for n in ('tasks', 'examples', 'stagewise_airflow')]))")
    assert json.loads(deployment.run("-c", probe).stdout) == [False, False, False]
    installed = sorted(p.name for p in deployment.site_packages.iterdir() if not p.name.startswith(("_", "team_")))
    assert [name for name in installed if not name.startswith("stagewise")] == [], installed


def test_airflow_lists_the_plugin_and_parses_every_pipeline_beside_the_teams_dags(deployment):
    """`airflow plugins` shows the UI plugin from the entry point (nothing copied into the plugins folder); the one
    line builds every pipeline's DAGs (one of each kind), and the team's DAGs still import their own `tasks` module (parsed as the
    dag-processor parses the dags-folder bundle: its folder on the path)."""
    plugins = deployment.airflow_json("plugins")
    assert [plugin["name"] for plugin in plugins] == ["stagewise_ui"]
    listed = deployment.airflow("dags", "list", "--local", "--bundle-name", "dags-folder", "--output", "json")
    assert "Failed to load all files" not in listed.stderr, listed.stderr[-3000:]  # no import error in any file
    dags = {row["dag_id"] for row in json.loads(listed.stdout.strip().splitlines()[-1])}
    families = {f"{name}_{kind}" for name in EXAMPLES for kind in KINDS}
    assert dags == families | {"team_report"}  # team_report imported the team's tasks.py


def _report_of(deployment: Deployment, example: str, conf: dict) -> dict:
    """One `airflow dags test <example>_pipeline` in the team's deployment; its report.json."""
    deployment.airflow("dags", "test", f"{example}_pipeline", "-c", json.dumps(conf))
    found = sorted(deployment.storage_root.glob(f"runs/{example}_pipeline/*/report.json"))
    assert len(found) == 1, found
    return json.loads(found[0].read_text())


@pytest.fixture(scope="module")
def cnn_report(deployment) -> dict:
    """examples/digits_cnn.yaml (its spec beside it, image column, search space and objective), a 6-trial sweep."""
    return _report_of(deployment, "digits_cnn", {"num_trials": 6, **ONE_SWEEP_WORKER})


def test_cnn_example_reaches_095_test_accuracy(cnn_report):
    """The CNN on 1x8x8 digit images is as good as the demo's MLP: test accuracy >= 0.95, the objective reported."""
    assert cnn_report["objective"]["metric"] == "accuracy"
    assert cnn_report["objective"]["test"] == cnn_report["test_accuracy"] >= 0.95


def test_cnn_example_runs_every_stage_with_its_own_model(cnn_report):
    """Its sweep prunes, its two stages grow the global batch, the registered bundle is the team's CNN module,
    predictions cover every row."""
    sweep, (s1, s2) = cnn_report["sweep"], cnn_report["training"]
    assert sweep["n_trials"] == 6 and sweep["n_pruned"] >= 1 and "hidden" not in sweep["best_params"]
    assert s2["global_batch"] > s1["global_batch"] and s2["world_size"] == 2
    bundle = torch.load(cnn_report["model_uri"], weights_only=True)
    assert bundle["spec"] == {"path": "digits_cnn:DigitsCNN", "args": {"channels": 16}}
    assert cnn_report["predictions"]["rows"] == 1797


@pytest.fixture(scope="module")
def tutorial_report(deployment) -> dict:
    """The tutorial-style script beside its config (``script: ddp_tutorial.py``) as every trial and both stages,
    with a 6-trial sweep (each trial is a torchrun job of its own)."""
    return _report_of(deployment, "ddp_tutorial", {"num_trials": 6, **ONE_SWEEP_WORKER})


def test_ddp_tutorial_script_runs_as_pruned_trials_and_growing_batch_stages(tutorial_report):
    """The user's script is each sweep trial (Hyperband prunes some through report()) and both stages, s2 from s1's
    model at a larger global batch; its model is evaluated, registered under its own name and scores every row."""
    sweep, (s1, s2) = tutorial_report["sweep"], tutorial_report["training"]
    assert sweep["n_trials"] == 6 and sweep["n_pruned"] >= 1 and sweep["n_complete"] >= 1
    assert set(sweep["best_params"]) == {"lr", "weight_decay", "hidden", "dropout"}
    assert (s1["world_size"], s2["world_size"]) == (1, 2) and s2["global_batch"] > s1["global_batch"]
    assert s1["val_metric"] is not None and s2["val_metric"] is not None  # from the script's last report()
    assert tutorial_report["registry"]["model_name"] == "digits_ddp_tutorial"
    assert tutorial_report["test_accuracy"] >= 0.9
    assert tutorial_report["predictions"]["rows"] == 1797


@pytest.fixture(scope="module")
def diabetes_report(deployment) -> dict:
    """examples/diabetes.yaml: a float target, a Regressor beside it, rmse minimised."""
    return _report_of(deployment, "diabetes", ONE_SWEEP_WORKER)


def test_diabetes_example_beats_the_mean_baseline(diabetes_report):
    """The regressor's test RMSE (the minimised objective, in the target's units) clearly beats predicting the mean."""
    objective, baseline = diabetes_report["objective"], diabetes_report["baseline"]["test_rmse"]
    assert objective["metric"] == "rmse" and "test_accuracy" not in diabetes_report
    assert objective["test"] == diabetes_report["test_metrics"]["test_rmse"]
    assert objective["test"] < 0.9 * baseline, (objective["test"], baseline)


def test_diabetes_example_runs_every_stage_with_a_float_target(diabetes_report):
    """Its sweep prunes, two stages grow the global batch, the registry keeps its own name, predictions are floats for every row."""
    import pyarrow.parquet as pq

    sweep, (s1, s2) = diabetes_report["sweep"], diabetes_report["training"]
    assert sweep["n_pruned"] >= 1 and sweep["n_complete"] >= 1
    assert s2["global_batch"] > s1["global_batch"] and s2["world_size"] == 2
    assert diabetes_report["registry"]["model_name"] == "diabetes_mlp" and diabetes_report["registry"]["promoted"]
    models = Path(diabetes_report["run_prefix"]).parents[2] / "models" / "diabetes_mlp"
    card = json.loads((models / diabetes_report["registry"]["version"] / "card.json").read_text())
    version = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert card["code_version"] == f"stagewise {version}", "installed, the card names the package version, not a commit"
    bundle = torch.load(diabetes_report["model_uri"], weights_only=True)
    assert bundle["spec"]["path"] == "diabetes:DiabetesMLP" and bundle["data"]["num_classes"] is None
    predictions = json.loads(Path(diabetes_report["predictions"]["uri"]).read_text())
    table = pq.read_table(predictions["files"][0]["uri"])
    assert diabetes_report["predictions"]["rows"] == 442
    assert str(table.schema.field("prediction").type) == "float"
    assert 25 <= table.column("prediction").to_numpy().mean() <= 346, "predictions are in the target's units"
