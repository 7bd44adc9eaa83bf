"""Fixtures of the browser suite: Debian's chromium driven by playwright, a live Airflow, screenshots kept.

Screenshots go to $STAGEWISE_UI_ARTIFACTS (default tests/ui/artifacts/, ignored by git), one folder per test.
Without chromium or playwright the suite skips with the reason; under CI=true it fails instead.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from stagewise.definitions.pipelines import KINDS, dag_id
from tests.conftest import service_unavailable
from tests.shared_stack import PipelinesStack

CHROMIUM = os.environ.get("STAGEWISE_CHROMIUM", "/usr/bin/chromium")
ARTIFACTS = Path(os.environ.get("STAGEWISE_UI_ARTIFACTS", Path(__file__).resolve().parent / "artifacts"))
UI_TIMEOUT_MS = 60_000  # a 2-core machine running the scheduler and sub-jobs renders slowly
UI_PIPELINE = "twin_pipeline"  # the DAG this suite runs, of the shared stack's pipeline `twin`


# Module, not session: playwright's sync API keeps an asyncio loop running until it exits, and a later test on the
# same pytest-xdist worker that calls asyncio.run() (the SageMaker trigger tests) would fail.
@pytest.fixture(scope="module")
def chromium():
    """A headless Debian chromium under playwright (playwright's own browser download is not used)."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        service_unavailable("playwright for Python is not installed (pip install -r requirements.txt)")
    if not os.access(CHROMIUM, os.X_OK):
        service_unavailable(f"no chromium at {CHROMIUM} (apt-get install -y chromium, or set STAGEWISE_CHROMIUM)")
    from playwright.sync_api import expect

    # expect() keeps its own 5 s timeout, apart from the page's: a grid that renders after a slow API call failed CI.
    expect.set_options(timeout=UI_TIMEOUT_MS)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True)
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture(scope="module")
def ui_airflow(chromium, shared_airflow) -> PipelinesStack:
    """The shared live stack (tests/shared_stack.py: pipelines side by side), every pipeline's DAGs parsed; this suite
    runs the `twin` pipeline, whose twin_pipeline is unpaused (retrain stays paused: its cron would run it)."""
    for name in shared_airflow.roots:
        for kind in KINDS:
            shared_airflow.live.wait_for_dag(dag_id(name, kind))
    shared_airflow.live.unpause(UI_PIPELINE)
    return shared_airflow


class Screens:
    """Numbered full-page screenshots of one test, so the steps read in order."""

    def __init__(self, page, folder: Path) -> None:
        self.page, self.folder, self.count = page, folder, 0
        folder.mkdir(parents=True, exist_ok=True)
        for old in folder.glob("*.png"):
            old.unlink()

    def shot(self, step: str) -> Path:
        self.count += 1
        path = self.folder / f"{self.count:02d}-{step}.png"
        self.page.screenshot(path=str(path), full_page=True)
        return path


@pytest.fixture(scope="module")
def admin_session(ui_airflow) -> dict:
    """The browser state (cookies, local storage) of the admin once logged in; filled by the module's first login."""
    return {}


@pytest.fixture
def logged_in(chromium, ui_airflow, admin_session, request):
    """A fresh browser page logged in as admin; yields (page, live, screens).

    The module's first test logs in through the login form and lands on the home page; the others start from that
    session's saved state (each page load of the React UI costs CPU-seconds of software rendering here).
    """
    live = ui_airflow.live
    context = chromium.new_context(viewport={"width": 1600, "height": 1000}, storage_state=admin_session.get("state"))
    context.set_default_timeout(UI_TIMEOUT_MS)
    page = context.new_page()
    screens = Screens(page, ARTIFACTS / re.sub(r"[^A-Za-z0-9_.-]+", "_", request.node.name))
    try:
        if "state" not in admin_session:
            page.goto(live.base_url)
            page.get_by_label("Username").fill("admin")
            page.get_by_label("Password").fill(live.password)
            screens.shot("login-form")
            page.get_by_role("button", name="Sign in").click()
            page.get_by_role("heading", name="Welcome").wait_for()
            screens.shot("logged-in-home")
            admin_session["state"] = context.storage_state()
        yield page, live, screens
    finally:
        screens.shot("last-state")
        context.close()
