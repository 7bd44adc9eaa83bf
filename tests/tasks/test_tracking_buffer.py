"""The tracker's bounded buffer, without a server: what does not fit is dropped and counted (the gap says how many),
creating and ending runs always fit, logging never waits on the network, and what a task could not send is left once
for the run's next task (two claimants never both get it)."""

from __future__ import annotations

import logging
import time

import pytest

from stagewise.tracking.api import MlflowApi
from stagewise.tracking.calls import Call, CallBuffer, RunHandle, claim_pending, write_pending
from stagewise.tracking.runs import Tracker, gaps
from tests.mlflow_server import free_port


def test_the_buffer_drops_what_does_not_fit_and_keeps_creating_and_ending_runs():
    """Invariant: len and bytes stay within the bound for metrics; create and end are never dropped (no run left
    RUNNING for want of room); each dropped call is counted."""
    handle = RunHandle("stage-s1")
    buffer = CallBuffer(max_calls=3, max_bytes=10_000)
    assert buffer.put(Call(kind="create", handle=handle, body={"name": "s1", "tags": {}, "params": {}}))
    logged = [buffer.put(Call(kind="log", handle=handle, body={"metrics": [{"key": "loss"}], "params": {}, "tags": {}}))
              for _ in range(5)]
    assert logged == [True, True, False, False, False] and buffer.dropped == 3
    assert buffer.put(Call(kind="end", handle=handle, body={"status": "FINISHED"})) and len(buffer) == 4
    assert not buffer.put(Call(kind="upload", handle=handle, body={"path": "big", "data": b"x" * 20_000}, size=20_064))
    assert buffer.dropped == 4 and [call.kind for call in buffer.take_all()] == ["create", "log", "log", "end"]

    by_bytes = CallBuffer(max_calls=100, max_bytes=1_000)
    kept = sum(by_bytes.put(Call(kind="upload", handle=handle, body={"path": "a", "data": b""}, size=300))
               for _ in range(5))
    assert (kept, by_bytes.dropped, by_bytes.bytes) == (3, 2, 900)


def test_a_tracker_whose_server_is_away_keeps_its_bound_and_reports_what_it_dropped(tmp_path, caplog):
    """Nothing listens: logging only queues, the buffer keeps what fits, the task's log has one warning, the gap
    counts the dropped calls and the ones left for a later task, and the pending record holds those."""
    out = str(tmp_path / "run")
    state = {"uri": "x", "parent_run_id": "parent-1", "experiment_id": "1", "artifact_uri": "file:///nowhere"}
    caplog.set_level(logging.WARNING, logger="stagewise.tracking")
    tracker = Tracker(MlflowApi(f"http://127.0.0.1:{free_port()}", 1), state, out, "train_s1", max_calls=4)
    started = time.monotonic()
    stage = tracker.nested("stage-s1", "train s1", {"stagewise.kind": "stage"}, {"lr": 0.1})
    for epoch in range(10):
        tracker.log(stage, metrics={"loss": 1.0 / (epoch + 1)}, step=epoch)
    tracker.end(stage, "FINISHED")
    assert time.monotonic() - started < 0.5, "logging only queues: the training loop never waits on the network"
    tracker.close(timeout_s=0.5)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "MLflow tracking" in r.getMessage()]
    assert len(warnings) == 1 and "train_s1" in warnings[0]
    # 4 calls fit: the replay of earlier tasks' calls, the create, two epochs; the end always fits; 8 epochs dropped
    (gap,) = gaps(out)
    assert (gap["task"], gap["dropped_calls"], gap["pending_calls"]) == ("train_s1", 8, 4)
    (record,) = claim_pending(out, "a later task")
    assert [call["kind"] for call in record["calls"]] == ["create", "log", "log", "end"]
    assert record["calls"][0]["body"]["params"] == {"lr": 0.1} and record["task"] == "train_s1"


def test_a_pending_record_goes_to_one_claimant_only(tmp_path):
    """Two tasks reaching the server together: the first claim takes the record (and removes it), the second gets none."""
    out = str(tmp_path / "run")
    handle = RunHandle("stage-s2", "run-2")
    assert write_pending(out, "train_s2", [Call(kind="end", handle=handle, body={"status": "FINISHED"}),
                                           Call(kind="replay")], "down", 0) == 1
    first, second = claim_pending(out, "a"), claim_pending(out, "b")
    assert [len(record["calls"]) for record in first] == [1] and second == []
    assert first[0]["calls"][0] == {"kind": "end", "key": "stage-s2", "run_id": "run-2", "artifact_uri": None,
                                    "body": {"status": "FINISHED"}}
    assert not list((tmp_path / "run" / "tracking" / "pending").iterdir())


@pytest.mark.subprocess
def test_a_process_that_exits_on_an_error_ends_its_open_runs_failed(tmp_path):
    """A stage's process dies of an exception before ending its run: at exit the run's end (FAILED, with the reason)
    is still made, or left for the run's next task when the server is away, never forgotten."""
    import subprocess
    import sys

    out = str(tmp_path / "run")
    code = f"""
from stagewise.tracking import runs
from stagewise.tracking.api import MlflowApi
runs.FLUSH_TIMEOUT_S = 0.3
state = {{"uri": "x", "parent_run_id": "parent-1", "experiment_id": "1", "artifact_uri": "file:///nowhere"}}
tracker = runs.Tracker(MlflowApi("http://127.0.0.1:{free_port()}", 1), state, {out!r}, "train_s1")
tracker.nested("stage-s1", "train s1", {{}}, {{}})
raise RuntimeError("the user's loss raised")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "the user's loss raised" in done.stderr
    (record,) = claim_pending(out, "a later task")
    assert [call["kind"] for call in record["calls"]] == ["create", "end"]
    assert record["calls"][1]["body"] == {"status": "FAILED", "reason": "the task's process exited before it ended this run"}
