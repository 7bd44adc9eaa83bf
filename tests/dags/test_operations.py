"""The operations around a run keep its promises, in a real Airflow: a cleared run reuses only what its inputs allow
(the intervals and the cache across runs: tests/dags/test_backfill_intervals.py)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import yaml

from tests.dags.conftest import REPO_ROOT, _with_path, make_airflow_env

# Three whole runs: on a loaded CI machine they can take longer than the suite's default 900 s.
pytestmark = [pytest.mark.airflow, pytest.mark.torchrun, pytest.mark.timeout(2400)]

WHEN = "2026-01-05T00:00:00+00:00"


def small_config(one_stage: bool = False, **extra) -> dict:
    """pipeline.yaml on a small budget: one trial of two epochs, two stages (or only s1) of one epoch each on one
    process (what these runs guard is what an operation reuses, not DDP: test_ml_pipeline runs s2 on two), one
    inference shard."""
    raw = yaml.safe_load((REPO_ROOT / "pipeline.yaml").read_text())
    raw["sweep"].update({"num_trials": 1, "num_workers": 1, "epochs": 2})
    raw["train"]["stages"] = raw["train"]["stages"][:1] if one_stage else raw["train"]["stages"]
    for stage in raw["train"]["stages"]:
        stage.update({"epochs": 1, "profile": "ddp1"})
    return {"sweep": raw["sweep"], "train": raw["train"], "inference": {**raw["inference"], "rows_per_shard": 100_000},
            **extra}


def fresh_env(tmp_path: Path, one_stage: bool = False, **config) -> tuple[dict, Path]:
    """An Airflow home and storage root of this test's own, with the demo data and small_config(**config)."""
    storage, home = tmp_path / "storage", tmp_path / "home"
    home.mkdir()
    return make_airflow_env(home, str(storage), storage, config=small_config(one_stage, **config)), storage


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


@pytest.mark.slow
def test_a_cleared_run_reuses_only_what_its_inputs_allow(tmp_path):
    """Cleared with the same data, the run keeps its committed work (preprocess, trials, stages resume at their end)
    and registers the same model with a card whose data fingerprint is the manifest's; cleared after new data landed,
    the sweep and both stages run again and a different model is registered, its card naming the new data. (What a
    succeeded run drops, checkpoints and the split copy, is kept here: this is about reuse within a run by its inputs,
    which a clear of a failed run, or with retention.drop_after_success off, relies on; tests/tasks/reuse covers the
    drop and that a clear afterwards preprocesses and trains again.)"""
    env, storage = fresh_env(tmp_path, retention={"drop_after_success": False})
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
