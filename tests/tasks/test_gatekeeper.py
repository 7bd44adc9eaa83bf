"""The gate with a person in it (stagewise.gatekeeper, stagewise.models.approval): a promotion that needs approval
waits as one open request per model name; an answer moves the current model only as decided, records who, when and
the note, and every decision reaches the notifiers, a failing one never failing the gate."""

from __future__ import annotations

import subprocess
import sys

import pytest

from stagewise import gatekeeper, registry
from stagewise.definitions.loading import load_config
from stagewise.models import approval
from tests.smtp_receiver import SmtpReceiver, closed_port, smtp_connection

NAME = "digits"
LINKS = {"report_url": "http://airflow.example/stagewise/runs/d/r",
         "required_actions_url": "http://airflow.example/dags/d/runs/r/tasks/approve_model/required_actions"}


@pytest.fixture
def make_config(write_config):
    def make(**overrides):
        return load_config(write_config(), {"registry.approval": "required", **overrides})
    return make


def _version(config, tmp_path, label: str, accuracy: float, **metrics) -> dict:
    model = tmp_path / f"{label}.pt"
    model.write_bytes(label.encode() * 10)
    card = registry.register(config.storage_root, NAME, str(model),
                             {"test_accuracy": accuracy, "val_accuracy": accuracy - 0.01, "study": f"s-{label}",
                              "source_run": f"d/{label}", **metrics})
    return {"version": card["version"], "rows": {"train": 100, "validation": 20, "test": 20}}


def _current(config) -> str | None:
    return registry.pointer(config.storage_root, NAME)["version"]


def _approve(config, gated, by="editor", note="looks right", chosen=gatekeeper.APPROVE, timed_out=False):
    return gatekeeper.answer(config, gated, {"chosen": chosen, "by": None if timed_out else by, "note": note,
                                             "at": "2026-12-03T10:00:00Z", "timed_out": timed_out}, "")


def _prefix(config) -> str:
    return registry.models_prefix(config.storage_root, NAME)


def test_human_approval_required_waits_and_an_approval_moves_the_current_model_with_who_and_the_note(make_config, tmp_path):
    config = make_config()
    first = _version(config, tmp_path, "a", 0.90)
    gated = gatekeeper.decide(config, first, "", run="d/run-1", links=LINKS)
    assert gated["awaiting_approval"] and not gated["promoted"] and gated["current"] is None and gated["model_uri"] is None
    assert _current(config) is None  # nothing moved while it waits
    review = gated["approval"]["review"]
    assert review["metrics"]["test_accuracy"] == {"candidate": 0.90, "current": None}
    assert review["objective"] == {"name": "val_accuracy", "candidate": pytest.approx(0.89), "current": None}
    assert review["rows"]["train"] == 100 and gated["approval"]["required_actions_url"] == LINKS["required_actions_url"]
    assert approval.open_request(_prefix(config))["version"] == first["version"]

    done = _approve(config, gated)
    assert done["promoted"] and done["current"] == first["version"] and _current(config) == first["version"]
    assert registry.pointer(config.storage_root, NAME)["by"] == "editor"
    assert done["approval"] | {"decision": "approved", "by": "editor", "note": "looks right"} == done["approval"]
    assert approval.open_request(_prefix(config)) is None
    decisions = [(entry["decision"], entry.get("by"), entry.get("note")) for entry in approval.history(_prefix(config), first["version"])]
    assert decisions == [("waiting", None, None), ("approved", "editor", "looks right")]


def test_human_approval_a_reject_and_a_timeout_keep_the_current_model_and_say_which(make_config, tmp_path):
    config = make_config()
    first = _version(config, tmp_path, "a", 0.90)
    _approve(config, gatekeeper.decide(config, first, "", run="d/run-1", links=LINKS))
    better = _version(config, tmp_path, "b", 0.95)
    rejected = _approve(config, gatekeeper.decide(config, better, "", run="d/run-2", links=LINKS),
                        chosen=gatekeeper.REJECT, note="drift in the new data")
    assert not rejected["promoted"] and rejected["current"] == first["version"] == _current(config)
    assert rejected["model_uri"] == registry.card(config.storage_root, NAME, first["version"])["model_uri"]
    assert rejected["approval"]["decision"] == "rejected" and "kept" in rejected["approval"]["effect"]
    timed_out = _approve(config, gatekeeper.decide(config, better, "", run="d/run-3", links=LINKS),
                         chosen=gatekeeper.REJECT, timed_out=True, note="")
    assert timed_out["approval"]["decision"] == "timed_out" and timed_out["approval"]["by"] is None
    assert "no answer within 1440 min" in timed_out["approval"]["effect"] and _current(config) == first["version"]
    kinds = [entry["decision"] for entry in approval.history(_prefix(config), better["version"])]
    assert kinds == ["waiting", "rejected", "waiting", "timed_out"]


def test_human_approval_a_newer_request_supersedes_the_pending_one_whose_answer_then_moves_nothing(make_config, tmp_path):
    config = make_config()
    first = _version(config, tmp_path, "a", 0.90)
    older = gatekeeper.decide(config, first, "", run="d/run-1", links=LINKS)
    newer = gatekeeper.decide(config, first, "", run="d/retrain-2", links=LINKS)
    assert newer["approval"]["superseded"] == {"run": "d/run-1", "version": first["version"]}
    assert approval.open_request(_prefix(config))["run"] == "d/retrain-2"  # one request per model name
    late = _approve(config, older)
    assert not late["promoted"] and "superseded" in late["approval"]["effect"] and _current(config) is None
    assert _approve(config, newer)["promoted"] and _current(config) == first["version"]


def test_human_approval_an_answered_request_is_settled_so_a_cleared_approval_task_asks_nobody_again(make_config,
                                                                                                  tmp_path):
    """approve_model cleared after its answer, or started after a newer run superseded its request: settled() gives
    what the request came to (the answer, who and the note stand) and nothing is recorded or moved anew."""
    config = make_config()
    first = _version(config, tmp_path, "a", 0.90)
    gated = gatekeeper.decide(config, first, "", run="d/run-1", links=LINKS)
    assert gatekeeper.settled(config, gated, "") is None  # still open: a person is asked
    _approve(config, gated, note="ship it")
    again = gatekeeper.settled(config, gated, "")
    assert (again["promoted"], again["current"], again["approval"]["by"], again["approval"]["note"]) == (
        True, first["version"], "editor", "ship it")
    assert again["approval"]["effect"] == "answered before: current model moved"
    kinds = [entry["decision"] for entry in approval.history(_prefix(config), first["version"])]
    assert kinds == ["waiting", "approved"]

    better = _version(config, tmp_path, "b", 0.95)
    older = gatekeeper.decide(config, better, "", run="d/run-2", links=LINKS)
    gatekeeper.decide(config, better, "", run="d/run-3", links=LINKS)
    superseded = gatekeeper.settled(config, older, "")
    assert not superseded["promoted"] and superseded["approval"]["decision"] == "superseded"
    assert _current(config) == first["version"]


def test_human_approval_an_answer_cut_off_between_closing_and_recording_leaves_the_retry_to_ask_and_apply(make_config,
                                                                                                           tmp_path):
    """The answer closed the request, then the task died before recording it: the retry asks again and its answer is
    applied (not taken for a superseded request's)."""
    config = make_config()
    first = _version(config, tmp_path, "a", 0.90)
    gated = gatekeeper.decide(config, first, "", run="d/run-1", links=LINKS)
    approval.close(_prefix(config), "d/run-1")  # what the first try did before it died
    assert gatekeeper.settled(config, gated, "") is None  # its own answer closed it: the retry asks again
    assert _approve(config, gated)["promoted"] and _current(config) == first["version"]


def test_human_approval_an_approval_after_the_current_model_moved_moves_nothing(make_config, tmp_path):
    """The reviewer compared with the model current when asked; a rollback or promotion since voids the comparison."""
    config = make_config()
    first, second = _version(config, tmp_path, "a", 0.90), _version(config, tmp_path, "b", 0.92)
    registry.promote(config.storage_root, NAME, first["version"])
    gated = gatekeeper.decide(config, second, "", run="d/run-2", links=LINKS)
    registry.promote(config.storage_root, NAME, second["version"])  # by hand, while the request waits
    third = _version(config, tmp_path, "c", 0.99)
    registry.promote(config.storage_root, NAME, third["version"])
    late = _approve(config, gated)
    assert not late["promoted"] and f"became {third['version']}" in late["approval"]["effect"]


def test_human_approval_when_worse_on_asks_only_when_the_watched_metric_drops_past_its_margin(make_config, tmp_path):
    config = make_config(**{"registry.approval": {"mode": "when_worse_on", "metric": "test_f1_macro", "margin": 0.02}})
    first = _version(config, tmp_path, "a", 0.90, test_f1_macro=0.80)
    assert gatekeeper.decide(config, first, "", run="d/1", links=LINKS)["promoted"]  # nothing current: no question
    slight = _version(config, tmp_path, "b", 0.91, test_f1_macro=0.79)
    assert gatekeeper.decide(config, slight, "", run="d/2", links=LINKS)["promoted"]  # 0.01 lost: within the margin
    worse = _version(config, tmp_path, "c", 0.95, test_f1_macro=0.70)
    asked = gatekeeper.decide(config, worse, "", run="d/3", links=LINKS)
    assert asked["awaiting_approval"] and "test_f1_macro 0.7000 is worse" in asked["approval"]["reason"]
    refused = _version(config, tmp_path, "d", 0.50, test_f1_macro=0.10)  # the gate refuses it: nobody is asked
    assert not gatekeeper.decide(config, refused, "", run="d/4", links=LINKS).get("awaiting_approval")


def test_human_approval_is_never_asked_by_a_report_only_gate(make_config, tmp_path):
    config = make_config(**{"registry.report_only": True})
    gated = gatekeeper.decide(config, _version(config, tmp_path, "a", 0.9), "", run="d/1", links=LINKS)
    assert gated["would_promote"] and not gated.get("awaiting_approval") and approval.open_request(_prefix(config)) is None


@pytest.mark.airflow  # Airflow's SmtpNotifier, imported in-process
def test_every_gate_decision_is_mailed_once_and_a_receiver_that_is_down_is_reported_not_raised(make_config, tmp_path,
                                                                                               monkeypatch):
    smtp = "airflow.providers.smtp.notifications.smtp.SmtpNotifier"
    args = {"to": "ml-team@example.org", "subject": "{{ stagewise.subject }}", "html_content": "{{ stagewise.html }}"}
    with SmtpReceiver() as receiver:
        monkeypatch.setenv("AIRFLOW_CONN_GATE_MAIL", receiver.connection_uri())
        monkeypatch.setenv("AIRFLOW_CONN_GATE_MAIL_DOWN", smtp_connection(closed_port()))
        config = make_config(**{"registry.notify": [{"notifier": smtp, "args": {**args, "smtp_conn_id": "gate_mail"}},
                                                    {"notifier": smtp, "args": {**args, "smtp_conn_id": "gate_mail_down"},
                                                     "on": ["approved"]}]})
        first = _version(config, tmp_path, "a", 0.90)
        gated = gatekeeper.decide(config, first, "", run="d/run-1", links=LINKS)
        done = _approve(config, gated, note="ship it")
        subjects = [message["Subject"] for message in receiver.messages]
    assert subjects == [f"[{config.name or NAME}] {NAME} {first['version']}: waiting for approval",
                        f"[{config.name or NAME}] {NAME} {first['version']}: approved and promoted"]
    text = "".join(part.get_payload(decode=True).decode() for part in receiver.messages[0].walk()
                   if not part.is_multipart())
    assert "test_accuracy: candidate 0.9000" in text and LINKS["required_actions_url"] in text
    assert [result["sent"] for result in done["notifications"]] == [True, True, False]
    unsent = done["notifications"][-1]
    assert unsent["decision"] == "approved" and "Connection refused" in unsent["error"]
    assert _current(config) == first["version"]  # the dead receiver changed nothing


def test_a_rollback_by_hand_is_recorded_with_who_did_it(make_config, tmp_path, write_config):
    config = make_config(**{"registry.approval": "none"})
    first, second = _version(config, tmp_path, "a", 0.90), _version(config, tmp_path, "b", 0.95)
    gatekeeper.decide(config, first, "", run="d/1", links=LINKS)
    gatekeeper.decide(config, second, "", run="d/2", links=LINKS)
    done = subprocess.run([sys.executable, "-m", "stagewise.registry", "rollback", "--config", str(write_config()),
                           "--by", "oncall-ana"], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    state = registry.pointer(config.storage_root, NAME)
    assert state["version"] == first["version"] and state["by"] == "oncall-ana"
    assert approval.history(_prefix(config), first["version"])[-1] | {"decision": "rolled_back", "by": "oncall-ana",
                                                                      "from": second["version"]} \
        == approval.history(_prefix(config), first["version"])[-1]
