"""What a user sees in the Airflow 3.3 UI, driven in Debian's chromium: several pipelines' DAGs and trigger forms, a
run in the grid, a task log, the Stagewise view. On the shared stack (tests/shared_stack.py), this suite's pipeline is
`twin`.

Run: ``python -m pytest -q tests/ui`` (screenshots in tests/ui/artifacts/ or $STAGEWISE_UI_ARTIFACTS).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from stagewise.definitions.pipelines import KINDS, dag_id
from tests.ui.conftest import UI_PIPELINE

pytestmark = [pytest.mark.browser, pytest.mark.airflow, pytest.mark.torchrun, pytest.mark.service]

RUN_TIMEOUT_S = 600
# A chart-data string that, left raw in report.html's JSON block, re-opened the block and stopped every chart drawing.
HOSTILE = "<!--<script>alert(1)</script>"
CHART_TITLES = ("Training across", "Sweep:", "Task timeline", "Data: rows by split")  # the four sections' charts
# Fields without a usable default that a person must fill before triggering; everything else has one.
REQUIRED_INPUT = {"twin_ingest": {"source_uri": "raw/incoming"}}
FORMS = ["twin_pipeline", "twin_retrain", "twin_batch_inference", "twin_ingest", "ml_pipeline"]  # another pipeline's too


def _open_trigger_form(page, live, dag_id: str):
    """The DAG page's Trigger button opens the trigger dialog; returns (dialog, its Trigger button)."""
    page.goto(f"{live.base_url}/dags/{dag_id}")
    page.get_by_role("button", name="Trigger Dag").click()
    dialog = page.get_by_role("dialog")
    dialog.get_by_text("Run Parameters").wait_for()
    return dialog, dialog.get_by_role("button", name="Trigger", exact=True)


def test_the_dag_list_shows_each_pipelines_dags_with_its_tag(logged_in, ui_airflow):
    """The DAG list holds <name>_pipeline, _retrain, _batch_inference, _ingest and _maintenance of every pipeline in
    the folder; filtering on a pipeline's tag leaves only its own."""
    from playwright.sync_api import expect

    page, live, screens = logged_in
    page.goto(f"{live.base_url}/dags")
    for name in ui_airflow.roots:
        for kind in KINDS:
            expect(page.get_by_role("link", name=dag_id(name, kind), exact=True)).to_be_visible()
    screens.shot("dag-list-every-pipeline")
    page.goto(f"{live.base_url}/dags?tags=twin")
    for kind in KINDS:
        expect(page.get_by_role("link", name=dag_id("twin", kind), exact=True)).to_be_visible()
    expect(page.get_by_role("link", name="ml_pipeline", exact=True)).to_have_count(0)
    screens.shot("dag-list-tag-twin")


@pytest.mark.parametrize("dag_id", FORMS)
def test_trigger_form_can_be_submitted_with_its_defaults(logged_in, ui_airflow, dag_id):
    """Each DAG's trigger form opens with Trigger enabled once the fields without a default are filled; a training
    DAG's sweep budget is its own pipeline's (twin's 5 trials, ml's 4)."""
    from playwright.sync_api import expect

    page, live, screens = logged_in
    dialog, trigger = _open_trigger_form(page, live, dag_id)
    if dag_id.endswith("_pipeline"):
        config = yaml.safe_load(ui_airflow.configs[dag_id.removesuffix("_pipeline")].read_text())
        expect(dialog.get_by_role("spinbutton", name="num_trials")).to_have_value(str(config["sweep"]["num_trials"]))
    for name in REQUIRED_INPUT.get(dag_id, {}):
        field = dialog.locator(f"#element_{name}")
        field.wait_for()
        screens.shot(f"{dag_id}-form-before-filling-{name}")
        expect(trigger).to_be_disabled()  # the field really is required: the form must not start a run without it
    for name, value in REQUIRED_INPUT.get(dag_id, {}).items():
        dialog.locator(f"#element_{name}").fill(value)
        dialog.locator(f"#element_{name}").press("Tab")
    expect(trigger).to_be_enabled()
    trigger.scroll_into_view_if_needed()  # the screenshot shows the button itself, below the long forms
    screens.shot(f"{dag_id}-form-ready")


@pytest.mark.slow
def test_a_run_triggered_from_the_form_succeeds_in_the_grid_with_epoch_progress_in_the_log(logged_in):
    """twin_pipeline triggered from the form with num_trials changed runs to success; train_s1's log shows its epochs."""
    from playwright.sync_api import expect

    page, live, screens = logged_in
    dialog, trigger = _open_trigger_form(page, live, UI_PIPELINE)
    expect(dialog.get_by_text("Trial budget of the Optuna sweep: 1 to 500.")).to_be_visible()  # bounds shown
    trials = dialog.get_by_role("spinbutton", name="num_trials")
    trials.fill("3")
    trials.press("Tab")
    expect(trials).to_have_value("3")
    screens.shot("form-num-trials-3")
    expect(trigger).to_be_enabled()
    trigger.scroll_into_view_if_needed()
    screens.shot("form-trigger-enabled")
    trigger.click()
    expect(dialog).to_be_hidden()
    screens.shot("triggered")

    runs = live.api("GET", f"/api/v2/dags/{UI_PIPELINE}/dagRuns").json()["dag_runs"]
    assert len(runs) == 1 and runs[0]["triggered_by"] == "ui", runs
    run_id = runs[0]["dag_run_id"]
    assert runs[0]["conf"]["num_trials"] == 3, runs[0]["conf"]

    page.goto(f"{live.base_url}/dags/{UI_PIPELINE}/runs/{run_id}")
    run_state = page.get_by_test_id("state-badge").first
    expect(run_state).to_have_text(re.compile("Queued|Running|Success"))
    screens.shot("grid-running")
    # The grid redraws itself every few seconds while a run is active: software rendering of that cost as much CPU
    # as the run. Wait over REST with the page parked, then read the outcome in the grid.
    page.goto("about:blank")
    assert live.wait_for_run(UI_PIPELINE, run_id, timeout=RUN_TIMEOUT_S) == "success", live.logs_tail()
    page.goto(f"{live.base_url}/dags/{UI_PIPELINE}/runs/{run_id}")
    expect(run_state).to_have_text("Success")
    expect(page.get_by_text("part-00000.parquet", exact=True).first).to_be_visible()  # named mapped tasks
    expect(page.get_by_text("worker 0", exact=True).first).to_be_visible()
    screens.shot("grid-success")

    page.goto(f"{live.base_url}/dags/{UI_PIPELINE}/runs/{run_id}/tasks/train_s1")
    expect(page.get_by_text("stage s1 epoch").first).to_be_visible()
    screens.shot("train-s1-log")

    report_uri = live.xcom(UI_PIPELINE, run_id, "report")["report_uri"]
    assert json.loads(Path(report_uri).read_text())["sweep"]["n_trials"] == 3, "the form's value reached the sweep"


@pytest.fixture(scope="module")
def finished_run(ui_airflow) -> str:
    """A successful twin_pipeline run: the one the form test made, else one triggered over REST."""
    live = ui_airflow.live
    done = live.api("GET", f"/api/v2/dags/{UI_PIPELINE}/dagRuns", params={"state": "success"}).json()["dag_runs"]
    if done:
        return done[-1]["dag_run_id"]
    run_id = live.trigger(UI_PIPELINE, {"num_trials": 3})
    assert live.wait_for_run(UI_PIPELINE, run_id, timeout=RUN_TIMEOUT_S) == "success", live.logs_tail()
    return run_id


def _watch(page):
    """Every request URL and every console error or uncaught exception of the page and its frames, from now on."""
    requests, errors = [], []
    page.on("request", lambda request: requests.append(request.url))
    page.on("console", lambda message: errors.append(f"{message.text} at {message.location}") if message.type == "error" else None)
    page.on("pageerror", lambda exc: errors.append(f"uncaught: {exc}"))
    return requests, errors


@pytest.mark.slow
def test_the_stagewise_view_shows_the_finished_runs_report_and_the_registry(logged_in, ui_airflow, finished_run):
    """From the Airflow UI: the Stagewise nav entry lists the run, the run's own tab opens its report.html with its
    four charts drawn, the registry shows the version this run registered under its pipeline; nothing leaves
    127.0.0.1 and the console stays clean."""
    from urllib.parse import urlsplit

    from playwright.sync_api import expect

    from stagewise.core import storage

    page, live, screens = logged_in
    storage_root = ui_airflow.roots["twin"]
    requests, errors = _watch(page)
    run_folder = Path(storage.run_prefix(str(storage_root), UI_PIPELINE, finished_run))
    report = json.loads((run_folder / "report.json").read_text())

    page.goto(live.base_url)  # the home page, with the nav bar the plugin adds its entry to
    page.get_by_role("link", name="Stagewise", exact=True).click()
    view = page.frame_locator('iframe[title="Stagewise"]')
    expect(view.get_by_role("heading", name="Stagewise runs")).to_be_visible()
    run_link = view.get_by_role("link", name=finished_run, exact=True)
    expect(run_link).to_be_visible()
    screens.shot("stagewise-runs")

    page.goto(f"{live.base_url}/dags/{UI_PIPELINE}/runs/{finished_run}")
    page.get_by_role("link", name="Stagewise report", exact=True).click()  # the run's tab from the plugin's dag_run view
    run_view = page.frame_locator('iframe[title="Stagewise report"]')
    expect(run_view.locator(f"[data-stagewise-run-id='{finished_run}']")).to_be_visible()
    section = run_view.locator("[data-stagewise-section='report']")
    expect(section).to_be_visible()
    assert (run_folder / "report.html").exists(), "the report step writes report.html beside report.json"
    expect(section).to_have_attribute("data-stagewise-report", "html")
    charts = run_view.frame_locator("#stagewise-report")
    expect(charts.get_by_text(finished_run).first).to_be_attached()
    for title in CHART_TITLES:  # the four sections' charts drew
        expect(charts.locator(".js-plotly-plot", has_text=title).first).to_be_attached()
    expect(charts.locator("svg.main-svg").first).to_be_attached()
    page.wait_for_load_state("networkidle")
    screens.shot("dag-run-stagewise-report")

    run_view.get_by_role("link", name="Model registry").click()
    version = report["registry"]["current"]
    expect(run_view.get_by_role("heading", name="Model registry")).to_be_visible()
    own_model = run_view.locator("section[data-stagewise-model]", has_text="pipeline twin")  # under its pipeline's name
    expect(own_model).to_contain_text(f"{storage_root}/models/{report['registry']['model_name']}")
    expect(own_model.locator(".badge.cur", has_text=version)).to_be_visible()
    screens.shot("stagewise-registry")

    outside = sorted({url for url in requests if urlsplit(url).scheme in ("http", "https", "ws", "wss")
                      and urlsplit(url).hostname != "127.0.0.1"})
    assert outside == [], f"requests left 127.0.0.1: {outside}"
    assert errors == [], "console errors:\n" + "\n".join(errors)


def test_stagewise_answers_are_locked_down_and_hostile_chart_data_still_draws(logged_in, ui_airflow, finished_run):
    """As the browser gets them, in the Airflow UI and opened alone: every /stagewise answer carries nosniff and a CSP
    letting only Airflow's pages frame it; report.html runs sandboxed (an opaque origin); and a report whose chart data
    holds '<!--<script>' and '</script>' draws all four charts, the string shown as text, without a console error."""
    from urllib.parse import unquote, urlsplit

    from playwright.sync_api import expect

    from stagewise.core import storage
    from stagewise.reporting import html as report_html

    page, live, screens = logged_in
    storage_root = ui_airflow.roots["twin"]
    _, errors = _watch(page)
    answers = []
    page.on("response", lambda answer: answers.append(answer) if "/stagewise/" in answer.url else None)

    page.goto(f"{live.base_url}/dags/{UI_PIPELINE}/runs/{finished_run}")
    page.get_by_role("link", name="Stagewise report", exact=True).click()
    run_view = page.frame_locator('iframe[title="Stagewise report"]')
    expect(run_view.locator("#stagewise-report")).to_have_attribute("sandbox", "allow-scripts allow-downloads")
    expect(run_view.frame_locator("#stagewise-report").locator("svg.main-svg").first).to_be_attached()

    # the finished run's report again, one split name made hostile, in a run folder of its own
    source = storage.run_prefix(str(storage_root), UI_PIPELINE, finished_run)
    report = {**json.loads(Path(source, "report.json").read_text()), "run_id": "manual__hostile_chart_data"}
    report["data"]["rows"][HOSTILE] = 7
    out = storage.run_prefix(str(storage_root), UI_PIPELINE, report["run_id"])
    storage.write_bytes(storage.join(out, "report.html"),
                        report_html.render(report, report_html.load_sources(report, source)).encode())
    storage.write_json(storage.join(out, "report.json"), report)
    run_url = f"{live.base_url}/stagewise/runs/{UI_PIPELINE}/{Path(out).name}"
    page.goto(run_url)
    charts = page.frame_locator("#stagewise-report")
    for title in CHART_TITLES:
        expect(charts.locator(".js-plotly-plot", has_text=title).locator("svg.main-svg").first).to_be_attached()
    hostile_label = charts.locator("#fig-data text", has_text=HOSTILE).first
    expect(hostile_label).to_be_visible()
    hostile_label.scroll_into_view_if_needed()  # the screenshot shows it
    framed = next(frame for frame in page.frames if frame.url.endswith("/report.html"))
    assert framed.evaluate("window.origin") == "null", "report.html must not run in Airflow's origin"
    screens.shot("hostile-chart-data-drawn")

    page.goto(f"{run_url}/report.html")  # opened alone, report.html's own CSP sandboxes it
    expect(page.locator("#fig-data text", has_text=HOSTILE).first).to_be_visible()
    assert page.evaluate("window.origin") == "null"

    runs = f"/stagewise/runs/{UI_PIPELINE}"
    seen = [(unquote(urlsplit(answer.url).path), answer.all_headers()) for answer in answers]
    assert {f"{runs}/{finished_run}", f"{runs}/{storage.safe_name(finished_run)}/report.html", f"{runs}/{Path(out).name}",
            f"{runs}/{Path(out).name}/report.html"} <= {path for path, _ in seen}, seen
    for path, headers in seen:
        assert headers.get("x-content-type-options") == "nosniff", path
        assert "frame-ancestors 'self'" in headers.get("content-security-policy", ""), (path, headers)
        if path.endswith("/report.html"):
            assert headers["content-security-policy"].startswith("sandbox allow-scripts allow-downloads;"), path
    assert errors == [], "console errors:\n" + "\n".join(errors)


def test_a_tracked_runs_view_links_its_mlflow_run_which_mlflows_own_ui_shows(logged_in, ui_airflow, finished_run):
    """twin is tracked in a real MLflow server: the run's Stagewise view links the DAG run's MLflow run, and following
    the link, MLflow's own UI shows that run by its Airflow run id, with no tracking gap named."""
    from playwright.sync_api import expect

    from stagewise.core import storage

    page, live, screens = logged_in
    report = json.loads(Path(storage.run_prefix(str(ui_airflow.roots["twin"]), UI_PIPELINE, finished_run),
                             "report.json").read_text())
    page.goto(f"{live.base_url}/stagewise/runs/{UI_PIPELINE}/{storage.safe_name(finished_run)}")
    link = page.locator("[data-stagewise-link='mlflow-run']")
    expect(link).to_be_visible()
    assert link.get_attribute("href") == report["tracking"]["run_url"] and report["tracking"]["gaps"] == []
    expect(page.get_by_text("tracking gap")).to_have_count(0)
    screens.shot("run-view-links-mlflow")
    page.goto(report["tracking"]["run_url"])
    expect(page.get_by_text(finished_run).first).to_be_visible()  # MLflow's UI polls the server: never network-idle
    screens.shot("mlflow-ui-shows-the-run")


@pytest.mark.slow  # a whole gated run, and a person's answer in the browser
def test_human_approval_a_waiting_gate_shows_under_required_actions_and_the_run_view_links_it(logged_in, ui_airflow):
    """A run of the gated pipeline (approval required) waits at approve_model: Airflow's Required Actions page shows
    the comparison body (why it waits, the metrics side by side), the Stagewise run view says it waits and links
    there, and a Reject given in that page with a note ends the run keeping the current model, recorded as the
    admin's. (The REST side, roles and timeouts: tests/dags/test_human_approval.py.)"""
    from playwright.sync_api import expect

    page, live, screens = logged_in
    dag, root = "gated_pipeline", ui_airflow.roots["gated"]
    live.unpause(dag)
    run_id = live.trigger(dag)
    detail = live.wait_for_hitl(dag, run_id, "approve_model", RUN_TIMEOUT_S)
    assert "| test_accuracy |" in detail["body"]

    page.goto(f"{live.base_url}/dags/{dag}/runs/{run_id}")
    page.get_by_role("link", name="Stagewise report", exact=True).click()
    run_view = page.frame_locator('iframe[title="Stagewise report"]')
    expect(run_view.locator("[data-stagewise-section='approval']")).to_contain_text("waiting for approval")
    decide = run_view.locator("[data-stagewise-link='required-actions']")
    expect(decide).to_be_visible()
    assert "/tasks/approve_model/required_actions" in decide.get_attribute("href")
    screens.shot("run-view-waiting-for-approval")

    page.goto(decide.get_attribute("href"))
    expect(page.get_by_text("Why it waits").first).to_be_visible()
    expect(page.get_by_text("test_accuracy").first).to_be_visible()
    expect(page.get_by_text("Trained on").first).to_be_visible()
    screens.shot("required-actions-comparison")
    note = page.locator("#element_note")  # the HITL form's field of the note Param
    note.scroll_into_view_if_needed()
    note.fill("not this week")
    screens.shot("required-actions-note-filled")
    page.get_by_role("button", name="Reject", exact=True).click()
    assert live.wait_for_run(dag, run_id, timeout=RUN_TIMEOUT_S) == "success", live.logs_tail()
    screens.shot("required-actions-answered")
    from stagewise.core import storage

    report = Path(storage.run_prefix(str(root), dag, run_id)) / "report.json"
    decided = json.loads(report.read_text())["registry"]["approval"]
    assert (decided["decision"], decided["by"], decided["note"]) == ("rejected", "admin", "not this week")
