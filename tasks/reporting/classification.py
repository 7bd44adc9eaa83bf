"""report.html's classification section: the test confusion matrix and, for a binary model, the ROC and
precision-recall curves with the decision threshold inference labels at (report.json's ``classification``)."""

from __future__ import annotations

import html
import json
from typing import Any

CURVE_COLOUR, THRESHOLD_COLOUR = "#1c7ed6", "#c92a2a"


def _layout(title: str, **extra: Any) -> dict[str, Any]:
    return {"title": {"text": title, "x": 0.01, "xanchor": "left"}, "template": "plotly_white",
            "margin": {"l": 70, "r": 30, "t": 60, "b": 60}, "height": 380, **extra}


def _nearest(thresholds: list[float], value: float | None) -> int | None:
    if value is None or not thresholds:
        return None
    return min(range(len(thresholds)), key=lambda index: abs(thresholds[index] - value))


def curves_figure(curves: dict[str, Any] | None, threshold: float | None) -> dict[str, Any] | None:
    """ROC (left) and precision-recall (right) of the test split, the threshold's point marked on both."""
    if not curves or "roc" not in curves:
        return None
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    roc, pr = curves["roc"], curves["pr"]
    fig = make_subplots(rows=1, cols=2, subplot_titles=("ROC curve", "Precision-recall curve"), horizontal_spacing=0.12)
    fig.add_trace(go.Scatter(x=roc["fpr"], y=roc["tpr"], mode="lines", name="ROC", line={"color": CURVE_COLOUR},
                             text=[f"threshold {t:.4g}" for t in roc["thresholds"]],
                             hovertemplate="fpr %{x:.3f}<br>tpr %{y:.3f}<br>%{text}<extra></extra>"), row=1, col=1)
    fig.add_trace(go.Scatter(x=[0, 1], y=[0, 1], mode="lines", name="chance", line={"dash": "dot", "color": "#adb5bd"},
                             hoverinfo="skip"), row=1, col=1)
    fig.add_trace(go.Scatter(x=pr["recall"], y=pr["precision"], mode="lines", name="precision-recall",
                             line={"color": "#ae3ec9"}, text=[f"threshold {t:.4g}" for t in pr["thresholds"]],
                             hovertemplate="recall %{x:.3f}<br>precision %{y:.3f}<br>%{text}<extra></extra>"),
                  row=1, col=2)
    base_rate = curves["positives"] / max(curves["positives"] + curves["negatives"], 1)
    fig.add_trace(go.Scatter(x=[0, 1], y=[base_rate, base_rate], mode="lines", name=f"base rate {base_rate:.3g}",
                             line={"dash": "dot", "color": "#adb5bd"}, hoverinfo="skip"), row=1, col=2)
    at_roc, at_pr = _nearest(roc["thresholds"], threshold), _nearest(pr["thresholds"], threshold)
    if at_roc is not None and at_pr is not None:
        label = f"decision threshold {threshold:.4g}"
        fig.add_trace(go.Scatter(x=[roc["fpr"][at_roc]], y=[roc["tpr"][at_roc]], mode="markers", name=label,
                                 marker={"color": THRESHOLD_COLOUR, "size": 11, "symbol": "x"}), row=1, col=1)
        fig.add_trace(go.Scatter(x=[pr["recall"][at_pr]], y=[pr["precision"][at_pr]], mode="markers", name=label,
                                 marker={"color": THRESHOLD_COLOUR, "size": 11, "symbol": "x"}, showlegend=False),
                      row=1, col=2)
    fig.update_xaxes(title_text="false positive rate", range=[0, 1], row=1, col=1)
    fig.update_yaxes(title_text="true positive rate", range=[0, 1.02], row=1, col=1)
    fig.update_xaxes(title_text="recall", range=[0, 1], row=1, col=2)
    fig.update_yaxes(title_text="precision", range=[0, 1.02], row=1, col=2)
    fig.update_layout(**_layout(f"Test split: {curves['positives']} positives, {curves['negatives']} negatives",
                                legend={"orientation": "h", "y": -0.2}, height=420))
    return json.loads(fig.to_json())


def confusion_table(confusion: dict[str, Any] | None) -> str:
    """The test confusion matrix as a table: a row per true class, a column per predicted class."""
    if not confusion:
        return ""
    labels, counts = confusion["labels"], confusion["counts"]
    head = "".join(f"<th>predicted {html.escape(str(label))}</th>" for label in labels)
    rows = "".join(f"<tr><th>true {html.escape(str(label))}</th>"
                   + "".join(f"<td class=num>{count}</td>" for count in row) + "</tr>"
                   for label, row in zip(labels, counts))
    return f"<table><caption>Confusion matrix (test split)</caption><tr><th></th>{head}</tr>{rows}</table>"


def threshold_table(decision: dict[str, Any] | None) -> str:
    if not decision or decision.get("value") is None:
        return ""
    rule = decision.get("rule") or "f1"
    how = "best F1" if rule == "f1" else f"{rule} at least {decision.get('target')}"
    return (f"<table><caption>Decision threshold</caption><tr><th>positive class at score</th>"
            f"<td class=num>&ge; {decision['value']:.4g}</td></tr><tr><th>chosen on</th><td>validation, {html.escape(how)}"
            f"</td></tr></table>")


def note(details: dict[str, Any]) -> str:
    """The section's one line of explanation."""
    curves = " and the curves of the positive class's score, the decision threshold marked" if details.get("curves") else ""
    return f"The test split's confusion matrix (of the label inference writes){curves}."


def tables(details: dict[str, Any]) -> str:
    return confusion_table(details.get("confusion_matrix")) + threshold_table(details.get("decision_threshold"))
