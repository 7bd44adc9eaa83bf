"""The operations around a run keep its promises, in a real Airflow: a cleared run reuses only what its inputs allow,
a second run with unchanged inputs is served from the cache, and each interval of a backfill trains its own data."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import yaml

from tests.dags.conftest import REPO_ROOT, _with_path, airflow, make_airflow_env

pytestmark = [pytest.mark.airflow, pytest.mark.torchrun]

WHEN = "2026-01-05T00:00:00+00:00"
ALL_REUSED = {"preprocess", "sweep", "train_s1", "train_s2", "evaluate", "inference"}


def small_config(**extra) -> dict:
    """pipeline.yaml on a small budget: one trial of two epochs, two stages of one epoch each."""
    raw = yaml.safe_load((REPO_ROOT / "pipeline.yaml").read_text())
    raw["sweep"].update({"num_trials": 1, "num_workers": 1, "epochs": 2})
    for stage in raw["train"]["stages"]:
        stage["epochs"] = 1
    return {"sweep": raw["sweep"], "train": raw["train"], **extra}


def fresh_env(tmp_path: Path, **config) -> tuple[dict, Path]:
    """An Airflow home and storage root of this test's own, with the demo data and small_config(**config)."""
    storage, home = tmp_path / "storage", tmp_path / "home"
    home.mkdir()
    return make_airflow_env(home, str(storage), storage, config=small_config(**config)), storage


def runs(env: dict) -> list[Path]:
    return sorted(Path(env["STAGEWISE_TEST_STORAGE"]).glob("runs/ml_pipeline/*/report.json"), key=os.path.getmtime)


def run_again(env: dict) -> tuple[dict, str]:
    """The run of WHEN again, whole, in the same run folder (tests/dags/run_again.py); its report and log."""
    command = f". scripts/airflow_env.sh && exec python -m tests.dags.run_again ml_pipeline '{WHEN}'"
    done = subprocess.run(["bash", "-c", command], cwd=REPO_ROOT, env=_with_path(env), capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-6000:]
    return json.loads(runs(env)[-1].read_text()), done.stdout + done.stderr


def card_of(report: dict, env: dict) -> dict:
    version = report["registry"]["version"]
    found = list(Path(env["STAGEWISE_TEST_STORAGE"]).glob(f"models/*/{version}/card.json"))
    return json.loads(found[0].read_text())


def manifest_of(report: dict) -> dict:
    return json.loads(Path(report["data"]["manifest_uri"]).read_text())


def add_rows(raw: Path, offset: int) -> None:
    """New data lands: a copy of the first shard's rows under new keys, as a new file."""
    first = sorted(raw.glob("*.parquet"))[0]
    table = pq.read_table(first)
    keys = pc.add(table.column("row_id"), offset)
    pq.write_table(table.set_column(table.schema.get_field_index("row_id"), "row_id", keys), raw / "part-09999.parquet")


def test_a_cleared_run_reuses_only_what_its_inputs_allow(tmp_path):
    """Cleared with the same data, the run keeps its committed work (preprocess, trials, stages resume at their end)
    and registers the same model with a card whose data fingerprint is the manifest's; cleared after new data landed,
    the sweep and both stages run again and a different model is registered, its card naming the new data."""
    env, storage = fresh_env(tmp_path)
    first, _ = run_again(env)
    first_card, first_manifest = card_of(first, env), manifest_of(first)
    assert first_card["data_fingerprint"] == first_manifest["fingerprint"] == first["data"]["fingerprint"]

    same, log = run_again(env)
    assert len(runs(env)) == 1  # one run folder: the same run, every task again
    assert "preprocess: inputs unchanged" in log
    assert "1 of its 1 trial(s) already finished" in log
    assert "resumes from" in log and "(made from the same inputs)" in log
    assert manifest_of(same)["fingerprint"] == first_manifest["fingerprint"]
    assert same["registry"]["version"] == first["registry"]["version"]
    assert card_of(same, env)["data_fingerprint"] == manifest_of(same)["fingerprint"]

    add_rows(storage / "raw" / "digits", offset=100_000)
    changed, log = run_again(env)
    assert "no longer stands" in log and "preprocessing" in log
    assert "0 of its 1 trial(s) already finished" in log
    assert changed["sweep"]["study_name"] != first["sweep"]["study_name"]
    assert [stage["fingerprint"] for stage in changed["training"]] != [stage["fingerprint"] for stage in first["training"]]
    assert changed["data"]["rows"]["train"] > first["data"]["rows"]["train"]
    assert changed["registry"]["version"] != first["registry"]["version"]
    card = card_of(changed, env)
    assert card["data_fingerprint"] == manifest_of(changed)["fingerprint"] != first_manifest["fingerprint"]


def partition(raw: Path, day: str, keep_remainder: int) -> None:
    """One interval's data: the rows whose key leaves ``keep_remainder`` modulo 3 are left out."""
    folder = raw.parent / "parts" / day
    folder.mkdir(parents=True)
    for shard in sorted(raw.glob("*.parquet")):
        table = pq.read_table(shard)
        keep = pc.not_equal(pc.bit_wise_and(table.column("row_id"), 3), keep_remainder)
        pq.write_table(table.filter(keep), folder / shard.name)


def test_each_interval_trains_its_own_data_and_an_unchanged_one_is_served_from_the_cache(tmp_path):
    """dataset.uri names the logical date: three intervals train three data sets (three fingerprints, three models);
    the first interval run again with cache: true reuses every step of its earlier run (its predictions too, when the
    model current then is current now) and names it in the report, report.html and the log."""
    env, storage = fresh_env(tmp_path, cache=True)
    for remainder, day in enumerate(("20260101", "20260102", "20260103")):
        partition(storage / "raw" / "digits", day, remainder)
    config_path = Path(env["STAGEWISE_CONFIG"])
    raw = yaml.safe_load(config_path.read_text())
    raw["dataset"]["uri"] = "raw/parts/{logical_date:%Y%m%d}"
    config_path.write_text(yaml.safe_dump(raw))

    reports = []
    for day in ("2026-01-01", "2026-01-02", "2026-01-03"):
        airflow(env, "dags", "test", "ml_pipeline", f"{day}T00:00:00+00:00")
        reports.append(json.loads(runs(env)[-1].read_text()))
    fingerprints = {report["data"]["fingerprint"] for report in reports}
    assert len(fingerprints) == 3 and len({report["registry"]["version"] for report in reports}) == 3
    for report, day in zip(reports, ("20260101", "20260102", "20260103"), strict=True):
        assert report["data_interval"]["logical_date"].startswith(f"{day[:4]}-{day[4:6]}-{day[6:]}")
        assert report["reused"] == {}
        assert card_of(report, env)["data_interval"] == report["data_interval"]

    again = airflow(env, "dags", "test", "ml_pipeline", "2026-01-01T00:00:00+00:00")
    cached = json.loads(runs(env)[-1].read_text())
    source = f"ml_pipeline/{reports[0]['run_id']}"
    # Its predictions are reused only where they would be the same: scored by the model current then and now.
    same_model = cached["predictions"]["model_version"] == reports[0]["predictions"]["model_version"]
    assert cached["reused"] == dict.fromkeys(ALL_REUSED if same_model else ALL_REUSED - {"inference"}, source)
    assert cached["registry"]["version"] == reports[0]["registry"]["version"]
    assert cached["data"]["fingerprint"] == reports[0]["data"]["fingerprint"]
    assert f"reused from {source}" in again.stdout + again.stderr
    html = Path(cached["html_uri"]).read_text()
    assert f"train_s1 reused from {source}" in html
