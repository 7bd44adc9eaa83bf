"""What a stage cost on a cluster (stagewise.reporting.cost): each attempt's figures recorded beside the stage, summed
into the stage's result, and shown in report.json, report.html's Stages table and the ``stagewise.report`` text beside
the stage's samples/s. No cluster: the costs are what the Slurm backend's cost() returns."""

from __future__ import annotations

from html.parser import HTMLParser
from pathlib import Path

from stagewise import report
from stagewise.core import storage
from stagewise.reporting import cost
from tests.tasks.test_report_html import _regression_run

FIRST = {"elapsed_s": 30.0, "cpu_time_s": 120.0, "nodes": 2, "gpu_hours": 0.0, "source": "scontrol"}
SECOND = {"elapsed_s": 12.5, "cpu_time_s": 25.0, "nodes": 1, "gpu_hours": 0.5, "source": "scontrol"}


def test_each_attempts_cost_is_recorded_and_summed_with_the_last_attempts_nodes(tmp_path):
    out = str(tmp_path / "runs" / "d" / "r")
    cost.record(out, "s2", 1, FIRST, job_id="17", state="NODE_FAIL")
    cost.record(out, "s2", 3, SECOND, job_id="19", state="COMPLETED")  # try 2 died before its job ended
    total = cost.gathered(out, "s2", upto=3)
    assert [(a["attempt"], a["job_id"], a["state"]) for a in total["attempts"]] == [(1, "17", "NODE_FAIL"),
                                                                                   (3, "19", "COMPLETED")]
    assert (total["elapsed_s"], total["cpu_time_s"], total["gpu_hours"]) == (42.5, 145.0, 0.5)
    assert (total["nodes"], total["source"]) == (1, "scontrol")
    assert cost.gathered(out, "s1", upto=3) is None
    assert cost.text(total) == "1 node, 42.5 s elapsed, 145.0 CPU-s, 0.500 GPU-h (2 attempts, scontrol)"


def test_unknown_figures_stay_unknown_not_zero():
    total = cost.summary([{"elapsed_s": 5.0, "cpu_time_s": None, "nodes": 2, "gpu_hours": None, "source": "sacct"}])
    assert total["cpu_time_s"] is None and total["gpu_hours"] is None
    assert cost.text(total) == "2 nodes, 5.0 s elapsed, ? CPU-s, ? GPU-h (1 attempt, sacct)"


class _Table(HTMLParser):
    """The rows of the page's Stages table, as cell texts."""

    def __init__(self) -> None:
        super().__init__()
        self.rows, self.inside, self.caption = [], False, False

    def handle_starttag(self, tag, attrs):
        if tag == "caption":
            self.caption = True
        elif tag == "tr" and self.inside:
            self.rows.append([])

    def handle_endtag(self, tag):
        if tag == "table":
            self.inside = False
        self.caption = self.caption and tag != "caption"

    def handle_data(self, data):
        if self.caption and data == "Stages":
            self.inside = True
        elif self.inside and self.rows and data.strip():
            self.rows[-1].append(data.strip())


def test_a_costed_stage_shows_nodes_elapsed_cpu_and_gpu_hours_beside_samples_per_s(tmp_path):
    """report.json's training entry and stage timing carry the cost, the page's Stages table has a column each, and
    the text summary names them; a stage without a cost (s1, local) has empty cost cells."""
    out = str(tmp_path / "runs" / "regression" / "r2")
    inputs = _regression_run(out)
    spent = cost.summary([{"attempt": 1, "job_id": "7", **FIRST}])
    inputs["training"][1]["cost"] = spent
    inputs["stage_results"] = {"train_s1": [{"duration_s": 3.0}], "train_s2": [{"duration_s": 31.0, "cost": spent}]}
    written = storage.read_json(report.build_report(**inputs)["report_uri"])
    s1, s2 = written["training"]
    assert s2["cost"] == spent and "cost" not in written["stages"]["train_s1"]
    assert written["stages"]["train_s2"]["cost"] == spent
    assert s1["samples_per_s"] == s2["samples_per_s"] == 100.0  # the mean of the epochs' figures

    parser = _Table()
    parser.feed(Path(written["html_uri"]).read_text())
    heads, first, second = parser.rows
    assert heads[-6:] == ["samples/s", "nodes", "elapsed s", "CPU s", "GPU h", "cost from"]
    assert second[0] == "s2" and second[-6:] == ["100", "2", "30", "120", "0", "1 attempt, scontrol"]
    assert first[0] == "s1" and first[-1] == "100"  # a local stage's cost cells are empty

    lines = report.summary_lines({**written, "test_accuracy": None})
    s2_line = next(line for line in lines if line.startswith("  train s2"))
    assert s2_line.endswith("100 samples/s; cost 2 nodes, 30.0 s elapsed, 120.0 CPU-s, 0.000 GPU-h (1 attempt, scontrol)")
    assert "cost" not in next(line for line in lines if line.startswith("  train s1"))


def test_a_page_without_costs_keeps_its_columns_and_takes_samples_per_s_from_the_history(tmp_path):
    """An older report.json (no samples_per_s, no cost) renders the same table with samples/s from metrics.json."""
    from stagewise.reporting import html as report_html

    out = str(tmp_path / "runs" / "regression" / "r3")
    inputs = _regression_run(out)
    page = report_html.render({"training": inputs["training"], "objective": {"metric": "rmse"}},
                              report_html.load_sources({"training": inputs["training"]}, out), plotly_script="")
    parser = _Table()
    parser.feed(page)
    assert parser.rows[0][-1] == "samples/s" and "nodes" not in parser.rows[0]
    assert [row[-1] for row in parser.rows[1:]] == ["100", "100"]
