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
    assert set(found[0]) == set(timeline.FIELDS)


def test_a_run_without_records_has_an_empty_timeline(tmp_path):
    """No timeline/ folder (a run from before it existed) reads as no attempts, not an error."""
    assert timeline.records(str(tmp_path / "nothing")) == []


def test_an_unreadable_record_is_skipped(tmp_path):
    """A stray file that is no JSON is left out with a warning instead of failing the report."""
    out = str(tmp_path)
    timeline.record(out, task_id="a", map_index=-1, try_number=1, state="success", start="2026-01-01T10:00:00+00:00")
    (tmp_path / "timeline" / "junk.json").write_text("{not json")
    assert [r["task_id"] for r in timeline.records(out)] == ["a"]
