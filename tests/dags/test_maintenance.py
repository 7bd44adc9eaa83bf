"""The <name>_maintenance DAG under `airflow dags test`: its one task applies the pipeline's retention policy to a
storage root of finished, failed and running runs and registered models (tests/retention_root.py)."""

from __future__ import annotations

import datetime as dt

import pytest

from tests import retention_root
from tests.dags.conftest import airflow, make_airflow_env

pytestmark = pytest.mark.airflow

RUNS = f"runs/{retention_root.PIPELINE_DAG}"


@pytest.mark.slow
def test_maintenance_dag_is_a_dry_run_in_a_test_then_applies_the_policy_once_opted_in(tmp_path):
    """A test run of a pipeline whose test runs may not write production lists what would go and removes nothing;
    opted in ($STAGEWISE_TEST_RUNS_WRITE), the same DAG removes what the policy names: the old run whole, the
    unfinished run Airflow says is not running loses all but its record, the version nothing protects goes; the
    current model, its rollback target, the pinned version, a run active within the hour and raw/ stay."""
    storage, home = tmp_path / "storage", tmp_path / "home"
    home.mkdir()
    env = make_airflow_env(home, str(storage), storage,
                           config={"retention": {"pinned_versions": [retention_root.version(3)]}})
    versions = retention_root.build(storage, dt.datetime.now(dt.UTC))
    before = retention_root.snapshot(storage)

    dry = airflow({**env, "STAGEWISE_TEST_RUNS_WRITE": ""}, "dags", "test", "ml_maintenance")
    assert "would remove run of ml_pipeline/ancient" in dry.stdout + dry.stderr
    assert retention_root.snapshot(storage) == before

    airflow(env, "dags", "test", "ml_maintenance")
    after = retention_root.snapshot(storage)
    assert not any(path.startswith(f"{RUNS}/ancient/") for path in after)
    assert {p.split("/", 3)[3] for p in after if p.startswith(f"{RUNS}/running_quiet/")} == {"config.yaml", "lineage.json"}
    busy = {p: v for p, v in before.items() if p.startswith(f"{RUNS}/running_busy/")}
    assert {p: v for p, v in after.items() if p in busy} == busy
    models = {p.split("/")[2] for p in after if p.startswith("models/digits/m-")}
    assert versions["unprotected"] not in models
    assert {versions["current"], versions["rollback"], versions["pinned"]} <= models
    assert {p: v for p, v in after.items() if p.startswith("raw/")} == {p: v for p, v in before.items() if p.startswith("raw/")}
