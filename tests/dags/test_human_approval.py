"""A human at the gate on a live stack (the shared one): a gated run waits in Airflow's own HITL task, visible over the
REST API and on the Stagewise run page; a viewer's answer is refused, an editor's reject keeps the current model and
records who and the note, and a clear of the answered run asks nobody again; a newer run supersedes a pending request
and an approval moves the current model; every decision is mailed to a real SMTP receiver, one that is down is named
in the report; in MLflow's registry `champion` moves only after approval, only the named respondent may answer, and
no answer times out to a reject."""

from __future__ import annotations

import json
from pathlib import Path
from urllib.parse import quote

import pytest

from stagewise import registry
from stagewise.models import approval

pytestmark = [pytest.mark.airflow, pytest.mark.torchrun, pytest.mark.service]  # service: the stack's MLflow server

TASK = "approve_model"
RUN_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def stack(shared_airflow):
    live = shared_airflow.live
    for dag_id in ("gated_pipeline", "gated_mlflow_pipeline"):
        live.wait_for_dag(dag_id)
        live.unpause(dag_id)
    return shared_airflow


def _hitl_path(dag_id: str, run_id: str) -> str:
    return f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{TASK}/-1/hitlDetails"


def _waiting(live, dag_id: str, run_id: str) -> dict:
    return live.wait_for_hitl(dag_id, run_id, TASK, RUN_TIMEOUT_S)


def _answer(client, dag_id: str, run_id: str, option: str, note: str):
    return client.patch(_hitl_path(dag_id, run_id), json={"chosen_options": [option], "params_input": {"note": note}})


def _report(root, dag_id: str, run_id: str) -> dict:
    from stagewise.core import storage

    return json.loads((Path(storage.run_prefix(str(root), dag_id, run_id)) / "report.json").read_text())


def _subjects(receiver) -> list[str]:
    return [message["Subject"] for message in receiver.messages]


@pytest.mark.slow  # five gated runs on two pipelines, one waiting out its timeout
def test_human_approval_waits_in_airflow_a_viewer_cannot_answer_and_an_editor_rejects_then_approves(stack, smtp_receiver):
    live, root = stack.live, stack.roots["gated"]
    dag = "gated_pipeline"
    first = live.trigger(dag)
    mlflow_first = live.trigger("gated_mlflow_pipeline")  # the MLflow pipeline's first run waits meanwhile (below)
    detail = _waiting(live, dag, first)
    assert detail["options"] == ["Approve", "Reject"] and "promote" in detail["subject"]
    assert "| test_accuracy |" in detail["body"] and "Why it waits" in detail["body"] and "Trained on" in detail["body"]
    state = next(ti["state"] for ti in live.task_instances(dag, first) if ti["task_id"] == TASK)
    assert state in ("awaiting_input", "deferred"), state
    with live.client_of("viewer") as viewer:  # the viewer reads the pending decision, but may not answer it
        assert viewer.get(_hitl_path(dag, first)).status_code == 200
        assert _answer(viewer, dag, first, "Approve", "me too").status_code == 403
    page = live.api("GET", f"/stagewise/runs/{dag}/{first}").text  # the run view, before any report exists
    assert "waiting for approval" in page and f"/dags/{dag}/runs/{quote(first, safe='')}/tasks/{TASK}/required_actions" in page

    with live.client_of("editor") as editor:
        answered = _answer(editor, dag, first, "Reject", "hold until the new labels land")
        assert answered.status_code == 200, answered.text
        assert live.wait_for_run(dag, first, RUN_TIMEOUT_S) == "success", live.logs_tail()
        report = _report(root, dag, first)["registry"]
        assert report["approval"] | {"decision": "rejected", "by": "editor", "note": "hold until the new labels land"} \
            == report["approval"]
        assert not report["promoted"] and registry.pointer(str(root), "digits")["version"] is None
        unsent = [result for result in report["notifications"] if not result["sent"]]
        # two notifiers, one receiver down: each decision (waiting, rejected) sent once and named once as unsent
        assert [result["decision"] for result in unsent] == ["waiting", "rejected"], report["notifications"]
        assert all("Connection refused" in result["error"] for result in unsent)
        # Cleared from the approval task on, the finished run asks nobody again: the editor's reject stands.
        live.api("POST", f"/api/v2/dags/{dag}/clearTaskInstances", json={
            "dry_run": False, "dag_run_id": first, "task_ids": [TASK], "include_downstream": True,
            "only_failed": False, "reset_dag_runs": True})
        assert live.wait_for_run(dag, first, RUN_TIMEOUT_S) == "success", live.logs_tail()
        again = _report(root, dag, first)["registry"]["approval"]
        assert (again["decision"], again["by"], again["note"]) == ("rejected", "editor", "hold until the new labels land")
        cleared = next(ti["try_number"] for ti in live.task_instances(dag, first) if ti["task_id"] == TASK)
        assert again["effect"].startswith("answered before") and "nobody is asked" in live.task_log(dag, first, TASK,
                                                                                                    cleared)

        # Two more runs: the later one's request supersedes the earlier one's, which then moves nothing.
        second = live.trigger(dag)
        _waiting(live, dag, second)
        third = live.trigger(dag)
        _waiting(live, dag, third)
        versions = {run: live.xcom(dag, run, "gate_model")["version"] for run in (second, third)}
        assert approval.open_request(registry.models_prefix(str(root), "digits"))["run"] == f"{dag}/{third}"
        assert _answer(editor, dag, third, "Approve", "new labels are in").status_code == 200
        assert live.wait_for_run(dag, third, RUN_TIMEOUT_S) == "success", live.logs_tail()
        pointer = registry.pointer(str(root), "digits")
        assert (pointer["version"], pointer["by"]) == (versions[third], "editor")
        assert _answer(editor, dag, second, "Approve", "late").status_code == 200
        assert live.wait_for_run(dag, second, RUN_TIMEOUT_S) == "success", live.logs_tail()
    late = _report(root, dag, second)["registry"]
    assert not late["promoted"] and "superseded" in late["approval"]["effect"]
    assert registry.pointer(str(root), "digits")["version"] == versions[third]  # the late approval moved nothing
    assert _report(root, dag, third)["registry"]["promoted"]

    def kinds(version: str, run: str) -> list[str]:
        return [entry["decision"] for entry in approval.history(registry.models_prefix(str(root), "digits"), version)
                if entry.get("run") == f"{dag}/{run}"]

    assert kinds(report["version"], first) == ["waiting", "rejected"]
    assert kinds(versions[second], second) == ["waiting", "superseded", "approved"]
    assert kinds(versions[third], third) == ["waiting", "approved"]
    subjects = _subjects(smtp_receiver)
    for said in ("waiting for approval", "rejected (current model kept)", "superseded by a newer request",
                 "approved and promoted"):
        assert any(subject.startswith("[gated]") and subject.endswith(said) for subject in subjects), (said, subjects)

    _mlflow_champion_moves_only_after_approval(stack, mlflow_first)


def _mlflow_champion_moves_only_after_approval(stack, first: str) -> None:
    """gated_mlflow: its first run's request (triggered above) times out to a reject and sets no champion; the next
    run waits, an operator (who may act on DAGs but is not the named respondent) is refused, the respondent approves
    and champion moves."""
    live, root, dag = stack.live, stack.roots["gated_mlflow"], "gated_mlflow_pipeline"
    assert live.wait_for_run(dag, first, RUN_TIMEOUT_S) == "success", live.logs_tail()
    timed_out = _report(root, dag, first)["registry"]
    assert timed_out["approval"]["decision"] == "timed_out" and timed_out["approval"]["by"] is None
    assert not timed_out["promoted"]
    second = live.trigger(dag)
    _waiting(live, dag, second)
    with live.client_of("operator") as operator:  # may act on DAGs, but is not the named respondent
        assert _answer(operator, dag, second, "Approve", "not mine").status_code == 403
    with live.client_of("editor") as editor:
        assert _answer(editor, dag, second, "Approve", "ok").status_code == 200
    assert live.wait_for_run(dag, second, RUN_TIMEOUT_S) == "success", live.logs_tail()
    approved = _report(root, dag, second)["registry"]
    assert approved["promoted"] and approved["approval"]["by"] == "editor"
    assert approved["current"] == approved["version"]
    from stagewise.definitions.loading import load_config
    from stagewise.tracking import registry as mlflow_registry

    config = load_config(stack.configs["gated_mlflow"])
    assert mlflow_registry.card_of(mlflow_registry.resolve(config, None))["version"] == approved["version"]
