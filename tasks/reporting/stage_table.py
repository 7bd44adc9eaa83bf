"""report.html's Stages table: each train stage's shape, outcome, throughput and, for a stage that ran on a cluster,
what it cost (stagewise.reporting.cost)."""

from __future__ import annotations

import html
from typing import Any

from stagewise.reporting import cost


def number(value: Any) -> str:
    """A cell's text: floats to 4 significant digits, anything else as it is."""
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


# The stage table's cost columns (stagewise.reporting.cost), shown where any stage ran on a cluster.
COST_COLUMNS = (("nodes", "nodes"), ("elapsed_s", "elapsed s"), ("cpu_time_s", "CPU s"), ("gpu_hours", "GPU h"))


def render(training: list[dict[str, Any]], sources: dict[str, Any], metric: str) -> str:
    """The Stages table: each stage's shape, outcome and throughput (samples/s, from report.json or its history) and,
    where any stage ran on a cluster, what it cost (nodes, elapsed, CPU time, GPU-hours, summed over its attempts)."""
    if not training:
        return ""
    costed = any(isinstance(s.get("cost"), dict) for s in training)
    rows = []
    for s in training:
        speed = s.get("samples_per_s")
        if speed is None:  # a report.json written before it carried the figure: its history has it
            speed = cost.samples_per_s(((sources.get("stages") or {}).get(s["stage"]) or {}).get("history"))
        cells = [*(s.get(k) for k in ("world_size", "global_batch", "lr", "epochs", "steps", "val_metric",
                                      "handed_epoch")), speed]
        spent = s.get("cost") if isinstance(s.get("cost"), dict) else {}
        if costed:
            cells += [spent.get(key) for key, _ in COST_COLUMNS] if spent else [""] * len(COST_COLUMNS)
        attempts = len(spent.get("attempts") or [])
        title = f' title="{html.escape(cost.text(spent))}"' if spent else ""
        rows.append(f"<tr data-stage='{html.escape(str(s['stage']))}'{title}><th>{html.escape(str(s['stage']))}</th>"
                    f"<td>{html.escape(str(s.get('strategy') or 'ddp'))}</td>"
                    + "".join(f"<td class=num>{html.escape(number(value))}</td>" for value in cells)
                    + (f"<td>{attempts} attempt{'s' if attempts != 1 else ''}, {html.escape(str(spent.get('source')))}"
                       "</td>" if costed and spent else "<td></td>" if costed else "") + "</tr>")
    heads = ["stage", "strategy", "world size", "global batch", "lr", "epochs", "steps", f"val {metric}",
             "epoch handed on", "samples/s"]
    if costed:
        heads += [label for _, label in COST_COLUMNS] + ["cost from"]
    return ("<table><caption>Stages</caption><tr>" + "".join(f"<th>{html.escape(head)}</th>" for head in heads)
            + "</tr>" + "".join(rows) + "</table>")
