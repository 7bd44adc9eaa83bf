"""The Slurm stage's trigger (stagewise.airflow.slurm_trigger): it polls the job's record as the backend's own wait
does, logs state changes and the output's new lines while the task is deferred, fires once with the job's end and
where the output was logged to, scancels on a user's kill (on_kill) and never on cleanup (a triggerer restart).
No cluster: the backend's job_record, node_states and cancel are stand-ins."""

from __future__ import annotations

import asyncio

import pytest
from airflow.sdk.module_loading import import_string

from stagewise.airflow.backends import slurm
from stagewise.airflow.backends.slurm_records import SlurmJob
from stagewise.airflow.slurm_trigger import SlurmJobTrigger
from stagewise.definitions.config import SlurmSettings

SETTINGS = SlurmSettings(slurm_conf="/etc/slurm/test.conf", poll_s=1, queue_wait_warn_s=0).model_dump(mode="json")


def _trigger(output: str = "", **changes) -> SlurmJobTrigger:
    return SlurmJobTrigger(**{"job_id": "41", "name": "sw-s2-abc-t1", "settings": SETTINGS, "output": output,
                              "offset": 0, "poll_s": 0, "carry": {"started": 1.5, "fingerprint": "f" * 64},
                              **changes})


def _records(monkeypatch, *records: SlurmJob, output=None, lines=()) -> list[str]:
    """job_record answers ``records`` in turn (the output file gains one of ``lines`` before each); the calls."""
    calls, queue, added = [], list(records), list(lines)

    def job_record(settings, job_id):
        calls.append(f"record {job_id} {settings.slurm_conf}")
        if output is not None and added:
            with open(output, "a") as handle:
                handle.write(added.pop(0))
        return queue.pop(0) if len(queue) > 1 else queue[0]

    monkeypatch.setattr(slurm, "job_record", job_record)
    monkeypatch.setattr(slurm, "node_states", lambda settings, nodes: {"n1": "IDLE", "n2": "DOWN+NOT_RESPONDING"})
    monkeypatch.setattr(slurm, "cancel", lambda settings, job_id: calls.append(f"cancel {job_id}"))
    return calls


def _events(trigger: SlurmJobTrigger) -> list[dict]:
    async def collect():
        return [event.payload async for event in trigger.run()]

    return asyncio.run(collect())


def test_the_trigger_serializes_to_its_module_path_and_comes_back_the_same():
    trigger = _trigger("/shared/logs/sw-s2.out", offset=120)
    path, kwargs = trigger.serialize()
    assert path == "stagewise.airflow.slurm_trigger.SlurmJobTrigger"
    again = import_string(path)(**kwargs)
    assert again.serialize() == (path, kwargs) and kwargs["offset"] == 120


def _said(capsys) -> list[str]:
    """The trigger's log lines' messages (Airflow 3's structlog writes them to stdout here)."""
    found = []
    for line in capsys.readouterr().out.splitlines():
        if "slurm_trigger.SlurmJobTrigger" in line and "] " in line:
            found.append(line.split("] ", 1)[1].rsplit(" [stagewise.airflow", 1)[0].strip())
    return found


def test_it_logs_state_changes_and_output_while_deferred_and_fires_once_when_the_job_ends(tmp_path, monkeypatch, capsys):
    output = tmp_path / "sw-s2.out"
    output.write_text("0: from the try before\n")  # the try's file: a requeue appends to it
    start = output.stat().st_size
    calls = _records(monkeypatch, SlurmJob(job_id="41", state="PENDING", reason="Resources"),
                     SlurmJob(job_id="41", state="RUNNING", nodes=2, node_list="n[1-2]"),
                     SlurmJob(job_id="41", state="RUNNING", nodes=2, node_list="n[1-2]"),
                     SlurmJob(job_id="41", state="COMPLETED", exit_code=0, nodes=2, node_list="n[1-2]"),
                     output=str(output), lines=["", "0: epoch 1\n1: epoch 1\n", "0: epoch 2\n0: no newl", "ine yet\n"])
    events = _events(_trigger(str(output), offset=start))
    assert events == [{"started": 1.5, "fingerprint": "f" * 64, "job_id": "41", "name": "sw-s2-abc-t1",
                       "state": "COMPLETED", "offset": output.stat().st_size, "message": "", "user_error": False,
                       "output": str(output)}]
    said = _said(capsys)
    assert "Slurm job 41: PENDING (Resources)" in said and "Slurm job 41: RUNNING on n[1-2]" in said
    assert said.count("Slurm job 41: RUNNING on n[1-2]") == 1 and "Slurm job 41: COMPLETED" in said
    assert [line for line in said if line.startswith("[node")] == ["[node 0] epoch 1", "[node 1] epoch 1",
                                                                   "[node 0] epoch 2", "[node 0] no newline yet"]
    assert any("waiting in the queue" in line and "Resources" in line for line in said)  # named, not failed
    assert "from the try before" not in " ".join(said)
    assert all(call.startswith("record 41 /etc/slurm/test.conf") for call in calls)


def test_a_requeue_after_a_lost_node_fires_node_fail_and_a_reason_that_never_clears_fires_never_runs(monkeypatch):
    _records(monkeypatch, SlurmJob(job_id="41", state="RUNNING", nodes=2, node_list="n[1-2]"),
             SlurmJob(job_id="41", state="PENDING", reason="BeginTime", restarts=1))
    [event] = _events(_trigger())
    assert event["state"] == "NODE_FAIL" and "n2" in event["message"]

    _records(monkeypatch, SlurmJob(job_id="41", state="PENDING", reason="PartitionNodeLimit"))
    [event] = _events(_trigger())
    assert event["state"] == "NEVER_RUNS" and "PartitionNodeLimit" in event["message"]


def test_a_requeue_without_a_lost_node_is_waited_on(monkeypatch):
    monkeypatch.setattr(slurm, "lost_nodes", lambda states: [])
    _records(monkeypatch, SlurmJob(job_id="41", state="RUNNING", node_list="n[1-2]"),
             SlurmJob(job_id="41", state="PENDING", reason="BeginTime", restarts=1),
             SlurmJob(job_id="41", state="COMPLETED", exit_code=0, restarts=1))
    assert [event["state"] for event in _events(_trigger())] == ["COMPLETED"]


def test_a_controller_that_stays_away_ends_the_wait_as_unknown(monkeypatch):
    monkeypatch.setattr("stagewise.airflow.slurm_trigger.MAX_POLL_FAILURES", 3)

    def job_record(settings, job_id):
        raise RuntimeError("scontrol show job did not answer in 60 s")

    monkeypatch.setattr(slurm, "job_record", job_record)
    [event] = _events(_trigger())
    assert event["state"] == "UNKNOWN" and "3 times in a row" in event["message"]


def test_a_users_kill_cancels_the_job_and_cleanup_never_does(monkeypatch):
    """on_kill runs only on a user's mark-failed / mark-success / clear of the deferred task (Airflow 3.3's
    TriggerRunner.run_trigger); cleanup runs on every exit, a triggerer restart included."""
    calls = _records(monkeypatch, SlurmJob(job_id="41", state="RUNNING"))
    trigger = _trigger()
    asyncio.run(trigger.cleanup())
    assert calls == []
    asyncio.run(trigger.on_kill())
    assert calls == ["cancel 41"]


@pytest.mark.parametrize("hook", ["on_kill", "cleanup"])
def test_the_hooks_are_the_base_triggers_own(hook):
    from airflow.triggers.base import BaseTrigger

    assert getattr(SlurmJobTrigger, hook) is not getattr(BaseTrigger, hook)  # both overridden, one cancels
