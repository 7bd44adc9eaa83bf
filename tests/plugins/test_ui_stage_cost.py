"""The run view's Training stages table (a run without report.html): each stage's samples/s and, where a stage ran on
a cluster, its nodes, elapsed seconds, CPU seconds and GPU-hours summed over its attempts (stagewise.reporting.cost)."""

from __future__ import annotations

import re

from stagewise.airflow.ui.run_page import summary_html

COST = {"elapsed_s": 42.5, "cpu_time_s": 145.0, "nodes": 2, "gpu_hours": 0.25, "source": "scontrol",
        "attempts": [{"attempt": 1, "elapsed_s": 30.0}, {"attempt": 2, "elapsed_s": 12.5}]}


def _rows(page: str) -> list[list[str]]:
    """The Training stages table's header and rows, as the texts of their cells."""
    body = page.split("<h2>Training stages</h2>", 1)[1].split("</table>", 1)[0]
    return [[re.sub(r"<[^>]+>", "", cell) for cell in re.findall(r"<t[hd][^>]*>(.*?)</t[hd]>", row)]
            for row in re.findall(r"<tr>(.*?)</tr>", body)]


def test_the_run_views_stage_table_shows_a_stages_cost_beside_its_samples_per_s():
    report = {"objective": {"metric": "accuracy"}, "training": [
        {"stage": "s1", "world_size": 1, "global_batch": 32, "lr": 0.1, "epochs": 2, "steps": 20, "val_metric": 0.9,
         "samples_per_s": 1500.0},
        {"stage": "s2", "world_size": 4, "global_batch": 64, "lr": 0.05, "epochs": 1, "steps": 5, "val_metric": 0.95,
         "samples_per_s": 800.25, "cost": COST}]}
    heads, local, slurm = _rows(summary_html(report))
    assert heads[-7:] == ["validation accuracy", "samples/s", "nodes", "elapsed s", "CPU s", "GPU h", "cost from"]
    assert slurm[0] == "s2" and slurm[-6:] == ["800.2", "2", "42.5", "145", "0.25", "2 attempt(s), scontrol"]
    assert local[0] == "s1" and local[-6] == "1500" and local[-1] == ""


def test_without_any_cost_the_table_has_no_cost_columns():
    report = {"training": [{"stage": "s1", "world_size": 1, "samples_per_s": None}]}
    heads, row = _rows(summary_html(report))
    assert heads[-1] == "samples/s" and "nodes" not in heads and row[-1] == "–"
