"""Hyperparameter sweep: one Optuna study shared by parallel worker processes.

Run:  ``python -m tasks.sweep create --study S``
      ``python -m tasks.sweep worker --study S --worker 0 --out storage/runs/x/y``   (one per worker)
      ``python -m tasks.sweep summary --study S --out storage/runs/x/y``

TPE (multivariate, constant liar, so parallel workers do not pile onto one point) samples; the
Hyperband pruner stops weak trials early on the per-epoch validation accuracy. The storage is a
journal file on one node (safe for parallel writers, unlike SQLite) or PostgreSQL across nodes.
The trial budget is split between workers by index, so it is exact however they race, and a
retried worker only runs the trials its earlier attempt did not finish.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from typing import Any

from tasks import storage
from tasks.cli import common_parser, parse_overrides, run_subjob
from tasks.config import CategoricalParam, FloatParam, PipelineConfig, Sweep, load_config
from tasks.errors import UserError

log = logging.getLogger("stagewise.sweep")

FINISHED = ("COMPLETE", "PRUNED", "FAIL")


def open_storage(uri: str) -> Any:
    """An Optuna storage from a URI: ``journal://<file>`` or an RDB URL such as ``postgresql://...``."""
    import optuna

    if uri.startswith("journal://"):
        from optuna.storages.journal import JournalFileBackend, JournalStorage

        path = uri[len("journal://"):]
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        return JournalStorage(JournalFileBackend(path))
    # Heartbeats let a dead worker's RUNNING trial be failed instead of hanging for ever.
    return optuna.storages.RDBStorage(uri, heartbeat_interval=30, grace_period=120)


def study_name(dag_id: str, run_id: str) -> str:
    return f"{storage.safe_name(dag_id)}__{storage.safe_name(run_id)}"


def worker_quota(num_trials: int, num_workers: int, worker: int) -> int:
    """Trials worker ``worker`` owns: the budget split as evenly as possible, summing exactly to it."""
    if not 0 <= worker < num_workers:
        raise UserError(f"worker index {worker} is outside 0..{num_workers - 1} (sweep.num_workers)")
    return num_trials // num_workers + (1 if worker < num_trials % num_workers else 0)


def suggest(trial: Any, sweep: Sweep) -> dict[str, Any]:
    params: dict[str, Any] = {}
    for name, space in sweep.search_space.items():
        if isinstance(space, FloatParam):
            params[name] = trial.suggest_float(name, space.low, space.high, log=space.log)
        elif isinstance(space, CategoricalParam):
            params[name] = trial.suggest_categorical(name, space.choices)
        else:
            params[name] = trial.suggest_int(name, space.low, space.high, log=space.log)
    return params


def create(config: PipelineConfig, name: str) -> dict[str, Any]:
    """Create the study, or find it when a cleared run comes back."""
    import optuna

    study = optuna.create_study(study_name=name, storage=open_storage(config.sweep.storage),
                                direction="maximize", load_if_exists=True)
    study.set_user_attr("num_trials", config.sweep.num_trials)
    log.info("study %s ready (%d trial(s) so far) on %s", name, len(study.trials), config.sweep.storage.split("://")[0])
    return {"study_name": name, "storage": config.sweep.storage}


def _load_study(config: PipelineConfig, name: str, seed_offset: int) -> Any:
    import optuna

    sweep = config.sweep
    sampler = optuna.samplers.TPESampler(multivariate=True, constant_liar=True, seed=sweep.seed + seed_offset)
    pruner = optuna.pruners.HyperbandPruner(min_resource=1, max_resource=sweep.epochs, reduction_factor=3)
    return optuna.load_study(study_name=name, storage=open_storage(sweep.storage), sampler=sampler, pruner=pruner)


def run_worker(config: PipelineConfig, name: str, worker: int, out: str) -> dict[str, Any]:
    """Run this worker's share of the budget; every trial trains for up to ``sweep.epochs`` epochs."""
    import optuna
    import torch

    from tasks.distributed import DistEnv
    from tasks.loader import split_batches
    from tasks.model import ModelSpec, build_model
    from tasks.preprocess import read_manifest
    from tasks.train import resolve_params
    from tasks.training import Loop, make_optimizer

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sweep = config.sweep
    torch.set_num_threads(config.profile(sweep.profile).threads_per_process)
    quota = worker_quota(sweep.num_trials, sweep.num_workers, worker)
    study = _load_study(config, name, seed_offset=worker)
    done = [t for t in study.get_trials(deepcopy=False) if t.user_attrs.get("worker") == worker and t.state.name in FINISHED]
    remaining = quota - len(done)
    log.info("worker %d: %d of its %d trial(s) already finished; running %d", worker, len(done), quota, max(remaining, 0))
    manifest = read_manifest(storage.join(out, "preprocess", "manifest.json"))
    train = split_batches(manifest, "train", rank=0, world_size=1, batch_size=sweep.batch_size, seed=sweep.seed)
    validation = split_batches(manifest, "validation", rank=0, world_size=1, batch_size=4096, seed=0, shuffle=False)
    env = DistEnv(rank=0, local_rank=0, world_size=1, device="cpu")
    epochs_run = 0
    started = time.monotonic()
    for _ in range(max(remaining, 0)):
        trial = study.ask()
        trial.set_user_attr("worker", worker)
        try:
            params = resolve_params(config, suggest(trial, sweep))
            torch.manual_seed(sweep.seed + trial.number)
            model = build_model(ModelSpec(num_features=len(manifest["features"]), num_classes=manifest["num_classes"],
                                          hidden=params["hidden"], dropout=float(params["dropout"])))
            optimizer = make_optimizer(model, lr=params["lr"], weight_decay=params["weight_decay"], momentum=params["momentum"])
            loop = Loop(model=model, optimizer=optimizer, env=env, train=train, validation=validation,
                        seed=sweep.seed + trial.number)
            value, state = float("nan"), optuna.trial.TrialState.COMPLETE
            for epoch in range(sweep.epochs):
                value = loop.train_epoch(lambda _step: params["lr"]).val_accuracy
                epochs_run += 1
                trial.report(value, epoch + 1)
                if trial.should_prune():
                    state = optuna.trial.TrialState.PRUNED
                    break
            trial.set_user_attr("epochs", epoch + 1)
            study.tell(trial, value if state == optuna.trial.TrialState.COMPLETE else None, state=state)
        except Exception as exc:  # a failing objective is recorded and the sweep goes on
            trial.set_user_attr("error", f"{type(exc).__name__}: {exc}"[:500])
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
            log.warning("trial %d failed: %s: %s", trial.number, type(exc).__name__, exc)
            state = optuna.trial.TrialState.FAIL
        finished = sum(1 for t in study.get_trials(deepcopy=False) if t.state.name in FINISHED)
        try:
            best = f"{study.best_value:.4f}"
        except ValueError:
            best = "n/a"
        log.info("worker %d: trial %d %s (value %.4f); study %d/%d trials done, best so far %s, %.1fs elapsed",
                 worker, trial.number, state.name.lower(), value, finished, sweep.num_trials, best, time.monotonic() - started)
    return {"worker": worker, "trials_run": max(remaining, 0), "epochs_run": epochs_run}


def summarize(config: PipelineConfig, name: str, out: str) -> dict[str, Any]:
    """Counts by state and the best trial; written to ``sweep/summary.json``. Fails when nothing completed."""
    import optuna

    study = optuna.load_study(study_name=name, storage=open_storage(config.sweep.storage))
    trials = study.get_trials(deepcopy=False)
    counts = {state: sum(1 for t in trials if t.state.name == state) for state in ("COMPLETE", "PRUNED", "FAIL", "RUNNING")}
    summary: dict[str, Any] = {
        "study_name": name, "n_trials": len(trials), "n_complete": counts["COMPLETE"], "n_pruned": counts["PRUNED"],
        "n_failed": counts["FAIL"], "n_running": counts["RUNNING"],
        "epochs_consumed": sum(int(t.user_attrs.get("epochs", 0)) for t in trials),
    }
    if counts["COMPLETE"] == 0:
        errors = sorted({t.user_attrs.get("error", "pruned") for t in trials if t.state.name != "COMPLETE"})
        raise UserError(f"sweep {name}: no trial completed ({counts}); reasons: {errors[:5]}")
    summary.update({"best_value": study.best_value, "best_params": study.best_params, "best_trial": study.best_trial.number})
    storage.write_json(storage.join(out, "sweep", "summary.json"), summary)
    log.info("sweep %s: %d trials (%d complete, %d pruned, %d failed); best %.4f with %s", name, len(trials),
             counts["COMPLETE"], counts["PRUNED"], counts["FAIL"], study.best_value, study.best_params)
    return summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Optuna sweep steps.")
    common = common_parser()
    sub = parser.add_subparsers(dest="step", required=True)
    for step in ("create", "worker", "summary"):
        p = sub.add_parser(step, parents=[common])
        p.add_argument("--study", required=True, help="study name")
        if step != "create":
            p.add_argument("--out", required=True, help="the run prefix")
    sub.choices["worker"].add_argument("--worker", type=int, required=True, help="this worker's index")
    args = parser.parse_args(argv)

    def work() -> dict[str, Any]:
        config = load_config(args.config, parse_overrides(args.override))
        if args.step == "create":
            return create(config, args.study)
        out = storage.resolve(config.storage_root, args.out)
        if args.step == "worker":
            return run_worker(config, args.study, args.worker, out)
        return summarize(config, args.study, out)

    run_subjob(f"sweep {args.step}", work, args.result_file)


if __name__ == "__main__":
    main()
