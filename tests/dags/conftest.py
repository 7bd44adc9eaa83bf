"""An isolated Airflow home (SQLite, LocalExecutor) and storage root for running DAGs in tests."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml

from tests import run_cache
from tests.conftest import TEST_ROWS_PER_SHARD

REPO_ROOT = Path(__file__).resolve().parents[2]


def make_airflow_env(home: Path, storage_root: str, journal_dir: Path, extra: dict | None = None,
                     config: dict | None = None, data_env: dict | None = None,
                     base_config: Path = REPO_ROOT / "pipeline.yaml") -> dict:
    """A fresh Airflow home and DB, pools created, the demo config on ``storage_root`` and its data written
    (tests/run_cache.py: a copy of a migrated DB with the config's pools, the demo data in two shards, scored in
    two inference shards).

    ``extra`` joins every process's environment, ``config`` the top-level config keys, and
    ``data_env`` only the environment of the process that writes the demo data; ``base_config``
    is the YAML those changes apply to (an example's, say).
    """
    with open(base_config) as handle:
        raw = yaml.safe_load(handle)
    raw["inference"]["rows_per_shard"] = TEST_ROWS_PER_SHARD
    raw.update(config or {})
    raw["storage_root"] = storage_root
    raw["sweep"]["storage"] = f"journal://{journal_dir}/optuna.journal"
    config_path = home / "pipeline.yaml"
    config_path.write_text(yaml.safe_dump(raw))
    env = dict(os.environ)
    # ``storage_root`` is this test's production: its `airflow dags test` runs write there, opted in by name.
    env.update({"AIRFLOW_HOME": str(home), "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home}/airflow.db",
                "STAGEWISE_CONFIG": str(config_path), "STAGEWISE_TEST_STORAGE": storage_root,
                "STAGEWISE_TEST_RUNS_WRITE": raw.get("name") or config_path.stem, **(extra or {})})
    db_url = env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"]
    if db_url.startswith("sqlite:///"):
        run_cache.migrated_sqlite_db(db_url.removeprefix("sqlite:///"), pools_of=config_path)
    else:
        airflow(env, "db", "migrate")
        command = ". scripts/airflow_env.sh && exec python -m stagewise.airflow.pools"
        subprocess.run(["bash", "-c", command], cwd=REPO_ROOT, env=env, check=True, capture_output=True)
    run_cache.demo_data(config_path, env=_with_path({**env, **(data_env or {})}))
    return env


@pytest.fixture(scope="session")
def airflow_env(tmp_path_factory) -> dict:
    """Environment for `airflow` CLI calls: a fresh home and DB, the demo config on a scratch storage root."""
    storage_root = tmp_path_factory.mktemp("storage")
    return make_airflow_env(tmp_path_factory.mktemp("airflow_home"), str(storage_root), storage_root)


def _with_path(env: dict) -> dict:
    env = dict(env)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
    return env


def airflow(env: dict, *args: str, check: bool = True, timeout: float = 900) -> subprocess.CompletedProcess:
    """Run the airflow CLI under the repo's Airflow settings (scripts/airflow_env.sh) and ``env``."""
    command = ". scripts/airflow_env.sh && exec airflow " + " ".join(f"'{a}'" for a in args)
    result = subprocess.run(["bash", "-c", command], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"airflow {' '.join(args)} failed ({result.returncode}):\n{result.stdout[-6000:]}\n{result.stderr[-6000:]}")
    return result
