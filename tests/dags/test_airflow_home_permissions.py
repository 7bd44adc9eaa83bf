"""The Airflow home's secrets stay private: the SQLite DB and the generated admin password file are 0600.

Run: ``pytest tests/dags/test_airflow_home_permissions.py`` (runs ``airflow db migrate`` in a scratch home).

Invariant: ``scripts/airflow_env.sh``, which every make target sources, creates both files private before
Airflow writes them (Airflow keeps an existing file's mode) and makes existing world-readable ones private.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
PASSWORD_FILE = "simple_auth_manager_passwords.json.generated"
# What `make up`'s api-server does at start: the simple auth manager writes the admin's password.
_WRITE_PASSWORDS = ("from airflow.api_fastapi.auth.managers.simple.simple_auth_manager import SimpleAuthManager; "
                    "SimpleAuthManager().init()")


def _run_with_airflow_env(home: Path, command: str) -> None:
    """``command`` in bash after sourcing scripts/airflow_env.sh, for a scratch AIRFLOW_HOME only."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}  # no outside home or DB
    env["AIRFLOW_HOME"] = str(home)
    result = subprocess.run(["bash", "-c", f". scripts/airflow_env.sh && {command}"], cwd=REPO_ROOT, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{command}: {result.stdout[-3000:]}\n{result.stderr[-3000:]}"


def _mode(path: Path) -> str:
    return oct(stat.S_IMODE(path.stat().st_mode))


@pytest.mark.airflow
def test_migrate_and_first_start_leave_db_and_password_private(tmp_path):
    """`airflow db migrate` (make airflow-init) and the auth manager's first start (make up) write 0600 files."""
    home = tmp_path / "airflow_home"
    _run_with_airflow_env(home, f"airflow db migrate > /dev/null && python -c '{_WRITE_PASSWORDS}'")
    assert (home / "airflow.db").stat().st_size > 0, "the migration wrote the DB"
    assert "admin" in json.loads((home / PASSWORD_FILE).read_text()), "the admin's password was written"
    assert _mode(home / "airflow.db") == "0o600"
    assert _mode(home / PASSWORD_FILE) == "0o600"


def test_existing_world_readable_secrets_are_made_private(tmp_path):
    """A home made before this fix (files 0644) is made private the next time the environment is sourced."""
    home = tmp_path / "airflow_home"
    home.mkdir()
    for name in ("airflow.db", PASSWORD_FILE):
        (home / name).write_text("")
        (home / name).chmod(0o644)
    _run_with_airflow_env(home, "true")
    assert {name: _mode(home / name) for name in ("airflow.db", PASSWORD_FILE)} == \
        {"airflow.db": "0o600", PASSWORD_FILE: "0o600"}
