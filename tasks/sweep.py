"""Hyperparameter sweep: one Optuna study shared by parallel worker tasks.

Run:  ``python -m stagewise.sweep create --study S``
      ``python -m stagewise.sweep subsets --out storage/runs/x/y``   (only for ``sweep.budget: rows`` or
      ``sweep.validation_rows``: the nested data subsets every trial trains on, stagewise.datasets.subsets)
      ``python -m stagewise.sweep worker --study S --worker 0 --out storage/runs/x/y``   (one per worker;
      under ``torchrun --nproc-per-node N`` each trial is an N-process DDP job; with ``sweep.entrypoint``
      one process drives the user's script as each trial, under torchrun itself)
      ``python -m stagewise.sweep summary --study S --out storage/runs/x/y``

Sampler and pruner come from the config (default: multivariate TPE with constant liar, so parallel
workers spread out, and Hyperband on the per-epoch validation accuracy). The storage is a journal
file on one node (safe for parallel writers, unlike SQLite) or PostgreSQL across nodes.

Budget and recovery: the trial budget is split between workers by index, so it is exact however
they race. A worker owns the trials it asked for (user attr ``worker``) and Airflow runs one
attempt of a mapped task at a time, so a worker that starts and finds its own trials still RUNNING
knows they belong to a dead attempt: it marks them FAIL (``abandoned``, not counted against the
budget) and enqueues their params once, so each is retried with the same params. This needs no
heartbeat (the journal storage has none) and no grace period.
"""

from __future__ import annotations

import argparse
import datetime as dt
import logging
import os
import signal
import time
from dataclasses import dataclass
from typing import Any

from stagewise.core import contract as env_contract
from stagewise.core import storage
from stagewise.core.cli import common_parser, help_before_imports, parse_overrides, run_subjob


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Optuna sweep steps.")
    common = common_parser()
    sub = parser.add_subparsers(dest="step", required=True)
    for step in ("create", "subsets", "worker", "summary"):
        p = sub.add_parser(step, parents=[common])
        if step != "subsets":
            p.add_argument("--study", required=True, help="study name")
        if step != "create":
            p.add_argument("--out", required=True, help="the run prefix")
    sub.choices["worker"].add_argument("--worker", type=int, required=True, help="this worker's index")
    return parser


# --help answers before the imports below, which load torch (seconds); they follow code on purpose
# ruff: noqa: E402
if __name__ == "__main__":
    help_before_imports(build_parser)

from stagewise.core.errors import UserError
from stagewise.datasets.loader import split_batches
from stagewise.datasets.manifest import read_manifest
from stagewise.datasets.subsets import Round, pass_splits, resolve_budget, subsets_uri, write_subsets
from stagewise.definitions.config import LRSchedule, PipelineConfig, Sweep
from stagewise.definitions.hyperparams import ran_params
from stagewise.definitions.loading import config_path, load_config
from stagewise.definitions.spec import user_hook
from stagewise.models.building import resolve_params
from stagewise.scripting.entrypoint import contract_environment, entrypoint_args, run_script
from stagewise.study.studies import (
    best_trial,
    counts_toward_budget,
    create,
    make_pruner,
    make_sampler,
    open_storage,
    recover_abandoned,
    storage_url,
    suggest,
)
from stagewise.study.summary import summarize
from stagewise.tracking.runs import Tracker, finish_trial, trial_tags
from stagewise.training.distributed import distributed_job
from stagewise.training.loop import rank_batches, start_loop
from stagewise.training.lr_schedule import stage_lr
from stagewise.training.recipe import recipe_params, schedule_label, training_recipe

log = logging.getLogger("stagewise.sweep")

# Fault injection for tests: the worker SIGKILLs itself after the first epoch of this trial number.
FAULT_ENV = "STAGEWISE_FAULT_KILL_TRIAL"


def worker_quota(num_trials: int, num_workers: int, worker: int) -> int:
    """Trials worker ``worker`` owns: the budget split as evenly as possible, summing exactly to it."""
    if not 0 <= worker < num_workers:
        raise UserError(f"worker index {worker} is outside 0..{num_workers - 1} (sweep.num_workers)")
    return num_trials // num_workers + (1 if worker < num_trials % num_workers else 0)


def _ask(study: Any, sweep: Sweep) -> Any:
    """A new trial; a sampler that cannot propose one (bad settings for this space) is a user error, not a retry."""
    try:
        return study.ask()
    except (ValueError, TypeError, ArithmeticError) as exc:
        raise UserError(f"sweep.sampler ({sweep.sampler.type}) cannot propose a trial for sweep.search_space: "
                        f"{type(exc).__name__}: {exc}") from None


def _broadcast(env: Any, value: Any) -> Any:
    if not env.distributed:
        return value
    import torch.distributed as dist

    holder = [value]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def _worker_study(sweep: Sweep, name: str, worker: int, resource: tuple[int, int] | None = None) -> tuple[Any, int]:
    """The shared study (this worker's sampler, the pruner over ``resource``: the row budget's (min, max) rows, or
    None for epochs) and how many trials of its quota are left to run."""
    import optuna

    study = optuna.load_study(study_name=name, storage=open_storage(storage_url(sweep, name)),
                              sampler=make_sampler(sweep, worker), pruner=make_pruner(sweep, resource))
    recovered = recover_abandoned(study, worker)
    done = [t for t in study.get_trials(deepcopy=False) if t.user_attrs.get("worker") == worker and counts_toward_budget(t)]
    quota = worker_quota(sweep.num_trials, sweep.num_workers, worker)
    remaining = max(quota - len(done), 0)
    log.info("worker %d: %d of its %d trial(s) already finished, %d recovered from a dead attempt; running %d",
             worker, len(done), quota, recovered, remaining)
    return study, remaining


def _finish(study: Any, trial: Any, state: str, value: float | None, error: str | None, config: PipelineConfig,
            worker: int, suggested: Any, started: float) -> None:
    """Tell the study how a trial ended and log one line of the sweep's progress."""
    import optuna

    if error:
        trial.set_user_attr("error", error)
        log.warning("trial %d failed: %s", trial.number, error)
    study.tell(trial, value if state == "COMPLETE" else None, state=optuna.trial.TrialState[state])
    finished = [t for t in study.get_trials(deepcopy=False) if counts_toward_budget(t)]
    best = best_trial(study)
    eta = sweep_eta(finished, config.sweep.num_trials, dt.datetime.now())
    log.info("worker %d: trial %d %s (val_%s %.4f, %s); study %d/%d trials done, best so far %s, %.1fs elapsed, ETA %s",
             worker, trial.number, state.lower(), config.objective.metric, float("nan") if value is None else value,
             suggested, len(finished), config.sweep.num_trials, f"{best.value:.4f}" if best is not None else "n/a",
             time.monotonic() - started, "n/a" if eta is None else f"{eta:.0f}s")


def sweep_eta(finished: list[Any], num_trials: int, now: dt.datetime) -> float | None:
    """Seconds until the study's budget is done at the pace since its first finished trial started (every worker
    together, so parallel workers count once); None before any trial finished."""
    starts = [trial.datetime_start for trial in finished if trial.datetime_start is not None]
    if not starts:
        return None
    pace = max((now - min(starts)).total_seconds(), 0.0) / len(finished)
    return pace * max(num_trials - len(finished), 0)


@dataclass(frozen=True, kw_only=True)
class Report:
    """One report of a trial to the pruner: a pass over the train files of each entry of ``passes``, then the objective
    at ``step`` (an epoch number under the epoch budget, rows seen under the row budget)."""

    step: int
    passes: list[dict[str, list[dict[str, Any]]]]
    pass_rows: list[int]


def trial_reports(sweep: Sweep, manifest: dict[str, Any], subsets: dict[str, Any] | None) -> list[Report]:
    """What a trial that is never pruned trains and reports, in order: one report per epoch over the whole split, or one
    per round of the row budget (stagewise.datasets.subsets) over its nested subsets."""
    train_rows = manifest["rows"]["train"]
    if sweep.budget == "epochs":
        whole = pass_splits(manifest, subsets, 1.0)
        return [Report(step=epoch + 1, passes=[whole], pass_rows=[train_rows]) for epoch in range(sweep.epochs)]
    assert subsets is not None
    return [Report(step=r.rows_seen, passes=[pass_splits(manifest, subsets, f) for f in r.fractions],
                   pass_rows=r.subset_rows(train_rows)) for r in (Round(**entry) for entry in subsets["rounds"])]


def read_subsets(sweep: Sweep, out: str) -> dict[str, Any] | None:
    """The committed subsets of a row budget or a validation cap (None when the sweep has neither)."""
    if not sweep.needs_subsets:
        return None
    uri = subsets_uri(out)
    if not storage.exists(uri):
        raise UserError(f"sweep.budget {sweep.budget} / validation_rows: {uri} is not committed; run `python -m "
                        f"stagewise.sweep subsets --out {out}` first (the create_study task does)")
    return storage.read_json(uri)


def prepare_subsets(config: PipelineConfig, out: str) -> dict[str, Any]:
    """Resolve the row budget against the committed train split and write its subsets (and the validation cap)."""
    sweep = config.sweep
    if not sweep.needs_subsets:
        return {"budget": sweep.budget, "subsets_uri": None}
    manifest = read_manifest(storage.join(out, "preprocess", "manifest.json"))
    processes = config.profile(sweep.profile).processes_per_node
    rounds = resolve_budget(sweep, manifest["rows"]["train"], processes) if sweep.budget == "rows" else []
    committed = write_subsets(manifest, out, rounds, sweep.validation_rows)
    return {"budget": sweep.budget, "subsets_uri": subsets_uri(out), "rounds": committed["rounds"]}


def run_worker(config: PipelineConfig, name: str, worker: int, out: str, config_file: str = "",
               overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run this worker's share of the budget. Under torchrun each trial is a DDP job: rank 0 owns the
    Optuna trial, reports once per epoch (or per round of a row budget), and broadcasts params and prune decisions
    to every rank. With ``sweep.entrypoint`` each trial is the user's script instead (:func:`run_script_trials`)."""
    if config.sweep.entrypoint is not None:
        return run_script_trials(config, name, worker, out, config_file, overrides or {})
    import optuna
    import torch

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sweep = config.sweep
    profile = config.profile(sweep.profile)
    with distributed_job(profile.device, profile.threads_per_process) as env:
        manifest = read_manifest(storage.join(out, "preprocess", "manifest.json"))
        reports = trial_reports(sweep, manifest, read_subsets(sweep, out))
        setting = "sweep.min_rows" if sweep.budget == "rows" else "sweep.batch_size"

        def batches(splits: dict[str, Any], quiet: bool = True) -> tuple[Any, Any]:
            return rank_batches(
                {**manifest, "splits": splits}, env, batch_size=sweep.batch_size, seed=sweep.seed, quiet=quiet,
                too_few_rows=lambda rows: (f"sweep.batch_size {sweep.batch_size} exceeds the ~{rows} train rows each of "
                                           f"{env.world_size} process(es) gets (sweep.profile '{sweep.profile}'): a trial "
                                           f"would take no optimizer step; lower sweep.batch_size or the process count, "
                                           f"or raise {setting}"))

        train, validation = batches(reports[0].passes[0], quiet=False)
        total_steps = trial_steps(reports, manifest, env, sweep.batch_size, sweep.seed)
        resource = (reports[0].step, reports[-1].step) if sweep.budget == "rows" else None
        study, remaining = _worker_study(sweep, name, worker, resource) if env.master else (None, 0)
        remaining = _broadcast(env, remaining)
        tracker = Tracker.for_run(config, out, f"sweep_worker {worker}") if env.master else None
        fault_trial = int(os.environ[FAULT_ENV]) if os.environ.get(FAULT_ENV) else None
        epochs_run, rows_run, started = 0, 0, time.monotonic()
        for _ in range(remaining):
            trial, suggested, error = None, None, None
            if env.master:
                trial = _ask(study, sweep)
                trial.set_user_attr("worker", worker)
                try:
                    suggested = suggest(trial, sweep)
                except Exception as exc:  # e.g. a space edited since the study began: this trial fails, the sweep goes on
                    error = f"suggesting params failed: {type(exc).__name__}: {exc}"[:500]
            suggested, error = _broadcast(env, (suggested, error))
            value, state, steps, rows_seen, passes = float("nan"), "FAIL" if error else "COMPLETE", 0, 0, 0
            tracked, lrs, loop = None, [], None
            trial_params = {**(suggested or {}), "batch_size": sweep.batch_size, "world_size": env.world_size,
                            "budget": sweep.budget}
            if not error:
                try:
                    torch.manual_seed(sweep.seed + (trial.number if trial else 0))
                    built, loop = start_loop(config, manifest, env, suggested, train, validation, seed=sweep.seed,
                                             strategy=sweep.strategy)
                    params, trial_started, reading = built.params, time.monotonic(), reports[0].passes[0]
                    # The spec's own schedule over the trial's own steps, as a stage runs it over its own (no warmup: a
                    # trial's batch never grew); without one, the trial's lr stays constant.
                    lr_at = stage_lr(params["lr"], warmup_steps=0, schedule=TRIAL_SCHEDULE, spec=built.spec,
                                     total_steps=total_steps, steps_per_epoch=loop.steps_per_epoch(0))
                    recipe = training_recipe(loop.optimizer, built.spec, TRIAL_SCHEDULE, warmup_steps=0,
                                             total_steps=total_steps)
                    trial_params = {**ran_params(trial_params, recipe), **recipe_params(recipe)}
                    if env.master:
                        log.info("trial %d: world size %d (%s), optimizer %s (%s, %d group(s)), schedule %s over its "
                                 "%d steps", trial.number, env.world_size, loop.strategy.describe(),
                                 recipe["optimizer"]["type"], recipe["optimizer"]["source"],
                                 len(recipe["optimizer"]["groups"]), schedule_label(recipe["lr_schedule"]), total_steps)
                    if trial is not None:
                        trial.set_user_attr("optimizer", recipe["optimizer"])
                        trial.set_user_attr("lr_schedule", recipe["lr_schedule"])
                        for key, value in spread_attrs(loop.strategy, env.world_size).items():
                            trial.set_user_attr(key, value)
                    if tracker is not None:
                        tracked = tracker.nested(f"trial-{trial.number}", f"trial {trial.number}",
                                                 trial_tags(name, trial.number, worker), trial_params)
                    # A user's hook that raises names itself (spec, hook, file:line): the trial fails with that.
                    guard = user_hook(built.spec, module=loop.module)
                    for index, report in enumerate(reports):
                        for splits in report.passes:
                            if splits != reading:  # the next subset of a row budget
                                loop.train_data, reading = batches(splits)[0], splits
                            before = loop.position.step
                            with guard:
                                epoch = loop.train_epoch(lr_at)
                            value = epoch.val_metric  # identical on every rank
                            lrs.append(epoch.lr)
                            steps = loop.position.step
                            rows_seen += (steps - before) * sweep.batch_size * env.world_size
                            passes += 1
                        epochs_run += len(report.passes)
                        prune = False
                        if tracked is not None:
                            tracker.log(tracked, metrics={f"val_{config.objective.metric}": value, "lr": lrs[-1]},
                                        step=report.step)
                        if env.master:
                            _progress(trial.number, index, len(reports), report, value, rows_seen, config,
                                      time.monotonic() - trial_started)
                            trial.report(value, report.step)
                            prune = trial.should_prune()
                            if fault_trial == trial.number and "retry_of" not in trial.user_attrs:
                                os.kill(os.getpid(), signal.SIGKILL)
                        if _broadcast(env, prune):
                            state = "PRUNED"
                            break
                    if steps == 0:  # a random init's accuracy is no result
                        state, error = "FAIL", f"took 0 optimizer steps (sweep.batch_size {sweep.batch_size})"
                except Exception as exc:  # a failing or diverging objective is recorded and the sweep goes on
                    state, error = "FAIL", failure(exc)
                finally:
                    if loop is not None:  # an fsdp trial in one process releases its group of one
                        loop.strategy.close()
            if tracker is not None and tracked is None:  # failed before its recipe was known
                tracked = tracker.nested(f"trial-{trial.number}", f"trial {trial.number}",
                                         trial_tags(name, trial.number, worker), trial_params)
            rows_run += rows_seen
            if env.master:
                trial.set_user_attr("lr_curve", lrs)
                trial.set_user_attr("epochs", passes)
                trial.set_user_attr("rows_seen", rows_seen)
                trial.set_user_attr("steps", steps)
                _finish(study, trial, state, value, error, config, worker, suggested, started)
            if tracked is not None:
                finish_trial(tracker, tracked, state, value, config.objective.metric, error)
        if tracker is not None:
            tracker.close()
        return {"worker": worker, "trials_run": remaining, "epochs_run": epochs_run, "rows_run": rows_run,
                "world_size": env.world_size}


# A trial's schedule when its spec has none of its own: the constant lr the sweep suggested.
TRIAL_SCHEDULE = LRSchedule()


def spread_attrs(strategy: Any, world_size: int) -> dict[str, Any]:
    """How a trial spread its model, as its study records it: the strategy's name, the world size and (fsdp) the
    number of units it sharded."""
    units = getattr(strategy, "units", None)
    return {"strategy": strategy.name, "world_size": world_size, **({"units": units} if units else {})}


def failure(exc: BaseException) -> str:
    """Why a trial failed, as its record says it: a user error's own message (it names the spec, hook, file and line),
    else the exception's type and message."""
    return (str(exc) if isinstance(exc, UserError) else f"{type(exc).__name__}: {exc}")[:1000]


def trial_steps(reports: list[Report], manifest: dict[str, Any], env: Any, batch_size: int, seed: int) -> int:
    """The optimizer steps of a trial that is never pruned: each pass of each report over its train files, as this
    rank's batches will take them (the schedule spans them, as a stage's spans its epochs)."""
    total, counted = 0, {}
    for number, splits in enumerate(splits for report in reports for splits in report.passes):
        key = repr(splits)
        if key not in counted:
            counted[key] = split_batches({**manifest, "splits": splits}, "train", rank=env.rank,
                                         world_size=env.world_size, batch_size=batch_size, seed=seed)
        total += counted[key].steps_per_epoch(number)
    return max(total, 1)


def _progress(number: int, index: int, total: int, report: Report, value: float, rows_seen: int,
              config: PipelineConfig, elapsed_s: float) -> None:
    """One line per report of a trial: where it stands in its budget, its objective and its training speed."""
    where = (f"epoch {report.step}/{total}" if config.sweep.budget == "epochs" else
             f"round {index + 1}/{total} ({report.step:,} rows of its budget; passes over "
             f"{' + '.join(f'{rows:,}' for rows in report.pass_rows)} rows)")
    log.info("trial %d %s: val_%s %.4f, %d rows trained, %.0f rows/s", number, where, config.objective.metric, value,
             rows_seen, rows_seen / max(elapsed_s, 1e-9))


def absolute_storage(uri: str) -> str:
    """The study's storage URI as a trial's script (in a scratch working dir) must see it: a journal file's path absolute."""
    if uri.startswith("journal://"):
        return "journal://" + os.path.abspath(uri[len("journal://"):])
    return uri


def trial_contract(config: PipelineConfig, config_file: str, trial: Any, params: dict[str, Any], out: str,
                   workdir: str) -> dict[str, Any]:
    """A bring-your-own trial's stage values (stagewise.contract.STAGE_VALUES) filled from ``sweep``: its batch, its
    epochs, the suggested lr as it is, the sweep's seed plus the trial number, outputs in the scratch ``workdir``."""
    sweep = config.sweep
    world = config.profile(sweep.profile).processes_per_node
    return {"config": str(config_path(config_file)), "stage": f"trial-{trial.number}", "run_prefix": out,
            "output_dir": os.path.join(workdir, "output"), "checkpoint_dir": os.path.join(workdir, "checkpoints"),
            "data_manifest": storage.join(out, "preprocess", "manifest.json"), "init_from": "", "params": params,
            "per_process_batch": sweep.batch_size, "grad_accum_steps": 1, "global_batch": sweep.batch_size * world,
            "lr": params["lr"], "epochs": sweep.epochs, "warmup_steps": 0, "seed": sweep.seed + trial.number}


def trial_environment(config: PipelineConfig, name: str, trial: Any, values: dict[str, Any], workdir: str,
                      overrides: dict[str, Any]) -> dict[str, str]:
    """What a bring-your-own trial script gets: the stage variables from :func:`trial_contract`, its own result,
    error and metrics files in ``workdir`` (never the worker's), and the trial's study (stagewise.contract.TRIAL_ENV)."""
    return {**contract_environment(config, values, overrides),
            env_contract.RESULT_FILE: os.path.join(workdir, "result.json"),
            env_contract.ERROR_FILE: os.path.join(workdir, "user_error.txt"),
            env_contract.METRICS_FILE: os.path.join(workdir, "metrics.json"),
            env_contract.STUDY_STORAGE: absolute_storage(storage_url(config.sweep, name)), env_contract.STUDY_NAME: name,
            env_contract.TRIAL_ID: str(trial._trial_id), env_contract.TRIAL_NUMBER: str(trial.number)}


def script_trial(config: PipelineConfig, config_file: str, name: str, trial: Any, suggested: dict[str, Any], out: str,
                 overrides: dict[str, Any]) -> tuple[str, float | None, str | None, int]:
    """Run ``sweep.entrypoint`` as one trial under torchrun (sweep.profile's processes) in a scratch working dir.

    Returns (state, value, error, epochs): PRUNED or COMPLETE with the last reported objective (the study records
    a pruned trial's values as its intermediates; the value is for the progress log), else FAIL with why (a nonzero
    exit, no report, a reason in $STAGEWISE_ERROR_FILE).
    """
    import tempfile

    sweep = config.sweep
    entry = sweep.entrypoint
    assert entry is not None
    what = entry.script or entry.module
    profile = config.profile(sweep.profile)
    with tempfile.TemporaryDirectory(prefix=f"stagewise-trial{trial.number}-") as workdir:
        values = trial_contract(config, config_file, trial, resolve_params(config, suggested), out, workdir)
        env = trial_environment(config, name, trial, values, workdir, overrides)
        log.info("trial %d: running %s with %s", trial.number, what, suggested)
        ran = run_script(config, entry, entrypoint_args(entry, "sweep", values), env,
                         processes=profile.processes_per_node, threads=profile.threads_per_process, workdir=workdir)
    last = ran.last_report
    epochs = last["epoch"] if last else 0
    trial.set_user_attr("epochs", epochs)
    if ran.code != 0 or ran.error:
        return "FAIL", None, ran.error or f"{what} exited with code {ran.code}", epochs
    if last is None:
        return "FAIL", None, f"{what} ended without reporting a metric (stagewise.spec.report)", epochs
    value = float(last["metrics"][config.objective.metric])
    return ("PRUNED" if last["pruned"] else "COMPLETE"), value, None, epochs


def run_script_trials(config: PipelineConfig, name: str, worker: int, out: str, config_file: str,
                      overrides: dict[str, Any]) -> dict[str, Any]:
    """This worker's share of the budget as runs of the user's ``sweep.entrypoint``: ask the study for a trial,
    run the script (it reports through stagewise.spec.report, which prunes), tell the study; a failing trial is
    recorded and the sweep goes on. One process drives; each trial is its own torchrun job."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sweep = config.sweep
    study, remaining = _worker_study(sweep, name, worker)
    tracker = Tracker.for_run(config, out, f"sweep_worker {worker}")
    epochs_run, started = 0, time.monotonic()
    for _ in range(remaining):
        trial = _ask(study, sweep)
        trial.set_user_attr("worker", worker)
        suggested, epochs = None, 0
        try:
            suggested = suggest(trial, sweep)
            state, value, error, epochs = script_trial(config, config_file, name, trial, suggested, out, overrides)
        except Exception as exc:  # e.g. a space edited since the study began: this trial fails, the sweep goes on
            state, value, error = "FAIL", None, failure(exc)
        epochs_run += epochs
        _finish(study, trial, state, value, error, config, worker, suggested, started)
        if tracker is not None:  # the script reported each epoch to the study: its curve goes to the trial's run
            tracked = tracker.nested(f"trial-{trial.number}", f"trial {trial.number}", trial_tags(name, trial.number, worker),
                                     suggested or {})
            reported = next(t for t in study.get_trials(deepcopy=False) if t.number == trial.number).intermediate_values
            for step, reported_value in sorted(reported.items()):
                tracker.log(tracked, metrics={f"val_{config.objective.metric}": reported_value}, step=step)
            finish_trial(tracker, tracked, state, value, config.objective.metric, error)
    if tracker is not None:
        tracker.close()
    return {"worker": worker, "trials_run": remaining, "epochs_run": epochs_run, "world_size":
            config.profile(sweep.profile).processes_per_node}


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))

    def work() -> dict[str, Any]:
        config = load_config(args.config, parse_overrides(args.override))
        if args.step == "create":
            return create(config, args.study)
        out = storage.resolve(config.storage_root, args.out)
        if args.step == "subsets":
            return prepare_subsets(config, out)
        if args.step == "worker":
            return run_worker(config, args.study, args.worker, out, str(config_path(args.config)),
                              parse_overrides(args.override))
        return summarize(config, args.study, out)

    run_subjob(f"sweep {args.step}", work, args.result_file if rank == 0 else None, quiet=rank != 0)


if __name__ == "__main__":
    main()
