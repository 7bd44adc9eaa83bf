"""`python -m stagewise.report latest` after a test run (docs/ci.md): the run a test run (`airflow dags test`) made in
this Airflow home's scratch root is what the command reports when it is the newest, never production's run in its
place; when production's is newer the command asks which one is meant. (Recipe end to end: tests/dags/test_ci_recipe.py.)"""

from __future__ import annotations

import datetime as dt
import os
from pathlib import Path

import pytest

from stagewise import report
from stagewise.core import storage
from stagewise.definitions.loading import SCRATCH_ENV_VAR, TEST_RUNS_WRITE_ENV_VAR
from tests.tasks.test_report import _inputs

OLD, NEW = 1_700_000_000, 1_700_000_600  # when the runs ended


def _run(root: Path, run_id: str, stamp: float, accuracy: float, *, recorded: bool = True) -> str:
    """A finished run of pipeline ml under ``root`` that ended at ``stamp``: recorded in its report's ``at`` and its
    mtime, or (``recorded`` off: a report from before ``at``) in its mtime only."""
    out = str(root / "runs" / "ml_pipeline" / run_id)
    inputs = {**_inputs(out), "run_id": run_id, "evaluation": {"test_accuracy": accuracy}}
    uri = report.build_report(**inputs)["report_uri"]
    written = storage.read_json(uri)
    if recorded:
        ended = dt.datetime.fromtimestamp(stamp, dt.UTC)
        written["at"] = {"started": (ended - dt.timedelta(minutes=5)).isoformat(), "ended": ended.isoformat()}
    else:
        del written["at"]
    storage.write_json(uri, written)
    os.utime(uri, (stamp, stamp))
    return uri


@pytest.fixture
def airflow_home(tmp_path, monkeypatch) -> Path:
    """A CI's fresh Airflow home, no scratch root named and no pipeline opted in: test runs go to its own scratch."""
    home = tmp_path / "airflow"
    monkeypatch.setenv("AIRFLOW_HOME", str(home))
    monkeypatch.delenv(SCRATCH_ENV_VAR, raising=False)
    monkeypatch.delenv(TEST_RUNS_WRITE_ENV_VAR, raising=False)
    return home


def _latest(config: Path, *extra: str) -> list[str]:
    return [*extra, "latest", "--config", str(config)]


def test_latest_after_a_test_run_reports_the_test_run_not_productions(write_config, storage_root, airflow_home, capsys):
    """Production has an older run (its report rewritten since, as retention does: a newer mtime); the test run in
    $AIRFLOW_HOME/stagewise-scratch/ml ended later: `latest` prints the test run's summary, says first where it is
    from, and ends REPORT <its report.json>; --production prints production's."""
    config = write_config()
    production = _run(storage_root, "scheduled_prod", OLD, 0.97)
    os.utime(production, (NEW + 86_400, NEW + 86_400))
    tested = _run(airflow_home / "stagewise-scratch" / "ml", "manual_ci", NEW, 0.61)

    report.main(_latest(config))
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"a test run (airflow dags test) of this Airflow home, in scratch under "
                               f"{airflow_home / 'stagewise-scratch'}, not in production's storage_root {storage_root}")
    assert lines[1] == "run ml_pipeline / manual_ci" and "  test accuracy: 0.6100" in lines
    assert lines[-1] == f"REPORT {tested}"

    report.main([*_latest(config), "--production"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "run ml_pipeline / scheduled_prod" and lines[-1] == f"REPORT {production}"


def test_a_pipeline_opted_in_or_the_ci_variable_reports_where_its_test_runs_wrote(write_config, storage_root, airflow_home,
                                                                                monkeypatch, capsys, tmp_path):
    """Opted in by name, a pipeline's test runs wrote production: `latest` reads production alone; under
    $STAGEWISE_SCRATCH_ROOT it reads that scratch root alone, and --production is refused as contradicting it."""
    config = write_config()
    production = _run(storage_root, "scheduled_prod", OLD, 0.97)
    _run(airflow_home / "stagewise-scratch" / "ml", "manual_ci", NEW, 0.61)
    monkeypatch.setenv(TEST_RUNS_WRITE_ENV_VAR, "ml")
    report.main(_latest(config))
    assert capsys.readouterr().out.splitlines()[-1] == f"REPORT {production}"

    monkeypatch.delenv(TEST_RUNS_WRITE_ENV_VAR)
    monkeypatch.setenv(SCRATCH_ENV_VAR, str(tmp_path / "ci"))
    ci = _run(tmp_path / "ci" / "ml", "manual_ci_scratch", OLD, 0.5)
    report.main(_latest(config))
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "run ml_pipeline / manual_ci_scratch" and lines[-1] == f"REPORT {ci}"
    with pytest.raises(SystemExit, match=f"--production and \\${SCRATCH_ENV_VAR} disagree"):
        report.main([*_latest(config), "--production"])


def test_latest_refuses_when_production_has_a_newer_run_than_the_test_run(write_config, storage_root, airflow_home, capsys):
    """A test run older than production's newest: which one a caller means cannot be told, so `latest` exits non-zero
    naming both runs, both places and the two ways to choose; nothing is printed as a report."""
    config = write_config()
    _run(storage_root, "scheduled_prod", NEW, 0.97)
    _run(airflow_home / "stagewise-scratch" / "ml", "manual_ci", OLD, 0.61, recorded=False)
    with pytest.raises(SystemExit) as refused:
        report.main(_latest(config))
    said = str(refused.value)
    scratch = airflow_home / "stagewise-scratch"
    assert said.startswith(f"which run to report? pipeline ml's newest test run (airflow dags test) is in scratch "
                           f"under {scratch} (manual_ci, ")
    assert f"production's storage_root {storage_root} has a newer one (scheduled_prod, " in said
    assert f"give --production for production's, or {SCRATCH_ENV_VAR}={scratch} for the test run's" in said
    assert "REPORT" not in capsys.readouterr().out


def test_without_test_runs_latest_reads_production_and_names_an_empty_root(write_config, storage_root, airflow_home, capsys):
    """No test run in this Airflow home: production's newest, as before; no run anywhere: exit naming the folder."""
    config = write_config()
    with pytest.raises(SystemExit, match=f"no report.json under {storage.join(str(storage_root), 'runs', 'ml_pipeline')}"):
        report.main(_latest(config))
    production = _run(storage_root, "scheduled_prod", OLD, 0.97)
    report.main(_latest(config))
    assert capsys.readouterr().out.splitlines()[-1] == f"REPORT {production}"
