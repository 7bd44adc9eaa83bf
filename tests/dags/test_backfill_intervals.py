"""Runs that read their interval, in a real Airflow: each interval of a backfill trains its own data, and an interval
whose data and config are unchanged is served from the cache (docs/pipelines.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import yaml

from tests.dags.conftest import airflow
from tests.dags.test_operations import card_of, fresh_env, runs

# Three whole runs: on a loaded CI machine they take longer than the suite's default 900 s.
pytestmark = [pytest.mark.airflow, pytest.mark.torchrun, pytest.mark.timeout(2400)]

REUSED = {"preprocess", "sweep", "train_s1", "evaluate", "inference"}
DAYS = ("20260101", "20260102")  # two intervals, each its own rows (partition: another remainder left out)


def partition(raw: Path, day: str, keep_remainder: int) -> None:
    """One interval's data: the rows whose key leaves ``keep_remainder`` modulo 3 are left out."""
    folder = raw.parent / "parts" / day
    folder.mkdir(parents=True)
    for shard in sorted(raw.glob("*.parquet")):
        table = pq.read_table(shard)
        keep = pc.not_equal(pc.bit_wise_and(table.column("row_id"), 3), keep_remainder)
        pq.write_table(table.filter(keep), folder / shard.name)


def new_report(env: dict, run) -> tuple[dict, object]:
    """The report of the one run folder ``run()`` adds, and what ``run()`` returned: the run's own, whatever the
    file times of the reports before it."""
    before = set(runs(env))
    done = run()
    [added] = set(runs(env)) - before
    return json.loads(added.read_text()), done


@pytest.mark.slow
def test_each_interval_trains_its_own_data_and_an_unchanged_one_is_served_from_the_cache(tmp_path):
    """dataset.uri names the logical date: two intervals train two data sets (two fingerprints, two models; the second
    reuses nothing of the first although the cache is on); the first interval run again with cache: true reuses every
    step of its earlier run (its predictions too, when the model current then is current now) and names it in the
    report, report.html and the log. (Stagewise's own source is in every fingerprint: editing it while this test runs
    fails the last step, rightly.)"""
    env, storage = fresh_env(tmp_path, cache=True, one_stage=True)
    for remainder, day in enumerate(DAYS):
        partition(storage / "raw" / "digits", day, remainder)
    config_path = Path(env["STAGEWISE_CONFIG"])
    raw = yaml.safe_load(config_path.read_text())
    raw["dataset"]["uri"] = "raw/parts/{logical_date:%Y%m%d}"
    config_path.write_text(yaml.safe_dump(raw))

    reports = []
    for day in DAYS:
        reports.append(new_report(env, lambda day=day: airflow(env, "dags", "test", "ml_pipeline",
                                                               f"{day[:4]}-{day[4:6]}-{day[6:]}T00:00:00+00:00"))[0])
    fingerprints = {report["data"]["fingerprint"] for report in reports}
    assert len(fingerprints) == 2 and len({report["registry"]["version"] for report in reports}) == 2
    for report, day in zip(reports, DAYS, strict=True):
        assert report["data_interval"]["logical_date"].startswith(f"{day[:4]}-{day[4:6]}-{day[6:]}")
        assert report["reused"] == {}
        assert card_of(report, env)["data_interval"] == report["data_interval"]

    cached, again = new_report(env, lambda: airflow(env, "dags", "test", "ml_pipeline", "2026-01-01T00:00:00+00:00"))
    source = f"ml_pipeline/{reports[0]['run_id']}"
    # Its predictions are reused only where they would be the same: scored by the model current then and now.
    same_model = cached["predictions"]["model_version"] == reports[0]["predictions"]["model_version"]
    assert cached["reused"] == dict.fromkeys(REUSED if same_model else REUSED - {"inference"}, source)
    assert cached["registry"]["version"] == reports[0]["registry"]["version"]
    assert cached["data"]["fingerprint"] == reports[0]["data"]["fingerprint"]
    assert f"reused from {source}" in again.stdout + again.stderr
    html = Path(cached["html_uri"]).read_text()
    assert f"train_s1 reused from {source}" in html
