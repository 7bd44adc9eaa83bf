"""The sweep's parameter importances: fANOVA as the report says, seeded so the summary and Optuna's plot agree, and
nothing computed (nor scikit-learn imported) for a sweep with fewer than two completed trials."""

from __future__ import annotations

import json
import re
from pathlib import Path

import optuna
import pytest

from stagewise.study import summary

SPACE = {"lr": optuna.distributions.FloatDistribution(0.001, 0.3, log=True),
         "dropout": optuna.distributions.FloatDistribution(0.0, 0.3),
         "hidden": optuna.distributions.CategoricalDistribution([64, 128, 256])}


def _study(completed: int, pruned: int = 1) -> optuna.Study:
    """An in-memory study of ``completed`` finished trials (value led by lr) and ``pruned`` pruned ones."""
    study = optuna.create_study(direction="maximize")
    for number in range(completed + pruned):
        params = {"lr": 0.001 * 1.6 ** number, "dropout": 0.3 * ((number * 7) % 5) / 5, "hidden": [64, 128, 256][number % 3]}
        state = optuna.trial.TrialState.COMPLETE if number < completed else optuna.trial.TrialState.PRUNED
        study.add_trial(optuna.trial.create_trial(params=params, distributions=SPACE, state=state,
                                                  value=params["lr"] * 3 + params["dropout"] if number < completed else None,
                                                  intermediate_values={1: 0.1}))
    return study


def _plotted_shares(page: Path) -> dict[str, float]:
    """The bars of Optuna's importance plot, read from the figure JSON in its HTML."""
    figure = json.loads(re.search(r"Plotly\.newPlot\(\s*\"[^\"]+\",\s*(\[.*?\]),\s*\{", page.read_text(), re.S).group(1))
    return {name: share for name, share in zip(figure[0]["y"], figure[0]["x"], strict=True)}


def test_the_plot_draws_the_summarys_seeded_shares(tmp_path):
    """With enough completed trials the summary's fANOVA shares come out the same on every computation, and the
    importance plot draws exactly those shares."""
    study = _study(completed=8)
    shares = summary.param_importances(study, 8, seed=0)
    assert set(shares) == set(SPACE) and sum(shares.values()) == pytest.approx(1.0)
    assert summary.param_importances(study, 8, seed=0) == shares, "seeded: the same every time"
    written = summary.write_plots(study, str(tmp_path / "plots"), str(tmp_path), shares)
    assert str(tmp_path / "plots" / "param_importances.html") in written
    plotted = _plotted_shares(tmp_path / "plots" / "param_importances.html")
    assert plotted.keys() == shares.keys()
    for name, share in shares.items():
        assert plotted[name] == pytest.approx(share, abs=0.006), name  # the plot rounds to two decimals at most


def test_below_two_completed_trials_no_importances_and_no_importance_plot(tmp_path, monkeypatch):
    """Below MIN_IMPORTANCE_TRIALS the importances are empty, and without importances the other plots are written,
    the importance plot is not: Optuna's importance code is never reached."""

    def refuse(*args, **kwargs):
        raise AssertionError("importances computed")

    monkeypatch.setattr(optuna.importance, "get_param_importances", refuse)
    monkeypatch.setattr(optuna.visualization, "plot_param_importances", refuse)
    study = _study(completed=1)
    assert summary.param_importances(study, 1, seed=0) == {}
    written = summary.write_plots(study, str(tmp_path / "plots"), str(tmp_path), {})
    assert sorted(Path(uri).name for uri in written) == ["intermediate_values.html", "optimization_history.html",
                                                         "parallel_coordinate.html"]


@pytest.mark.subprocess
def test_a_one_trial_sweep_summary_imports_no_scikit_learn(write_config, storage_root, subprocess_env):
    """A sweep of one completed trial (the budget of a CI run): its summary has no importances and no importance plot,
    and the process that wrote it never imported scikit-learn, which only the importances need."""
    import subprocess
    import sys

    out = str(storage_root / "runs" / "test" / "one")
    code = f"""
import sys
from stagewise.definitions.loading import load_config
from stagewise.study.studies import create, open_storage, storage_url
from stagewise.study.summary import summarize
import optuna
config = load_config({str(write_config())!r})
create(config, "one")
study = optuna.load_study(study_name="one", storage=open_storage(storage_url(config.sweep, "one")))
trial = study.ask()
trial.suggest_float("lr", 0.005, 0.3, log=True)
study.tell(trial, 0.5)
result = summarize(config, "one", {out!r})
print(result["importances"], sorted(uri.rsplit("/", 1)[1] for uri in result["plots"]), "sklearn" in sys.modules)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=subprocess_env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[-1] == ("{} ['intermediate_values.html', 'optimization_history.html', "
                                            "'parallel_coordinate.html'] False")
