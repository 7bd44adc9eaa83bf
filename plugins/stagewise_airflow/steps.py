"""The callables behind ml_pipeline's tasks: each turns the Airflow context into a sub-job call.

Heavy steps (per-shard work, sweep workers, training, evaluation, scoring) run as child processes
through :mod:`stagewise.airflow.launch`; small bookkeeping steps (plan, reduce, commit, report) run
in the task process. Every step takes and returns small dicts: URIs, ids, metrics.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from stagewise.airflow import credentials, launch, slurm_subjob
from stagewise.airflow.stage_steps import data_fingerprint as _data_fingerprint
from stagewise.airflow.stage_steps import fingerprinted_job, job_fingerprint, remember_stage, with_cost
from stagewise.core.errors import UserError
from stagewise.definitions.config import ConfigError, PipelineConfig
from stagewise.definitions.intervals import INTERVAL_FIELDS, fields_in, fill, interval_record, static_prefix
from stagewise.definitions.loading import config_path, load_config, snapshot


def all_results(results: Sequence[Any]) -> list[Any]:
    """Materialise mapped results in one request (iterating a lazy XCom sequence probes past its end)."""
    return list(results[:])


def _context() -> Any:
    from airflow.sdk import get_current_context

    return get_current_context()


def task_seconds(context: Any) -> float | None:
    """Seconds since Airflow started this attempt: the work and its start-up (process, DAG parse, sub-job launch)."""
    import datetime as dt

    start = getattr(context["ti"], "start_date", None)
    return round((dt.datetime.now(dt.UTC) - start).total_seconds(), 3) if start is not None else None


@functools.lru_cache(maxsize=8)
def _cached_config(path: str, storage_conn_id: str = "") -> PipelineConfig:
    with credentials.exported(credentials.aws_environment(storage_conn_id)):  # an s3:// snapshot needs the run's keys
        return load_config(path)


def run_config(run: dict[str, Any]) -> PipelineConfig:
    """The run's config: the snapshot start_run wrote (the file plus the trigger form's overrides, resolved), read
    with the run's storage connection (its keys may live in Airflow only, not in the worker's environment)."""
    return _cached_config(run["config"], run.get("storage_conn_id", ""))


def run_config_reference(run: dict[str, Any]) -> dict[str, Any]:
    """Where the run's config snapshot is, its hash and the file it came from: for report.json and the model card."""
    return {"config_uri": run["config"], "config_hash": run.get("config_hash"), "config_source": run.get("config_source")}


def _config_args(run: dict[str, Any]) -> list[str]:
    """A sub-job reads the run's snapshot: one URI, however much a user typed into the form."""
    return ["--config", run["config"]]


def launch_subjob(run: dict[str, Any], module: str, args: list[str], profile: str, distributed: bool = False,
                  label: str = "", **kwargs: Any) -> dict[str, Any]:
    """Run a step's sub-job on its profile: on this worker, or as a Slurm job named by ``label`` (a Slurm profile)."""
    attempt = _context()["ti"].try_number
    config = run_config(run)
    if config.profile(profile).backend == "slurm":
        result = slurm_subjob.run(config, run, module, [*args, *_config_args(run)], profile, attempt=attempt,
                                  label=label or module, distributed=distributed)
    else:
        result = launch.run(module, [*args, *_config_args(run)], config.profile(profile), distributed=distributed,
                            attempt=attempt, extra_env=credentials.task_environment(config),
                            import_paths=config.model.import_paths or (), **kwargs)
    return {**result, "task_s": task_seconds(_context())} if isinstance(result, dict) else result


def inline(config: PipelineConfig | None, work: Callable[[], Any]) -> Any:
    """Run bookkeeping in-process with ``config``'s storage credentials; a user error fails the task without retry."""
    from airflow.sdk.exceptions import AirflowFailException

    started = time.monotonic()
    try:
        with credentials.exported(credentials.task_environment(config) if config else {}):
            result = work()
    except UserError as exc:
        raise AirflowFailException(str(exc)) from None
    if isinstance(result, dict):
        result = {**result, "duration_s": round(time.monotonic() - started, 3), "attempt": _context()["ti"].try_number,
                  "task_s": task_seconds(_context())}
    return result


def _started_run(context: Any, result: Any = None) -> dict[str, Any] | None:
    """The run's start_run result (its config, overrides and storage prefix), or None before start_run returned."""
    ti = context["ti"]
    run = result if ti.task_id == "start_run" else ti.xcom_pull(task_ids="start_run", map_indexes=-1)
    return run if isinstance(run, dict) and "out" in run else None


def _record_attempt(context: Any, state: str, ended: bool, result: Any = None) -> None:
    """This attempt's start or end into the run's timeline (stagewise.reporting.timeline); a storage hiccup never fails the task.

    The run's own config places it (an s3:// run stays on S3 whatever this process's default config says); only
    a start_run that fails, before the run exists, falls back to the process's config.
    """
    import logging

    from stagewise.core import storage
    from stagewise.reporting import timeline

    ti = context["ti"]
    if ti.task_id == "start_run" and state == "running":  # recorded with its start once it returns the run
        return
    try:
        if run := _started_run(context, result):
            config, out = run_config(run), run["out"]
        elif started_by_test(context.get("dag_run")):
            return  # a test run that never started has no scratch root yet, and production's is not its to write
        else:
            config = _cached_config(str(config_path()))
            out = storage.run_prefix(config.storage_root, context["dag"].dag_id, context["run_id"])
        start = timeline.iso(ti.start_date) if getattr(ti, "start_date", None) else None
        upstream, ready = _readiness(context)
        with credentials.exported(credentials.task_environment(config)):
            timeline.record(out, task_id=ti.task_id, map_index=ti.map_index, try_number=ti.try_number, state=state,
                            start=start, end=timeline.iso() if ended else None, upstream=upstream, ready=ready)
            if state == "failed" and config.tracking.mlflow_uri:
                from stagewise.tracking.runs import fail_parent

                fail_parent(config, out, ti.task_id)
    except Exception as exc:  # the timeline is a view of the run, never a reason to fail it
        logging.getLogger("stagewise.timeline").warning("could not record %s of %s: %s", state, ti.task_id, exc)


def _readiness(context: Any) -> tuple[list[str] | None, str | None]:
    """The attempt's upstream task ids and, for a task without any, its run's start: what the report measures its
    wait to start from (Airflow's task runtime exposes no queued time)."""
    from stagewise.reporting import timeline

    task = getattr(context["ti"], "task", None)
    upstream = sorted(task.upstream_task_ids) if task is not None else None
    started = getattr(context.get("dag_run"), "start_date", None)
    return upstream, timeline.iso(started) if upstream == [] and started is not None else None


def timeline_hooks() -> dict[str, Any]:
    """Operator arguments that record every attempt. Success is recorded in post_execute, before Airflow reports it,
    so a downstream report never sees an upstream attempt still "running"."""
    return {"pre_execute": lambda context: _record_attempt(context, "running", ended=False),
            "post_execute": lambda context, result=None: _record_attempt(context, "success", ended=True, result=result),
            "on_retry_callback": lambda context: _record_attempt(context, "up_for_retry", ended=True),
            "on_failure_callback": lambda context: _record_attempt(context, "failed", ended=True)}


def started_by_test(dag_run: Any) -> bool:
    """Whether ``airflow dags test`` (``DAG.test()``) started this run: Airflow records it as triggered by a test."""
    triggered_by = getattr(dag_run, "triggered_by", None)
    if triggered_by is not None:
        return str(getattr(triggered_by, "value", triggered_by)).lower() == "test"
    # The task SDK's dag run (3.2, 3.3) has no triggered_by; DAG.test() alone names its run's user "dag_test".
    return getattr(dag_run, "triggering_user_name", None) == "dag_test"


def _test_run_scratch(dag_run: Any, path: str) -> str | None:
    """A test run's own scratch root (stagewise.definitions.loading.scratch_for_test_run), None for any other run;
    says where a test run writes as the run's first log line."""
    import logging

    from stagewise.definitions import loading
    from stagewise.definitions.pipelines import name_of

    if not started_by_test(dag_run):
        return None
    log, name = logging.getLogger("stagewise.start_run"), name_of(path)
    scratch = loading.scratch_for_test_run(name)
    if scratch:
        log.warning("test run (airflow dags test): pipeline %s runs in scratch under %s, never in its storage_root: "
                    "no production file, pointer (current model, MLflow alias) or study is written; its input is read "
                    "where the config says. To let %s's test runs write production, set $%s=%s (docs/ci.md)",
                    name, scratch, name, loading.TEST_RUNS_WRITE_ENV_VAR, name)
    elif explicit := loading.scratch_root():
        log.warning("test run (airflow dags test): pipeline %s runs in CI mode under $%s=%s (docs/ci.md)",
                    name, loading.SCRATCH_ENV_VAR, explicit)
    else:
        log.warning("test run (airflow dags test): pipeline %s writes its production storage_root: $%s names it",
                    name, loading.TEST_RUNS_WRITE_ENV_VAR)
    return scratch


def start_run(mode: str = "pipeline", config_file: str | None = None) -> dict[str, Any]:
    """Validate the config with the trigger form's values once, fix the run's storage prefix, and write the run's
    config snapshot (``<run>/config.yaml``, resolved) that every later task and sub-job of the run reads instead of
    the file: editing the file mid-run changes the next run, never this one. Beside it, ``<run>/lineage.json``: the
    Stagewise version and the user's source fingerprints as the run starts, which its model card names.

    ``mode="retrain"`` warm-starts the sweep from the current model's study with the retrain budget. ``config_file``
    is the DAG's own config (the file its DAG was built from), never this process's default. A run started by
    ``airflow dags test`` runs in scratch (docs/ci.md) unless $STAGEWISE_TEST_RUNS_WRITE names its pipeline.
    """
    from stagewise.airflow.params import overrides_from_params, unknown_trigger_keys
    from stagewise.core import storage
    from stagewise.reporting import lineage
    from stagewise.study.studies import study_name

    context = _context()
    dag_id, run_id = context["dag"].dag_id, context["run_id"]
    path = str(config_path(config_file))

    def work() -> dict[str, Any]:
        scratch = _test_run_scratch(context["dag_run"], path)  # first: a retrain reads the scratch registry too
        base = load_config(path, test_scratch=scratch)
        if unknown := unknown_trigger_keys(context["dag_run"].conf, context["dag"].params):
            raise ConfigError(f"trigger conf: unknown key(s) {unknown}; {dag_id} takes {sorted(context['dag'].params)}")
        try:
            params = dict(context["params"])
            if mode == "inference":
                overrides = {"inference.input_uri": params["input_uri"]}
            else:
                overrides = overrides_from_params(base, params)
        except (KeyError, ValueError) as exc:
            raise ConfigError(f"trigger params: {exc}") from None
        if mode == "retrain":
            from stagewise import registry

            with credentials.exported(credentials.task_environment(base)):
                overrides.update(registry.retrain_overrides(base))
        config = load_config(path, overrides, test_scratch=scratch)
        if filled := _interval_inputs(config, context):  # this run's own data: scheduled, catch-up and backfilled alike
            overrides.update(filled)
            config = load_config(path, overrides, test_scratch=scratch)
        out = storage.run_prefix(config.storage_root, dag_id, run_id)
        text, config_hash = snapshot(config)
        snapshot_uri = storage.join(out, "config.yaml")
        with credentials.exported(credentials.task_environment(config)):
            code = lineage.write(out, config)  # the code the run starts with, for its model card; the snapshot commits
            storage.write_bytes(snapshot_uri, text.encode())  # written before any task of the run reads it
            if config.tracking.mlflow_uri:  # the parent MLflow run, before any sub-job looks for it
                from stagewise.tracking.runs import start_parent

                start_parent(config, dag_id=dag_id, run_id=run_id, out=out, config_text=text, config_hash=config_hash,
                             code_version=code["code_version"], stagewise_version=code["stagewise_version"])
            if config.registry.backend == "mlflow":
                _check_registry_owner(config, dag_id)
        return {"dag_id": dag_id, "run_id": run_id, "config": snapshot_uri, "config_hash": config_hash,
                "config_source": path, "storage_conn_id": config.storage_conn_id, "overrides": overrides, "out": out,
                "study": study_name(dag_id, run_id), "data_interval": interval_record(_interval_of(context))}

    return inline(None, work)  # the config is read inside: a bad one must fail the task without retry


def _check_registry_owner(config: PipelineConfig, dag_id: str) -> None:
    """A model name another pipeline or team holds in MLflow fails the run here, before it trains; a server out of
    reach does not (tracking is best-effort until the registration, which checks again)."""
    from stagewise.definitions.pipelines import pipeline_of
    from stagewise.tracking.registry import check_owner

    try:
        check_owner(config, pipeline_of(dag_id) or config.name)
    except RuntimeError as exc:
        logging.getLogger("stagewise.start_run").warning("registry owner not checked (its registration checks it): %s", exc)


def _interval_of(context: Any) -> dict[str, Any]:
    """The run's data interval and logical date (None where Airflow gives the run none)."""
    return {name: context.get(name) for name in INTERVAL_FIELDS}


def _interval_inputs(config: PipelineConfig, context: Any) -> dict[str, str]:
    """Overrides that fill the run's interval into dataset.uri and inference.input_uri where they name it."""
    values, filled = _interval_of(context), {}
    for key, template in (("dataset.uri", config.dataset.uri), ("inference.input_uri", config.inference.input_uri)):
        if template and fields_in(template, key):
            try:
                filled[key] = fill(template, key, values)
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
    if filled:
        logging.getLogger("stagewise.start_run").info("this run reads its interval's data: %s (interval %s)", filled,
                                                      interval_record(values))
    return filled


def ingest(config_file: str | None = None) -> dict[str, Any]:
    """Copy the ``source_uri`` Param's Parquet into the data set of the DAG's config; the task's outlet Asset announces it."""
    from stagewise.core import storage
    from stagewise.data import ingest as ingest_files

    context = _context()
    path = str(config_path(config_file))
    if _test_run_scratch(context["dag_run"], path) is not None:  # its target is production's data set: never written
        from airflow.sdk.exceptions import AirflowFailException

        raise AirflowFailException(f"a test run (airflow dags test) of the ingest DAG would copy into {path}'s dataset.uri, "
                                   "production's data set; it writes nothing. Opt the pipeline in by name with "
                                   "$STAGEWISE_TEST_RUNS_WRITE to test ingest against its real storage (docs/ci.md)")
    config = load_config(config_file)
    source = context["params"]["source_uri"]
    target = storage.resolve(config.storage_root, static_prefix(config.dataset.uri))
    return inline(config, lambda: ingest_files(config, source, target))


def run_ref(run: dict[str, Any]) -> str:
    """The run as reuse records name it: ``<dag_id>/<run_id>``."""
    return f"{run['dag_id']}/{run['run_id']}"


def reused_from(*results: Any) -> str | None:
    """The run whose committed work stands in for this step (its upstream's plan or result says so), else None."""
    found = [result.get("reused_from") for result in results if isinstance(result, dict)]
    return found[0] if found and all(found) else None


def create_study(run: dict[str, Any], prepared: dict[str, Any]) -> list[dict[str, Any]]:
    """Create (or find again) the study of the sweep's inputs, and write the data subsets of a row budget (a sub-job:
    it reads the whole train split once); return one entry per worker to map over.

    The study is named by the run and its inputs' fingerprint (data, model, search, code): a cleared run whose data
    changed sweeps a new study, one whose inputs are unchanged finds its finished trials. With ``cache.sweep`` a study
    another run finished for the same inputs stands in, and every worker returns at once.
    """
    from stagewise.core import storage
    from stagewise.reuse import cache
    from stagewise.reuse.fingerprints import code_identity, sweep_inputs
    from stagewise.study.studies import create

    config = run_config(run)

    def work() -> dict[str, Any]:
        fingerprint = sweep_inputs(config, _data_fingerprint(prepared), code_identity(config))
        hit = cache.lookup(config, "sweep", fingerprint, run_ref(run),
                           lambda result: cache.record_problem(result.get("summary_uri"), fingerprint))
        if hit is not None:  # this run's summary is the study that stands in
            storage.write_json(storage.join(run["out"], "sweep", "summary.json"), hit)
            return {"study": hit["study_name"], "fingerprint": fingerprint, "reused_from": hit["reused_from"]}
        name = f"{run['study']}__{fingerprint[:12]}"
        create(config, name)
        return {"study": name, "fingerprint": fingerprint, "reused_from": None}

    planned = inline(config, work)
    if planned["reused_from"] is None and config.sweep.needs_subsets:
        launch_subjob(run, "stagewise.sweep", ["subsets", "--out", run["out"]], config.preprocess.profile)
    keys = ("study", "fingerprint", "reused_from")
    workers = range(1 if planned["reused_from"] else config.sweep.num_workers)  # a study that stands in: one returns
    return [{"worker": worker, **{key: planned[key] for key in keys}} for worker in workers]


def sweep_worker(run: dict[str, Any], worker: dict[str, Any]) -> dict[str, Any]:
    """One worker of the shared study; a multi-process trial profile makes every trial a torchrun DDP job.

    With ``sweep.entrypoint`` the worker is one process that drives the user's script as each of its trials,
    under torchrun with the profile's processes (stagewise.sweep.run_script_trials).
    """
    planned = {key: worker.get(key) for key in ("study", "fingerprint", "reused_from")}
    if planned["reused_from"]:
        return planned
    config = run_config(run)
    profile = config.sweep.profile
    ddp_trials = config.profile(profile).processes_per_node > 1 and config.sweep.entrypoint is None
    result = launch_subjob(run, "stagewise.sweep", ["worker", "--study", worker["study"], "--worker", str(worker["worker"]),
                                                    "--out", run["out"]], profile, distributed=ddp_trials,
                           label=f"sweep-{worker['worker']}")
    return {**result, **planned}


def sweep_summary(run: dict[str, Any], workers: Sequence[dict[str, Any]]) -> dict[str, Any]:
    from stagewise.core import storage
    from stagewise.reuse import cache
    from stagewise.study.summary import summarize

    config = run_config(run)
    first = all_results(workers)[0]
    if first.get("reused_from"):
        return inline(config, lambda: storage.read_json(storage.join(run["out"], "sweep", "summary.json")))

    def work() -> dict[str, Any]:
        summary = summarize(config, first["study"], run["out"], fingerprint=first["fingerprint"])
        cache.remember(config, "sweep", first["fingerprint"], run_ref(run), summary)
        return summary

    return inline(config, work)


# Backends whose stage runs this install's stagewise.train with its fingerprinted arguments (cache, resume keys):
# local torchrun, and Slurm (every node runs the same shared install; stagewise.airflow.backends.slurm).
FINGERPRINTED_BACKENDS = ("local", "slurm")


def train_stage(run: dict[str, Any], stage: str, swept: dict[str, Any], previous: dict[str, Any] | None) -> dict[str, Any]:
    """Launch one stage under torchrun (stagewise.train, or the user's own entrypoint), or submit it as its backend's job.

    A stage of the built-in loop on a local or Slurm profile is keyed by its inputs' fingerprint: its checkpoints
    resume only a try with the same inputs, and with ``cache.stage`` a stage another run trained from the same inputs
    stands in. A Slurm stage's result carries what it cost (stagewise.reporting.cost), summed over its attempts.
    """
    config = run_config(run)
    if stage not in {spec.name for spec in config.train.stages}:
        return _not_in_snapshot(run, stage, previous)
    from stagewise.airflow.backends import run_job
    from stagewise.airflow.stage_job import build

    spec = config.stage(stage)
    init_from = previous["checkpoint_uri"] if previous else None
    params, attempt = swept["best_params"], _context()["ti"].try_number
    if config.profile(spec.profile).backend not in FINGERPRINTED_BACKENDS or spec.entrypoint is not None:
        job = inline(config, lambda: build(config, run, stage, params, init_from, attempt))  # bad args: the user's
        return run_job(job) if spec.entrypoint is None else _own_script_stage(config, run, job)
    job, hit = fingerprinted_job(config, run, stage, swept, previous, attempt)
    if hit is not None:
        return {**hit, "task_s": task_seconds(_context())}
    result = run_job(job)
    if job.backend == "slurm":
        result = with_cost(config, job, result)
    return remember_stage(config, run_ref(run), job_fingerprint(job), {**result, "task_s": task_seconds(_context())})


def _not_in_snapshot(run: dict[str, Any], stage: str, previous: dict[str, Any] | None) -> dict[str, Any]:
    """A stage added to the config after this run started: the run keeps the shape it started with, so this task
    trains nothing and hands the stage before's result through to the tasks after it (marked, so the report leaves
    it out)."""
    import logging

    logging.getLogger("stagewise.train").warning(
        "train stage '%s' was added to the config after this run started (its snapshot %s has no such stage): "
        "nothing to train in this run; the stage before's model goes on unchanged, and the next run trains it",
        stage, run["config"])
    if previous is None:
        from airflow.sdk.exceptions import AirflowFailException

        raise AirflowFailException(f"train stage '{stage}' is not in this run's snapshot {run['config']} and no stage "
                                   "of the run comes before it to hand on")
    return {**previous, "handed_through": stage}


def _own_script_stage(config: PipelineConfig, run: dict[str, Any], job: Any) -> dict[str, Any]:
    """A stage with its own entrypoint: run it like any stage, then check what it left (missing outputs fail here,
    without retry, rather than in evaluate three times) and track it."""
    from stagewise.airflow.backends import run_job
    from stagewise.scripting.stage_contract import byo_result

    started = time.monotonic()
    reported = run_job(job)
    result = inline(config, lambda: byo_result(config, job.stage, run["out"], job.contract, reported))
    if config.tracking.mlflow_uri:
        from stagewise.tracking.runs import log_script_stage

        inline(config, lambda: log_script_stage(config, run["out"], job.contract, result))
    return {**result, "duration_s": round(time.monotonic() - started, 3), "task_s": task_seconds(_context())}


def evaluate(run: dict[str, Any], trained: dict[str, Any]) -> dict[str, Any]:
    """Test the model; keyed by the trained stage's and the data's fingerprints, so with ``cache.evaluate`` the same
    model on the same test split is not scored twice."""
    from stagewise.reuse import cache
    from stagewise.reuse.fingerprints import code_identity, evaluation_inputs

    config = run_config(run)
    fingerprint = None
    if trained.get("fingerprint") and trained.get("data_fingerprint"):
        fingerprint = inline(config, lambda: evaluation_inputs(config, trained["fingerprint"], trained["data_fingerprint"],
                                                                code_identity(config)))
        hit = inline(config, lambda: cache.lookup(config, "evaluate", fingerprint, run_ref(run),
                                                   lambda result: cache.record_problem(result.get("metrics_uri"), fingerprint)))
        if hit is not None:
            return {**hit, "task_s": task_seconds(_context())}
    result = launch_subjob(run, "stagewise.evaluate", ["--model", trained["model_uri"], "--out", run["out"],
                                                       *(["--inputs-fingerprint", fingerprint] if fingerprint else [])],
                           config.evaluate.profile)
    if fingerprint:
        inline(config, lambda: cache.remember(config, "evaluate", fingerprint, run_ref(run), result))
    return result


def register_model(run: dict[str, Any], trained: dict[str, Any], evaluation: dict[str, Any], swept: dict[str, Any]) -> dict[str, Any]:
    """Add the trained model to the registry with its card (metrics, params, data, code, source run)."""
    from stagewise import registry
    from stagewise.core import storage

    config = run_config(run)

    def work() -> dict[str, Any]:
        card = registry.model_card(config, trained=trained, evaluation=evaluation, best_params=swept.get("best_params"),
                                   study=swept.get("study_name", run["study"]), source_run=f"{run['dag_id']}/{run['run_id']}",
                                   manifest_uri=storage.join(run["out"], "preprocess", "manifest.json"),
                                   run_out=run["out"])  # the code as the run started with it (lineage.json)
        card.update(run_config_reference(run))  # what the model was trained with, after the file has changed
        if trained.get("data_fingerprint"):  # the data these weights trained on, whatever the run's folder holds now
            card["data_fingerprint"] = trained["data_fingerprint"]
        card["inputs_fingerprint"] = trained.get("fingerprint")
        card["reused"] = reused_work(trained=trained, evaluation=evaluation, swept=swept)
        card["data_interval"] = run.get("data_interval")
        return registry.register_for(config, run["out"], trained["model_uri"], card, dag_id=run["dag_id"],
                                     run_id=run["run_id"])

    return inline(config, work)


def reused_work(**results: Any) -> dict[str, str]:
    """Which results stand in for work another run did: ``{step: "<dag_id>/<run_id>"}``."""
    return {name: result["reused_from"] for name, result in results.items()
            if isinstance(result, dict) and result.get("reused_from")}


def gate_model(run: dict[str, Any], registered: dict[str, Any]) -> dict[str, Any]:
    """Promote the new version only if it beats the current one (or ask a person: registry.approval); return the
    model inference should use. Each decision goes to the config's notifiers."""
    from stagewise import gatekeeper
    from stagewise.airflow.required_actions import links
    from stagewise.core import storage

    config = run_config(run)

    def work() -> dict[str, Any]:
        manifest_uri = storage.join(run["out"], "preprocess", "manifest.json")
        rows = storage.read_json(manifest_uri).get("rows") if storage.exists(manifest_uri) else None
        return gatekeeper.decide(config, {**registered, "rows": rows}, run["out"], run=run_ref(run),
                                 links=links(run), context=_context())

    return inline(config, work)


def resolve_model(run: dict[str, Any]) -> dict[str, Any]:
    """The registered model a batch_inference run scores with: the version Param, else the current one."""
    from stagewise import registry

    config = run_config(run)
    version = _context()["params"].get("model_version") or None
    return inline(config, lambda: registry.serving_model(config, version, run["out"]))


def write_report(run: dict[str, Any], *, stats: Sequence[dict], reduced: dict, transformed: Sequence[dict], prepared: dict,
                 workers: Sequence[dict], swept: dict, trained: list[dict], evaluation: dict, registered: dict,
                 gated: dict, scored: Sequence[dict], predictions: dict) -> dict[str, Any]:
    from stagewise import report
    from stagewise.reporting import timeline
    from stagewise.tracking import runs as tracking

    config = run_config(run)
    trained = [result for result in trained if not result.get("handed_through")]  # stages added after the run began
    stage_results = {"preprocess": [*all_results(stats), reduced, *all_results(transformed), prepared], "sweep": [*all_results(workers), swept]}
    stage_results.update({f"train_{result['stage']}": [result] for result in trained})
    stage_results.update({"evaluate": [evaluation], "registry": [registered, gated], "inference": [*all_results(scored), predictions]})
    gate_keys = ("model_name", "promoted", "reason", "current", "previous", "metric", "direction", "margin",
                 "candidate_value", "incumbent_value")
    # Only a report-only gate (CI, docs/ci.md) says what it would have done.
    gate_keys += tuple(key for key in ("report_only", "would_promote", "decision") if key in gated)
    # Who approved or rejected (when, their note) and each notifier's result, sent or not.
    gate_keys += tuple(key for key in ("approval", "notifications") if key in gated)

    def work() -> dict[str, Any]:
        from stagewise.reuse import leftovers

        links = tracking.links(run["out"], registered)
        # Every upstream task succeeded (report's trigger rule): what only a resume reads can go (stagewise.reuse.leftovers).
        dropped = leftovers.drop_finished(config, run["out"], [result["stage"] for result in trained])
        written = report.build_report(
            dag_id=run["dag_id"], run_id=run["run_id"], out=run["out"], stage_results=stage_results, preprocess=prepared,
            sweep=swept, training=list(trained), evaluation=evaluation, predictions=predictions,
            registry={**{key: gated.get(key) for key in gate_keys}, "version": registered["version"]},
            direction=config.objective.direction, tasks=timeline.records(run["out"]), config=run_config_reference(run),
            tracking=links, reused=reused_work(preprocess=prepared, sweep=swept, evaluate=evaluation, inference=predictions,
                                               **{f"train_{result['stage']}": result for result in trained}),
            data_interval=run.get("data_interval"), dropped=dropped)
        if links is not None:
            tracking.finish_parent(config, run["out"], written)
        return written

    return inline(config, work)


def write_inference_report(run: dict[str, Any], model: dict[str, Any], scored: Sequence[dict], predictions: dict) -> dict[str, Any]:
    from stagewise import report
    from stagewise.reporting import timeline
    from stagewise.tracking import runs as tracking

    config = run_config(run)

    def work() -> dict[str, Any]:
        links = tracking.links(run["out"], model)
        written = report.build_inference_report(
            dag_id=run["dag_id"], run_id=run["run_id"], out=run["out"], model=model,
            stage_results={"inference": [*all_results(scored), predictions]}, predictions=predictions,
            tasks=timeline.records(run["out"]), config=run_config_reference(run), tracking=links)
        if links is not None:
            tracking.finish_parent(config, run["out"], written)
        return written

    return inline(config, work)
