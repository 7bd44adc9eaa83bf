"""report.html rendered from a finished run's files alone (no Airflow): every section's figure carries the run's own
numbers, the objective follows the config, nothing is fetched from outside, and an s3:// root works."""

from __future__ import annotations

import json
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest
import yaml

from stagewise import report
from stagewise.core import storage
from stagewise.reporting import html as report_html
from stagewise.reporting import timeline
from stagewise.study.studies import create, open_storage, suggest
from stagewise.study.summary import summarize
from tests.conftest import base_config, preprocess_digits

CHECKPOINT_EVERY = 10
FIGURE = re.compile(r'<script type="application/json" data-figure="([^"]+)">(.*?)</script>', re.S)
HOSTILE = "<!--<script>alert(1)</script> & \u2028\u2029 -->"  # ends, or re-opens, a script block if left raw


def figures(page: str) -> dict[str, dict]:
    """The page's figures by div id, parsed back from the JSON blocks the page draws."""
    found = {name: json.loads(text) for name, text in FIGURE.findall(page)}
    for name in found:
        assert f'<div id="{name}" class="plot"></div>' in page, f"{name} has no div to draw in"
    return found


def traces_by_state(figure: dict) -> dict[str, dict]:
    return {trace["meta"]["state"]: trace for trace in figure["data"] if isinstance(trace.get("meta"), dict)}


class _Refs(HTMLParser):
    """Every URL a browser would fetch on its own: src/href attributes and CSS url(...) in style."""

    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.urls += [value for name, value in attrs if name in ("src", "href", "data", "srcset") and value]
        self.urls += [f"{tag}:{name}" for name, value in attrs if tag == "link" and name == "rel"]


def outside_references(page: str) -> list[str]:
    # The figure JSON and plotly.js sit in script bodies, which the parser leaves alone: what remains is markup.
    parser = _Refs()
    parser.feed(page)
    refs = [url for url in parser.urls if re.match(r"(https?:)?//", url) or url.startswith("link:")]
    return refs + re.findall(r"url\(\s*['\"]?(?:https?:)?//[^)]*\)", page) + re.findall(r"@import", page)


def _crash_second_epoch_once(monkeypatch):
    """Loop.train_epoch raises at the start of the stage's second epoch, once: the first attempt dies mid-stage."""
    from stagewise.training import loop as loop_module

    original, calls = loop_module.Loop.train_epoch, {"n": 0}

    def flaky(self, lr_at, on_step=None):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("worker lost")
        return original(self, lr_at, on_step)

    monkeypatch.setattr(loop_module.Loop, "train_epoch", flaky)
    return lambda: monkeypatch.setattr(loop_module.Loop, "train_epoch", original)



@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A run built by the real sub-job functions in this process: preprocess, a sweep (study + summary), two training
    stages whose first dies once and resumes, evaluation, the registry gate against an earlier current model, the
    task timeline, then the report step. Returns (report dict, run prefix, sweep summary, metrics by stage)."""
    import optuna

    from stagewise import evaluate, registry
    from stagewise.definitions.loading import load_config
    from stagewise.train import run_stage

    monkeypatch = pytest.MonkeyPatch()
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    root = tmp_path_factory.mktemp("html") / "storage"
    root.mkdir()
    raw = base_config(root)
    raw["train"]["checkpoint_every_steps"] = CHECKPOINT_EVERY
    config_path = root.parent / "pipeline.yaml"
    config_path.write_text(yaml.safe_dump(raw))
    config = load_config(config_path)
    out = str(root / "runs" / "ml_pipeline" / "r1")
    prepared = preprocess_digits(config_path, out)

    name = "ml_pipeline__r1"
    create(config, name)
    study = optuna.load_study(study_name=name, storage=open_storage(config.sweep.storage))
    for number, (state, values) in enumerate([("COMPLETE", [0.8, 0.9, 0.93]), ("PRUNED", [0.3]), ("COMPLETE", [0.7, 0.85, 0.9]),
                                              ("PRUNED", [0.2, 0.4]), ("FAIL", []), ("COMPLETE", [0.5, 0.6, 0.7])]):
        trial = study.ask()
        trial.set_user_attr("worker", number % 2)
        suggest(trial, config.sweep)
        for epoch, value in enumerate(values, start=1):
            trial.report(value, epoch)
        trial.set_user_attr("steps", 0 if state == "FAIL" else 30)
        study.tell(trial, values[-1] if state == "COMPLETE" else None, state=optuna.trial.TrialState[state])
    swept = summarize(config, name, out)

    restore = _crash_second_epoch_once(monkeypatch)
    with pytest.raises(RuntimeError, match="worker lost"):
        run_stage(config, "s1", out, swept["best_params"], None)
    restore()
    first = run_stage(config, "s1", out, swept["best_params"], None)  # the retry resumes from its checkpoint
    second = run_stage(config, "s2", out, swept["best_params"], first["checkpoint_uri"])
    trained = [first, second]

    def registered(stage: dict) -> dict:
        evaluation = evaluate.evaluate(config, stage["model_uri"], out)
        card = registry.model_card(config, trained=stage, evaluation=evaluation, best_params=swept["best_params"],
                                   study=name, source_run="ml_pipeline/r1",
                                   manifest_uri=storage.join(out, "preprocess", "manifest.json"))
        return evaluation, registry.register(config.storage_root, config.registry.model_name, stage["model_uri"], card)

    _, incumbent = registered(first)
    registry.gate_new_version(config, incumbent["version"])  # an earlier run's model is current
    evaluation, candidate = registered(second)
    gated = registry.gate_new_version(config, candidate["version"])

    attempts = [("start_run", -1, 1, "success", "2026-01-01T10:00:00+00:00", "2026-01-01T10:00:01+00:00"),
                ("preprocess_stats", 0, 1, "success", "2026-01-01T10:00:02+00:00", "2026-01-01T10:00:05+00:00"),
                ("preprocess_stats", 1, 1, "up_for_retry", "2026-01-01T10:00:02+00:00", "2026-01-01T10:00:04+00:00"),
                ("preprocess_stats", 1, 2, "success", "2026-01-01T10:00:08+00:00", "2026-01-01T10:00:11+00:00"),
                ("train_s1", -1, 1, "up_for_retry", "2026-01-01T10:01:00+00:00", "2026-01-01T10:01:30+00:00"),
                ("train_s1", -1, 2, "success", "2026-01-01T10:01:35+00:00", "2026-01-01T10:02:00+00:00"),
                ("report", -1, 1, "running", "2026-01-01T10:03:00+00:00", None)]
    for task_id, map_index, try_number, state, start, end in attempts:
        timeline.record(out, task_id=task_id, map_index=map_index, try_number=try_number, state=state, start=start, end=end)

    result = report.build_report(
        dag_id="ml_pipeline", run_id="manual__2026-01-01T10:00:00+00:00", out=out,
        stage_results={"train_s1": [{**first, "attempt": 2}], "train_s2": [second]}, preprocess=prepared, sweep=swept,
        training=trained, evaluation=evaluation, predictions={"uri": f"{out}/predictions/manifest.json", "rows": 1797,
                                                              "rows_quarantined": 3, "model_version": gated["current"]},
        registry={**gated, "version": candidate["version"]}, direction=config.objective.direction,
        tasks=timeline.records(out))
    metrics = {s["stage"]: storage.read_json(storage.join(out, "train", s["stage"], "metrics.json")) for s in trained}
    yield storage.read_json(result["report_uri"]), out, swept, metrics
    monkeypatch.undo()


def test_report_step_writes_the_page_beside_report_json(finished_run):
    """report.html sits at runs/<dag_id>/<run_id>/report.html and report.json points at it; it links the storage
    root's plotly.js instead of carrying its 4.8 MB."""
    written, out, _, _ = finished_run
    assert written["html_uri"] == storage.join(out, "report.html")
    assert Path(written["html_uri"]).stat().st_size < 500_000, "plotly.js must be linked, not embedded"


def test_training_curve_spans_every_stage_with_marked_boundaries_and_the_resume(finished_run):
    """One annotation and line per stage at its first global step (name and global batch shown, lr and world size on
    hover), an epoch point per recorded history entry with a gap between stages, the resume marker where the retried
    stage picked up its checkpoint, and below them the lr and the noise scale on log axes that label every tick."""
    written, out, _, metrics = finished_run
    figure = figures(Path(out, "report.html").read_text())["fig-training"]
    stages = written["training"]
    labels = [a for a in figure["layout"]["annotations"] if a.get("name", "").startswith("stage:")]
    assert [a["name"] for a in labels] == [f"stage:{s['stage']}" for s in stages]
    offsets = [0, metrics["s1"]["history"][-1]["steps"]]
    assert [a["x"] for a in labels] == offsets
    assert len({a["y"] for a in labels}) == len(labels), "labels of stages that start close together stand apart"
    for label, stage in zip(labels, stages):
        assert f"batch {stage['global_batch']}" in label["text"] and label["xshift"] > 0
        assert f"world size {stage['world_size']}" in label["hovertext"] and f"lr {stage['lr']:.4g}" in label["hovertext"]
    assert "attempt 2" in labels[0]["text"] and "attempt" not in labels[1]["text"]
    loss, objective, resumed = figure["data"][:3]
    epochs = sum(len(m["history"]) for m in metrics.values())
    gap = len(metrics["s1"]["history"])
    assert loss["x"][gap] is None and loss["y"][gap] is None, "no line from s1's last epoch to s2's first"
    steps = [x for x in loss["x"] if x is not None]
    assert len(steps) == len([y for y in objective["y"] if y is not None]) == epochs
    assert steps == sorted(steps) and steps[-1] == offsets[1] + metrics["s2"]["history"][-1]["steps"]
    assert objective["y"][-1] == pytest.approx(metrics["s2"]["history"][-1]["val_metric"])
    assert "accuracy" in objective["name"] and "higher is better" in figure["layout"]["yaxis2"]["title"]["text"]
    resumes = metrics["s1"]["resumes"]
    assert len(resumes) == 1 and 0 < resumes[0]["step"] <= metrics["s1"]["history"][0]["steps"]
    assert resumed["x"] == [resumes[0]["step"]] and "resumed" in resumed["name"]
    assert not metrics["s2"]["resumes"]
    (lr,) = [trace for trace in figure["data"] if trace["name"].startswith("learning rate")]
    layout = figure["layout"]
    assert lr["x"] == loss["x"] and lr["yaxis"] == "y3" and layout["yaxis3"]["type"] == "log"
    assert [y for y in lr["y"] if y is not None] == [entry["lr"] for name in ("s1", "s2") for entry in metrics[name]["history"]]
    # Two panels: the lr and the noise scale below the loss, never on the loss panel's axes.
    assert layout["yaxis3"]["domain"][1] < layout["yaxis"]["domain"][0]
    # The gradient noise scale each epoch ended at, beside each stage's global batch, on one log axis.
    (noise,) = [trace for trace in figure["data"] if trace["name"].startswith("gradient noise scale")]
    (batch,) = [trace for trace in figure["data"] if trace["name"].startswith("global batch")]
    measured = [(x, e["noise_scale"]) for x, e in zip(steps, [e for n in ("s1", "s2") for e in metrics[n]["history"]])
                if e["noise_scale"] is not None]  # epochs whose smoothed estimate was not positive yet have none
    assert measured and noise["yaxis"] == batch["yaxis"] == "y4" and layout["yaxis4"]["overlaying"] == "y3"
    assert [x for x in noise["x"] if x is not None] == [x for x, _ in measured]
    assert [y for y in noise["y"] if y is not None] == pytest.approx([value for _, value in measured])
    assert layout["yaxis3"]["tickformat"] and layout["yaxis4"]["tickformat"], "every log tick says its value"
    assert [y for y in batch["y"] if y is not None] == [s["global_batch"] for s in stages for _ in range(2)]
    assert [s["noise_scale"] for s in written["training"]] == pytest.approx(
        [metrics[name]["history"][-1]["noise_scale"] for name in ("s1", "s2")])


def test_sweep_figure_counts_each_outcome_as_the_summary_does(finished_run):
    """Complete, pruned and failed trials are separate traces whose point counts match sweep/summary.json; the best
    params and the importances are on the page."""
    written, out, swept, _ = finished_run
    page = Path(out, "report.html").read_text()
    found = figures(page)
    by_state = traces_by_state(found["fig-sweep"])
    counts = {state: len(by_state[state]["x"]) for state in ("COMPLETE", "PRUNED", "FAIL")}
    assert counts == {"COMPLETE": swept["n_complete"], "PRUNED": swept["n_pruned"], "FAIL": swept["n_failed"]}
    assert counts == {"COMPLETE": 3, "PRUNED": 2, "FAIL": 1}
    colours = {by_state[state]["marker"]["color"] for state in counts}
    assert len(colours) == 3, "each outcome has its own colour"
    assert max(by_state["COMPLETE"]["y"]) == pytest.approx(swept["best_value"])
    for param, value in swept["best_params"].items():
        assert f"<th>{param}</th><td class=num>{value if not isinstance(value, float) else f'{value:.4g}'}</td>" in page
    # Three completed trials cannot apportion the variance: a sentence says so instead of a chart of equal shares.
    assert swept["importances"] and "fig-importance" not in found
    needed = max(5, 2 * len(swept["importances"]))
    assert f"Parameter importances need at least {needed} completed trials to mean anything; this sweep completed 3." in page


def test_the_importance_chart_shows_once_enough_trials_completed():
    """fANOVA's shares are drawn from five completed trials (two per parameter when there are more parameters)."""
    from stagewise.reporting.html import importance_figure

    shares = {"lr": 0.7, "momentum": 0.2, "weight_decay": 0.1}
    assert importance_figure(shares, 5) is None
    drawn = importance_figure(shares, 6)
    assert drawn is not None and set(drawn["data"][0]["y"]) == set(shares)


def test_timeline_has_a_lane_per_mapped_task_and_a_bar_per_attempt(finished_run):
    """Mapped tasks get one lane per map index; a retried task shows both tries, each coloured by its outcome."""
    written, out, _, _ = finished_run
    figure = figures(Path(out, "report.html").read_text())["fig-timeline"]
    lanes = figure["layout"]["yaxis"]["categoryarray"]
    assert lanes == ["start_run", "preprocess_stats[0]", "preprocess_stats[1]", "train_s1", "report"]
    by_state = traces_by_state(figure)
    bars = [(lane, text, state) for state, trace in by_state.items() for lane, text in zip(trace["y"], trace["text"])]
    assert len(bars) == len(written["tasks"]) == 7
    assert ("preprocess_stats[1]", "try 1", "up_for_retry") in bars and ("preprocess_stats[1]", "try 2", "success") in bars
    assert ("train_s1", "try 1", "up_for_retry") in bars and ("report", "try 1", "running") in bars
    assert {t["task_id"] for t in written["tasks"]} >= {"start_run", "preprocess_stats", "train_s1", "report"}


def test_data_counts_test_metrics_and_the_gate_against_the_current_model(finished_run):
    """Rows by split and set aside come from the manifest and the predictions; the gate shows both models' metric."""
    written, out, _, _ = finished_run
    page = Path(out, "report.html").read_text()
    kept, aside = figures(page)["fig-data"]["data"]
    rows = storage.read_json(storage.join(out, "preprocess", "manifest.json"))["rows"]
    assert dict(zip(kept["x"], kept["y"])) == rows
    assert aside["y"] == [written["data"]["rows_dropped"], 3]
    gate = written["registry"]
    assert gate["previous"] and gate["incumbent_value"] is not None and gate["candidate_value"] is not None
    assert f"<td class=num>{gate['previous']}</td>" in page and f"{gate['incumbent_value']:.4g}" in page
    assert "Gate on test_accuracy (maximize" in page
    assert f"<tr class=highlight><th>test_accuracy</th><td class=num>{written['test_metrics']['test_accuracy']:.4g}" in page
    assert f"dag_id <b>ml_pipeline</b> · run_id <b>{written['run_id']}</b>" in page


def test_page_fetches_nothing_from_outside(finished_run):
    """No src/href/url() to another host and no <link>: plotly.js is the storage root's own copy, linked once by a
    relative path that resolves to it, and the figures and drawer are inline."""
    _, out, _, _ = finished_run
    page = Path(out, "report.html").read_text()
    assert outside_references(page) == []
    assert page.count("<script") == page.count("</script>")
    assert len(re.findall(r"Plotly\.newPlot", page)) >= 1
    assert sum(1 for _ in re.finditer(r"<script type=\"text/javascript\">", page)) == 1, "the drawer once"
    (src,) = re.findall(r'<script type="text/javascript" data-stagewise-asset="[^"]+" src="([^"]+)"></script>', page)
    assert not src.startswith("/") and (Path(out) / src).resolve().is_file(), "plotly.js linked relatively, once"
    assert outside_references('<link rel="stylesheet" href="https://cdn.example.org/x.css">'), "the check must bite"
    assert outside_references('<script src="//cdn.example.org/plotly.js"></script>')


def test_html_command_renders_the_page_again_from_the_files(finished_run, capsys):
    """`python -m stagewise.report html <run prefix>` rewrites report.html from report.json and the stages' files."""
    _, out, _, _ = finished_run
    page = Path(out, "report.html")
    before = figures(page.read_text())
    page.unlink()
    report.main(["html", out])
    assert capsys.readouterr().out.strip() == f"HTML {page}"
    again = figures(page.read_text())
    assert again.keys() == before.keys()
    assert again["fig-training"]["data"] == before["fig-training"]["data"]
    with pytest.raises(SystemExit, match="does not exist"):
        report.main(["html", str(Path(out).parent / "no-such-run")])


def _regression_run(out: str) -> dict:
    """A minimised-rmse run's files as the stages write them: each stage's metrics.json and the sweep's trials.json
    (stagewise.sweep.trial_records over a real study); returns build_report's inputs."""
    import optuna

    from stagewise.study.summary import trial_records

    study = optuna.create_study(direction="minimize")
    for values, state in (([80.0, 70.0], "COMPLETE"), ([90.0], "PRUNED"), ([75.0, 60.0], "COMPLETE"), ([65.0, 62.0], "COMPLETE")):
        trial = study.ask()
        trial.suggest_float("lr", 0.001, 0.1, log=True)
        for epoch, value in enumerate(values, start=1):
            trial.report(value, epoch)
        study.tell(trial, values[-1] if state == "COMPLETE" else None, state=optuna.trial.TrialState[state])
    storage.write_json(storage.join(out, "sweep", "trials.json"),
                       {"metric": "rmse", "direction": "minimize", "trials": trial_records(study)})
    training = []
    for stage, batch, steps in (("s1", 32, 10), ("s2", 128, 3)):
        history = [{"epoch": e, "train_loss": 1.0 / (e + 1), "val_metric": 70.0 - e, "val_metrics": {"rmse": 70.0 - e},
                    "samples_per_s": 100.0, "lr": 0.01, "steps": steps * (e + 1)} for e in range(2)]
        storage.write_json(storage.join(out, "train", stage, "metrics.json"),
                           {"stage": stage, "history": history, "resumes": [], "complete": True})
        training.append({"stage": stage, "world_size": 1, "global_batch": batch, "lr": 0.01, "epochs": 2,
                         "steps": 2 * steps, "val_metric": 69.0})
    timeline.record(out, task_id="train_s1", map_index=-1, try_number=1, state="success",
                    start="2026-01-01T10:00:00+00:00", end="2026-01-01T10:00:09+00:00")
    return dict(dag_id="regression", run_id="r2", out=out, stage_results={}, direction="minimize",
                preprocess={"rows": {"train": 300, "validation": 60, "test": 82}, "rows_dropped": 0},
                sweep={"n_trials": 4, "n_complete": 3, "n_pruned": 1, "n_failed": 0, "best_value": 60.0,
                       "best_params": {"lr": 0.01}}, training=training,
                evaluation={"test_rmse": 55.5, "test_mae": 44.0, "test_objective": 55.5, "objective": "rmse"},
                predictions={"uri": None, "rows": 0}, registry={}, tasks=timeline.records(out))


def test_a_regressor_page_shows_rmse_minimised_not_accuracy(tmp_path):
    """With objective rmse / minimize the curves, the sweep and the tables name rmse and 'lower is better', the best-so-far
    line only goes down, and accuracy appears nowhere on the page."""
    out = str(tmp_path / "runs" / "regression" / "r2")
    written = storage.read_json(report.build_report(**_regression_run(out))["report_uri"])
    page = Path(written["html_uri"]).read_text()
    found = figures(page)
    training, sweep_figure = found["fig-training"], found["fig-sweep"]
    assert "rmse" in training["data"][1]["name"] and "lower is better" in training["layout"]["yaxis2"]["title"]["text"]
    assert "rmse" in sweep_figure["layout"]["yaxis"]["title"]["text"] and "minimize" in sweep_figure["layout"]["title"]["text"]
    best = next(t for t in sweep_figure["data"] if t["name"] == "best so far")["y"]
    assert best == sorted(best, reverse=True) and best[-1] == 60.0
    assert {s: len(t["x"]) for s, t in traces_by_state(sweep_figure).items()} == {"COMPLETE": 3, "PRUNED": 1, "FAIL": 0}
    assert "<tr class=highlight><th>test_rmse</th>" in page
    body = page.split("</head>", 1)[1]
    assert "accuracy" not in body.replace(json.dumps(written["run_id"]), "")
    assert [a["x"] for a in training["layout"]["annotations"]] == [0, 20]


@pytest.mark.service
def test_report_under_an_s3_root(s3_bucket):
    """On s3:// (moto) the report step puts report.html beside report.json, the timeline is listed from the bucket,
    and the html command renders the page again from the bucket alone."""
    out = f"{s3_bucket}/runs/regression/r2"
    inputs = _regression_run(out)
    assert [t["task_id"] for t in inputs["tasks"]] == ["train_s1"], "timeline records are listed from the bucket"
    result = report.build_report(**inputs)
    assert result["html_uri"] == f"{out}/report.html"
    fs, path = storage.filesystem(result["html_uri"])
    first = fs.cat_file(path).decode()
    assert set(figures(first)) >= {"fig-training", "fig-sweep", "fig-timeline", "fig-data"}
    fs.rm_file(path)
    assert report.render_html(out) == result["html_uri"]
    again = fs.cat_file(path).decode()
    assert figures(again)["fig-training"] == figures(first)["fig-training"]


def test_latest_prints_where_the_page_is_before_the_report(write_config, storage_root, capsys):
    """`python -m stagewise.report latest` (make demo's last step) names report.html, then report.json on the last line."""
    out = str(storage_root / "runs" / "ml_pipeline" / "r2")
    written = report.build_report(**{**_regression_run(out), "dag_id": "ml_pipeline"})
    report.main(["latest", "--config", str(write_config())])
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-2:] == [f"HTML {written['html_uri']}", f"REPORT {written['report_uri']}"]


def test_a_batch_inference_run_gets_a_page_of_its_scoring_and_timeline(tmp_path):
    """build_inference_report writes report.html too: the model and rows it scored and its task timeline, with no
    training, sweep or gate section (that run has none)."""
    out = str(tmp_path / "runs" / "batch_inference" / "r3")
    timeline.record(out, task_id="infer_shard", map_index=0, try_number=1, state="success",
                    start="2026-01-01T10:00:00+00:00", end="2026-01-01T10:00:04+00:00")
    timeline.record(out, task_id="infer_shard", map_index=1, try_number=1, state="success",
                    start="2026-01-01T10:00:01+00:00", end="2026-01-01T10:00:05+00:00")
    result = report.build_inference_report(
        dag_id="batch_inference", run_id="r3", out=out, model={"current": "m-123", "model_uri": "models/x/model.pt"},
        stage_results={}, predictions={"uri": f"{out}/predictions/manifest.json", "rows": 900, "rows_quarantined": 7},
        tasks=timeline.records(out))
    written = storage.read_json(result["report_uri"])
    page = Path(written["html_uri"]).read_text()
    found = figures(page)
    assert set(found) == {"fig-timeline"}
    assert found["fig-timeline"]["layout"]["yaxis"]["categoryarray"] == ["infer_shard[0]", "infer_shard[1]"]
    assert "scored 900 rows with model m-123, 7 quarantined" in page
    assert 'id="training"' not in page and 'id="sweep"' not in page and "Gate on" not in page
    assert outside_references(page) == []


def test_no_string_in_the_chart_data_can_end_or_reopen_its_script_block():
    """Chart data is embedded with '<', '>', '&', U+2028 and U+2029 as JSON \\u escapes: a split name or task id holding
    '<!--<script>' and '</script>' can neither end its block nor swallow the next one (which stopped every chart from
    drawing), and each block parses back to its figure with the string intact."""
    hostile = {"dag_id": "ml_pipeline", "run_id": "r-hostile", "training": [],
               "data": {"rows": {"train": 10, HOSTILE: 3}},
               "tasks": [{"task_id": HOSTILE, "map_index": -1, "try_number": 1, "state": "success",
                          "start": "2026-01-01T10:00:00+00:00", "end": "2026-01-01T10:00:03+00:00"}]}
    page = report_html.render(hostile, {"stages": {}, "trials": None}, generated_at="2026-01-01T10:05:00+00:00")
    blocks = dict(FIGURE.findall(page))
    assert set(blocks) == {"fig-timeline", "fig-data"}
    for name, text in blocks.items():
        assert not set(text) & set("<>&\u2028\u2029"), f"{name}: {text[:300]}"
    found = figures(page)
    assert found["fig-data"] == report_html.data_figure(hostile)
    assert found["fig-data"]["data"][0]["x"] == ["train", HOSTILE]
    assert found["fig-timeline"]["data"][0]["y"] == [HOSTILE]


def test_a_binary_classifiers_page_draws_both_curves_the_threshold_and_the_confusion_matrix(tmp_path):
    """evaluate's metrics.json holds the test split's curves, confusion matrix and threshold: report.json carries
    them under 'classification' and the page draws ROC and precision-recall with the threshold marked on each."""
    import numpy as np

    from stagewise.models.curves import binary_curves, confusion_counts

    out = str(tmp_path / "runs" / "binary" / "r1")
    rng = np.random.default_rng(0)
    labels = (rng.random(500) < 0.1).astype(int)
    scores = np.clip(0.3 * labels + rng.random(500) * 0.7, 0, 1)
    metrics_uri = storage.join(out, "evaluate", "metrics.json")
    storage.write_json(metrics_uri, {"confusion_matrix": confusion_counts(labels, scores >= 0.6, 2),
                                     "curves": binary_curves(labels, scores),
                                     "decision_threshold": {"value": 0.6, "rule": "f1", "target": None}})
    inputs = _regression_run(out)
    inputs["evaluation"] = {"test_auprc": 0.5, "test_objective": 0.5, "objective": "auprc", "metrics_uri": metrics_uri}
    written = storage.read_json(report.build_report(**{**inputs, "direction": "maximize"})["report_uri"])
    assert written["classification"]["decision_threshold"]["value"] == 0.6
    assert np.asarray(written["classification"]["confusion_matrix"]["counts"]).sum() == 500
    page = Path(written["html_uri"]).read_text()
    curves = figures(page)["fig-curves"]
    names = [trace["name"] for trace in curves["data"]]
    assert {"ROC", "precision-recall", "decision threshold 0.6"} <= set(names)
    assert "<caption>Confusion matrix (test split)</caption>" in page and "&ge; 0.6" in page


def test_curves_are_scikit_learns_at_every_distinct_score():
    """The ROC and precision-recall points are exact (numpy on the written scores), thinned to at most 200."""
    import numpy as np
    from sklearn.metrics import precision_recall_curve, roc_curve

    from stagewise.models.curves import CURVE_POINTS, binary_curves

    rng = np.random.default_rng(1)
    labels = (rng.random(150) < 0.2).astype(int)
    scores = np.round(rng.random(150), 2)  # ties, as rounded scores have
    curves = binary_curves(labels, scores)
    fpr, tpr, _ = roc_curve(labels, scores, drop_intermediate=False)
    assert curves["roc"]["fpr"] == pytest.approx(list(fpr), abs=1e-6) and curves["roc"]["tpr"] == pytest.approx(list(tpr), abs=1e-6)
    precision, recall, _ = precision_recall_curve(labels, scores, drop_intermediate=False)
    assert curves["pr"]["precision"] == pytest.approx(list(precision[:-1][::-1]), abs=1e-6)
    assert curves["pr"]["recall"] == pytest.approx(list(recall[:-1][::-1]), abs=1e-6)
    assert len(binary_curves(rng.random(5000) < 0.5, rng.random(5000))["roc"]["fpr"]) <= CURVE_POINTS + 1
