"""The runs page and the registry page at any size: 10,000 reports and 1,000 model versions, a page at a time.

The app under test is Airflow's api-server app with the Stagewise plugin, as in test_ui_plugin (its fixtures); the
reports are synthetic report.json files (the keys the runs page reads), dated ten minutes apart.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import shutil
from pathlib import Path

import pytest

from stagewise.core import storage
from tests.plugins import test_ui_plugin

airflow_db = test_ui_plugin.airflow_db  # the fixtures: the api-server app with the plugin, on a copy of the DB
airflow_api = test_ui_plugin.airflow_api

NUM_RUNS = 10_000
START = dt.datetime(2026, 9, 1, tzinfo=dt.UTC).timestamp()
STEP_S = 600.0


def dag_of(number: int) -> str:
    """Every tenth run belongs to a DAG no pipeline holds now; the others alternate between two of pipeline ml's."""
    return "old_pipeline" if number % 10 == 0 else "ml_pipeline" if number % 2 else "ml_retrain"


def state_of(number: int) -> str:
    return ("kept", "promoted", "no gate")[number % 3]


def run_id_of(number: int) -> str:
    return f"scheduled__{number:05d}"


def write_report(root: Path, number: int) -> Path:
    """Run ``number``'s report.json, written ``number`` x 10 minutes after START (so the highest is the newest)."""
    folder = root / "runs" / dag_of(number) / run_id_of(number)
    folder.mkdir(parents=True, exist_ok=True)
    state = state_of(number)
    registry = {} if state == "no gate" else {"model_name": "digits", "version": f"m-{number}",
                                              "promoted": state == "promoted", "current": f"m-{number}"}
    report = {"dag_id": dag_of(number), "run_id": run_id_of(number), "registry": registry,
              "objective": {"metric": "accuracy", "test": 0.5}, "sweep": {"best_value": 0.6}}
    path = folder / "report.json"
    path.write_text(json.dumps(report))
    stamp = START + number * STEP_S
    os.utime(path, (stamp, stamp))
    return path


@pytest.fixture(scope="module")
def many_runs(tmp_path_factory) -> Path:
    """A storage root holding NUM_RUNS reports (shared by this module's tests; a test that adds one removes it)."""
    root = tmp_path_factory.mktemp("many-runs") / "storage"
    for number in range(NUM_RUNS):
        write_report(root, number)
    return root


def listed_runs(text: str) -> list[str]:
    """The run ids of a runs page's rows, top to bottom."""
    return re.findall(r'<a href="[^"]*/runs/[^"]+">(scheduled__\d+)</a>', text)


def count_line(text: str) -> str:
    return re.search(r"<span class='count'>([^<]*)</span>", text).group(1)


def newest(numbers) -> list[str]:
    return [run_id_of(number) for number in sorted(numbers, reverse=True)]


def test_the_runs_page_pages_through_every_report(airflow_api, many_runs):
    """10,000 reports: the first page shows the newest 50 and says "runs 1–50 of 10,000", a middle and the last page
    show theirs (the oldest run last), previous/next link their neighbours, and a page past the end shows the last."""
    client, token = airflow_api(str(many_runs))
    bearer = {"Authorization": f"Bearer {token}"}
    first = client.get("/stagewise/", headers=bearer)
    assert first.status_code == 200, first.text
    assert count_line(first.text) == "runs 1–50 of 10,000"
    assert listed_runs(first.text) == newest(range(NUM_RUNS - 50, NUM_RUNS))
    assert 'href="/stagewise/?page=2" rel="next"' in first.text and 'rel="prev"' not in first.text
    middle = client.get("/stagewise/?page=100", headers=bearer).text
    assert count_line(middle) == "runs 4,951–5,000 of 10,000"
    assert listed_runs(middle) == newest(range(5000, 5050))
    assert 'href="/stagewise/?page=99" rel="prev"' in middle and 'href="/stagewise/?page=101" rel="next"' in middle
    last = client.get("/stagewise/?page=200", headers=bearer).text
    assert count_line(last) == "runs 9,951–10,000 of 10,000"
    assert listed_runs(last) == newest(range(50)) and 'rel="next"' not in last
    assert listed_runs(client.get("/stagewise/?page=999", headers=bearer).text) == newest(range(50))
    wide = client.get("/stagewise/?per_page=500&page=2", headers=bearer).text
    assert count_line(wide) == "runs 501–1,000 of 10,000" and len(listed_runs(wide)) == 500
    assert 'href="/stagewise/?per_page=500&amp;page=3"' in wide  # the page size stays in the links


def test_filters_by_pipeline_state_and_days_and_keep_them_in_the_links(airflow_api, many_runs):
    """pipeline=ml leaves out the DAG no pipeline holds, state keeps the runs whose report records it, from/to keep
    the runs reported on those UTC days (both included); the count says how many of all are shown and the paging
    links carry every filter; an unknown state or a day that is no date is refused (400)."""
    client, token = airflow_api(str(many_runs))
    bearer = {"Authorization": f"Bearer {token}"}
    start, end = dt.date(2026, 9, 10), dt.date(2026, 9, 20)
    wanted = [number for number in range(NUM_RUNS) if dag_of(number) != "old_pipeline" and state_of(number) == "kept"
              and start <= dt.datetime.fromtimestamp(START + number * STEP_S, dt.UTC).date() <= end]
    assert 50 < len(wanted) < NUM_RUNS
    query = f"pipeline=ml&state=kept&from={start}&to={end}"
    page = client.get(f"/stagewise/?{query}", headers=bearer).text
    assert count_line(page) == f"runs 1–50 of {len(wanted):,} filtered from 10,000"
    assert listed_runs(page) == newest(wanted)[:50]
    assert f'href="/stagewise/?{query.replace("&", "&amp;")}&amp;page=2" rel="next"' in page
    assert "<option value='ml' selected>" in page and "<option value='kept' selected>" in page
    second = client.get(f"/stagewise/?{query}&page=2", headers=bearer).text
    assert listed_runs(second) == newest(wanted)[50:100]
    only_ml = client.get("/stagewise/?pipeline=ml", headers=bearer).text
    assert count_line(only_ml) == f"runs 1–50 of {NUM_RUNS - NUM_RUNS // 10:,} filtered from 10,000"
    promoted = client.get("/stagewise/?state=promoted", headers=bearer).text
    assert count_line(promoted).endswith(f"of {len([n for n in range(NUM_RUNS) if state_of(n) == 'promoted']):,} "
                                         "filtered from 10,000")
    one_day = client.get(f"/stagewise/?from={start}&to={start}", headers=bearer).text
    assert count_line(one_day) == "runs 1–50 of 144 filtered from 10,000"  # a run every 10 minutes
    nothing = client.get("/stagewise/?from=2030-01-01", headers=bearer).text
    assert "no runs" in count_line(nothing) and "No run matches these filters" in nothing
    for bad in ("state=bogus", "from=yesterday", "pipeline=nope"):
        answer = client.get(f"/stagewise/?{bad}", headers=bearer)
        assert answer.status_code == 400, (bad, answer.text)


def test_a_report_added_or_removed_between_two_requests_is_seen(airflow_api, many_runs, monkeypatch):
    """Another process writes a run's report (a new run folder, and a report into a folder that had none) or
    removes a run folder: the next request counts and lists it, or no longer does; also where the listing trusts
    folder mtimes at once (no racy window), so a report written into a known folder is found by its own stat."""
    from stagewise.reporting import listing

    monkeypatch.setattr(listing, "RACY_S", 0.0)
    client, token = airflow_api(str(many_runs))
    bearer = {"Authorization": f"Bearer {token}"}
    assert count_line(client.get("/stagewise/", headers=bearer).text) == "runs 1–50 of 10,000"
    added, waiting = NUM_RUNS + 1, NUM_RUNS + 2
    pending = many_runs / "runs" / dag_of(waiting) / run_id_of(waiting)
    pending.mkdir(parents=True)  # a run in flight: its folder, no report yet
    try:
        write_report(many_runs, added)
        page = client.get("/stagewise/", headers=bearer).text
        assert count_line(page) == "runs 1–50 of 10,001" and listed_runs(page)[0] == run_id_of(added)
        write_report(many_runs, waiting)
        page = client.get("/stagewise/", headers=bearer).text
        assert count_line(page) == "runs 1–50 of 10,002" and listed_runs(page)[:2] == newest([added, waiting])
        shutil.rmtree(pending)
        shutil.rmtree(many_runs / "runs" / dag_of(added) / run_id_of(added))
        page = client.get("/stagewise/", headers=bearer).text
        assert count_line(page) == "runs 1–50 of 10,000" and listed_runs(page)[0] == run_id_of(NUM_RUNS - 1)
    finally:
        for number in (added, waiting):
            shutil.rmtree(many_runs / "runs" / dag_of(number) / run_id_of(number), ignore_errors=True)


def test_a_run_is_listed_and_filtered_by_when_it_ran_and_a_renamed_pipelines_runs_say_so(airflow_api, many_runs):
    """A run of 2026-09-03 whose report retention rewrote today (its mtime: now) is listed and filtered by its recorded
    start: not first, not among today's runs, but on 2026-09-03 (before: first, and today's filter listed every
    rewritten report). A run of a DAG no pipeline holds now (renamed or removed) is marked "former name"; ml's are not."""
    client, token = airflow_api(str(many_runs))
    bearer = {"Authorization": f"Bearer {token}"}
    number = NUM_RUNS + 3
    path = write_report(many_runs, number)
    report = json.loads(path.read_text())
    report["at"] = {"started": "2026-09-03T10:00:00+00:00", "ended": "2026-09-03T10:20:00+00:00"}
    path.write_text(json.dumps(report))  # its mtime now, as after retention's note
    try:
        first = client.get("/stagewise/", headers=bearer).text
        assert listed_runs(first)[0] == run_id_of(NUM_RUNS - 1) and run_id_of(number) not in listed_runs(first)
        today = dt.datetime.now(dt.UTC).date()
        assert run_id_of(number) not in listed_runs(client.get(f"/stagewise/?from={today}", headers=bearer).text)
        day = client.get("/stagewise/?from=2026-09-03&to=2026-09-03&per_page=500", headers=bearer).text
        assert run_id_of(number) in listed_runs(day) and "2026-09-03 10:00 UTC" in day
        assert ">started</th>" in first
        former = [row for row in first.split("<tr")[1:] if "scheduled__09990" in row]
        assert former and "former name" in former[0]
        assert not any("former name" in row for row in first.split("<tr")[1:] if "ml_pipeline" in row)
    finally:
        shutil.rmtree(path.parent)


def test_a_user_sees_and_counts_only_the_runs_of_dags_they_may_read(airflow_api, many_runs, monkeypatch):
    """Denied ml_retrain, a user's pages count and list none of its runs (the count says so), and the pipeline
    filter offers only pipelines with a DAG they may read."""
    from airflow.api_fastapi.app import get_auth_manager

    client, token = airflow_api(str(many_runs))
    monkeypatch.setattr(get_auth_manager(), "is_authorized_dag", lambda *, method, access_entity=None, details=None,
                        user: details is None or details.id != "ml_retrain")
    bearer = {"Authorization": f"Bearer {token}"}
    readable = [number for number in range(NUM_RUNS) if dag_of(number) != "ml_retrain"]
    page = client.get("/stagewise/", headers=bearer).text
    assert count_line(page) == f"runs 1–50 of {len(readable):,}"
    assert listed_runs(page) == newest(readable)[:50] and "ml_retrain" not in page
    last = client.get(f"/stagewise/?page={-(-len(readable) // 50)}", headers=bearer).text
    assert listed_runs(last) == newest(readable)[-(len(readable) % 50 or 50):]
    monkeypatch.setattr(get_auth_manager(), "is_authorized_dag", lambda *, method, access_entity=None, details=None,
                        user: details is None or details.id == "old_pipeline")
    page = client.get("/stagewise/", headers=bearer).text
    assert count_line(page) == f"runs 1–50 of {NUM_RUNS // 10:,}" and "<option value='ml'" not in page


def write_versions(root: Path, count: int) -> list[str]:
    """``count`` version folders of model digits with their cards (the keys the page reads), one a minute; the
    versions, newest first."""
    versions = []
    for number in range(count):
        version = f"v{number:04d}"
        folder = root / "models" / "digits" / version
        folder.mkdir(parents=True)
        registered = dt.datetime.fromtimestamp(START + number * 60, dt.UTC).isoformat()
        (folder / "card.json").write_text(json.dumps({
            "version": version, "registered_at": registered, "objective": "accuracy", "test_accuracy": 0.9,
            "val_accuracy": 0.89, "source_run": f"ml_pipeline/{run_id_of(number)}"}))
        versions.append(version)
    return versions[::-1]


def test_the_registry_page_pages_a_models_1000_versions(airflow_api, storage_root):
    """1,000 versions: a model's section shows 50 at a time, newest first, with those versions' cards, and says
    "versions 1–50 of 1,000"; ?model=digits&page=20 shows the oldest 50; a card added since shows at once."""
    versions = write_versions(storage_root, 1000)
    client, token = airflow_api(str(storage_root))
    bearer = {"Authorization": f"Bearer {token}"}
    first = client.get("/stagewise/registry", headers=bearer)
    assert first.status_code == 200, first.text
    assert count_line(first.text) == "versions 1–50 of 1,000"
    shown = re.findall(r"<summary>Card of <span class='mono'>(v\d+)</span>", first.text)
    assert shown == versions[:50]
    assert 'href="/stagewise/registry?model=digits&amp;page=2" rel="next"' in first.text
    last = client.get("/stagewise/registry?model=digits&page=20", headers=bearer).text
    assert count_line(last) == "versions 951–1,000 of 1,000"
    assert re.findall(r"<summary>Card of <span class='mono'>(v\d+)</span>", last) == versions[950:]
    other = client.get("/stagewise/registry?model=other&page=20", headers=bearer).text  # another model's page
    assert count_line(other) == "versions 1–50 of 1,000"
    storage.write_json(str(storage_root / "models" / "digits" / "v9999" / "card.json"), {
        "version": "v9999", "registered_at": "2030-01-01T00:00:00+00:00", "objective": "accuracy"})
    again = client.get("/stagewise/registry", headers=bearer).text
    assert count_line(again) == "versions 1–50 of 1,001" and "Card of <span class='mono'>v9999</span>" in again
