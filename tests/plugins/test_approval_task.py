"""The approval task (stagewise.airflow.approval): it is in the DAG only with registry.approval on, between the gate
and inference, as Airflow's HITL task with Approve/Reject and a note; its body sets the metrics side by side; a
human's answer and a timeout reach stagewise.gatekeeper as such."""

from __future__ import annotations

import datetime as dt

import pytest
import yaml

from tests.conftest import unnamed

GATED = {"awaiting_approval": True, "model_name": "digits", "version": "m-aaaa", "reason": "no current model",
         "approval": {"reason": "registry.approval is required", "compared": "m-bbbb", "run": "d/r",
                      "report_url": "http://a/stagewise/runs/d/r", "required_actions_url": "http://a/x",
                      "superseded": {"run": "d/older", "version": "m-cccc"},
                      "review": {"metrics": {"test_accuracy": {"candidate": 0.91, "current": 0.9},
                                             "test_rows": {"candidate": 384, "current": 380}},
                                 "objective": {"name": "val_accuracy", "candidate": 0.93, "current": None},
                                 "rows": {"train": 1161, "test": 384}, "data_fingerprint": "6a62",
                                 "data_interval": {"start": "2026-11-01", "end": "2026-11-02"}, "study": "s",
                                 "source_run": "d/r"}}}


def _dag(tmp_path, storage_root, monkeypatch, approval):
    from stagewise.airflow.dags import build_pipelines

    folder = tmp_path / "pipelines"
    folder.mkdir()
    (folder / "fraud.yaml").write_text(yaml.safe_dump({**unnamed(storage_root), "registry": {"approval": approval}}))
    monkeypatch.setenv("_AIRFLOW_PARSING_CONTEXT_DAG_ID", "fraud_pipeline")
    namespace: dict = {}
    build_pipelines(namespace, str(folder))
    return namespace["fraud_pipeline"]


def test_the_approval_task_sits_between_the_gate_and_inference_only_with_approval_on(tmp_path, storage_root, monkeypatch):
    from stagewise.airflow.approval import GateApprovalOperator

    dag = _dag(tmp_path, storage_root, monkeypatch, {"mode": "required", "timeout_minutes": 90, "respondents": ["ana"]})
    task = dag.get_task("approve_model")
    assert isinstance(task, GateApprovalOperator) and task.upstream_task_ids == {"start_run", "gate_model"}
    assert "plan_inference" in task.downstream_task_ids
    assert task.options == ["Approve", "Reject"] and task.defaults == ["Reject"]  # a timeout takes Reject
    assert task.response_timeout == dt.timedelta(minutes=90) and task.assigned_users == [{"id": "ana", "name": "ana"}]
    assert set(task.params) == {"note"}  # the form asks for the note alone, not the pipeline's Params
    (tmp_path / "pipelines").rename(tmp_path / "before")
    assert "approve_model" not in _dag(tmp_path, storage_root, monkeypatch, "none").task_ids


def test_the_body_sets_the_candidate_beside_the_current_model_with_the_data_and_the_links():
    from stagewise.airflow.approval import body

    text = body(GATED)
    assert "| test_accuracy | 0.9100 | 0.9000 |" in text and "| test_rows | 384 | 380 |" in text
    assert "| val_accuracy (sweep's best) | 0.9300 | – |" in text
    assert "1,161 train, 384 test rows (data `6a62`, interval 2026-11-01 to 2026-11-02)" in text
    assert "Supersedes** the pending request of d/older" in text and "(http://a/stagewise/runs/d/r)" in text


@pytest.mark.parametrize(("event", "expected"), [
    ({"chosen_options": ["Approve"], "params_input": {"note": "ok"}, "responded_by_user": {"id": "ana", "name": "ana"}},
     {"chosen": "Approve", "by": "ana", "note": "ok", "timed_out": False}),
    ({"chosen_options": ["Reject"], "params_input": {"note": ""}, "responded_by_user": None, "timedout": True},
     {"chosen": "Reject", "by": None, "note": "", "timed_out": True}),
])
def test_a_persons_answer_and_a_timeout_reach_the_gatekeeper_as_such(tmp_path, storage_root, monkeypatch, event, expected):
    from stagewise import gatekeeper

    task = _dag(tmp_path, storage_root, monkeypatch, "required").get_task("approve_model")
    seen = {}
    monkeypatch.setattr(gatekeeper, "answer", lambda config, gated, response, out, **_: seen.update(response) or "done")
    monkeypatch.setattr("stagewise.airflow.steps.run_config", lambda run: None)
    task.run, task.gated = {"out": "x"}, GATED
    at = dt.datetime(2026, 12, 3, tzinfo=dt.UTC)
    assert task.execute_complete({}, {**event, "responded_at": at}) == "done"
    assert seen == {**expected, "at": at.isoformat()}



def test_a_request_no_longer_open_is_not_asked_again(tmp_path, storage_root, monkeypatch):
    """A cleared approve_model whose request was answered (or superseded) returns what it came to without writing a
    HITL detail; one still open is asked through HITLOperator."""
    from airflow.providers.standard.operators.hitl import HITLOperator

    from stagewise import gatekeeper

    task = _dag(tmp_path, storage_root, monkeypatch, "required").get_task("approve_model")
    monkeypatch.setattr("stagewise.airflow.steps.run_config", lambda run: None)
    monkeypatch.setattr("stagewise.airflow.steps.inline", lambda config, work: work())
    monkeypatch.setattr(HITLOperator, "execute", lambda self, context: "asked")
    task.run, task.gated = {"out": "x"}, GATED
    monkeypatch.setattr(gatekeeper, "settled", lambda config, gated, out: {"reason": "approved by ana: answered before"})
    assert task.execute({}) == {"reason": "approved by ana: answered before"}
    monkeypatch.setattr(gatekeeper, "settled", lambda config, gated, out: None)
    assert task.execute({}) == "asked" and "Promote" not in task.subject and task.body.startswith("**Why it waits")
