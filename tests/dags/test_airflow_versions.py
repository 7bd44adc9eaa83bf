"""Stagewise in a team's Airflow of each supported minor (3.2 and 3.3): the README's install adds Stagewise and changes
no package the deployment has, Airflow least of all; on the older minor a pipeline runs under `airflow dags test`, the
Stagewise pages serve its run, and on a live stack of that deployment a gated run waits for a person in Airflow 3.2's
deferred HITL task (tests/dags/test_adoption.py runs the examples on the newer one, installed the same way;
tests/dags/test_human_approval.py the approval on 3.3).

The deployments are this environment's packages as links (tests/airflow_versions.py): the 3.3 one is this environment
as it is; the 3.2 one is Airflow 3.2.2 with its dependencies as of its release in front of it, made once per machine
and kept, so a run of the suite pays only the install and the pipeline.
"""

from __future__ import annotations

import json
import os
import subprocess
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests import airflow_versions, run_cache
from tests.conftest import base_config
from tests.dags.conftest import REPO_ROOT

pytestmark = [pytest.mark.airflow, pytest.mark.torchrun]

(OLDER,) = airflow_versions.OLDER_AIRFLOW  # 3.2.2; the newer minor is this environment's (requirements.txt)
VERSION = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["version"]
DIGITS_ROWS = 1797


@dataclass
class Deployment:
    """A team's Airflow venv after the README's install: what pip listed before and after, and the venv's own folder."""

    python: Path
    before: dict[str, str]
    after: dict[str, str]
    site_packages: Path

    def env(self, home: Path) -> dict[str, str]:
        """The team's environment with ``home`` as AIRFLOW_HOME: none of the checkout's paths or settings."""
        env = {key: value for key, value in os.environ.items()
               if not key.startswith(("AIRFLOW", "STAGEWISE")) and key not in ("PYTHONPATH", "VIRTUAL_ENV")}
        env.update({"AIRFLOW_HOME": str(home), "AIRFLOW__CORE__DAGS_FOLDER": str(home / "dags"),
                    "AIRFLOW__CORE__PLUGINS_FOLDER": str(home / "plugins"), "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
                    "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
                    "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home}/airflow.db", "OMP_NUM_THREADS": "1"})
        return env

    def run(self, home: Path, *args: str, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
        """``python <args>`` in the team's venv from its Airflow home; fails with its output."""
        done = subprocess.run([str(self.python), *args], env={**self.env(home), **(env or {})}, cwd=home,
                              capture_output=True, text=True, timeout=timeout)
        assert done.returncode == 0, f"{args} failed ({done.returncode}):\n{done.stdout[-6000:]}\n{done.stderr[-6000:]}"
        return done


def _install(root: Path, layers, wheel: Path) -> Deployment:
    """A fresh venv over ``layers`` (the team's packages), and the README's install of ``wheel`` into it."""
    python = airflow_versions.make_venv(root / "venv", layers)
    before = airflow_versions.installed(python)
    airflow_versions.install_as_readme_says(python, wheel, root)
    return Deployment(python, before, airflow_versions.installed(python), airflow_versions.site_packages(python))


def _assert_only_stagewise_was_added(deployment: Deployment) -> None:
    """pip added stagewise at this version and nothing else; every package the deployment had kept its version, and
    nothing but stagewise went into the venv itself (no copy shadowing one of the team's)."""
    assert deployment.after == {**deployment.before, "stagewise": VERSION}, {
        name: (deployment.before.get(name), deployment.after.get(name))
        for name in deployment.before.keys() | deployment.after.keys()
        if deployment.before.get(name) != deployment.after.get(name)}
    own = sorted(p.name for p in deployment.site_packages.iterdir() if not p.name.startswith(("_", "team_")))
    assert [name for name in own if not name.startswith("stagewise")] == [], own


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    return airflow_versions.build_wheel(tmp_path_factory.mktemp("wheel"))


def test_the_readme_install_into_airflow_3_3_adds_stagewise_and_changes_nothing(wheel, tmp_path):
    """Into this environment's Airflow (3.3, every package requirements.txt pins): only stagewise is new, every
    other package keeps its version (requirements.txt as constraints moved ten of a team's)."""
    image = airflow_versions.make_image(tmp_path / "image")
    deployment = _install(tmp_path, [image], wheel)
    assert deployment.before["apache-airflow"].startswith("3.3.")
    _assert_only_stagewise_was_added(deployment)


@pytest.fixture(scope="module")
def layer_3_2() -> airflow_versions.Layer:
    return airflow_versions.airflow_layer(OLDER)


@pytest.fixture(scope="module")
def airflow_3_2(tmp_path_factory, wheel, layer_3_2) -> Deployment:
    """Airflow 3.2.2 as a team has it, with Stagewise installed the README's way."""
    return _install(tmp_path_factory.mktemp("airflow-3.2"), layer_3_2.paths, wheel)


def test_the_readme_install_into_airflow_3_2_keeps_its_airflow_and_every_package(airflow_3_2):
    """Into Airflow 3.2.2 the same command adds stagewise alone: Airflow stays 3.2.2 (no upgrade, no DB migration)."""
    assert (airflow_3_2.before["apache-airflow"], airflow_3_2.before["apache-airflow-core"]) == (OLDER, OLDER)
    _assert_only_stagewise_was_added(airflow_3_2)


# The smallest pipeline that still runs every kind of task: one raw shard, a one-trial sweep of one epoch on one
# worker, one one-process stage of one epoch, one inference shard.
def _smallest_pipeline(folder: Path, storage_root: Path, name: str = "team", **changes: dict) -> Path:
    raw = base_config(storage_root)
    raw["name"] = name
    raw["sweep"].update({"num_trials": 1, "num_workers": 1, "epochs": 1})
    raw["train"]["stages"] = [{**raw["train"]["stages"][0], "epochs": 1}]
    raw["inference"]["rows_per_shard"] = DIGITS_ROWS
    for section, values in changes.items():
        raw[section] = {**raw.get(section, {}), **values}
    folder.mkdir()
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _readme_dag_files(dags: Path, pipelines: Path) -> None:
    """The two DAG files the README gives a team, over the folder of pipeline configs ``pipelines``."""
    dags.mkdir(parents=True)
    (dags / "stagewise_pipelines.py").write_text(
        f"from stagewise.airflow.dags import build_pipelines\nbuild_pipelines(globals(), {str(pipelines)!r})\n")
    (dags / "stagewise_pipelines_check.py").write_text(
        f"from stagewise.airflow.dags import check_pipelines\ncheck_pipelines({str(pipelines)!r})\n")


@dataclass
class Run:
    home: Path
    report: dict
    log: str


@pytest.fixture(scope="module")
def run_on_3_2(airflow_3_2, layer_3_2, tmp_path_factory) -> Run:
    """The team's Airflow 3.2 home (its own migrated DB), the two DAG files the README gives, the pools, the demo data,
    and one `airflow dags test team_pipeline`."""
    root = tmp_path_factory.mktemp("team-3.2")
    home, storage_root = root / "airflow", root / "storage"
    config = _smallest_pipeline(root / "pipelines", storage_root)
    _readme_dag_files(home / "dags", config.parent)
    (home / "plugins").mkdir()
    (home / "airflow.db").write_bytes(layer_3_2.airflow_db.read_bytes())
    airflow_3_2.run(home, "-m", "stagewise.airflow.pools", "--config", str(config))
    run_cache.demo_data(config, num_shards=1)
    done = airflow_3_2.run(home, "-m", "airflow", "dags", "test", "team_pipeline",
                           env={"STAGEWISE_TEST_RUNS_WRITE": "team"})  # the run writes the storage root
    (found,) = storage_root.glob("runs/team_pipeline/*/report.json")
    return Run(home, json.loads(found.read_text()), done.stdout + done.stderr)


def test_a_pipeline_runs_end_to_end_on_airflow_3_2(run_on_3_2):
    """Every kind of task ran under Airflow 3.2's task SDK: the sweep, a torchrun stage, the gate, inference, the
    report; and the plugin logged no warning about the Airflow it found (3.2 is supported)."""
    report = run_on_3_2.report
    assert report["dag_id"] == "team_pipeline"
    assert report["sweep"]["n_trials"] == 1 and report["sweep"]["n_complete"] == 1
    (stage,) = report["training"]
    assert stage["stage"] == "s1" and stage["world_size"] == 1
    assert report["registry"]["promoted"] and report["predictions"]["rows"] == DIGITS_ROWS
    assert "Stagewise supports Airflow" not in run_on_3_2.log


# The api-server's app as Airflow 3.2 builds it (the plugin mounted from its entry point), every user an admin.
PAGES_PROBE = """
import json, sys
from fastapi.testclient import TestClient
from airflow.api_fastapi.app import create_app

client = TestClient(create_app("core"))
print(json.dumps({path: [answer.status_code, answer.text] for path in sys.argv[1:] for answer in [client.get(path)]}))
"""


@pytest.mark.slow
def test_the_stagewise_pages_serve_the_run_on_airflow_3_2(airflow_3_2, run_on_3_2):
    """The UI plugin's pages, read through Airflow 3.2's api-server app: the runs list names the run, its page and
    report.json and the registry answer."""
    report = run_on_3_2.report
    run_page = f"/stagewise/runs/team_pipeline/{report['run_id']}"
    paths = ["/stagewise/", run_page, f"{run_page}/report.json", "/stagewise/registry"]
    auth = {"AIRFLOW__CORE__AUTH_MANAGER": "airflow.api_fastapi.auth.managers.simple.simple_auth_manager.SimpleAuthManager",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "True",
            "AIRFLOW__API_AUTH__JWT_SECRET": "stagewise-airflow-versions-" + "0" * 48}
    done = airflow_3_2.run(run_on_3_2.home, "-c", PAGES_PROBE, *paths, env=auth)
    answers = json.loads(done.stdout.strip().splitlines()[-1])
    assert {path: status for path, (status, _) in answers.items()} == dict.fromkeys(paths, 200)
    assert report["run_id"] in answers["/stagewise/"][1] or report["run_id"].replace("+", "%2B") in answers["/stagewise/"][1]
    assert json.loads(answers[f"{run_page}/report.json"][1])["run_id"] == report["run_id"]
    assert report["registry"]["version"] in answers["/stagewise/registry"][1]


@pytest.mark.slow  # a live Airflow 3.2 stack and one gated run
def test_human_approval_on_airflow_3_2_defers_and_an_editors_approval_over_rest_moves_the_current_model(
        airflow_3_2, layer_3_2, tmp_path):
    """Airflow 3.2's HITL task defers to the triggerer (3.3 parks it in awaiting_input): on a live 3.2 stack of the
    team's deployment, a gated run waits at approve_model with its detail over the REST API, a viewer's answer is
    refused, an editor's approval resumes the task and moves the current model, recorded with who and the note."""
    from stagewise import registry
    from stagewise.models import approval
    from tests.live_airflow import LiveAirflow
    from tests.shared_stack import STACK_USERS

    storage_root, dag, task = tmp_path / "storage", "gated_team_pipeline", "approve_model"
    config = _smallest_pipeline(tmp_path / "pipelines", storage_root, "gated_team",
                                registry={"approval": "required"})
    run_cache.demo_data(config, num_shards=1)
    _readme_dag_files(tmp_path / "dags", config.parent)
    with LiveAirflow(tmp_path / "live", tmp_path / "dags", {"OMP_NUM_THREADS": "1"}, users=STACK_USERS,
                     python=airflow_3_2.python, migrated_db=layer_3_2.airflow_db, triggerer=True) as live:
        pools = subprocess.run([str(airflow_3_2.python), "-m", "stagewise.airflow.pools", "--config", str(config)],
                               env=live.env, capture_output=True, text=True, timeout=300)
        assert pools.returncode == 0, pools.stderr[-3000:]
        assert live.api("GET", "/api/v2/version").json()["version"] == OLDER
        live.wait_for_dag(dag)
        live.unpause(dag)
        run = live.trigger(dag)
        detail = live.wait_for_hitl(dag, run, task)
        assert detail["options"] == ["Approve", "Reject"] and "| test_accuracy |" in detail["body"]
        assert next(ti["state"] for ti in live.task_instances(dag, run) if ti["task_id"] == task) == "deferred"
        path = live.hitl_path(dag, run, task)
        answer = {"chosen_options": ["Approve"], "params_input": {"note": "checked on 3.2"}}
        with live.client_of("viewer") as viewer:
            assert viewer.get(path).status_code == 200 and viewer.patch(path, json=answer).status_code == 403
        assert registry.pointer(str(storage_root), "digits")["version"] is None  # nothing moved while it waits
        with live.client_of("editor") as editor:
            answered = editor.patch(path, json=answer)
            assert answered.status_code == 200, answered.text
        assert live.wait_for_run(dag, run, 600) == "success", live.logs_tail()
    (found,) = storage_root.glob(f"runs/{dag}/*/report.json")
    report = json.loads(found.read_text())["registry"]
    assert report["promoted"] and report["approval"] | {"decision": "approved", "by": "editor",
                                                        "note": "checked on 3.2"} == report["approval"]
    assert registry.pointer(str(storage_root), "digits")["version"] == report["version"]
    decisions = approval.history(registry.models_prefix(str(storage_root), "digits"), report["version"])
    assert [entry["decision"] for entry in decisions] == ["waiting", "approved"]
