"""report.html: one self-contained, offline page per run, beside its report.json.

Run: ``python -m stagewise.report html <run prefix>`` renders it again from a finished run's files alone: report.json,
``train/<stage>/metrics.json`` (per-epoch history and resume points) and ``sweep/trials.json`` (every trial).

Four sections: the training curve across all stages on one global step axis (loss, the run's objective and the lr, each
stage's boundary marked with its global batch, learning rate and world size, and where a retry resumed); the sweep
(objective per trial over time by outcome, the best params, parameter importances); the timeline of the run's task
attempts (mapped tasks as lanes); the data counts, the test metrics and the gate's decision against the current model;
a classifier's confusion matrix, and a binary one's ROC and precision-recall curves (stagewise.reporting.classification).
plotly.js is the storage root's one copy (``assets/``, linked by a relative path, so the page opens offline from the
root's folder tree: stagewise.core.assets); each figure is a JSON block that one inline script draws.
"""

from __future__ import annotations

import datetime as dt
import html
import json
import logging
from typing import Any

from stagewise.core import assets, storage
from stagewise.core.errors import DataError
from stagewise.reporting import classification, stage_table
from stagewise.reporting.notify import decision_lines

log = logging.getLogger("stagewise.report")

STATE_COLOURS = {"COMPLETE": "#2b8a3e", "PRUNED": "#e8890c", "FAIL": "#c92a2a", "ABANDONED": "#868e96"}
TASK_COLOURS = {"success": "#2b8a3e", "up_for_retry": "#e8890c", "failed": "#c92a2a", "running": "#868e96"}
LOSS_COLOUR, OBJECTIVE_COLOUR, LR_COLOUR = "#1c7ed6", "#ae3ec9", "#2b8a3e"
NOISE_COLOUR = "#e8590c"  # the gradient noise scale and the batch it is compared with
# what could end or re-open a script block, as JSON's own \u escapes (the same characters once parsed)
_SCRIPT_JSON_ESCAPES = str.maketrans({"<": "\\u003c", ">": "\\u003e", "&": "\\u0026"})

CSS = """
body { font: 15px/1.45 -apple-system, "Segoe UI", Roboto, Helvetica, Arial, sans-serif; color: #212529; margin: 0;
       background: #f8f9fa; }
header { background: #1f2933; color: #f8f9fa; padding: 18px 32px; }
header h1 { margin: 0 0 4px; font-size: 22px; font-weight: 600; }
header .meta { color: #ced4da; font-size: 14px; }
header .outcome { margin-top: 8px; font-size: 16px; }
header .tracking { margin-top: 6px; font-size: 14px; }
header .dropped { margin-top: 6px; font-size: 13px; color: #ced4da; }
header .tracking a { color: #9ecbff; }
.promoted { color: #8ce99a; } .refused { color: #ffc078; }
main { max-width: 1240px; margin: 0 auto; padding: 8px 24px 40px; }
section { background: #fff; border: 1px solid #dee2e6; border-radius: 6px; margin: 18px 0; padding: 14px 20px; }
section h2 { font-size: 18px; margin: 4px 0 6px; }
p.note { color: #495057; margin: 4px 0 10px; font-size: 14px; }
.plot { width: 100%; min-height: 320px; }
.tables { display: flex; flex-wrap: wrap; gap: 28px; }
table { border-collapse: collapse; font-size: 14px; margin: 8px 0; }
caption { text-align: left; font-weight: 600; padding-bottom: 4px; }
th, td { border-bottom: 1px solid #e9ecef; padding: 4px 12px 4px 0; text-align: left; vertical-align: top; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
tr.highlight td { font-weight: 600; }
.missing { color: #868e96; font-style: italic; }
"""

DRAW = """document.querySelectorAll('script[data-figure]').forEach(function (s) {
  var figure = JSON.parse(s.textContent);
  Plotly.newPlot(s.dataset.figure, figure.data, figure.layout, {responsive: true, displaylogo: false});
});"""


def _number(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _read_json(uri: str) -> Any | None:
    try:
        return storage.read_json(uri) if storage.exists(uri) else None
    except (OSError, ValueError, DataError) as exc:
        log.warning("report.html: cannot read %s: %s", uri, exc)
        return None


def objective_of(report: dict[str, Any], trials: dict[str, Any] | None = None) -> tuple[str, str]:
    """The run's objective metric and direction, as its config named them (report.json, else the sweep's record)."""
    named = report.get("objective") or {}
    metric = named.get("metric") or (trials or {}).get("metric") or "accuracy"
    direction = named.get("direction") or (trials or {}).get("direction") or "maximize"
    return metric, direction


def _better(direction: str) -> str:
    return "lower is better" if direction == "minimize" else "higher is better"


def load_sources(report: dict[str, Any], out: str) -> dict[str, Any]:
    """What the page draws besides report.json: each stage's metrics.json and the sweep's trials.json."""
    stages = {}
    for stage in report.get("training") or []:
        stages[stage["stage"]] = _read_json(storage.join(out, "train", stage["stage"], "metrics.json"))
    trials_uri = (report.get("sweep") or {}).get("trials_uri") or storage.join(out, "sweep", "trials.json")
    return {"stages": stages, "trials": _read_json(trials_uri)}


def _layout(title: str, **extra: Any) -> dict[str, Any]:
    return {"title": {"text": title, "x": 0.01, "xanchor": "left", "yref": "container", "y": 0.98, "yanchor": "top"},
            "template": "plotly_white", "margin": {"l": 70, "r": 70, "t": 84, "b": 60},
            "legend": {"orientation": "h", "x": 0, "xanchor": "left", "y": 1.0, "yanchor": "bottom"},
            "hoverlabel": {"namelength": -1}, **extra}


def _log_axis(title: str, **extra: Any) -> dict[str, Any]:
    """A log axis whose every tick says its value (plotly's default labels a log axis's minor ticks 2..9 alone)."""
    return {"title": {"text": title}, "type": "log", "tickformat": ".2~g", "showgrid": False, **extra}


def training_figure(report: dict[str, Any], sources: dict[str, Any]) -> dict[str, Any] | None:
    """Two panels on one global optimizer-step axis: loss and validation objective per epoch above; the learning
    rate, and the gradient noise scale against each stage's global batch, below, each on a log axis of its own. A
    line and a label per stage start (its details on hover), a marker where a retry resumed from a checkpoint; no
    line crosses from one stage into the next."""
    import plotly.graph_objects as go

    metric, direction = objective_of(report, sources.get("trials"))
    stages = report.get("training") or []
    if not stages:
        return None
    fig = go.Figure()
    loss_x, loss_y, obj_y, hover, lr_y = [], [], [], [], []
    noise_x, noise_y, noise_text, batch_x, batch_y = [], [], [], [], []
    resume_x, resume_y, resume_text = [], [], []
    shapes, annotations, offset = [], [], 0
    attempts = report.get("stages") or {}
    for index, stage in enumerate(stages):
        name = stage["stage"]
        metrics = sources["stages"].get(name) or {}
        history = metrics.get("history") or []
        attempt = (attempts.get(f"train_{name}") or {}).get("attempt") or 1
        decision = stage.get("batch_decision") or {}
        adaptive = (f" (adaptive: noise scale {_number(decision.get('noise_scale'))})" if decision else "")
        details = (f"{html.escape(name)}: global batch {stage.get('global_batch')}{adaptive}<br>lr "
                   f"{_number(stage.get('lr'))}<br>world size {stage.get('world_size')}"
                   + (f"<br>attempt {attempt}" if attempt > 1 else ""))
        shapes.append({"type": "line", "name": f"stage:{name}", "xref": "x", "yref": "paper", "x0": offset, "x1": offset,
                       "y0": 0, "y1": 1, "line": {"color": "#495057", "width": 1.5, "dash": "dash"}})
        # Short labels, stepped down in turn, clear of the axis: adaptive stages can start a few steps apart.
        annotations.append({"name": f"stage:{name}", "x": offset, "xref": "x", "y": 1 - 0.07 * (index % 3),
                            "yref": "paper", "xshift": 4, "text": f"<b>{html.escape(name)}</b> · batch "
                            f"{stage.get('global_batch')}" + (f" · attempt {attempt}" if attempt > 1 else ""),
                            "hovertext": details, "showarrow": False, "xanchor": "left", "yanchor": "top",
                            "align": "left", "bgcolor": "rgba(255,255,255,0.85)", "bordercolor": "#adb5bd",
                            "font": {"size": 11}})
        if index:  # a gap: no line runs from one stage's last epoch to the next one's first
            for series in (loss_x, loss_y, obj_y, lr_y, hover, noise_x, noise_y, noise_text):
                series.append(None)
        for entry in history:
            step = offset + int(entry["steps"])
            norm = f", grad norm {_number(entry['grad_norm'])} before clipping" if entry.get("grad_norm") is not None else ""
            text = (f"stage {name}, epoch {entry['epoch'] + 1}, step {step}<br>lr {_number(entry.get('lr'))}, "
                    f"{_number(entry.get('samples_per_s'))} samples/s{norm}")
            loss_x.append(step)
            loss_y.append(entry["train_loss"])
            obj_y.append(entry["val_metric"])
            lr_y.append(entry.get("lr"))
            hover.append(text)
            if entry.get("noise_scale") is not None and 0 < entry["noise_scale"] < float("inf"):
                noise_x.append(step)
                noise_y.append(entry["noise_scale"])
                noise_text.append(text)
        for number, resume in enumerate(metrics.get("resumes") or [], start=1):
            step = offset + int(resume["step"])
            before = [e for e in history if int(e["steps"]) <= int(resume["step"])]
            resume_x.append(step)
            resume_y.append((before[-1] if before else history[0])["train_loss"] if history else None)
            resume_text.append(f"stage {name}: retry {number} resumed from the checkpoint at step {step} "
                               f"(epoch {int(resume['epoch']) + 1})")
            shapes.append({"type": "line", "name": f"resume:{name}:{number}", "xref": "x", "yref": "paper", "x0": step,
                           "x1": step, "y0": 0.45, "y1": 0.85, "line": {"color": "#c92a2a", "width": 1, "dash": "dot"}})
        last = int(history[-1]["steps"]) if history else int(stage.get("steps") or 0)
        if stage.get("global_batch"):  # the batch the stage trained at, beside the noise scale it measured
            batch_x += [offset, offset + last, None]
            batch_y += [stage["global_batch"], stage["global_batch"], None]
        offset += last
    fig.add_trace(go.Scatter(x=loss_x, y=loss_y, name="training loss", mode="lines+markers",
                             line={"color": LOSS_COLOUR}, text=hover, hovertemplate="loss %{y:.4g}<br>%{text}<extra></extra>"))
    fig.add_trace(go.Scatter(x=loss_x, y=obj_y, name=f"validation {metric} (right axis, {_better(direction)})",
                             mode="lines+markers", yaxis="y2", line={"color": OBJECTIVE_COLOUR}, text=hover,
                             hovertemplate=f"val {metric} %{{y:.4g}}<br>%{{text}}<extra></extra>"))
    if resume_x:
        fig.add_trace(go.Scatter(x=resume_x, y=resume_y, name="resumed from checkpoint (retry)", mode="markers",
                                 marker={"symbol": "x", "size": 12, "color": "#c92a2a"}, text=resume_text,
                                 hovertemplate="%{text}<extra></extra>"))
    # The lr each epoch ended at: the batch rescale, warmup and the stage's schedule, in the lower panel.
    fig.add_trace(go.Scatter(x=loss_x, y=lr_y, name="learning rate (lower panel)", mode="lines+markers",
                             yaxis="y3", line={"color": LR_COLOUR, "dash": "dot"}, text=hover,
                             hovertemplate="lr %{y:.4g}<br>%{text}<extra></extra>"))
    if noise_x:  # B_simple against the global batch: where the noise scale is above the batch, a larger one pays
        fig.add_trace(go.Scatter(x=noise_x, y=noise_y, name="gradient noise scale B_simple (lower panel, right)",
                                 mode="lines+markers", yaxis="y4", line={"color": NOISE_COLOUR}, text=noise_text,
                                 hovertemplate="noise scale %{y:.4g}<br>%{text}<extra></extra>"))
        fig.add_trace(go.Scatter(x=batch_x, y=batch_y, name="global batch (lower panel, right)", mode="lines",
                                 yaxis="y4", line={"color": NOISE_COLOUR, "dash": "dash", "width": 1},
                                 hovertemplate="global batch %{y}<extra></extra>"))
    fig.update_layout(**_layout(f"Training across {len(stages)} stage(s): loss and validation {metric} per epoch; "
                                "below, the learning rate and the noise scale", shapes=shapes, annotations=annotations,
                                height=620,
                                xaxis={"title": {"text": "optimizer step (global, counted across stages)"},
                                       "rangemode": "tozero", "anchor": "y3"},
                                yaxis={"title": {"text": "training loss"}, "domain": [0.45, 1.0]},
                                yaxis2={"title": {"text": f"validation {metric} ({_better(direction)})"},
                                        "overlaying": "y", "side": "right", "showgrid": False},
                                yaxis3=_log_axis("learning rate", domain=[0.0, 0.33], anchor="x"),
                                **({"yaxis4": _log_axis("noise scale / global batch", overlaying="y3", side="right",
                                                        anchor="x")} if noise_x else {})))
    return json.loads(fig.to_json())


def _trial_y(trial: dict[str, Any]) -> float | None:
    if trial.get("value") is not None:
        return trial["value"]
    steps = trial.get("intermediate") or {}
    return steps[max(steps, key=int)] if steps else None


def _trial_state(trial: dict[str, Any]) -> str:
    return trial["state"] if trial.get("counted", True) else "ABANDONED"


def sweep_figure(report: dict[str, Any], trials: dict[str, Any] | None) -> dict[str, Any] | None:
    """Each trial's objective at the time it finished, coloured by outcome, with the best-so-far line."""
    import plotly.graph_objects as go

    if not trials or not trials.get("trials"):
        return None
    metric, direction = objective_of(report, trials)
    rows = sorted(trials["trials"], key=lambda t: (t.get("complete") or t.get("start") or "", t["number"]))
    known = [y for t in rows if (y := _trial_y(t)) is not None]
    floor = (max(known) if direction == "minimize" else min(known)) if known else 0.0
    fig = go.Figure()
    labels = {"COMPLETE": "complete", "PRUNED": "pruned (value at its last report)", "FAIL": "failed",
              "ABANDONED": "abandoned (its worker died; retried)"}
    for state, label in labels.items():
        picked = [t for t in rows if _trial_state(t) == state]
        if not picked and state == "ABANDONED":
            continue
        ys = [_trial_y(t) for t in picked]
        no_value = state in ("FAIL", "ABANDONED")
        fig.add_trace(go.Scatter(
            x=[t.get("complete") or t.get("start") for t in picked], y=[floor if no_value else y for y in ys],
            name=f"{label}: {len(picked)}", mode="markers", meta={"state": state},
            marker={"color": STATE_COLOURS[state], "size": 10, "symbol": "x" if no_value else "circle",
                    "line": {"width": 1, "color": "#fff"}},
            text=[f"trial {t['number']} (worker {t.get('worker')}): {state.lower()}<br>"
                  + "<br>".join(f"{k} = {html.escape(_number(v))}" for k, v in sorted((t.get("params") or {}).items()))
                  + (f"<br>{html.escape(str(t['error'])[:160])}" if t.get("error") else "") for t in picked],
            hovertemplate=f"{metric} %{{y:.4g}}<br>%{{text}}<extra></extra>"))
    best_x, best_y, best = [], [], None
    for t in rows:
        if _trial_state(t) == "COMPLETE" and t.get("value") is not None:
            if best is None or (t["value"] < best if direction == "minimize" else t["value"] > best):
                best = t["value"]
            best_x.append(t.get("complete"))
            best_y.append(best)
    fig.add_trace(go.Scatter(x=best_x, y=best_y, name="best so far", mode="lines", line={"shape": "hv", "color": "#495057"},
                             hoverinfo="skip"))
    fig.update_layout(**_layout(f"Sweep: validation {metric} of each trial when it finished ({direction})", height=420,
                                xaxis={"title": {"text": "trial finished at (UTC)"}, "type": "date"},
                                yaxis={"title": {"text": f"validation {metric} ({_better(direction)})"}}))
    return json.loads(fig.to_json())


def importance_trials_needed(importances: dict[str, float] | None) -> int:
    """Completed trials below which fANOVA's shares say nothing (with two, every parameter gets an equal share): five,
    and two per parameter."""
    return max(5, 2 * len(importances or {}))


def importance_figure(importances: dict[str, float] | None, completed: int) -> dict[str, Any] | None:
    import plotly.graph_objects as go

    if not importances or completed < importance_trials_needed(importances):
        return None
    ordered = sorted(importances.items(), key=lambda kv: kv[1])
    fig = go.Figure(go.Bar(x=[v for _, v in ordered], y=[k for k, _ in ordered], orientation="h", name="importance",
                           marker={"color": "#1c7ed6"}, hovertemplate="%{y}: %{x:.3f}<extra></extra>"))
    fig.update_layout(**_layout("Parameter importance (fANOVA over the completed trials)", height=140 + 36 * len(ordered),
                                showlegend=False, xaxis={"title": {"text": "share of the objective's variance explained"},
                                                         "range": [0, 1]}))
    return json.loads(fig.to_json())


def lane(entry: dict[str, Any]) -> str:
    """A task's lane in the timeline: its id, and for a mapped task its map index."""
    index = entry.get("map_index")
    return f"{entry['task_id']}[{index}]" if index is not None and int(index) >= 0 else entry["task_id"]


def _parse(moment: str) -> dt.datetime:
    parsed = dt.datetime.fromisoformat(moment)
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=dt.UTC)


def timeline_figure(tasks: list[dict[str, Any]], generated_at: str) -> dict[str, Any] | None:
    """A Gantt chart of the run's task attempts: a lane per task (per map index), a bar per attempt by outcome."""
    import plotly.graph_objects as go

    entries = [t for t in tasks if t.get("start")]
    if not entries:
        return None
    lanes = []
    for entry in sorted(entries, key=lambda t: t["start"]):
        if lane(entry) not in lanes:
            lanes.append(lane(entry))
    fig = go.Figure()
    for state, colour in TASK_COLOURS.items():
        picked = [t for t in entries if (t.get("state") or "running") == state]
        if not picked:
            continue
        ends = [_parse(t["end"] or generated_at) for t in picked]
        starts = [_parse(t["start"]) for t in picked]
        label = "running or ended unrecorded" if state == "running" else state.replace("_", " ")
        fig.add_trace(go.Bar(
            base=[s.isoformat() for s in starts], x=[max((e - s).total_seconds() * 1000, 1.0) for s, e in zip(starts, ends)],
            y=[lane(t) for t in picked], orientation="h", name=f"{label}: {len(picked)}", meta={"state": state},
            marker={"color": colour}, text=[f"try {t['try_number']}" for t in picked], textposition="inside",
            insidetextanchor="middle", customdata=[[(e - s).total_seconds()] for s, e in zip(starts, ends)],
            hovertemplate="%{y} %{text}: %{customdata[0]:.1f} s<br>from %{base|%H:%M:%S}<extra></extra>"))
    fig.update_layout(**_layout("Task timeline: every attempt of every task (mapped tasks as separate lanes)",
                                height=140 + 22 * len(lanes), barmode="overlay", bargap=0.25,
                                xaxis={"title": {"text": "wall-clock time (UTC)"}, "type": "date"},
                                yaxis={"title": {"text": "task [map index]"}, "categoryorder": "array",
                                       "categoryarray": lanes, "autorange": "reversed", "automargin": True}))
    return json.loads(fig.to_json())


def data_figure(report: dict[str, Any]) -> dict[str, Any] | None:
    import plotly.graph_objects as go

    rows = (report.get("data") or {}).get("rows") or {}
    if not rows:
        return None
    split_names = [name for name in ("train", "validation", "test") if name in rows] + \
        [name for name in rows if name not in ("train", "validation", "test")]
    aside = {"dropped as dirty (preprocess)": (report.get("data") or {}).get("rows_dropped") or 0,
             "quarantined (inference)": (report.get("predictions") or {}).get("rows_quarantined") or 0}
    fig = go.Figure()
    fig.add_trace(go.Bar(x=split_names, y=[rows[n] for n in split_names], name="rows kept, by split",
                         marker={"color": "#1c7ed6"}, text=[rows[n] for n in split_names], textposition="outside"))
    fig.add_trace(go.Bar(x=list(aside), y=list(aside.values()), name="rows set aside", marker={"color": "#c92a2a"},
                         text=list(aside.values()), textposition="outside"))
    fig.update_layout(**_layout("Data: rows by split, and rows set aside", height=360,
                                yaxis={"title": {"text": "rows"}}, xaxis={"title": {"text": ""}}))
    return json.loads(fig.to_json())


def _table(caption: str, rows: list[tuple[str, Any]], highlight: str | None = None) -> str:
    rows = [(key, value) for key, value in rows if value is not None]  # what the run did not record is left out
    if not rows:
        return ""
    body = "".join(f"<tr{' class=highlight' if key == highlight else ''}><th>{html.escape(str(key))}</th>"
                   f"<td class=num>{html.escape(_number(value))}</td></tr>" for key, value in rows)
    return f"<table><caption>{html.escape(caption)}</caption>{body}</table>"


def _script_json(value: Any) -> str:
    """``value`` as JSON that is inert inside ``<script type="application/json">``: no string in it can end or confuse
    the block (``</script>``, ``<!--``, ``<script``), and JSON.parse of the element's text gives ``value`` back."""
    # ensure_ascii writes every non-ASCII character, U+2028/U+2029 included, as \uXXXX
    return json.dumps(value, separators=(",", ":"), ensure_ascii=True).translate(_SCRIPT_JSON_ESCAPES)


def _figure_block(figure_id: str, figure: dict[str, Any] | None, missing: str) -> tuple[str, str]:
    """The figure's div and its JSON block; a note in its place when the run recorded nothing to draw."""
    if figure is None:
        return f"<p class=missing>{html.escape(missing)}</p>", ""
    return (f'<div id="{figure_id}" class="plot"></div>',
            f'<script type="application/json" data-figure="{figure_id}">{_script_json(figure)}</script>')


def config_line(config: dict[str, Any]) -> str:
    """The header's word on the run's config: the snapshot's hash (its URI on hover; it sits beside report.json)."""
    if not config.get("config_hash"):
        return "config not recorded"
    return (f'config <b title="{html.escape(str(config.get("config_uri")))}">'
            f'{html.escape(str(config["config_hash"]))}</b> (config.yaml, from {html.escape(str(config.get("config_source")))})')


def reuse_line(report: dict[str, Any]) -> str:
    """The header's word on work this run reused from earlier runs (stagewise.reuse), and the interval it read."""
    parts = [f"{html.escape(step)} reused from {html.escape(str(source))}"
             for step, source in sorted((report.get("reused") or {}).items())]
    if (interval := report.get("data_interval") or {}).get("start"):
        parts.insert(0, f"data interval {html.escape(str(interval.get('start')))} to {html.escape(str(interval.get('end')))}")
    return f'<div class="reused">{" · ".join(parts)}</div>' if parts else ""


def dropped_line(report: dict[str, Any]) -> str:
    """The header's word on the files only a resume reads (checkpoints, hand-offs, the split copy) that went once the
    run succeeded, and on what stayed and why (stagewise.reuse.leftovers)."""
    dropped = report.get("dropped")
    if not isinstance(dropped, dict):
        return ""
    files = [entry for entry in dropped.get("files") or [] if isinstance(entry, dict)]
    listed = "".join(f"<li>{html.escape(str(entry.get('file')))}: {int(entry.get('bytes') or 0):,} bytes</li>"
                     for entry in files)
    kept = f" · {html.escape(str(dropped['kept']))}" if dropped.get("kept") else ""
    return (f'<div class="dropped"><details><summary>{len(files)} file(s) only a resume reads dropped after the run '
            f'succeeded, {int(dropped.get("bytes") or 0):,} bytes{kept}</summary><ul>{listed}</ul></details></div>')


def tracking_line(tracking: dict[str, Any] | None) -> str:
    """Links to the MLflow run and model version, and what tracking missed (empty when the run was not tracked)."""
    if not tracking:
        return ""
    parts = []
    web = ("http://", "https://")
    if str(tracking.get("run_url") or "").startswith(web):
        parts.append(f'<a href="{html.escape(tracking["run_url"])}" target="_blank" rel="noopener">MLflow run</a>')
    if str(tracking.get("model_version_url") or "").startswith(web):
        parts.append(f'<a href="{html.escape(tracking["model_version_url"])}" target="_blank" rel="noopener">'
                     f'MLflow model {html.escape(str(tracking.get("model_version_label") or "version"))}</a>')
    for gap in tracking.get("gaps") or []:
        dropped = f", {gap['dropped_calls']} call(s) dropped" if gap.get("dropped_calls") else ""
        parts.append(f'<span class=refused title="{html.escape(str(gap.get("error")))}">tracking gap in '
                     f'{html.escape(str(gap.get("task")))}{dropped}</span>')
    return f'<div class="tracking">{" · ".join(parts)}</div>' if parts else ""


def outcome_line(report: dict[str, Any], metric: str) -> str:
    registry = report.get("registry") or {}
    test = (report.get("objective") or {}).get("test")
    parts = []
    if registry:
        verdict = "promoted to current" if registry.get("promoted") else "not promoted"
        if registry.get("report_only"):  # CI's gate: what it would have done, nothing moved
            verdict = f"not promoted (report only: {html.escape(str(registry.get('decision')))})"
        parts.append(f"<span class={'promoted' if registry.get('promoted') else 'refused'}>model "
                     f"{html.escape(str(registry.get('version')))} {verdict}</span> ({html.escape(str(registry.get('reason')))})")
    if test is not None:
        parts.append(f"test {html.escape(metric)} {_number(test)}")
    if "training" not in report and report.get("model_version"):  # a batch_inference run
        predictions = report.get("predictions") or {}
        parts.append(f"scored {predictions.get('rows')} rows with model {html.escape(str(report['model_version']))}, "
                     f"{predictions.get('rows_quarantined') or 0} quarantined")
    return " · ".join(parts) or "no model was registered"


def render(report: dict[str, Any], sources: dict[str, Any], generated_at: str | None = None,
           plotly_script: str | None = None) -> str:
    """The whole page as one string: header, the sections (four for a pipeline run; scoring and the timeline for a
    batch_inference run), plotly.js once (``plotly_script``, the tag that loads it; default: inline), each figure's
    JSON and one draw script."""
    if plotly_script is None:
        plotly_script = f'<script type="text/javascript">{assets.plotly_js()[1].decode()}</script>'

    generated_at = generated_at or dt.datetime.now(dt.UTC).isoformat()
    trials = sources.get("trials")
    metric, direction = objective_of(report, trials)
    sweep = report.get("sweep") or {}
    blocks, scripts = {}, {}
    for figure_id, figure, missing in (
            ("fig-training", training_figure(report, sources), "No training stage recorded a history."),
            ("fig-sweep", sweep_figure(report, trials), "No per-trial record (sweep/trials.json) was found."),
            ("fig-importance", importance_figure(sweep.get("importances"), int(sweep.get("n_complete") or 0)),
             f"Parameter importances need at least {importance_trials_needed(sweep.get('importances'))} completed "
             f"trials to mean anything; this sweep completed {int(sweep.get('n_complete') or 0)}."),
            ("fig-timeline", timeline_figure(report.get("tasks") or [], generated_at),
             "No task attempt was recorded for this run (timeline/)."),
            ("fig-data", data_figure(report), "No data counts were recorded.")):
        blocks[figure_id], scripts[figure_id] = _figure_block(figure_id, figure, missing)

    best = _table("Best trial", [("trial", sweep.get("best_trial")), (f"validation {metric}", sweep.get("best_value")),
                                 *sorted((sweep.get("best_params") or {}).items())])
    counts = _table("Trials", [(key[2:], sweep.get(key)) for key in ("n_trials", "n_complete", "n_pruned", "n_failed")
                               if sweep.get(key) is not None])
    stages_table = stage_table.render(report.get("training") or [], sources, metric)
    data = report.get("data") or {}
    predictions = report.get("predictions") or {}
    data_table = _table("Rows", [*[(f"{name} split", count) for name, count in (data.get("rows") or {}).items()],
                                 ("dropped as dirty (preprocess)", data.get("rows_dropped")),
                                 ("scored (inference)", predictions.get("rows")),
                                 ("quarantined (inference)", predictions.get("rows_quarantined"))])
    test_metrics = dict(sorted((report.get("test_metrics") or {}).items()))
    test_table = _table(f"Test metrics (objective: {metric}, {direction})", list(test_metrics.items()),
                        highlight=f"test_{metric}")
    registry = report.get("registry") or {}
    gate_metric = registry.get("metric") or f"test_{metric}"
    gate_table = _table(f"Gate on {gate_metric} ({registry.get('direction') or direction}, margin "
                        f"{_number(registry.get('margin'))})", [
                            ("this run's model", registry.get("version")),
                            (f"its {gate_metric}", registry.get("candidate_value")),
                            ("current model before the gate", registry.get("previous") or "none"),
                            (f"its {gate_metric}", registry.get("incumbent_value")),
                            ("decision", "promoted" if registry.get("promoted") else "not promoted"),
                            ("why", registry.get("decision") or registry.get("reason")),
                            ("model scored (would be current)" if registry.get("report_only") else "current model now",
                             registry.get("current")), *decision_lines(registry)]) \
        if registry else "<p class=missing>No gate decision was recorded.</p>"
    title = f"{report.get('dag_id')} / {report.get('run_id')}"
    objective = f" · objective <b>{html.escape(metric)}</b> ({html.escape(direction)})"
    timeline_section = f"""<section id="timeline"><h2>Task timeline</h2>
<p class="note">Every attempt of every task, from its start to its end; a retried task shows one bar per try.</p>
{blocks['fig-timeline']}</section>"""
    details = report.get("classification") or {}
    classification_section = ""
    if details:  # a classifier's: the confusion matrix, and a binary one's curves
        threshold = (details.get("decision_threshold") or {}).get("value")
        figure = classification.curves_figure(details.get("curves"), threshold)
        block, scripts["fig-curves"] = _figure_block("fig-curves", figure, "") if figure else ("", "")
        classification_section = f"""<section id="classification"><h2>Classification</h2>
<p class="note">{classification.note(details)}</p>{block}<div class="tables">{classification.tables(details)}</div></section>"""
    if "training" in report:
        sections = f"""<section id="training"><h2>Training across stages</h2>
<p class="note">Each point is one epoch, placed at the optimizer step it ended on, counted across all stages. A dashed line
marks where a stage began (its name and global batch beside it; hover the label for its learning rate and world size);
a red cross and dotted line mark where a retry resumed from a checkpoint. The lower panel holds the learning rate and,
where measured, the gradient noise scale against each stage's global batch, each on a log axis of its own.</p>
{blocks['fig-training']}<div class="tables">{stages_table}</div></section>
<section id="sweep"><h2>Sweep</h2>
<p class="note">Every trial of the study, by outcome; pruned trials at the value of their last report (an epoch, or a round of a row budget), failed ones
on the axis' worst edge.</p>
{blocks['fig-sweep']}<div class="tables">{best}{counts}</div>{blocks['fig-importance']}</section>
{timeline_section}
<section id="outcome"><h2>Data, test metrics and the gate</h2>
{blocks['fig-data']}<div class="tables">{data_table}{test_table}{gate_table}</div></section>
{classification_section}"""
    else:  # a batch_inference run: no training, sweep or gate, only what it scored and how its tasks ran
        objective, scripts = "", {"fig-timeline": scripts["fig-timeline"]}
        scoring = _table("Scoring", [("model version", report.get("model_version")), ("rows scored", predictions.get("rows")),
                                     ("rows quarantined", predictions.get("rows_quarantined")),
                                     ("predictions manifest", predictions.get("uri"))])
        sections = f"""<section id="outcome"><h2>Scoring</h2><div class="tables">{scoring}</div></section>
{timeline_section}"""
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>Stagewise run {html.escape(title)}</title>
<style>{CSS}</style>
{plotly_script}
</head><body>
<header><h1>Stagewise run {html.escape(title)}</h1>
<div class="meta">dag_id <b>{html.escape(str(report.get('dag_id')))}</b> · run_id <b>{html.escape(str(report.get('run_id')))}</b>
{objective} · {config_line(report.get('config') or {})} · report generated {html.escape(generated_at[:19])} UTC</div>
<div class="outcome">{outcome_line(report, metric)}</div>{tracking_line(report.get('tracking'))}{reuse_line(report)}{dropped_line(report)}</header>
<main>
{sections}
</main>
{''.join(scripts.values())}
<script type="text/javascript">{DRAW}</script>
</body></html>
"""


def write(report: dict[str, Any], out: str, sources: dict[str, Any] | None = None) -> str:
    """Render the run's page and put it at ``<out>/report.html`` in one write, linking the storage root's plotly.js;
    ``sources``: what :func:`load_sources` read (read here when not given). Returns its URI."""
    uri = storage.join(out, "report.html")
    sources = sources if sources is not None else load_sources(report, out)
    page = render(report, sources, plotly_script=assets.plotly_script(out, out))
    storage.write_bytes(uri, page.encode())
    log.info("report page written to %s", uri)
    return uri
