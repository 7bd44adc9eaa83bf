"""Shared fixtures: a scratch storage root and a small valid pipeline config written to disk."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parent.parent
for path in (REPO_ROOT, REPO_ROOT / "plugins"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))


def base_config(storage_root: Path) -> dict:
    """A small, fast, valid config as a plain dict; tests mutate it to make bad cases."""
    with open(REPO_ROOT / "pipeline.yaml") as handle:
        raw = yaml.safe_load(handle)
    raw["storage_root"] = str(storage_root)
    raw["sweep"]["storage"] = f"journal://{storage_root}/optuna.journal"
    raw["sweep"].update({"num_trials": 4, "num_workers": 2, "epochs": 3})
    for stage in raw["train"]["stages"]:
        stage["epochs"] = 2
    return raw


@pytest.fixture
def storage_root(tmp_path: Path) -> Path:
    root = tmp_path / "storage"
    root.mkdir()
    return root


@pytest.fixture
def write_config(tmp_path: Path, storage_root: Path):
    """Write a config dict (default: base_config) to a YAML file and return its path."""

    def write(raw: dict | None = None, name: str = "pipeline.yaml") -> Path:
        path = tmp_path / name
        path.write_text(yaml.safe_dump(raw if raw is not None else base_config(storage_root)))
        return path

    return write


@pytest.fixture
def subprocess_env() -> dict:
    """Environment for sub-job processes: the repo importable, one thread each."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    return env
