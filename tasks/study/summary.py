"""A finished sweep in files: counts by outcome and the best trial (``sweep/summary.json``), every trial
(``sweep/trials.json``), parameter importances and Optuna's plots, viewable offline.
"""

from __future__ import annotations

import logging
from typing import Any

from stagewise.core import assets, storage
from stagewise.core.errors import UserError
from stagewise.definitions.config import PipelineConfig
from stagewise.study.studies import (
    FINISHED,
    best_trial,
    counts_toward_budget,
    open_storage,
    outcome,
    recover_abandoned,
    storage_kind,
    storage_url,
)

log = logging.getLogger("stagewise.sweep")


def _shares_evaluator(importances: dict[str, float]) -> Any:
    """An Optuna importance evaluator that hands back ``importances``: the plot draws the summary's shares, and
    fANOVA runs once."""
    from optuna.importance import BaseImportanceEvaluator

    class Computed(BaseImportanceEvaluator):
        def evaluate(self, study: Any, params: Any = None, *, target: Any = None) -> dict[str, float]:
            return dict(importances)

    return Computed()


def write_plots(study: Any, prefix: str, run_folder: str, importances: dict[str, float] | None = None) -> list[str]:
    """Optimisation history, intermediate values, parallel coordinates and, when there are ``importances``, their
    bars, as HTML files under ``prefix`` (in ``run_folder``), each linking the storage root's one plotly.js
    (stagewise.core.assets)."""
    from optuna import visualization

    plots = {"optimization_history": visualization.plot_optimization_history,
             "intermediate_values": visualization.plot_intermediate_values,
             "parallel_coordinate": visualization.plot_parallel_coordinate}
    if importances:
        evaluator = _shares_evaluator(importances)
        plots["param_importances"] = lambda study: visualization.plot_param_importances(study, evaluator=evaluator)
    written = []
    script = assets.plotly_script(prefix, run_folder)
    for name, plot in plots.items():
        try:
            figure = plot(study)
        except (ValueError, RuntimeError, ZeroDivisionError) as exc:
            log.info("plot %s skipped: %s", name, exc)
            continue
        uri = storage.join(prefix, f"{name}.html")
        page = (f'<!doctype html><html><head><meta charset="utf-8">{script}</head><body>'
                f'{figure.to_html(include_plotlyjs=False, full_html=False)}</body></html>')
        storage.write_bytes(uri, page.encode())
        written.append(uri)
    return written


def trial_records(study: Any) -> list[dict[str, Any]]:
    """Every trial as the report draws it: number, outcome, value, per-epoch values, params, worker, times and how it
    spread its model (strategy, world size, fsdp units)."""

    def when(moment: Any) -> str | None:
        return moment.isoformat() if moment is not None else None

    return [{"number": t.number, "state": outcome(t), "value": t.value, "intermediate": {str(k): v for k, v in
             sorted(t.intermediate_values.items())}, "params": t.params, "worker": t.user_attrs.get("worker"),
             "counted": counts_toward_budget(t), "error": t.user_attrs.get("error"), "start": when(t.datetime_start),
             "complete": when(t.datetime_complete), "lr_curve": t.user_attrs.get("lr_curve"),
             "optimizer": t.user_attrs.get("optimizer"), "lr_schedule": t.user_attrs.get("lr_schedule"),
             "strategy": t.user_attrs.get("strategy"), "world_size": t.user_attrs.get("world_size"),
             "units": t.user_attrs.get("units")}
            for t in study.get_trials(deepcopy=False)]


# Fewer completed trials than this give no importances: one trial's shares are all equal. Skipping them also skips
# importing optuna.importance, which imports scikit-learn (seconds of a short run's summary).
MIN_IMPORTANCE_TRIALS = 2


def param_importances(study: Any, completed: int, seed: int) -> dict[str, float]:
    """fANOVA's importances of the params over the ``completed`` trials (what the report says it draws), seeded with
    ``seed``; empty below MIN_IMPORTANCE_TRIALS or when they cannot be computed."""
    if completed < MIN_IMPORTANCE_TRIALS:
        return {}
    import optuna

    try:
        evaluator = optuna.importance.FanovaImportanceEvaluator(seed=seed)
        return {k: float(v) for k, v in optuna.importance.get_param_importances(study, evaluator=evaluator).items()}
    except (ValueError, RuntimeError, ZeroDivisionError) as exc:
        log.info("param importances skipped: %s", exc)
        return {}


def summarize(config: PipelineConfig, name: str, out: str, fingerprint: str | None = None) -> dict[str, Any]:
    """Counts by state and the best trial into ``sweep/summary.json``, every trial into ``sweep/trials.json`` and plots
    beside it, with the sweep inputs' ``fingerprint`` (stagewise.reuse) the study was made under. Fails when nothing
    completed."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.load_study(study_name=name, storage=open_storage(storage_url(config.sweep, name)))
    stale = recover_abandoned(study, worker=None)  # every worker is done: nothing may stay RUNNING
    trials = study.get_trials(deepcopy=False)
    counted = [t for t in trials if counts_toward_budget(t)]
    counts = {state: sum(1 for t in counted if outcome(t) == state) for state in FINISHED}
    summary: dict[str, Any] = {
        "study_name": name, "n_trials": len(counted), "n_complete": counts["COMPLETE"], "n_pruned": counts["PRUNED"],
        "n_failed": counts["FAIL"], "n_abandoned": sum(1 for t in trials if t.user_attrs.get("abandoned")),
        "n_stale_recovered": stale, "epochs_consumed": sum(int(t.user_attrs.get("epochs", 0)) for t in trials),
        "rows_consumed": sum(int(t.user_attrs.get("rows_seen", 0)) for t in trials), "budget": config.sweep.budget,
        "storage_kind": storage_kind(config.sweep), "fingerprint": fingerprint,
        "summary_uri": storage.join(out, "sweep", "summary.json"),
    }
    if counts["COMPLETE"] == 0:
        reasons: dict[str, int] = {}
        for t in counted:
            reason = t.user_attrs.get("error") or ("pruned" if t.state.name == "PRUNED" else
                                                   "took 0 optimizer steps" if outcome(t) == "FAIL" else "no value")
            reasons[reason] = reasons.get(reason, 0) + 1
        listed = "; ".join(f"{count} x {reason}" for reason, count in sorted(reasons.items(), key=lambda kv: -kv[1])[:5])
        raise UserError(f"sweep {name}: none of {len(counted)} trials completed ({counts}); why: {listed}")
    best = best_trial(study)
    summary.update({"best_value": best.value, "best_params": best.params, "best_trial": best.number})
    # The best trial's spread (units can differ between trials whose params change the model's depth).
    summary["strategy"] = {"name": config.sweep.strategy, "world_size": best.user_attrs.get("world_size"),
                           "units": best.user_attrs.get("units")}
    summary["importances"] = param_importances(study, counts["COMPLETE"], config.sweep.seed)
    summary["plots"] = write_plots(study, storage.join(out, "sweep", "plots"), out, summary["importances"])
    trials_uri = storage.join(out, "sweep", "trials.json")  # before summary.json, which commits the sweep's files
    storage.write_json(trials_uri, {"study_name": name, "metric": config.objective.metric,
                                    "direction": config.objective.direction, "trials": trial_records(study)})
    summary["trials_uri"] = trials_uri
    storage.write_json(storage.join(out, "sweep", "summary.json"), summary)
    log.info("sweep %s: %d trials (%d complete, %d pruned, %d failed); best %.4f with %s", name, len(counted),
             counts["COMPLETE"], counts["PRUNED"], counts["FAIL"], best.value, best.params)
    return summary
