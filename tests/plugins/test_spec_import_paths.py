"""A user's spec module beside the pipeline config is importable in the task process and in every sub-job."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from stagewise.airflow import launch
from stagewise.definitions.config import ConfigError, Profile
from stagewise.definitions.loading import load_config
from stagewise.definitions.spec import SpecRef
from tests.conftest import base_config

# A spec of the team's own, in a module that exists only in the pipelines folder (not on the repo's path).
USER_SPEC = "from stagewise.models.mlp import MLPClassifier\n\n\nclass TeamNet(MLPClassifier):\n    pass\n"


def _pipelines_folder(tmp_path: Path, storage_root: Path, module: str, **model) -> Path:
    folder = tmp_path / "pipelines"
    folder.mkdir(exist_ok=True)
    (folder / f"{module}.py").write_text(USER_SPEC)
    raw = base_config(storage_root)
    raw["model"] = {"spec": f"{module}:TeamNet", **model}
    path = folder / "team.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.mark.subprocess
def test_a_spec_beside_its_config_loads_in_this_process_and_in_a_sweep_sub_job(tmp_path, storage_root, digits_run):
    """The config's folder is model.import_paths by default: the task process imports the spec, and a sweep worker
    launched as the Airflow task launches it trains its trial with it (before: 'cannot import module')."""
    from stagewise.study.studies import create

    path = _pipelines_folder(tmp_path, storage_root, "team_spec_one")
    config = load_config(path, {"sweep.num_trials": 1, "sweep.epochs": 1})
    assert config.model.import_paths == [str(path.parent)]
    assert type(SpecRef(config.model.spec).load()).__name__ == "TeamNet"
    _, out = digits_run
    create(config, "team")
    snapshot = tmp_path / "snapshot.yaml"  # what start_run hands the sub-job: the resolved config, elsewhere
    from stagewise.definitions.loading import snapshot as resolve

    snapshot.write_text(resolve(config)[0])
    result = launch.run("stagewise.sweep", ["worker", "--study", "team", "--worker", "0", "--out", out,
                                        "--config", str(snapshot)], Profile(), import_paths=config.model.import_paths)
    assert result["trials_run"] == 1, json.dumps(result)


def test_a_spec_found_nowhere_is_refused_when_the_config_loads(tmp_path, storage_root):
    """A module neither in model.import_paths nor installed fails config load naming model.spec and the folders."""
    path = _pipelines_folder(tmp_path, storage_root, "team_spec_two", import_paths=["lib"])
    with pytest.raises(ConfigError, match=r"model.spec 'team_spec_two:TeamNet': no module 'team_spec_two' in "
                                          r"model.import_paths \[.*/pipelines/lib'\]"):
        load_config(path)


def test_the_launcher_puts_the_import_paths_on_the_sub_jobs_path():
    """Sub-jobs (and a user's script, which may import its spec before loading the config) see the folders."""
    env = launch.child_env(Profile(), "/tmp/error", ["/teams/pipelines"])
    assert env["PYTHONPATH"].split(os.pathsep) == ["/teams/pipelines", *os.environ["PYTHONPATH"].split(os.pathsep)]
