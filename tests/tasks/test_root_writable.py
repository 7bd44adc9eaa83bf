"""The config check probes a relative storage_root as runs will write it (issue 53, Low): the template's
``storage_root: storage`` beside a config in a read-only folder passed the check, and the first task failed writing
there with a raw PermissionError (retried as a fault of the machine).

Tests run as root here, and root writes through permission bits: where the suite runs as root, os.access is
replaced by the check a user without privileges meets (the mode bits), so the same chmod-ed folder is refused.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import yaml

from stagewise import config as config_cli
from stagewise.definitions import roots
from tests.conftest import base_config


@pytest.fixture
def unprivileged(monkeypatch):
    """os.access as a user who is not root sees it: write and search need the owner's mode bits."""
    if os.geteuid() != 0:
        return
    real = os.access

    def access(path, mode, **kwargs):
        if mode & (os.W_OK | os.X_OK):
            bits = os.stat(path).st_mode
            if (mode & os.W_OK and not bits & stat.S_IWUSR) or (mode & os.X_OK and not bits & stat.S_IXUSR):
                return False
        return real(path, mode, **kwargs)

    monkeypatch.setattr(roots.os, "access", access)


@pytest.fixture
def read_only_folder(tmp_path):
    folder = tmp_path / "shipped"
    folder.mkdir()
    yield folder
    folder.chmod(0o755)


def _config_in(folder: Path, storage_root: str) -> Path:
    raw = base_config(folder / "unused")
    raw["storage_root"] = storage_root
    path = folder / "pipeline.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_a_relative_root_in_a_read_only_folder_fails_the_check_naming_setting_path_and_fix(
        read_only_folder, unprivileged, monkeypatch):
    monkeypatch.delenv("STAGEWISE_SCRATCH_ROOT", raising=False)
    path = _config_in(read_only_folder, "storage")
    read_only_folder.chmod(0o555)
    with pytest.raises(SystemExit) as caught:
        config_cli.main([str(path)])
    message = str(caught.value)
    assert message.startswith(f"{path}: storage_root 'storage' is relative to the config's folder")
    assert f"under {read_only_folder.resolve() / 'storage'}" in message
    assert f"{read_only_folder.resolve()} (the nearest folder of it that exists" in message
    assert "is not writable by this user" in message and "set storage_root to an absolute folder" in message
    assert not (read_only_folder / "storage").exists(), "the probe writes nothing"


def test_the_same_config_in_a_writable_folder_passes_and_an_existing_read_only_root_is_named_itself(
        read_only_folder, unprivileged, monkeypatch, capsys):
    monkeypatch.delenv("STAGEWISE_SCRATCH_ROOT", raising=False)
    path = _config_in(read_only_folder, "storage")
    config_cli.main([str(path)])
    assert f"storage_root: {read_only_folder.resolve() / 'storage'}" in capsys.readouterr().out
    root = read_only_folder / "storage"
    root.mkdir()
    root.chmod(0o555)
    try:
        with pytest.raises(SystemExit, match=rf"but {root.resolve()} is not writable by this user \(uid \d+\)"):
            config_cli.main([str(path)])
    finally:
        root.chmod(0o755)


def test_an_absolute_root_is_left_to_the_run(read_only_folder, unprivileged, monkeypatch, capsys):
    """An absolute root may be another host's (a deployment path checked on a laptop): the check does not probe it."""
    monkeypatch.delenv("STAGEWISE_SCRATCH_ROOT", raising=False)
    path = _config_in(read_only_folder, str(read_only_folder / "storage"))
    read_only_folder.chmod(0o555)
    config_cli.main([str(path)])
    assert "storage_root:" in capsys.readouterr().out


def test_unwritable_problem_names_a_file_in_the_way_and_accepts_a_folder_to_create(tmp_path):
    (tmp_path / "a_file").write_text("x")
    assert roots.unwritable_problem(tmp_path / "a_file" / "root") == (
        f"{tmp_path / 'a_file'} (the nearest folder of it that exists; runs would create the rest) is a file, not a folder")
    assert roots.unwritable_problem(tmp_path / "new" / "deeper") is None
    assert roots.nearest_existing(tmp_path / "new" / "deeper") == tmp_path
