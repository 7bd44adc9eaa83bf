"""Sweep benchmarks: what Hyperband pruning saves and costs, and the speed-up of parallel workers.

Each function returns ``{"ours", "baseline", "unit", "details"}``; the harness turns that into a ratio.
"""

from __future__ import annotations

import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

REPO_ROOT = Path(__file__).resolve().parent.parent


def _pruning_runs(rows: int) -> dict[str, dict[str, Any]]:
    """The same sweep (budget, seed, TPE) with Hyperband and unpruned, on the synthetic set."""
    from bench.training import _prepare
    from stagewise.definitions.loading import load_config
    from stagewise.study.studies import create
    from stagewise.study.summary import summarize
    from stagewise.sweep import run_worker

    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-pruning-") as tmp:
        config, out = _prepare(Path(tmp), rows)
        for pruner in ("hyperband", "none"):
            raw = yaml.safe_load(Path(tmp, "pipeline.yaml").read_text())
            raw["sweep"].update({"num_trials": 48, "num_workers": 1, "epochs": 27, "batch_size": 64, "seed": 7,
                                 "pruner": {"type": pruner, "min_resource": 1, "reduction_factor": 4}})
            path = Path(tmp, f"{pruner}.yaml")
            path.write_text(yaml.safe_dump(raw))
            config = load_config(path)
            started = time.perf_counter()
            create(config, pruner)
            run_worker(config, pruner, 0, out)
            summary = summarize(config, pruner, out)
            results[pruner] = {**summary, "wall_s": time.perf_counter() - started}
    return results


_CACHE: dict[int, dict[str, dict[str, Any]]] = {}


def _pruning(rows: int) -> dict[str, dict[str, Any]]:
    if rows not in _CACHE:  # both pruning benchmarks read the same pair of sweeps
        _CACHE[rows] = _pruning_runs(rows)
    return _CACHE[rows]


def sweep_pruning_epochs(rows: int = 3_000) -> dict[str, Any]:
    """Training epochs a Hyperband-pruned sweep consumes / the same sweep unpruned (48 trials, up to 27 epochs).

    Hyperband as pipeline.yaml sets it: min_resource 1, reduction_factor 4 (Optuna's default of 3
    measured 0.43 here: its never-pruning bracket takes a larger share of the trials). Trials go to
    brackets by a hash of study name and trial number, so a small budget makes the ratio noisy:
    with 24 trials two runs gave 0.36 and 0.45; 48 trials halve that spread.
    """
    runs = _pruning(rows)
    pruned, full = runs["hyperband"], runs["none"]
    return {"ours": float(pruned["epochs_consumed"]), "baseline": float(full["epochs_consumed"]), "unit": "epochs",
            "details": {"n_pruned": pruned["n_pruned"], "reduction_factor": 4, "pruned_wall_s": round(pruned["wall_s"], 1),
                        "unpruned_wall_s": round(full["wall_s"], 1), "rows": rows}}


def sweep_pruning_quality(rows: int = 3_000) -> dict[str, Any]:
    """Best validation accuracy of the pruned sweep / that of the unpruned one (same budget and seed)."""
    runs = _pruning(rows)
    pruned, full = runs["hyperband"], runs["none"]
    return {"ours": pruned["best_value"], "baseline": full["best_value"], "unit": "val accuracy",
            "details": {"pruned_best_params": pruned["best_params"], "unpruned_best_params": full["best_params"]}}


def _span_of(instances: list[dict], task_id: str) -> float:
    """Seconds from the first start to the last end of the mapped instances of ``task_id``."""
    workers = [ti for ti in instances if ti["task_id"] == task_id]
    starts = [datetime.fromisoformat(ti["start_date"]) for ti in workers]
    ends = [datetime.fromisoformat(ti["end_date"]) for ti in workers]
    return (max(ends) - min(starts)).total_seconds()


def sweep_parallel_speedup(rows: int = 0) -> dict[str, Any]:
    """Sweep wall time with 1 worker / with 2, same budget, through a real scheduler with LocalExecutor.

    ml_pipeline runs on a live api-server + scheduler + dag-processor (SQLite); the sweep's wall time
    is first sweep_worker start to last sweep_worker end. Pruning is off so both runs do the same work.
    """
    from tests.live_airflow import LiveAirflow

    with tempfile.TemporaryDirectory(prefix="bench-parallel-") as tmp:
        raw = yaml.safe_load((REPO_ROOT / "pipeline.yaml").read_text())
        raw["storage_root"] = str(Path(tmp, "storage"))
        raw["sweep"].update({"storage": f"journal://{tmp}/optuna.journal", "epochs": 30, "pruner": {"type": "none"}})
        config_path = Path(tmp, "pipeline.yaml")
        config_path.write_text(yaml.safe_dump(raw))
        env = {"STAGEWISE_CONFIG": str(config_path)}
        import os

        from stagewise.data import write_demo
        from stagewise.definitions.loading import load_config

        previous = os.environ.get("STAGEWISE_CONFIG")
        os.environ["STAGEWISE_CONFIG"] = str(config_path)
        try:
            write_demo()
            config = load_config()
        finally:
            os.environ.pop("STAGEWISE_CONFIG") if previous is None else os.environ.update(STAGEWISE_CONFIG=previous)
        spans = {}
        with LiveAirflow(Path(tmp, "airflow"), REPO_ROOT / "dags", env=env) as live:
            for name, pool in config.pools.items():
                live.api("POST", "/api/v2/pools", expect=(200, 201, 409), json={"name": name, "slots": pool.slots,
                                                                         "description": pool.description})
            live.wait_for_dag("ml_pipeline")
            live.unpause("ml_pipeline")
            for workers in (1, 2):
                run_id = live.trigger("ml_pipeline", {"num_trials": 24, "num_sweep_workers": workers, "sweep_epochs": 30})
                state = live.wait_for_run("ml_pipeline", run_id, timeout=900)
                if state != "success":
                    raise RuntimeError(f"ml_pipeline run with {workers} worker(s) ended {state}:\n{live.logs_tail()}")
                spans[workers] = _span_of(live.task_instances("ml_pipeline", run_id), "sweep_worker")
    return {"ours": spans[1], "baseline": spans[2], "unit": "s (1 worker / 2 workers)",
            "details": {"one_worker_s": round(spans[1], 2), "two_workers_s": round(spans[2], 2), "num_trials": 24,
                        "epochs_per_trial": 30, "note": "ratio = 1-worker time / 2-worker time (a speed-up)"}}


# The row budget both data-budget benchmarks and bench/scale.py run: a trial sees at most this many rows, whatever
# the data set's size (its first round max_rows / 4^3), so the sweep's cost stays flat as the data grows.
ROW_BUDGET = {"budget": "rows", "max_rows": 500_000}


def _budget_runs(rows: int) -> dict[str, dict[str, Any]]:
    """pipeline.yaml's sweep (8 trials, TPE, Hyperband with reduction factor 4, batch 32, up to 9 epochs) on ``rows``
    synthetic rows, once with the epoch budget and once with the row budget; one worker runs the trials in turn, so
    wall time is the work alone. The row budget's time includes writing its subsets."""
    from bench.training import _prepare
    from stagewise.definitions.loading import load_config
    from stagewise.study.studies import create
    from stagewise.study.summary import summarize
    from stagewise.sweep import prepare_subsets, run_worker

    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-budget-") as tmp:
        _, out = _prepare(Path(tmp), rows)
        for budget in ("rows", "epochs"):
            raw = yaml.safe_load(Path(tmp, "pipeline.yaml").read_text())
            raw["sweep"].update({"num_workers": 1, **(ROW_BUDGET if budget == "rows" else {})})
            path = Path(tmp, f"{budget}.yaml")
            path.write_text(yaml.safe_dump(raw))
            config = load_config(path)
            started = time.perf_counter()
            create(config, budget)
            subsets = prepare_subsets(config, out)
            run_worker(config, budget, 0, out)
            summary = summarize(config, budget, out)
            results[budget] = {**summary, "wall_s": time.perf_counter() - started, "rounds": subsets.get("rounds"),
                               "direction": config.objective.direction}
    return results


_BUDGET_CACHE: dict[int, dict[str, dict[str, Any]]] = {}


def _budgets(rows: int) -> dict[str, dict[str, Any]]:
    if rows not in _BUDGET_CACHE:  # both data-budget benchmarks read the same pair of sweeps
        _BUDGET_CACHE[rows] = _budget_runs(rows)
    return _BUDGET_CACHE[rows]


def sweep_data_budget(rows: int = 1_000_000) -> dict[str, Any]:
    """Sweep wall time with the row budget (sweep.budget rows, max_rows 500,000) / with the epoch budget, same trials."""
    runs = _budgets(rows)
    by_rows, by_epochs = runs["rows"], runs["epochs"]
    return {"ours": by_rows["wall_s"], "baseline": by_epochs["wall_s"], "unit": "s (sweep wall time)",
            "details": {"rows": rows, "num_trials": by_rows["n_trials"], **ROW_BUDGET,
                        "row_budget_rounds_end_at": [r["rows_seen"] for r in by_rows["rounds"]],
                        "rows_trained": {"rows": by_rows["rows_consumed"], "epochs": by_epochs["rows_consumed"]},
                        "pruned": {"rows": by_rows["n_pruned"], "epochs": by_epochs["n_pruned"]},
                        "epochs_consumed_by_epoch_budget": by_epochs["epochs_consumed"]}}


def sweep_data_budget_quality(rows: int = 1_000_000) -> dict[str, Any]:
    """Best validation objective of the row-budget sweep / that of the epoch-budget one (direction-aware: a minimised
    objective's ratio is epochs' / rows')."""
    runs = _budgets(rows)
    by_rows, by_epochs = runs["rows"], runs["epochs"]
    ours, baseline = by_rows["best_value"], by_epochs["best_value"]
    if by_rows["direction"] == "minimize":  # so that a ratio above 1 is better either way
        ours, baseline = baseline, ours
    return {"ours": ours, "baseline": baseline, "unit": f"best val objective ({by_rows['direction']})",
            "details": {"rows_best_params": by_rows["best_params"], "epochs_best_params": by_epochs["best_params"]}}
