"""A run's task attempts as files (stagewise.reporting.timeline): one record per attempt, rewritten whole, listed by start."""

from __future__ import annotations

from stagewise.reporting import timeline


def test_an_attempt_keeps_its_first_start_and_gains_its_end(tmp_path):
    """The end rewrite (or a deferred task's second start) keeps the first recorded start; each try is its own record."""
    out = str(tmp_path / "runs" / "d" / "r")
    timeline.record(out, task_id="train_s1", map_index=-1, try_number=1, state="running", start="2026-01-01T10:00:00+00:00")
    timeline.record(out, task_id="train_s1", map_index=-1, try_number=1, state="up_for_retry",
                    start="2026-01-01T10:05:00+00:00", end="2026-01-01T10:01:00+00:00")
    timeline.record(out, task_id="train_s1", map_index=-1, try_number=2, state="success", start="2026-01-01T10:02:00+00:00",
                    end="2026-01-01T10:03:00+00:00")
    timeline.record(out, task_id="infer_shard", map_index=3, try_number=1, state="running", start="2026-01-01T09:59:00+00:00")
    found = timeline.records(out)
    assert [(r["task_id"], r["map_index"], r["try_number"], r["state"]) for r in found] == [
        ("infer_shard", 3, 1, "running"), ("train_s1", -1, 1, "up_for_retry"), ("train_s1", -1, 2, "success")]
    assert found[1]["start"] == "2026-01-01T10:00:00+00:00" and found[1]["end"] == "2026-01-01T10:01:00+00:00"
    assert found[0]["end"] is None
    assert set(found[0]) == {*timeline.FIELDS, "wait_s"}


def test_a_run_without_records_has_an_empty_timeline(tmp_path):
    """No timeline/ folder (a run from before it existed) reads as no attempts, not an error."""
    assert timeline.records(str(tmp_path / "nothing")) == []


def test_an_unreadable_record_is_skipped(tmp_path):
    """A stray file that is no JSON is left out with a warning instead of failing the report."""
    out = str(tmp_path)
    timeline.record(out, task_id="a", map_index=-1, try_number=1, state="success", start="2026-01-01T10:00:00+00:00")
    (tmp_path / "timeline" / "junk.json").write_text("{not json")
    assert [r["task_id"] for r in timeline.records(out)] == ["a"]


def _attempt(task_id: str, start: str, end: str | None, *, upstream: list[str] | None, try_number: int = 1,
             map_index: int = -1, ready: str | None = None) -> dict:
    """A synthetic attempt record at 10:MM:SS on 2026-01-01 (start and end given as 'MM:SS')."""
    stamp = "2026-01-01T10:{}+00:00".format
    return {"task_id": task_id, "map_index": map_index, "try_number": try_number, "state": "success",
            "start": stamp(start), "end": stamp(end) if end else None, "upstream": upstream,
            "ready": stamp(ready) if ready else None}


def test_an_attempt_waits_from_when_it_could_have_started():
    """A first task waits from its run's start, a task from its last upstream attempt's end (every map index counts),
    a retry from its previous try's end; a task whose upstream left no ended record, or a record from before upstream
    was kept, has no known wait (None), never a made-up one."""
    found = timeline.waits([
        _attempt("start_run", "00:05", "00:10", upstream=[], ready="00:00"),
        _attempt("preprocess_stats", "00:12", "00:20", upstream=["start_run"], map_index=0),
        _attempt("preprocess_stats", "01:30", "01:40", upstream=["start_run"], map_index=1),
        _attempt("reduce_stats", "02:40", "02:41", upstream=["preprocess_stats", "start_run"]),
        _attempt("train_s1", "03:00", "03:30", upstream=["reduce_stats"]),
        _attempt("train_s1", "04:00", "04:30", upstream=["reduce_stats"], try_number=2),
        _attempt("evaluate", "05:00", None, upstream=["never_ran"]),
        _attempt("old_record", "05:00", "05:01", upstream=None)])
    assert [entry["wait_s"] for entry in found] == [5.0, 2.0, 80.0, 60.0, 19.0, 30.0, None, None]


def test_stage_waits_sum_each_stages_tasks_and_leave_run_level_tasks_out():
    """plan/commit tasks count under their stage, train_<stage> under its own; start_run and report under none."""
    found = [{"task_id": task_id, "wait_s": wait} for task_id, wait in (
        ("start_run", 4.0), ("plan_shards", 1.0), ("preprocess_transform", 2.5), ("commit_preprocess", None),
        ("sweep_worker", 7.0), ("train_s2", 3.0), ("gate_model", 0.5), ("infer_shard", 1.5), ("report", 9.0))]
    assert timeline.stage_waits(found) == {"preprocess": 3.5, "sweep": 7.0, "train_s2": 3.0, "registry": 0.5,
                                           "inference": 1.5}
