"""The waiting decision as the Stagewise pages show it (stagewise.airflow.ui.approvals): the version, why and since when,
the model it is compared with (or that none is current yet), and the link to Airflow's Required Actions; what the
request holds is escaped."""

from __future__ import annotations

from stagewise.airflow.ui.approvals import pending_html

REQUEST = {"version": "m-aaaa", "run": "gated_pipeline/manual__1", "asked_at": "2026-12-04T18:37:07Z",
           "reason": "registry.approval is required", "compared": "m-bbbb",
           "required_actions_url": "http://airflow/dags/gated_pipeline/runs/manual__1/tasks/approve_model/required_actions"}


def test_a_waiting_request_names_the_compared_model_and_links_required_actions():
    html = pending_html(REQUEST)
    assert "waiting for approval" in html and "compared with <span class='mono'>m-bbbb</span>." in html
    assert f"href='{REQUEST['required_actions_url']}'>Decide under Required Actions</a>" in html


def test_a_first_request_says_no_model_is_current_and_a_foreign_link_is_left_out():
    html = pending_html({**REQUEST, "compared": None, "required_actions_url": "javascript:alert(1)",
                         "reason": "<b>x</b>"})
    assert "no model is current yet." in html and "compared with" not in html
    assert "javascript:" not in html and "<b>x</b>" not in html and "&lt;b&gt;x&lt;/b&gt;" in html
