"""The supported Airflow range is one fact: pyproject.toml's requirement, stagewise.airflow.compat's check and the
minors tests/dags/test_airflow_versions.py installs into are the same; outside it every process warns in one line."""

from __future__ import annotations

import logging
import tomllib

from packaging.requirements import Requirement

from stagewise.airflow import compat
from tests.airflow_versions import OLDER_AIRFLOW, REPO_ROOT


def test_the_supported_range_is_pyprojects_and_the_tested_minors():
    """3.2 (the layer the version tests build) and 3.3 (this environment) are the range, and nothing else is."""
    dependencies = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (airflow,) = [Requirement(r) for r in dependencies if Requirement(r).name == "apache-airflow"]
    assert airflow.specifier == Requirement(f"apache-airflow{compat.SUPPORTED_AIRFLOW}").specifier
    tested = {tuple(int(part) for part in version.split(".")[:2]) for version in (*OLDER_AIRFLOW, compat.airflow_version())}
    assert tested == set(compat.SUPPORTED_MINORS)
    for version in ("3.1.8", "3.2.0", "3.2.2", "3.3.0", "3.3.2", "3.4.0", "4.0.0"):
        assert airflow.specifier.contains(version) == (compat.unsupported(version) is None), version


def test_an_untested_airflow_gets_one_line_naming_the_range_and_the_version(monkeypatch, caplog):
    """Airflow 3.4.0 (or 3.1): one warning per process, naming the supported range and the Airflow found."""
    message = compat.unsupported("3.4.0")
    assert "\n" not in message and ">=3.2,<3.4" in message and "3.4.0" in message
    assert compat.unsupported("3.3.2") is None and compat.unsupported("3.2.0") is None
    monkeypatch.setattr(compat, "airflow_version", lambda: "3.1.8")
    compat.warn_if_unsupported.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=compat.__name__):
            compat.warn_if_unsupported()
            compat.warn_if_unsupported()
    finally:
        compat.warn_if_unsupported.cache_clear()
    assert [record.getMessage() for record in caplog.records] == [compat.unsupported("3.1.8")]
