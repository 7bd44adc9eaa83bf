"""One Optuna study shared by every sweep worker and trial script: opened from a storage URI, searched by the
configured sampler and pruner, its trials counted the way the sweep counts them.

Optuna is imported inside the functions that need it, so importing this module stays light.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from stagewise.core import contract, storage
from stagewise.core.errors import UserError
from stagewise.definitions.config import (
    LEGACY_JOURNAL,
    STUDY_PLACEHOLDER,
    CategoricalParam,
    FloatParam,
    PipelineConfig,
    Sweep,
)

log = logging.getLogger("stagewise.sweep")

FINISHED = ("COMPLETE", "PRUNED", "FAIL")


def open_storage(uri: str) -> Any:
    """An Optuna storage from a URI: ``journal://<file>`` or an RDB URL such as ``postgresql://...``."""
    import optuna

    if uri.startswith("journal://"):
        from optuna.storages.journal import JournalFileBackend, JournalStorage

        path = uri[len("journal://"):]
        if STUDY_PLACEHOLDER in path:
            raise ValueError(f"{uri} names a journal file per study: storage_url(sweep, study) fills in the study")
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        return JournalStorage(JournalFileBackend(path))
    return optuna.storages.RDBStorage(uri)


def _configured_url(sweep: Sweep) -> str:
    """``sweep.storage``, or with ``sweep.storage_conn_id`` the URL the Airflow task built from that connection into
    $STAGEWISE_STUDY_STORAGE (the sub-job's environment: never the config, argv or a log)."""
    if not sweep.storage_conn_id:
        return sweep.storage
    url = os.environ.get(contract.STUDY_STORAGE, "")
    if not url:
        raise UserError(f"sweep.storage_conn_id '{sweep.storage_conn_id}': ${contract.STUDY_STORAGE} is not set; an "
                        f"Airflow task sets it from the connection (outside Airflow, export the database URL there)")
    return url


def storage_url(sweep: Sweep, study: str = "") -> str:
    """The storage URI of study ``study``: the configured one, with a per-study journal's ``{study}`` filled in (the
    study's name made safe for a file name; needed only there)."""
    url = _configured_url(sweep)
    if STUDY_PLACEHOLDER not in url:
        return url
    if not study:
        raise ValueError(f"sweep.storage {url} holds a journal file per study: name the study")
    return url.replace(STUDY_PLACEHOLDER, storage.safe_name(study))


def journal_file(sweep: Sweep, study: str) -> str | None:
    """The local file holding study ``study`` when the storage is a journal (None for a database)."""
    url = storage_url(sweep, study)
    return url[len("journal://"):] if url.startswith("journal://") else None


def legacy_journal(config: PipelineConfig) -> str | None:
    """The one shared journal earlier releases kept every study of a storage root in, when the storage is now a file
    per study and that old file is still there: studies made before the move are read from it, never written."""
    if STUDY_PLACEHOLDER not in config.sweep.storage or "://" in config.storage_root.removeprefix("file://"):
        return None
    path = os.path.join(config.storage_root.removeprefix("file://"), LEGACY_JOURNAL)
    return path if os.path.isfile(path) else None


def journal_files(config: PipelineConfig) -> list[str]:
    """Every local journal file that holds studies of this config's storage, sorted: each study's own file under a
    per-study layout, the legacy shared one while it is there; the one file otherwise; [] for a database."""
    import glob

    url = _configured_url(config.sweep)
    if not url.startswith("journal://"):
        return []
    path = url[len("journal://"):]
    if STUDY_PLACEHOLDER not in path:
        return [path] if os.path.isfile(path) else []
    head, tail = path.split(STUDY_PLACEHOLDER, 1)
    found = glob.glob(glob.escape(head) + "*" + glob.escape(tail))
    return sorted(found) + [old for old in [legacy_journal(config)] if old is not None]


def load_earlier(config: PipelineConfig, name: str) -> Any:
    """An existing study to read (a warm start's source): from its own storage, else from the legacy shared journal.

    A journal file that does not exist is skipped rather than opened, which would create it empty. KeyError when no
    storage holds the study."""
    import optuna

    own, places = journal_file(config.sweep, name), []
    if own is None or os.path.isfile(own):
        places.append(storage_url(config.sweep, name))
    if (old := legacy_journal(config)) is not None:
        places.append(f"journal://{old}")
    for uri in places:
        try:
            return optuna.load_study(study_name=name, storage=open_storage(uri))
        except KeyError:
            continue
    raise KeyError(f"Record does not exist: no study named {name!r} in {storage_kind(config.sweep)} storage")


def storage_kind(sweep: Sweep) -> str:
    """The storage's scheme (journal, postgresql+psycopg2, ...): what logs and summaries may say about it."""
    return _configured_url(sweep).split("://", 1)[0]


def study_name(dag_id: str, run_id: str) -> str:
    return f"{storage.safe_name(dag_id)}__{storage.safe_name(run_id)}"


def suggest(trial: Any, sweep: Sweep) -> dict[str, Any]:
    """Sample the space: unconditional params first, then those whose ``when`` holds."""
    params: dict[str, Any] = {}
    ordered = sorted(sweep.search_space.items(), key=lambda item: item[1].when is not None)
    for name, space in ordered:
        if space.when and not all(params.get(parent) in values for parent, values in space.when.items()):
            continue
        if isinstance(space, FloatParam):
            params[name] = trial.suggest_float(name, space.low, space.high, log=space.log)
        elif isinstance(space, CategoricalParam):
            params[name] = trial.suggest_categorical(name, space.choices)
        else:
            params[name] = trial.suggest_int(name, space.low, space.high, log=space.log)
    return params


def make_sampler(sweep: Sweep, seed_offset: int) -> Any:
    import optuna

    spec, seed = sweep.sampler, sweep.seed + seed_offset
    if spec.type == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if spec.type == "grid":

        class QuotaGridSampler(optuna.samplers.GridSampler):
            def after_trial(self, study: Any, trial: Any, state: Any, values: Any) -> None:
                pass  # the worker quota ends the sweep; Study.stop() only works inside optimize()

        return QuotaGridSampler(sweep.grid(), seed=seed)
    if spec.type == "cmaes":
        return optuna.samplers.CmaEsSampler(seed=seed, n_startup_trials=spec.n_startup_trials, warn_independent_sampling=False)
    return optuna.samplers.TPESampler(multivariate=spec.multivariate, constant_liar=spec.constant_liar,
                                      n_startup_trials=spec.n_startup_trials, seed=seed)


def make_pruner(sweep: Sweep, rows: tuple[int, int] | None = None) -> Any:
    """The configured pruner over epochs, or over ``rows`` seen: a row budget's (first round's, last round's) rows.
    Under a row budget the median pruner's warmup counts the rows of that many first rounds."""
    import optuna

    spec = sweep.pruner
    if spec.type == "none":
        return optuna.pruners.NopPruner()
    if spec.type == "median":
        warmup = spec.n_warmup_steps
        if rows is not None and warmup:
            warmup = rows[0] * spec.reduction_factor ** (warmup - 1)
        return optuna.pruners.MedianPruner(n_startup_trials=spec.n_startup_trials, n_warmup_steps=warmup)
    low, high = rows if rows is not None else (spec.min_resource, sweep.epochs)
    return optuna.pruners.HyperbandPruner(min_resource=low, max_resource=high, reduction_factor=spec.reduction_factor)


def counts_toward_budget(trial: Any) -> bool:
    """Whether a trial counts against the budget: finished, and not an abandoned attempt's (that one is retried)."""
    return trial.state.name in FINISHED and not trial.user_attrs.get("abandoned")


def outcome(trial: Any) -> str:
    """The trial's state as the sweep counts it: a COMPLETE trial that took no optimizer step counts as FAIL."""
    if trial.state.name == "COMPLETE" and trial.user_attrs.get("steps") == 0:
        return "FAIL"  # its value is a random init's accuracy, never a result
    return trial.state.name


def best_trial(study: Any) -> Any | None:
    """The best trial that completed and trained (Optuna's own best_trial would accept a 0-step one)."""
    complete = [t for t in study.get_trials(deepcopy=False) if counts_toward_budget(t) and outcome(t) == "COMPLETE"]
    pick = min if study.direction.name == "MINIMIZE" else max
    return pick(complete, key=lambda t: t.value, default=None)


def _owner(config: PipelineConfig) -> dict[str, str]:
    """What a study belongs to: the pipeline's model name and its objective."""
    return {"model_name": config.registry.model_name, "metric": config.objective.metric,
            "direction": config.objective.direction}


def _claim(study: Any, config: PipelineConfig) -> None:
    """Mark a new study as this pipeline's; refuse one that another pipeline or objective made (never join it)."""
    mine, theirs = _owner(config), study.user_attrs.get("stagewise_owner")
    made_for = theirs or {"direction": study.direction.name.lower()}
    if any(made_for.get(key) != value for key, value in mine.items() if key in made_for):
        raise UserError(f"study '{study.study_name}' on {storage_kind(config.sweep)} storage belongs to another "
                        f"pipeline or objective ({made_for}); this run's is {mine}: it is not joined. Two pipelines "
                        f"sharing sweep.storage need distinct DAG ids (the study name is <dag_id>__<run_id>)")
    if theirs is None:
        study.set_user_attr("stagewise_owner", mine)


def create(config: PipelineConfig, name: str) -> dict[str, Any]:
    """Create the study, or find it again when a cleared run comes back; warm-start a new one if asked."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(study_name=name, storage=open_storage(storage_url(config.sweep, name)),
                                direction=config.objective.direction, load_if_exists=True)
    _claim(study, config)
    warm = config.sweep.warm_start_from
    if warm and not study.trials and not study.user_attrs.get("warm_started_from"):
        try:
            best = best_trial(load_earlier(config, warm))
        except KeyError as exc:
            raise UserError(f"sweep.warm_start_from: study '{warm}' has no completed trial to start from ({exc})") from None
        if best is None:
            raise UserError(f"sweep.warm_start_from: study '{warm}' has no completed trial to start from")
        params = {k: v for k, v in best.params.items() if k in config.sweep.search_space}
        study.enqueue_trial(params, user_attrs={"warm_start_of": f"{warm}#{best.number}"})
        study.set_user_attr("warm_started_from", warm)
        log.info("study %s warm-starts from %s: enqueued its best params %s (value %.4f)", name, warm, params, best.value)
    study.set_user_attr("num_trials", config.sweep.num_trials)
    log.info("study %s ready (%d trial(s) so far) on %s", name, len(study.trials), storage_kind(config.sweep))
    return {"study_name": name, "storage_kind": storage_kind(config.sweep)}


def recover_abandoned(study: Any, worker: int | None) -> int:
    """Fail the RUNNING trials of a dead attempt (of ``worker``, or any when None) and enqueue their params once."""
    import optuna

    recovered = 0
    for trial in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        if worker is not None and trial.user_attrs.get("worker") != worker:
            continue
        study._storage.set_trial_user_attr(trial._trial_id, "abandoned", "its worker attempt died")
        study._storage.set_trial_state_values(trial._trial_id, optuna.trial.TrialState.FAIL)
        if "retry_of" not in trial.user_attrs and trial.params:
            study.enqueue_trial(trial.params, user_attrs={"retry_of": trial.number})
            log.warning("trial %d was left RUNNING by a dead worker: marked failed, retrying once with %s",
                        trial.number, trial.params)
        recovered += 1
    return recovered
