"""Task chains shared by the DAG files: each function adds its tasks to the DAG being defined.

Still wiring only: every task body is a thin step from :mod:`stagewise.airflow.steps`; the config
decides task ids, mapping and each task's instance profile (pool, slots, queue, retries, timeout).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from airflow.sdk import Asset, task

from stagewise.airflow import shard_steps, steps
from stagewise.airflow.profiles import task_kwargs
from stagewise.definitions.bookkeeping import BOOKKEEPING
from stagewise.definitions.config import PipelineConfig

# Names of mapped task instances in the grid (Jinja over the task's expanded kwargs; rendered before the body runs).
# A shard of several files is named by its first and how many more (stagewise.datasets.sharding).
SHARD_FILE_NAME = ("{% set shard = task.op_kwargs['shard'] %}{% set files = shard.get('files') or [shard] %}"
                   "{{ files[0]['uri'].rstrip('/').split('/')[-1] }}"
                   "{% if files | length > 1 %} + {{ files | length - 1 }} more file(s){% endif %}")
SWEEP_WORKER_NAME = "worker {{ task.op_kwargs['worker']['worker'] }}"
INFERENCE_SHARD_NAME = ("{% set shard = task.op_kwargs['shard'] %}{% if shard.get('no_model') %}nothing to score: "
                        "no current model{% else %}{% set files = shard.get('files') or [shard] %}"
                        "{% set groups = files[0]['row_groups'] %}{{ files[0]['uri'].rstrip('/').split('/')[-1] }}"
                        "{% if files | length > 1 %} + {{ files | length - 1 }} more file(s)"
                        "{% elif groups | length > 1 %}, row groups {{ groups[0] }}-{{ groups[-1] }}"
                        "{% else %}, row group {{ groups[0] }}{% endif %}, {{ shard['rows'] }} rows{% endif %}")


def knobs(config: PipelineConfig, profile: str) -> dict[str, Any]:
    """The profile's Airflow knobs, plus the hooks that record each attempt for the run's task timeline; the team's
    callbacks (config ``airflow.on_*_callback``) run after Stagewise's own (Airflow calls a list in order)."""
    hooks = steps.timeline_hooks()
    for event in ("on_failure_callback", "on_retry_callback", "on_success_callback"):
        if theirs := [_callable(path, f"airflow.{event}") for path in getattr(config.airflow, event)]:
            hooks[event] = [hooks[event], *theirs] if event in hooks else theirs
    return {**task_kwargs(config.profile(profile)), **hooks}


def _callable(path: str, key: str) -> Any:
    """``module:function`` imported (at parse time: a typo is this DAG's import error, naming the key)."""
    import importlib

    module, _, name = path.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ImportError(f"{key}: cannot import {path} ({exc})") from None


# The default_args key carrying the pipeline's name and config into the serialized DAG: the api-server's Stagewise
# pages read it from the metadata DB (stagewise.airflow.ui), so they show exactly the pipelines the DAG file built.
# Operators take from default_args only the names of their own parameters, so no task ever receives it.
PIPELINE_DEFAULT_ARG = "stagewise_pipeline"


def carried_pipeline(config: PipelineConfig, name: str) -> dict[str, Any]:
    """What a DAG carries of its pipeline (PIPELINE_DEFAULT_ARG): its name and config, with ``model.args`` replaced by
    their SHA-256 and size. The spec's arguments are the team's, of any size (a 10 MB string sat in every DAG's
    default_args, which the DB stores per version and REST returns to every reader); no page reads them, and a run
    reads its own snapshot, never the DAG's copy."""
    values = config.model_dump(mode="json")
    encoded = json.dumps(values["model"].get("args") or {}, sort_keys=True).encode()
    values["model"]["args"] = {}
    return {"name": name, "config": values,
            "model_args": {"sha256": hashlib.sha256(encoded).hexdigest(), "bytes": len(encoded)}}


def dag_settings(config: PipelineConfig, *kinds: str, max_active_runs: int = 4) -> dict[str, Any]:
    """The DAG arguments the pipeline's ``airflow`` section sets: start date, catchup, tags (after stagewise and the
    DAG's ``kinds``, the first of which is the pipeline's name), owner, default_args and the run limit
    (``max_active_runs`` is this DAG's own default); default_args also carry the pipeline (PIPELINE_DEFAULT_ARG)."""
    import pendulum

    settings = config.airflow
    start = settings.start_date
    pipeline = carried_pipeline(config, kinds[0] if kinds else config.name)
    return {"start_date": pendulum.datetime(start.year, start.month, start.day, tz="UTC"), "catchup": settings.catchup,
            "tags": list(dict.fromkeys(["stagewise", *kinds, *settings.tags])),
            "max_active_runs": settings.max_active_runs or max_active_runs,
            "default_args": {**settings.default_args, "owner": settings.owner, PIPELINE_DEFAULT_ARG: pipeline}}


RAW_DATA_ASSET_PREFIX = "stagewise_raw_data"


def raw_data_asset(config: PipelineConfig) -> Asset:
    """The Asset for the raw data location: an ingest task or the REST API's asset events mark new data.

    Its name carries a hash of the URI: Airflow keeps an asset name bound to its first URI, so a fixed
    name would leave the asset inactive (and ingest failing) once dataset.uri changes.
    """
    import hashlib

    from stagewise.core.storage import resolve
    from stagewise.definitions.intervals import static_prefix

    location = resolve(config.storage_root, static_prefix(config.dataset.uri))  # an interval's data: its folder
    uri = location if "://" in location else f"file://{location}"
    return Asset(uri=uri, name=f"{RAW_DATA_ASSET_PREFIX}-{hashlib.sha256(uri.encode()).hexdigest()[:12]}")


def start(config: PipelineConfig, config_file: str, mode: str = "pipeline") -> Any:
    """Validates the conf against the DAG's own ``config_file``: a bad one is the user's to fix and fails without retry
    (AirflowFailException), while a fault of the machine (the task dying before it starts, an execution-API timeout
    under load) retries as any light task does: it runs with the bookkeeping profile (stagewise.definitions.bookkeeping)."""
    return task(steps.start_run, task_id="start_run", **knobs(config, BOOKKEEPING))(mode, config_file)


def preprocess(config: PipelineConfig, run: Any) -> dict[str, Any]:
    """plan_shards -> preprocess_stats[shard] -> reduce_stats -> preprocess_transform[shard] -> commit_preprocess."""
    bookkeeping = knobs(config, BOOKKEEPING)
    shards = task(shard_steps.plan_shards, task_id="plan_shards", **bookkeeping)(run)
    stats = task(shard_steps.preprocess_stats, task_id="preprocess_stats", map_index_template=SHARD_FILE_NAME,
                 **knobs(config, config.preprocess.profile)).partial(
        run=run).expand(shard=shards)
    reduced = task(shard_steps.reduce_stats, task_id="reduce_stats", **bookkeeping)(run, stats)
    transformed = task(shard_steps.preprocess_transform, task_id="preprocess_transform",
                       map_index_template=SHARD_FILE_NAME, **knobs(config, config.preprocess.profile)).partial(
        run=run, reduced=reduced).expand(shard=shards)
    prepared = task(shard_steps.commit_preprocess, task_id="commit_preprocess", **bookkeeping)(run, reduced, transformed)
    return {"stats": stats, "reduced": reduced, "transformed": transformed, "prepared": prepared}


def sweep(config: PipelineConfig, run: Any, data: dict[str, Any]) -> dict[str, Any]:
    """create_study -> sweep_worker[i] (trials in parallel on one shared study) -> sweep_summary (the best params)."""
    bookkeeping = knobs(config, BOOKKEEPING)
    # Drawing the sweep's data subsets is a sub-job over the data: then create_study is work, in the compute pool.
    creating = knobs(config, config.preprocess.profile) if config.sweep.needs_subsets else bookkeeping
    worker_ids = task(steps.create_study, task_id="create_study", **creating)(run, data["prepared"])
    workers = task(steps.sweep_worker, task_id="sweep_worker", map_index_template=SWEEP_WORKER_NAME,
                   **knobs(config, config.sweep.profile)).partial(
        run=run).expand(worker=worker_ids)
    swept = task(steps.sweep_summary, task_id="sweep_summary", **bookkeeping)(run, workers)
    return {"workers": workers, "swept": swept}


def train_stages(config: PipelineConfig, run: Any, swept: dict[str, Any]) -> dict[str, Any]:
    """train_<stage> for each configured stage in order, each starting from the previous one's checkpoint.

    A stage whose profile has ``sagemaker.deferrable`` is a SageMakerStageOperator, one with ``backend: slurm`` and
    ``slurm.deferrable`` a SlurmStageOperator: both wait in the triggerer.
    """
    trained, previous = [], None
    for stage in config.train.stages:
        profile = config.profile(stage.profile)
        deferred = next((getattr(profile, backend) for backend in ("sagemaker", "slurm") if profile.backend == backend
                         and getattr(profile, backend) is not None and getattr(profile, backend).deferrable), None)
        if stage.entrypoint is not None:  # an own script's outputs are checked by the TaskFlow step (it waits there)
            deferred = None
        if deferred is not None:
            from stagewise.airflow import operators

            operator = operators.SageMakerStageOperator if profile.backend == "sagemaker" else operators.SlurmStageOperator
            previous = operator(task_id=f"train_{stage.name}", run=run, stage=stage.name, swept=swept["swept"],
                                previous=previous, **knobs(config, stage.profile)).output
        else:
            previous = task(steps.train_stage, task_id=f"train_{stage.name}", **knobs(config, stage.profile))(
                run, stage.name, swept["swept"], previous)
        trained.append(previous)
    return {"trained": trained}


def evaluate_and_gate(config: PipelineConfig, run: Any, swept: dict[str, Any], trained: dict[str, Any]) -> dict[str, Any]:
    """evaluate -> register_model -> gate_model: the last stage's model on the test split, registered, promoted if better."""
    bookkeeping = knobs(config, BOOKKEEPING)
    final = trained["trained"][-1]
    evaluation = task(steps.evaluate, task_id="evaluate", **knobs(config, config.evaluate.profile))(run, final)
    registered = task(steps.register_model, task_id="register_model", **bookkeeping)(run, final, evaluation, swept["swept"])
    gated = task(steps.gate_model, task_id="gate_model", **bookkeeping)(run, registered)
    approval = config.registry.approval
    if approval.mode != "none":  # a person's answer between the gate and the rest (stagewise.airflow.approval)
        from stagewise.airflow.approval import TASK_ID, GateApprovalOperator

        gated = GateApprovalOperator(task_id=TASK_ID, run=run, gated=gated, timeout_minutes=approval.timeout_minutes,
                                     respondents=approval.respondents, **bookkeeping).output
    return {"evaluation": evaluation, "registered": registered, "gated": gated}


def inference_chain(config: PipelineConfig, run: Any, model: Any) -> dict[str, Any]:
    """plan -> infer_shard[*] -> commit, scoring with ``model`` (a dict holding model_uri and version)."""
    bookkeeping = knobs(config, BOOKKEEPING)
    shards = task(shard_steps.plan_inference, task_id="plan_inference", **bookkeeping)(run, model)
    scored = task(shard_steps.infer_shard, task_id="infer_shard", map_index_template=INFERENCE_SHARD_NAME,
                  **knobs(config, config.inference.profile)).partial(
        run=run, model=model).expand(shard=shards)
    predictions = task(shard_steps.commit_predictions, task_id="commit_predictions", **bookkeeping)(run, model, scored)
    return {"scored": scored, "predictions": predictions}


def report(config: PipelineConfig, run: Any, *phases: dict[str, Any]) -> Any:
    """The run's report.json from every phase's results (see stagewise.report)."""
    results = {name: value for phase in phases for name, value in phase.items()}
    return task(steps.write_report, task_id="report", **knobs(config, BOOKKEEPING))(run, **results)
